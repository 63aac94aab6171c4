"""The whole RL step through the product: generate + train + sync, BF16 vs QUADS exact vs fast.

    python -m benchmarks.rl.rl_step --out DIR [--models moe,dense] [--variants bf16@fp32,bf16@bf16,quads@fp32,quads-fast@fp32]
        [--prompts 8] [--generations 8] [--prompt-len 64] [--new-tokens 192] [--warmup 1] [--steps 3] [--budget-s 540]
        [--humming-cache DIR]
    python -m benchmarks.rl.rl_step --tiny --device cpu --out /tmp/rl_step        # CPU smoke run of this script

One GRPO step of :class:`quads.integrations.trl.QuadsGRPOTrainer` (TRL 1.16's GRPOTrainer) is timed
per variant, one process, each variant a fresh model with the same seed (the same weights), so the
ratios are same-run ratios. The step: the weight sync (``sync_weights_``: re-quantize the masters
into the rollout; a BF16 copy for ``bf16``), the rollout (prefill + ``--new-tokens`` sampled tokens
for ``--prompts`` x ``--generations`` sequences through the CUDA-graph decoder), TRL's scoring
forward of the trainer (``old_per_token_logps``, no grad: the trainer's side of the importance
ratio), the GRPO loss forward + backward and AdamW, on the same sequences. Completions have a fixed
length (the tokenizer's EOS lies outside the model's vocabulary, so it is never sampled) and the
reward is a constant-cost dummy; nothing else varies between variants.

Phases (seconds, the device synchronized at each boundary): ``generate`` and ``sync`` from the
rollout engine (``timing/quads/*``), ``score`` (TRL's no-grad scoring forward, timed around it),
``train`` = step - generate - sync - score (loss forward, backward, AdamW, TRL's host work:
rewards, decoding the completions, metrics), ``step`` (the optimizer step's wall clock). Median
over ``--steps`` steps after ``--warmup`` (the first step holds the graph capture and kernel
compilation: ``first_step_s``). TRL's own work is inside ``train`` for every variant alike.

First step and humming's disk cache: ``--humming-cache DIR`` points humming's JIT cache at ``DIR``
(default: the environment's, :func:`~quads.ops.backends.humming.library.humming_cache_dir`); each
row records ``humming_cache``: ``"cold"`` when the directory was missing or empty as its variant
started, else ``"warm"``. A cold first step: a fresh, empty ``DIR``; a warm one: the same ``DIR``
again in a new process (humming's in-process cache lives as long as the process).

Models (random init from a config, no hub; vocabulary 32000, embeddings and ``lm_head`` BF16/FP32
in every variant, never NVFP4):

* ``moe``: Qwen3-MoE, 4 layers, hidden 2048, 32/4 heads of 128, 64 experts top-6 of width 1408
  (2.4B parameters), transformers' ``grouped_mm`` experts;
* ``moe-128e``: Qwen3-30B-A3B's widths, 4 layers: hidden 2048, 32/4 heads of 128, 128 experts top-8
  of width 768;
* ``moe-2880``: GPT-OSS's widths, 4 layers: hidden 2880, 64/8 heads of 64, 32 experts top-4 of
  width 2880 (humming serves 2880 through its padded layout);
* ``dense``: Qwen3, 6 layers, hidden 3072, MLP 8192, 24/8 heads of 128 (0.8B parameters);
* ``dense-4096``: Qwen3, 4 layers, hidden 4096, MLP 12288, 32/8 heads of 128.

Variants ``<preset>@<masters>``: a preset of ``POLICY_PRESETS`` (``bf16``, ``quads``, ...) or
``quads-fast`` (``quads`` with ``QuadsPolicy(side="rollout", kernel="fast")``: humming's GEMMs);
masters ``fp32`` (FP32 parameters under BF16 autocast: the example's recipe) or ``bf16`` (BF16
parameters). Both ways matter for the BF16 peer of an MoE: transformers' ``grouped_mm`` experts
are not autocast, so with FP32 masters the BF16 MoE multiplies its experts in FP32 (the QUADS
trainer's grouped path multiplies in the autocast dtype); ``bf16@bf16`` is the fair BF16 peer.

``--profile``: one more step, after the timed ones, runs under ``torch.profiler`` (CPU and CUDA activity, kernels inside
CUDA-graph replays included); each kernel is put in the phase whose range holds its start (the
device is synchronized at every phase boundary), and ``<out>/profile_<model>_<variant>.json``
holds, per phase, the range's wall time, the sum of kernel times and the top kernels by time.

Writes ``<out>/rl_step.json`` (every row, the configuration, peak memory per variant) and
``<out>/rl_step.md`` (the table), and appends one row per phase to the results CSV
(``benchmarks/timing.py``: kernel ``rl_step/<phase>``, us = seconds x 1e6).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.timing import add_csv_argument, append_results  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402

VOCAB = 32000
PHASES = ("step", "generate", "score", "train", "sync")
DEFAULT_VARIANTS = "bf16@fp32,bf16@bf16,quads@fp32,quads-fast@fp32"
#: name -> (MoE, layers, hidden, heads, key/value heads, head dim, MLP or expert width, experts, top-k)
MODELS = {
    "moe": (True, 4, 2048, 32, 4, 128, 1408, 64, 6),
    "moe-128e": (True, 4, 2048, 32, 4, 128, 768, 128, 8),
    "moe-2880": (True, 4, 2880, 64, 8, 64, 2880, 32, 4),
    "dense": (False, 6, 3072, 24, 8, 128, 8192, 0, 0),
    "dense-4096": (False, 4, 4096, 32, 8, 128, 12288, 0, 0),
}


def build_model(kind: str, tiny: bool, device: str):
    """The benchmark model, FP32, random weights (seed 0), on ``device``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB // (100 if tiny else 1), max_position_embeddings=4096, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; use one of {', '.join(MODELS)}")
    moe, layers, hidden, heads, kv_heads, head_dim, width, experts, top_k = MODELS[kind]
    if tiny:
        layers, hidden, heads, kv_heads, head_dim, width, experts, top_k = 2, 64, 4, 2, 16, 128, 8 if moe else 0, 2
    common.update(head_dim=head_dim, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=kv_heads)
    if moe:
        cfg = Qwen3MoeConfig(intermediate_size=3 * hidden, moe_intermediate_size=width // (4 if tiny else 1),
                             num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
                             norm_topk_prob=True, **common)
        cfg._experts_implementation = "grouped_mm"
        cls = Qwen3MoeForCausalLM
    else:
        cfg = Qwen3Config(intermediate_size=width, **common)
        cls = Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg).float()
    return model


def make_tokenizer(vocab: int):
    """Tokens ``t0 .. t{vocab-1}`` (one per model id) plus ``<eos>`` beyond the model's vocabulary:
    the rollout can never sample it, so every completion has the full length. The pad token is
    ``t0`` (the model's config takes it as its padding index; prompts have one length: no padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    words.update({"<eos>": vocab, "<unk>": vocab + 1})
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="t0", unk_token="<unk>")


def make_dataset(n: int, prompt_len: int, vocab: int):
    import datasets

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, prompt_len), generator=g).tolist()
    return datasets.Dataset.from_list([{"prompt": " ".join(f"t{i}" for i in row)} for row in ids])


def dummy_reward(completions, **kwargs):
    """A reward with variance (non-zero advantages) and no model in it."""
    return [(len(c) * 7919 % 101) / 100 for c in completions]


def resolve(variant: str):
    """``<preset>@<masters>`` -> (PolicyPreset, masters dtype)."""
    from quads.policies import POLICY_PRESETS
    from quads.policies.presets import with_kernel

    name, _, masters = variant.partition("@")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if masters not in dtypes:
        raise ValueError(f"variant {variant!r}: masters must be fp32 or bf16 (e.g. quads@fp32)")
    base_name = name[: -len("-fast")] if name.endswith("-fast") and name not in POLICY_PRESETS else name
    if base_name not in POLICY_PRESETS:
        raise ValueError(f"variant {variant!r}: unknown preset {name!r} (a POLICY_PRESETS name, optionally + '-fast')")
    preset = POLICY_PRESETS[base_name]
    if base_name != name:
        try:
            preset = with_kernel(preset, "fast")
        except ValueError as err:
            raise ValueError(f"variant {variant!r}: {err}") from None
    return preset, dtypes[masters]


class NotApplicable(Exception):
    """The variant's plan cannot apply to the model (e.g. routed experts only on a dense model)."""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _PhaseProfile:
    """The last step under ``torch.profiler``, its kernels summed per phase (module doc, ``--profile``)."""

    TOP = 40

    def __init__(self, trainer, last_step: int, path: Path):
        from transformers import TrainerCallback

        self.path, self.prof = path, None
        # CPU runs (smoke tests of this script) sum the CPU ops instead of kernels
        self.device_type = torch.autograd.DeviceType.CUDA if torch.cuda.is_available() else torch.autograd.DeviceType.CPU
        prof_of = self
        engine = trainer.quads_rollout
        for name in ("generate", "sync_weights"):
            setattr(engine, name, self._ranged(getattr(engine, name), name.split("_")[0]))
        trainer._get_per_token_logps_and_entropies = self._ranged(trainer._get_per_token_logps_and_entropies, "score")

        class Last(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == last_step:
                    from torch.profiler import ProfilerActivity, profile

                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                    prof_of.prof = profile(activities=activities)
                    prof_of.prof.__enter__()

            def on_step_end(self, args, state, control, **kw):
                if prof_of.prof is not None:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    prof_of.prof.__exit__(None, None, None)
                    prof_of.write()
                    prof_of.prof = None

        trainer.add_callback(Last())

    @staticmethod
    def _ranged(fn, phase: str):
        def ranged(*a, **k):
            if phase == "score" and torch.is_grad_enabled():
                return fn(*a, **k)
            with torch.profiler.record_function(f"rl_step:{phase}"):
                return fn(*a, **k)
        return ranged

    def write(self) -> None:
        events = self.prof.events()
        ranges = [(e.name.split(":", 1)[1], e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith("rl_step:")]
        step = (min(e.time_range.start for e in events), max(e.time_range.end for e in events))
        phases: dict[str, dict] = {}
        for e in events:
            if e.device_type != self.device_type or e.time_range.elapsed_us() <= 0:
                continue
            start = e.time_range.start
            phase = next((name for name, a, b in ranges if a <= start <= b), "train")
            ph = phases.setdefault(phase, {"kernel_us": 0.0, "kernels": {}})
            k = ph["kernels"].setdefault(e.name[:160], [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
            ph["kernel_us"] += e.time_range.elapsed_us()
        wall = {name: 0.0 for name, _, _ in ranges}
        for name, a, b in ranges:
            wall[name] += b - a
        wall["step"] = step[1] - step[0]
        out = {"wall_us": wall, "phases": {}}
        for phase, ph in phases.items():
            top = sorted(ph["kernels"].items(), key=lambda kv: -kv[1][1])[: self.TOP]
            out["phases"][phase] = {"kernel_us": round(ph["kernel_us"], 1), "distinct": len(ph["kernels"]),
                                    "launches": sum(c for c, _ in ph["kernels"].values()),
                                    "top": [{"kernel": n, "calls": c, "us": round(t, 1)} for n, (c, t) in top]}
        write_atomically(self.path, json.dumps(out, indent=1))
        summary = ", ".join(f"{p} {v['kernel_us'] / 1e3:.1f} ms kernels" for p, v in out["phases"].items())
        print(f"[rl_step] profile -> {self.path}: {summary}; ranges (ms) "
              f"{ {k: round(v / 1e3, 1) for k, v in wall.items()} }", flush=True)


class _Clock:
    """Step wall clock (TRL callback) and TRL's no-grad scoring forwards (method wrapper)."""

    def __init__(self, trainer, device: str):
        from transformers import TrainerCallback

        self.device, self.step_s, self.score_s, self._score, self._t = device, [], [], 0.0, None
        clock = self

        class Steps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                _sync(device)
                clock._t, clock._score = time.perf_counter(), 0.0

            def on_step_end(self, args, state, control, **kw):
                _sync(device)
                clock.step_s.append(time.perf_counter() - clock._t)
                clock.score_s.append(clock._score)

        trainer.add_callback(Steps())
        inner = trainer._get_per_token_logps_and_entropies

        def timed(*a, **k):
            if torch.is_grad_enabled():
                return inner(*a, **k)
            _sync(device)
            t = time.perf_counter()
            out = inner(*a, **k)
            _sync(device)
            self._score += time.perf_counter() - t
            return out

        trainer._get_per_token_logps_and_entropies = timed


def humming_cache_state(path: Path) -> str:
    """``"cold"`` when humming's cache directory ``path`` is missing or empty, else ``"warm"``."""
    return "warm" if path.is_dir() and any(path.iterdir()) else "cold"


def run_variant(kind: str, variant: str, args) -> dict:
    from trl import GRPOConfig

    from quads.integrations.trl import QuadsGRPOTrainer

    from quads.policies.presets import preset_problem

    from quads.ops.backends.humming.library import humming_cache_dir

    cache_state = humming_cache_state(humming_cache_dir())
    preset, masters = resolve(variant)
    model = build_model(kind, args.tiny, args.device).to(masters)
    problem = preset_problem(preset, model)
    if problem:
        raise NotApplicable(problem)
    params = sum(p.numel() for p in model.parameters())
    tok = make_tokenizer(model.config.vocab_size)
    total = args.warmup + args.steps + (1 if args.profile else 0)  # the profiled step is not timed
    batch = args.prompts * args.generations
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, use_cpu=args.device == "cpu", bf16=True, per_device_train_batch_size=batch,
                            num_generations=args.generations, max_completion_length=args.new_tokens, temperature=1.0,
                            learning_rate=1e-6, lr_scheduler_type="constant", max_steps=total, logging_steps=1,
                            save_strategy="no", report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0)
        trainer = QuadsGRPOTrainer(model, dummy_reward, config, train_dataset=make_dataset(args.prompts * total, args.prompt_len,
                                   model.config.vocab_size), processing_class=tok, quads_policy=preset)
        clock = _Clock(trainer, args.device)
        if args.profile:
            _PhaseProfile(trainer, total - 1, Path(args.out) / f"profile_{kind}_{variant.replace('@', '_')}.json")
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "timing/quads/generate_s" in h]
        decode = {**trainer.quads_rollout.decode_report(), **trainer.quads_rollout.sync_report()}
        kernels = kernel_counts(trainer.quads_rollout.model)
        lengths = [h.get("completions/mean_length") for h in logs]
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
        del trainer, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    timed = slice(args.warmup, args.warmup + args.steps)
    gen = [h["timing/quads/generate_s"] for h in logs]
    syn = [h["timing/quads/sync_s"] for h in logs]
    phases = {"step": clock.step_s, "generate": gen, "score": clock.score_s, "sync": syn,
              "train": [s - g - y - c for s, g, y, c in zip(clock.step_s, gen, syn, clock.score_s)]}
    row = {"model": kind, "variant": variant, "preset": preset.name, "masters": str(masters).replace("torch.", ""),
           "params": params, "first_step_s": clock.step_s[0], "humming_cache": cache_state, "peak_gib": round(peak, 2),
           "decode": decode, "completion_len": lengths, "kernels": kernels, "per_step": phases}
    row.update({f"{p}_s": statistics.median(v[timed]) for p, v in phases.items()})
    return row


def kernel_counts(model) -> dict[str, int]:
    """How many rollout modules run each kernel class (e.g. ``{"HummingLinearKernel": 24, ...}``):
    whether every layer of a ``-fast`` variant is on the fast kernels."""
    from collections import Counter

    from quads.policies.modules import RolloutModule

    return dict(Counter(type(m.quads_kernel()).__name__ for m in model.modules() if isinstance(m, RolloutModule)))


def table(rows: list[dict]) -> str:
    """Markdown: per model, each variant's median phases, its step against the BF16 peers."""
    head = ("| model | variant | step s | vs bf16@fp32 | vs bf16@bf16 | generate s | score s | train s | sync s | "
            "first step s (humming cache) | peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        peers = {p["variant"]: p["step_s"] for p in rows if p["model"] == r["model"]}
        ratio = lambda v: f"{peers[v] / r['step_s']:.2f}x" if v in peers else "-"  # noqa: E731  (>1: faster)
        lines.append(f"| {r['model']} | {r['variant']} | {r['step_s']:.3f} | {ratio('bf16@fp32')} | {ratio('bf16@bf16')} | "
                     f"{r['generate_s']:.3f} | {r['score_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.4f} | "
                     f"{r['first_step_s']:.1f} ({r['humming_cache']}) | {r['peak_gib']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="moe,dense")
    p.add_argument("--variants", default=None, help=f"default {DEFAULT_VARIANTS} (CPU: without quads-fast)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=0, help="start no new variant after this many seconds (0: none)")
    p.add_argument("--profile", action="store_true", help="profile the last step per phase (module doc)")
    p.add_argument("--humming-cache", default=None, metavar="DIR",
                   help="humming's JIT cache directory (default: the environment's); module doc")
    p.add_argument("--tiny", action="store_true", help="toy widths (a smoke run of this script)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_csv_argument(p)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step holds the capture and compilation)")
    variants = (args.variants or (DEFAULT_VARIANTS if args.device == "cuda" else "bf16@fp32,bf16@bf16,quads@fp32")).split(",")
    for v in variants:
        try:
            resolve(v)
        except ValueError as err:
            p.error(str(err))
    if args.humming_cache:  # read by humming at each compile; set before any variant imports it
        os.environ["HUMMING_CACHE_DIR"] = os.path.abspath(os.path.expanduser(args.humming_cache))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows, skipped, failed = time.time(), [], [], []
    for kind in args.models.split(","):
        for variant in variants:
            if args.budget_s and time.time() - start > args.budget_s:
                skipped.append(f"{kind}/{variant}")
                continue
            t0 = time.time()
            try:
                row = run_variant(kind, variant, args)
            except NotApplicable as err:
                print(f"[rl_step] {kind} {variant}: not applicable ({err})", flush=True)
                continue
            except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others' rows
                failed.append(f"{kind}/{variant}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                print(f"[rl_step] {kind} {variant}: FAILED {failed[-1]}", flush=True)
                import traceback

                traceback.print_exc()
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            rows.append(row)
            print(f"[rl_step] {kind} {variant}: step {row['step_s']:.3f} s (generate {row['generate_s']:.3f}, score "
                  f"{row['score_s']:.3f}, train {row['train_s']:.3f}, sync {row['sync_s']:.4f}; first step "
                  f"{row['first_step_s']:.1f} s, humming cache {row['humming_cache']}; {row['decode']['decoder']}, "
                  f"{row['decode']['captures']} capture(s); sync {row['decode']['sync']} {row['decode']['replays']} "
                  f"replay(s) {row['decode']['sync_blocker'] or ''}; kernels {row['kernels']}) "
                  f"[{time.time() - t0:.0f} s]", flush=True)
            write_atomically(out / "rl_step.json", json.dumps({"args": vars(args), "rows": rows, "skipped": skipped, "failed": failed}, indent=1))
    text = table(rows) + (f"\n\nnot run (--budget-s): {', '.join(skipped)}" if skipped else "")
    text += "".join(f"\n\nFAILED {f}" for f in failed)
    write_atomically(out / "rl_step.json", json.dumps({"args": vars(args), "rows": rows, "skipped": skipped, "failed": failed}, indent=1))
    write_atomically(out / "rl_step.md", text + "\n")
    print(text)
    shape = f"B={args.prompts}x{args.generations} prompt={args.prompt_len} new={args.new_tokens}"
    append_results([{"kernel": f"rl_step/{phase}", "shape": f"{r['model']} {shape}", "variant": r["variant"],
                     "us": r[f"{phase}_s"] * 1e6} for r in rows for phase in PHASES],
                   raw=os.path.abspath(out / "rl_step.json"), csv_path=args.csv)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
