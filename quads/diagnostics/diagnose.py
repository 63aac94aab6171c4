"""``quads diagnose``: how far an NVFP4 rollout's log-probs drift from the trainer's.

For a local HF causal LM (dense or MoE) and a set of prompts, the BF16 model samples
completions once; every configuration then scores *the same* completions twice:

* the **rollout engine path**: incremental decoding with a KV cache, as a generation engine
  computes sampling log-probs, with the eager attention kernel; ``--tokens-per-step`` completion
  tokens per cached forward (default 16; 1 = token by token, bit-identical on CPU, tested);
* the **trainer path**: one teacher-forced forward over prompt + completion (SDPA attention).

Per configuration it reports the per-token |log p_rollout - log p_trainer| (mean, p99, max),
the k3 KL estimate and a per-layer table of activation quantization error. Rows: one per plan of
``POLICY_PRESETS`` (the ``bf16-fp32-experts`` ablation is the precision probe's lines instead),
the FP8 reference and the residual fraction sweep (docs/validation.md says what each compares).

A plan that cannot apply to the model (the routed-experts plans on a dense model, boundary
layers on a model with 6 or fewer) is listed as not run, with the reason. The report ends with
the plan it recommends for this model on each GPU kind (:mod:`quads.diagnostics.recommend`:
the fastest plan measured on that hardware whose mean gap is within 1.5x the BF16 floor).

On an MoE model with supported routers (:mod:`quads.policies.routing`) each row also reports
its routing flips (``routing_flip_topk``: the share of tokens whose top-k experts the trainer
path picks otherwise than the rollout engine path did, mean over MoE layers;
``routing_flip_top1``): the engine path's forwards record their experts (int16, layers x k per
token), the trainer path's forward records its own, compared on every attended token but the last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from quads.diagnostics.cli_inputs import (
    UsageError,
    atomic_write_text,
    check_device,
    check_model_convertible,
    check_output_file,
    check_tokenizer,
    device_name,
    load_local_causal_lm,
    positive_float,
    positive_int,
    read_prompts,
    seed_int,
    thread_count,
)
from quads.diagnostics.fp8_reference import fp8_w8a8_
from quads.diagnostics.mismatch import k3_kl, logp_gap_stats
from quads.diagnostics.precision_probe import precision_probe, probe_warning
from quads.diagnostics.scoring import positions_from_mask, score_incremental, score_teacher_forced
from quads.ops.activation_quant import ActivationQuant, dequantize_activation, quantize_activation_reference
from quads.policies import POLICY_PRESETS, QuadsPolicy, copy_model, prepare_trainer_, quantize_
from quads.ops.weight_cache import clear_weight_cache, weight_cache_enabled
from quads.diagnostics.plan_speeds import HARDWARE
from quads.diagnostics.recommend import PLAN_TABLE, Recommendation, recommend
from quads.policies.presets import with_residual_fraction
from quads.policies.routing import RoutingRecorder, flip_counts, flip_shares, routing_problem
from quads.policies.scope import routed_expert_names, scope_problem
from quads.policies.walk import conversion_targets

__all__ = ["ROWS", "DiagnoseRow", "run_diagnose", "add_parser", "JSON_SCHEMA", "plan_names", "select_rows"]

#: the ``schema`` field of ``quads diagnose --json`` (docs/validation.md lists its fields); the
#: number goes up whenever a field is renamed or removed or changes meaning
JSON_SCHEMA = "quads.diagnose/2"

GENERIC_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1 + 1 =",
    "The quick brown fox",
    "In reinforcement learning, the policy",
    "Q: What is 12 times 7?\nA:",
    "import torch\n",
]

#: the FP8 W8A8 reference rollout (not a quads policy)
FP8 = "fp8-w8a8"


@dataclass(frozen=True)
class DiagnoseRow:
    name: str
    rollout: QuadsPolicy | str | None  # a rollout policy, FP8, or None (BF16)
    trainer: QuadsPolicy | None  # a trainer policy, or None (BF16)
    description: str
    preset: str | None = None  # the POLICY_PRESETS plan this row measures (None: a reference or sweep row)


def _preset_row(name: str, preset, description: str | None = None, plan: str | None = None) -> DiagnoseRow:
    return DiagnoseRow(name, preset.rollout, preset.trainer, description or preset.description, plan)


#: the per-layer table's residual column: the residual fraction of the default rollout policy
LAYER_RESIDUAL_FRACTION = POLICY_PRESETS["quads"].rollout.residual_fraction


def _rows() -> list[DiagnoseRow]:
    """The floor and the FP8 reference, then one row per preset (``quads`` after its k sweep)."""
    rows = [
        _preset_row("bf16-floor", POLICY_PRESETS["bf16"], "BF16 rollout engine path vs BF16 trainer (engine drift floor)",
                    "bf16"),
        DiagnoseRow("fp8-w8a8", FP8, None, "FP8 W8A8 rollout vs BF16 trainer"),
    ]
    for name, preset in POLICY_PRESETS.items():
        if name == "bf16" or not preset.trainer_experts_autocast:  # the ablation: see autocast_precision_probe
            continue
        if name == "quads":
            rows += [_preset_row(f"quads-{k}", with_residual_fraction(preset, k / 100),
                                 f"W4A4 + {k}% residual vs W4A16 QAT trainer") for k in (25, 50, 75)]
            rows.append(_preset_row("quads-100", preset, "W4A4 + 100% residual vs W4A16 QAT trainer (preset quads)",
                                    "quads"))
        else:
            rows.append(_preset_row(name, preset, plan=name))
    return rows


ROWS = _rows()


#: the row every report keeps: the BF16 floor every other row is read against
FLOOR = "bf16-floor"


def plan_names() -> list[str]:
    """The names ``--plans`` takes: every row's (``quads-50``, ``fp8-w8a8``) and every preset's
    (``quads`` is the ``quads-100`` row, ``bf16`` the floor)."""
    return list(dict.fromkeys([r.name for r in ROWS] + [r.preset for r in ROWS if r.preset]))


def select_rows(rows: list[DiagnoseRow], plans) -> list[DiagnoseRow]:
    """The rows of ``rows`` that ``plans`` names (row or preset names; None: every row), in report
    order, the BF16 floor always among them. An unknown name is a one-line ValueError naming it."""
    if plans is None:
        return list(rows)
    if isinstance(plans, str):
        plans = [p for p in plans.split(",") if p.strip()]
    wanted = [str(p).strip() for p in plans]
    unknown = [p for p in wanted if p not in plan_names()]
    if unknown:
        raise ValueError(f"diagnose plans: unknown plan {unknown[0]!r}; choose from {', '.join(plan_names())}")
    if not wanted:
        raise ValueError("diagnose plans: no plan named; choose from " + ", ".join(plan_names()))
    keep = set(wanted) | {FLOOR}
    return [r for r in rows if r.name in keep or (r.preset is not None and r.preset in keep)]


def _variant(base: nn.Module, policy: QuadsPolicy | str | None) -> nn.Module:
    """A converted deep copy of the BF16 base model (this tool owns its models, no TRL patching)."""
    model = copy.deepcopy(base)
    if policy is None:
        return model
    if policy == FP8:
        return fp8_w8a8_(model)
    return quantize_(model, policy)


def _drop_variant_weights() -> None:
    """Free what a scored variant derived from its weights: each variant is a fresh copy, so no
    later one can use its cached entries, and keeping them (up to the cache's budget) next to the
    next copy is what ran the 720M-parameter MoE's report out of memory."""
    clear_weight_cache()


def _use_engine_attention(model: nn.Module) -> None:
    """The rollout engine path runs a different attention kernel from the trainer's (eager
    vs the default SDPA), as a real engine does; on CPU, incremental and full-sequence SDPA
    are otherwise bit-identical and the BF16 floor would read 0."""
    if getattr(model.config, "_attn_implementation", None) != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")


@torch.no_grad()
def sample_completions(model, tokenizer, prompts, max_new_tokens: int, temperature: float, seed: int):
    """Sample one completion per prompt with the BF16 model; returns ids, mask, completion mask."""
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(next(model.parameters()).device)
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    completion = out[:, enc["input_ids"].shape[1]:]
    eos = tokenizer.eos_token_id
    is_eos = completion == eos
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # tokens after the first EOS
    completion_mask = ~after_eos
    attention_mask = torch.cat([enc["attention_mask"], completion_mask.long()], dim=1)
    return out, attention_mask, completion_mask


@torch.no_grad()
def layer_activation_errors(model, input_ids, attention_mask, fractions=(0.0, 0.5)) -> list[dict]:
    """Relative activation quantization error per quantizable layer input, on real inputs."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for target in conversion_targets(model, QuadsPolicy(side="rollout").skips):
        def hook(m, args, name=target.name):
            x = args[0].detach()
            seen.setdefault(name, []).append(x.reshape(-1, x.shape[-1]))
        hooks.append(target.module.register_forward_pre_hook(hook))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask))
    finally:
        for h in hooks:
            h.remove()
    rows, done = [], {}
    for name, xs in seen.items():
        same_input = tuple(x.data_ptr() for x in xs)  # q/k/v (gate/up) read one tensor: measure it once
        if same_input not in done:
            x = torch.cat(xs).float()
            errors = {"K": x.shape[1], "tokens": x.shape[0]}
            for f in fractions:
                xh = dequantize_activation(quantize_activation_reference(x, ActivationQuant(f)))
                errors[f"rel_err_k{int(f * 100)}"] = ((xh - x).norm() / x.norm().clamp_min(1e-30)).item()
            done[same_input] = errors
        rows.append({"layer": name, **done[same_input]})
    return rows


def rows_with_weight_global_scale(mode: str, block_scaling: str | None = None,
                                  activation_block_scaling: str | None = None) -> list[DiagnoseRow]:
    """:data:`ROWS` with every quads policy's ``weight_global_scale`` set to ``mode`` and, where
    given (not None), its ``weight_block_scaling`` / ``activation_block_scaling``."""
    def set_mode(policy):
        if not isinstance(policy, QuadsPolicy):
            return policy
        fields = {"weight_global_scale": mode}
        if block_scaling is not None:
            fields["weight_block_scaling"] = block_scaling
        if activation_block_scaling is not None:
            fields["activation_block_scaling"] = activation_block_scaling
        return dataclasses.replace(policy, **fields)

    return [dataclasses.replace(r, rollout=set_mode(r.rollout), trainer=set_mode(r.trainer)) for r in ROWS]


def row_problem(row: DiagnoseRow, model: nn.Module) -> str | None:
    """Why ``row``'s policies cannot apply to ``model`` (scope or boundary layers), or None."""
    for policy in (row.rollout, row.trainer):
        problem = scope_problem(model, policy) if isinstance(policy, QuadsPolicy) else None
        if problem:
            return problem
    return None


def model_kind(model: nn.Module) -> str:
    """``"moe"`` (the model has routed experts) or ``"dense"``."""
    return "moe" if routed_expert_names(model) else "dense"


def target_hardware(device: torch.device) -> tuple[str, ...]:
    """The hardware kinds to recommend for: the GPU the run is on (sm_90: hopper, sm_100+:
    blackwell; another GPU: none), or every kind of the speed table for a CPU run (the CPU runs
    the torch reference, whose numerics the exact kernels reproduce bit for bit)."""
    if device.type != "cuda":
        return HARDWARE
    major, _ = torch.cuda.get_device_capability(device)
    return ("hopper",) if major == 9 else ("blackwell",) if major >= 10 else ()


def run_diagnose(model, tokenizer, prompts, max_new_tokens=16, temperature=1.0, seed=0,
                 progress: Callable | None = None, tokens_per_step: int = 16,
                 weight_global_scale: str = "group", weight_block_scaling: str | None = None,
                 activation_block_scaling: str | None = None, plans=None,
                 announce: Callable[[str], None] | None = None) -> dict:
    """The whole report as a dict (see module doc). ``plans``: the rows to score (row or preset
    names, a list or a comma-separated string; None: all; the BF16 floor always), checked
    before any work; ``announce``: called with one line up front (rows, scoring passes) and one
    with the time estimate once the first passes are timed. Derived weights are cached for the run
    (``weight_cache_enabled``: the models' weights only change by quads' own in-place writes).
    ``weight_global_scale``: the policies' (``"group"``, the default, or ``"tensor"``);
    ``weight_block_scaling`` / ``activation_block_scaling``: ``"6"`` or ``"4over6"`` for every
    quads row, or None (default) to keep each plan's own (the ``quads-4over6`` row's is ``4over6``)."""
    rows, skipped = [], []
    chosen = select_rows(rows_with_weight_global_scale(weight_global_scale, weight_block_scaling,
                                                       activation_block_scaling), plans)
    for row in chosen:
        problem = row_problem(row, model)
        if problem:
            skipped.append({"config": row.name, "reason": problem})
        else:
            rows.append(row)
    with weight_cache_enabled():
        report = _run_diagnose(model, tokenizer, prompts, max_new_tokens, temperature, seed, progress,
                               tokens_per_step, rows, announce)
    report["weight_global_scale"] = weight_global_scale
    report["weight_block_scaling"] = weight_block_scaling
    report["activation_block_scaling"] = activation_block_scaling
    report["not_run"] = skipped
    report["model_kind"] = kind = model_kind(model)
    hardware = target_hardware(next(model.parameters()).device)
    report["recommendations"] = [dataclasses.asdict(recommend(report["rows"], h, kind)) for h in hardware]
    report["precision_probe"] = autocast_precision_probe(model)
    return report


def autocast_precision_probe(model: nn.Module) -> dict[str, str | None]:
    """The precision probe's line (None: no mismatch) for ``model`` trained as
    ``GRPOConfig(bf16=True)`` trains it (FP32 masters under BF16 autocast) against a BF16
    rollout copy: ``"transformers"`` as transformers runs it, ``"quads"`` as
    :func:`quads.prepare_trainer_` prepares it for the ``bf16`` plan. (The gap rows score a
    BF16 trainer without autocast, where ``bf16-fp32-experts`` is ``bf16``: this line is
    where that plan's trap shows.)"""
    trainer = copy_model(model, torch.float32)
    rollout = copy_model(model, torch.bfloat16)
    lines = {"transformers": probe_warning(precision_probe(trainer, rollout))}
    prepare_trainer_(trainer, "bf16")
    lines["quads"] = probe_warning(precision_probe(trainer, rollout))
    return lines


class _Estimate:
    """Announces the time left once the first quantized rollout pass (the slowest kind) is timed:
    that pass's seconds for every rollout pass left, the mean of the trainer-side passes so far
    (or that same figure, before any) for every trainer pass left."""

    def __init__(self, rollout_passes: int, trainer_passes: int, announce):
        self.left = {"rollout": rollout_passes, "trainer": trainer_passes}
        self.seconds = {"rollout": [], "trainer": []}
        self.announce, self.done = announce, announce is None

    def passed(self, side: str, key, seconds: float) -> None:
        self.left[side] -= 1
        self.seconds[side].append(seconds)
        if self.done or not (side == "rollout" and isinstance(key, QuadsPolicy) or self.left["rollout"] == 0):
            return
        self.done = True
        per_rollout = seconds
        per_trainer = sum(self.seconds["trainer"]) / len(self.seconds["trainer"]) if self.seconds["trainer"] else seconds
        rest = self.left["rollout"] * per_rollout + self.left["trainer"] * per_trainer
        self.announce(f"estimate: about {rest:.0f} s for the {self.left['rollout'] + self.left['trainer']} scoring "
                      f"passes left ({per_rollout:.1f} s for one quantized rollout pass)")


def _run_diagnose(model, tokenizer, prompts, max_new_tokens, temperature, seed, progress, tokens_per_step,
                  config_rows, announce=None) -> dict:
    model.eval()
    rollout_keys = list(dict.fromkeys(r.rollout for r in config_rows))
    trainer_keys = list(dict.fromkeys(r.trainer for r in config_rows))
    if announce is not None:
        announce(f"{len(config_rows)} row(s) ({', '.join(r.name for r in config_rows)}): "
                 f"{len(rollout_keys)} rollout + {len(trainer_keys)} trainer scoring passes; "
                 "--plans NAME,... scores fewer")
    estimate = _Estimate(len(rollout_keys), len(trainer_keys), announce)
    ids, attn, comp_mask = sample_completions(model, tokenizer, prompts, max_new_tokens, temperature, seed)
    n = comp_mask.shape[1]
    bar = progress(total=len(rollout_keys) + len(trainer_keys) + 1) if progress else None
    rollout_lp, trainer_lp, rollout_routing, trainer_routing = {}, {}, {}, {}
    for key in rollout_keys:
        started = time.perf_counter()
        engine = _variant(model, key)
        _use_engine_attention(engine)
        with _recording(engine, ids.shape[0]) as routing:
            rollout_lp[key] = score_incremental(engine, ids, attn, n, temperature, tokens_per_step)
        rollout_routing[key] = _aligned(routing, attn, fed_only=True)
        del engine
        _drop_variant_weights()
        estimate.passed("rollout", key, time.perf_counter() - started)
        bar and bar.update(1)
    for key in trainer_keys:
        started = time.perf_counter()
        trainer = _variant(model, key)
        with _recording(trainer, ids.shape[0]) as routing:
            trainer_lp[key] = score_teacher_forced(trainer, ids, attn, n, temperature, mask_positions=True)
        trainer_routing[key] = _aligned(routing, attn, fed_only=False)
        del trainer
        _drop_variant_weights()
        estimate.passed("trainer", key, time.perf_counter() - started)
        bar and bar.update(1)
    rows = []
    for row in config_rows:
        gap = logp_gap_stats(rollout_lp[row.rollout], trainer_lp[row.trainer], comp_mask)
        rows.append({"config": row.name, "preset": row.preset, "description": row.description,
                     "gap_mean": gap["mean"], "gap_p99": gap["p99"], "gap_max": gap["max"],
                     "k3_kl": k3_kl(rollout_lp[row.rollout], trainer_lp[row.trainer], comp_mask)})
        recorded, own = rollout_routing[row.rollout], trainer_routing[row.trainer]
        if recorded is not None and own is not None:
            shares = flip_shares(flip_counts(own, recorded))
            rows[-1].update(routing_flip_topk=shares["flip_topk"], routing_flip_top1=shares["flip_top1"])
    layers = layer_activation_errors(model, ids, attn, fractions=(0.0, LAYER_RESIDUAL_FRACTION))
    bar and bar.update(1)
    bar and bar.close()
    return {"num_prompts": len(prompts), "completion_tokens": int(comp_mask.sum()),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
            "tokens_per_step": tokens_per_step,
            "rows": rows, "layer_residual_fraction": LAYER_RESIDUAL_FRACTION, "layers": layers}


def _recording(model: nn.Module, batch: int):
    """Record ``model``'s MoE routing in the block (a list: the (B, S, L, k) recording on exit),
    or nothing (an empty list) for a model without supported routers."""
    if routing_problem(model) is not None:
        return contextlib.nullcontext([])
    return RoutingRecorder(model).appending(batch)


def _aligned(recorded: list, attention_mask: torch.Tensor, fed_only: bool) -> torch.Tensor | None:
    """The recording (B, T, L, k) over the scored sequence, -1 where a token is not attended
    (padding, after EOS) and, with ``fed_only``, at the last token (the engine path never feeds it)."""
    if not recorded:
        return None
    routing = recorded[0]
    if fed_only:
        routing = torch.cat([routing, routing.new_full((routing.shape[0], 1, *routing.shape[2:]), -1)], dim=1)
    return routing.masked_fill(~attention_mask.bool()[:, :, None, None], -1)


def format_report(report: dict) -> str:
    floor = next(r for r in report["rows"] if r["config"] == "bf16-floor")
    took = f", {report['seconds']:.1f} s" if "seconds" in report else ""
    lines = [f"{report['num_prompts']} prompts, {report['completion_tokens']} completion tokens, "
             f"T={report['temperature']}{took}"
             + (f", weight_global_scale={report['weight_global_scale']}" if "weight_global_scale" in report else "")
             + (f", weight_block_scaling={report['weight_block_scaling']}" if report.get("weight_block_scaling") else "")
             + (f", activation_block_scaling={report['activation_block_scaling']}"
                if report.get("activation_block_scaling") else ""),
             "",
             f"{'config':<14} {'gap mean':>9} {'mean/floor':>10} {'gap p99':>9} {'gap max':>9} {'max/floor':>9} "
             f"{'k3 KL':>10}  description"]

    def over_floor(value: float, key: str) -> float:
        return value / floor[key] if floor[key] > 0 else float("nan")

    flips = any("routing_flip_topk" in r for r in report["rows"])  # an MoE model: the routing flip column
    if flips:
        lines[-1] = lines[-1].replace("  description", f" {'flips':>7}  description")
    for r in report["rows"]:
        flip = f" {r.get('routing_flip_topk', float('nan')):>7.4f}" if flips else ""
        lines.append(f"{r['config']:<14} {r['gap_mean']:>9.4f} {over_floor(r['gap_mean'], 'gap_mean'):>10.2f} "
                     f"{r['gap_p99']:>9.4f} {r['gap_max']:>9.4f} {over_floor(r['gap_max'], 'gap_max'):>9.2f} "
                     f"{r['k3_kl']:>10.2e}{flip}  {r['description']}")
    for r in report.get("not_run", []):
        lines.append(f"{r['config']:<14} not run: {r['reason']}")
    k = report["layer_residual_fraction"]
    residual = f"rel_err_k{int(k * 100)}"
    lines += ["", f"{'layer input':<45} {'K':>5} {'W4A4 err':>9} {f'+{k:.0%} res':>10}"]
    for l in report["layers"]:
        lines.append(f"{l['layer']:<45} {l['K']:>5} {l['rel_err_k0']:>9.4f} {l[residual]:>10.4f}")
    if "precision_probe" in report:
        lines.append("")
        for how, line in report["precision_probe"].items():
            lines.append(f"FP32 masters under BF16 autocast, {how}: "
                         + (line or "every unconverted module multiplies in bfloat16 on both sides"))
    if "recommendations" in report:
        lines.append("")
        lines += [Recommendation(**r).line() for r in report["recommendations"]]
        if not report["recommendations"]:
            lines.append("no recommendation: the speed table covers hopper and blackwell GPUs only")
        lines.append(f"every plan's measured gap, accuracy and whole-RL-step speed: {PLAN_TABLE}")
    return "\n".join(lines)


def _load(path: str | None, prompts: list[str] | None = None):
    """(model, tokenizer, default prompts): the embedded MoE, or a checked local directory
    (its tokenizer checked on the user's ``prompts`` when given)."""
    if path is None:
        from quads.tasks import load_default_model
        from quads.tasks.arithmetic import make_prompts

        model, tok = load_default_model()
        return model, tok, [p["prompt"] for p in make_prompts(32, seed=11, split="heldout")]
    model, tok = load_local_causal_lm(path, torch.bfloat16, prompts=prompts)
    return model, tok, GENERIC_PROMPTS


def _cmd(args: argparse.Namespace) -> int:
    """Every input is checked (prompts, output path, model) before the first configuration runs."""
    from quads.extras import require
    from quads.tensor.finite import nonfinite_names

    require("quads diagnose", "transformers")
    try:
        from tqdm.auto import tqdm
    except ImportError:  # a progress bar is a nicety: the announced rows and estimate remain
        tqdm = None

    prompts = read_prompts(args.prompts) if args.prompts else None
    if args.json:
        check_output_file(args.json)
    torch.set_num_threads(args.threads)
    device = check_device(args.device)
    model, tok, default_prompts = _load(args.model, prompts)
    where = args.model or "the embedded model"
    # no IndexError inside generate; the user's own prompts must also reach the model unmangled
    check_tokenizer(tok, model, where, prompts or default_prompts, allow_unknown=prompts is None)
    bad = nonfinite_names(model.named_parameters())
    if bad:
        raise UsageError(f"{where}: non-finite weights (NaN/Inf) in {len(bad)} tensor(s), e.g. {bad[0]}")
    # K % 16 & co. of every row that applies to this model (run_diagnose reports the others), before sampling
    rows = [r for r in select_rows(rows_with_weight_global_scale(args.weight_global_scale), args.plans)
            if not row_problem(r, model)]
    check_model_convertible(model, [p for r in rows for p in (r.rollout, r.trainer) if isinstance(p, QuadsPolicy)],
                            where)
    model.to(device)
    prompts = (prompts or default_prompts) * args.repeat
    started = time.perf_counter()
    report = run_diagnose(model, tok, prompts, args.max_new_tokens, args.temperature, args.seed,
                          progress=(lambda total: tqdm(total=total, desc="scoring configs", file=sys.stderr))
                          if tqdm is not None else None,
                          tokens_per_step=args.tokens_per_step, weight_global_scale=args.weight_global_scale,
                          weight_block_scaling=args.weight_block_scaling,
                          activation_block_scaling=args.activation_block_scaling, plans=args.plans,
                          announce=lambda line: print(f"quads diagnose: {line}", file=sys.stderr, flush=True))
    report["seconds"] = round(time.perf_counter() - started, 2)
    report["model"] = args.model or "embedded tiny-moe-arith"
    print(format_report(report))
    if args.json:
        # a complete report or none, through a unique O_EXCL temporary file (no planted symlink followed)
        atomic_write_text(args.json, json.dumps({"schema": JSON_SCHEMA, **report}, indent=1))
        print(f"\nJSON written to {args.json}")
    return 0


def plan_list(text: str) -> list[str]:
    """argparse type of ``--plans``: comma-separated known plan names (an unknown one exits 2)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    try:
        select_rows(ROWS, names)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("diagnose plans: ")) from None
    return names


def add_parser(sub) -> None:
    from quads.diagnostics.cli_inputs import HelpFormatter as Formatter

    p = sub.add_parser("diagnose", help="rollout-vs-trainer log-prob mismatch per precision config",
                       description=__doc__, formatter_class=Formatter)
    p.add_argument("--model", default=None, help="local HF causal LM directory (default: the embedded MoE)")
    p.add_argument("--prompts", default=None, help="text file, one prompt per line (\\n escapes allowed)")
    p.add_argument("--repeat", type=positive_int, default=1, help="sample each prompt this many times")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--seed", type=seed_int, default=0, help="in [0, 2**32)")
    p.add_argument("--threads", type=thread_count, default=2, help="intra-op CPU threads (at most 4x the CPUs)")
    p.add_argument("--device", type=device_name, default="cpu",
                   help="where the models run (e.g. cuda: the rollout rows then use the kernels)")
    p.add_argument("--tokens-per-step", type=positive_int, default=16,
                   help="completion tokens per cached engine forward (1 = token by token; same log-probs on CPU)")
    p.add_argument("--weight-global-scale", choices=("group", "tensor"), default="group",
                   help="QuadsPolicy.weight_global_scale of every quads row: one NVFP4 global weight scale per "
                        "q/k/v and gate/up group, or per weight")
    p.add_argument("--weight-block-scaling", choices=("6", "4over6"), default=None,
                   help="QuadsPolicy.weight_block_scaling of every quads row: 6 (NVIDIA's recipe) or 4over6 "
                        "(Four Over Six: each 16-element block's max to 4 or 6, whichever errs less); "
                        "default: each plan's own")
    p.add_argument("--activation-block-scaling", choices=("6", "4over6"), default=None,
                   help="QuadsPolicy.activation_block_scaling of every quads row (activations and residual); "
                        "default: each plan's own")
    p.add_argument("--plans", type=plan_list, default=None, metavar="NAME,...",
                   help="score only these rows (row or preset names: " + ", ".join(plan_names())
                        + "); the BF16 floor is always scored; default: every row")
    p.add_argument("--json", default=None, help="also write the report as JSON here (checked before the run)")
    p.set_defaults(func=_cmd)
