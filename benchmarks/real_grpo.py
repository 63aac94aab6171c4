"""GRPO on the real model (SmolLM2-135M-Instruct) under one precision configuration and seed.

A self-contained GRPO loop (no TRL: the GPU image has none) built from quads' parts, so each
configuration runs exactly the same algorithm:

* **rollout**: the configuration's rollout engine (``build_rollout_model`` of the trainer's
  masters; BF16, FP8 W8A8 or NVFP4 W4A4 with or without residual compensation) samples ``G``
  completions per prompt (T = 1, no top-k / top-p) and returns each sampled token's log-prob from
  the engine's own float32 logits. On CUDA it samples with quads' :class:`GraphedDecoder` (the
  decode step captured as one CUDA graph: 15x faster than ``generate`` at this size); elsewhere
  with transformers ``generate`` (``--engine`` overrides; both give the same greedy tokens,
  ``tests/test_real_grpo_sampling.py``). The engine differs from the trainer's forward as a
  separate inference engine does, so BF16 shows an engine-drift floor: it decodes token by token
  against a key/value cache with eager attention (the trainer: one teacher-forced SDPA pass over
  the whole sequence), in the rollout's BF16 weights at decode batch shapes (the trainer: FP32
  masters under BF16 autocast);
* **trainer**: FP32 masters, forward under BF16 autocast (like TRL's ``bf16=True``), with the
  configuration's trainer policy (none, W4A16 QAT or symmetric W4A4 QAT); one teacher-forced
  forward gives the trainer log-probs;
* **loss**: GRPO, group-normalised advantages, one policy-gradient step per batch (ratio
  ``exp(lp - sg(lp))``), token-level normalisation, no KL term; TRL's ``sequence_mask``
  importance correction against the rollout (sequence ratio ``exp(sum(lp_train - lp_rollout))``,
  sequences with ratio > 3 masked);
* **sync**: after every optimizer step ``sync_weights_`` re-quantizes the masters into the rollout.

Every step writes one JSON line to ``<out>/<config>-s<seed>/metrics.jsonl``: reward, final-answer
accuracy, step credit, completion length, the mismatch metrics of
:func:`quads.diagnostics.mismatch.mismatch_metrics` (gap mean / p99 / max, k3 KL, raw IS ratios,
masked fraction) and phase timings. Held-out accuracy (greedy, exact final answer) is measured
before and after, with the configuration's rollout engine and with the BF16 masters, into
``summary.json``. ``--resume`` continues from ``state.pt`` (masters + optimizer + RNG), so a long
run can be cut into pieces that each fit a 10-minute command.

    python -m benchmarks.real_grpo --config quads --seed 0 --steps 200 --out runs/real_grpo --device cuda
    python -m benchmarks.real_grpo --config naive --seed 0 --steps 3 --prompts 2 --group 2 --max-new-tokens 64 \\
        --eval-problems 4 --out runs/real_grpo_smoke           # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

import quads
from quads.diagnostics.fp8_reference import fp8_w8a8_, round_fp8_weights_
from quads.diagnostics.mismatch import mismatch_metrics
from quads.diagnostics.scoring import positions_from_mask
from quads.integrations.graphed_decode import GraphedDecoder, SamplingSpec
from quads.models import find_smollm2, load_smollm2
from quads.policies import POLICY_PRESETS, build_rollout_model, copy_model
from quads.policies.presets import with_residual_fraction
from quads.tasks.chain_sum import MAX_NEW_TOKENS, chat_prompt, make_problems, score_completion
from quads.tensor.files import open_for_append, write_atomically

FP8 = "fp8"
#: configuration -> (trainer policy or None, rollout policy / FP8 / None)
CONFIGS = {
    "bf16": (None, None),
    "naive": (POLICY_PRESETS["naive"].trainer, POLICY_PRESETS["naive"].rollout),
    "sym-qat": (POLICY_PRESETS["sym-qat"].trainer, POLICY_PRESETS["sym-qat"].rollout),
    "w4a16-qat": (POLICY_PRESETS["w4a16-qat"].trainer, POLICY_PRESETS["w4a16-qat"].rollout),
    "quads": (POLICY_PRESETS["quads"].trainer, POLICY_PRESETS["quads"].rollout),
    "quads-50": (POLICY_PRESETS["quads"].trainer, with_residual_fraction(POLICY_PRESETS["quads"], 0.5).rollout),  # the paper's k
    "fp8": (None, FP8),
}
IS_CLIP_MAX = 3.0


def build_models(base, config: str, device):
    trainer_policy, rollout_policy = CONFIGS[config]
    trainer = copy_model(base, torch.float32, device)
    trainer.requires_grad_(True)
    trainer.train()
    if trainer_policy is not None:
        quads.quantize_(trainer, trainer_policy)
    if rollout_policy == FP8:
        rollout = fp8_w8a8_(copy_model(trainer, torch.bfloat16, device), weights="stored")
    else:
        rollout = build_rollout_model(trainer, rollout_policy, dtype=torch.bfloat16, device=device)
    # A different attention kernel from the trainer's (SDPA), as a separate engine has (and as
    # `quads diagnose` does): the BF16 configuration then measures an engine-drift floor.
    rollout.set_attn_implementation("eager")
    rollout.eval()
    return trainer, rollout


def sync_rollout(rollout, trainer) -> None:
    """``sync_weights_``, then (FP8 rollout) the copied weights rounded to E4M3 in place."""
    quads.sync_weights_(rollout, trainer)
    round_fp8_weights_(rollout)


def encode_prompts(tok, problems, device):
    tok.padding_side = "left"
    texts = [chat_prompt(tok, p["numbers"]) for p in problems]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def completion_mask(completion: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including the first EOS, 0 after it."""
    is_eos = completion == eos_id
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return (~after).long()


ENGINES = ("graphed", "generate")


class RolloutSampler:
    """The rollout engine's sampling: ``GraphedDecoder`` (``"graphed"``) or ``generate``.

    One decoder per sampling mode (sampled / greedy), so each keeps its captured CUDA graph across
    steps; the graphs read the rollout's weights in place, so they stay valid across
    ``sync_weights_``. Returns completions padded with ``pad_id`` after the first EOS and each
    token's log-prob under the engine's float32 logits (T = 1: the raw distribution).
    """

    def __init__(self, model, eos_id: int, pad_id: int, engine: str = "auto"):
        if engine == "auto":
            engine = "graphed" if next(model.parameters()).device.type == "cuda" else "generate"
        if engine not in ENGINES:
            raise ValueError(f"RolloutSampler: engine must be one of {ENGINES} or 'auto', got {engine!r}")
        self.model, self.eos_id, self.pad_id, self.engine = model, int(eos_id), int(pad_id), engine
        self._decoders: dict[bool, GraphedDecoder] = {}

    @torch.no_grad()
    def sample(self, ids, attn, max_new_tokens: int, do_sample: bool = True):
        if self.engine == "graphed":
            decoder = self._decoders.get(do_sample)
            if decoder is None:
                decoder = self._decoders[do_sample] = GraphedDecoder(self.model)
            spec = SamplingSpec(max_new_tokens=max_new_tokens, eos_token_ids=(self.eos_id,),
                                pad_token_id=self.pad_id, do_sample=do_sample)
            return decoder.generate(ids, attn, spec)
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        out = self.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                  pad_token_id=self.pad_id, eos_token_id=self.eos_id, output_logits=True,
                                  return_dict_in_generate=True, **kwargs)
        completion = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()
        return completion, torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


def sample(sampler: RolloutSampler, ids, attn, group: int, max_new_tokens: int):
    """``group`` completions per prompt and their rollout log-probs."""
    ids, attn = ids.repeat_interleave(group, 0), attn.repeat_interleave(group, 0)
    completion, logps = sampler.sample(ids, attn, max_new_tokens)
    return ids, attn, completion, logps


def trainer_logps(trainer, prompt_ids, prompt_attn, completion, cmask):
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    attn = torch.cat([prompt_attn, cmask], dim=1)
    n = completion.shape[1]
    device_type = input_ids.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16):  # positions skip left padding, as in generate
        logits = trainer(input_ids=input_ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                         logits_to_keep=n + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def held_out_accuracy(sampler: RolloutSampler, tok, problems, device, max_new_tokens: int, batch: int = 64) -> float:
    correct = 0
    for s in range(0, len(problems), batch):
        chunk = problems[s : s + batch]
        ids, attn = encode_prompts(tok, chunk, device)
        completion, _ = sampler.sample(ids, attn, max_new_tokens, do_sample=False)
        for p, c in zip(chunk, completion):
            correct += score_completion(tok.decode(c, skip_special_tokens=True), p["numbers"])["final"]
    return correct / max(len(problems), 1)


def evaluate(trainer, sampler: RolloutSampler, tok, problems, device, max_new_tokens) -> dict:
    """Greedy held-out accuracy with the rollout engine and with the BF16 masters (same engine kind)."""
    master = copy_model(trainer, torch.bfloat16, device).eval()
    master_sampler = RolloutSampler(master, sampler.eos_id, sampler.pad_id, sampler.engine)
    return {"rollout": held_out_accuracy(sampler, tok, problems, device, max_new_tokens),
            "master_bf16": held_out_accuracy(master_sampler, tok, problems, device, max_new_tokens)}


def _write_atomically(path: Path, write) -> None:
    """``write(file)`` into a new temporary file beside ``path``, then renamed over it
    (:func:`quads.tensor.files.write_atomically`): an interrupted run leaves the old file or the
    new one, never half of one, and a planted link is never written through."""
    write_atomically(path, write)


def _write_json(path: Path, obj) -> None:
    _write_atomically(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def _now(device) -> float:
    """Wall clock after the device's queued work (phase timings must not leak into the next phase)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def grpo_backward(trainer, p_ids, p_attn, completion, cmask, rollout_lp, adv, micro_batch: int):
    """Teacher-forced trainer log-probs and the GRPO loss's gradient, in micro-batches of sequences.

    The loss is the whole batch's (normalised by its token count), so the gradient does not depend
    on ``micro_batch``; only the activation peak does. Returns (detached log-probs, loss value).
    """
    m = cmask.float()
    tokens = m.sum().clamp_min(1.0)
    lps, loss_total = [], 0.0
    for rows in torch.arange(completion.shape[0], device=completion.device).split(micro_batch):
        lp = trainer_logps(trainer, p_ids[rows], p_attn[rows], completion[rows], cmask[rows])
        ratio = torch.exp(((lp.detach() - rollout_lp[rows]) * m[rows]).sum(-1))
        is_weight = torch.where(ratio <= IS_CLIP_MAX, ratio, torch.zeros_like(ratio))  # TRL sequence_mask
        pg = torch.exp(lp - lp.detach())  # = 1, gradient of lp
        loss = -((is_weight * adv[rows])[:, None] * pg * m[rows]).sum() / tokens
        loss.backward()
        loss_total += loss.item()
        lps.append(lp.detach())
    return torch.cat(lps), loss_total


def grpo_step(trainer, rollout, sampler, tok, opt, problems, args, device) -> dict:
    t0 = _now(device)
    p_ids, p_attn = encode_prompts(tok, problems, device)
    p_ids, p_attn, completion, rollout_lp = sample(sampler, p_ids, p_attn, args.group, args.max_new_tokens)
    cmask = completion_mask(completion, tok.eos_token_id)
    t_gen = _now(device)
    scores = [score_completion(tok.decode(c, skip_special_tokens=True), problems[i // args.group]["numbers"])
              for i, c in enumerate(completion)]
    rewards = torch.tensor([s["reward"] for s in scores], device=device)
    grouped = rewards.view(-1, args.group)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    m = cmask.float()
    opt.zero_grad(set_to_none=True)
    lp, loss_total = grpo_backward(trainer, p_ids, p_attn, completion, cmask, rollout_lp, adv, args.train_micro_batch)
    metrics = mismatch_metrics(rollout_lp, lp, cmask.bool(), is_mode="sequence_mask", clip_max=IS_CLIP_MAX, prefix="")
    grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), args.max_grad_norm).item()
    opt.step()
    t_train = _now(device)
    sync_rollout(rollout, trainer)
    t_sync = _now(device)
    metrics.update({
        "reward": rewards.mean().item(),
        "final_acc": sum(s["final"] for s in scores) / len(scores),
        "step_credit": sum(s["steps"] for s in scores) / len(scores),
        "completion_len": m.sum(-1).mean().item(),
        "loss": loss_total, "grad_norm": grad_norm,
        "t_generate": t_gen - t0, "t_train": t_train - t_gen, "t_sync": t_sync - t_train,
    })
    return metrics


def run(args) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else find_smollm2()
    if model_dir is None:
        sys.exit("SmolLM2 is not built: run `quads fetch-real-model` (or pass --model DIR)")
    base, tok = load_smollm2(model_dir)
    run_dir = Path(args.out) / f"{args.config}-s{args.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / "state.pt"
    torch.manual_seed(args.seed)
    trainer, rollout = build_models(base, args.config, device)
    del base
    sampler = RolloutSampler(rollout, tok.eos_token_id, tok.pad_token_id, args.engine)
    opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    heldout = make_problems(args.eval_problems, seed=0, split="heldout")
    summary_path = run_dir / "summary.json"
    start = 0
    if args.resume and state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=True)  # no pickle
        trainer.load_state_dict(state["trainer"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"].cpu())  # map_location moved it
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"].cpu())
        start = state["step"]
        sync_rollout(rollout, trainer)
        summary = json.loads(summary_path.read_text())
    else:
        write_atomically(run_dir / "metrics.jsonl", "")
        summary = {"config": args.config, "seed": args.seed, "args": vars(args),
                   "engine": sampler.engine,
                   "heldout_before": evaluate(trainer, sampler, tok, heldout, device, args.max_new_tokens)}
        _write_json(summary_path, summary)
        print(f"[{args.config} s{args.seed}] held-out before: {summary['heldout_before']}", flush=True)
    rng = random.Random(f"{args.seed}/{start}")
    target = args.total_steps or start + args.steps  # the run's last step
    end = min(start + args.steps, target)
    began = time.perf_counter()
    with open_for_append(run_dir / "metrics.jsonl") as log:
        for step in range(start, end):
            if args.time_budget_s and time.perf_counter() - began > args.time_budget_s:
                end = step  # out of time for this call: save the state, continue with --resume
                print(f"[{args.config} s{args.seed}] time budget reached after step {step - 1}", flush=True)
                break
            problems = make_problems(args.prompts, seed=rng.randrange(2**31), split="train")
            metrics = {"step": step, **grpo_step(trainer, rollout, sampler, tok, opt, problems, args, device)}
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            print(f"[{args.config} s{args.seed}] step {step}: reward {metrics['reward']:.3f} "
                  f"acc {metrics['final_acc']:.3f} gap mean {metrics['logp_gap_mean']:.4f} "
                  f"max {metrics['logp_gap_max']:.3f} masked {metrics['is_masked_fraction']:.2f} "
                  f"({metrics['t_generate']:.1f}+{metrics['t_train']:.1f}+{metrics['t_sync']:.1f} s)", flush=True)
    done = end >= target
    if done:
        summary["heldout_after"] = evaluate(trainer, sampler, tok, heldout, device, args.max_new_tokens)
        summary["steps"] = end
        print(f"[{args.config} s{args.seed}] held-out after {end} steps: {summary['heldout_after']}", flush=True)
    _write_json(summary_path, summary)
    if not done or args.keep_state:
        state = {"trainer": trainer.state_dict(), "optimizer": opt.state_dict(), "step": end,
                 "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state() if device.type == "cuda" else None}
        _write_atomically(state_path, lambda f: torch.save(state, f))
    elif state_path.exists():
        state_path.unlink()
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200, help="steps to run in this call")
    p.add_argument("--total-steps", type=int, default=None,
                   help="the run's length; with --resume, calls continue until it (held-out 'after' at the end)")
    p.add_argument("--resume", action="store_true", help="continue from <run>/state.pt if present")
    p.add_argument("--keep-state", action="store_true", help="keep state.pt after the last step")
    p.add_argument("--time-budget-s", type=float, default=0,
                   help="stop starting new steps after this many seconds (then save state.pt; resume later)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--train-micro-batch", type=int, default=16,
                   help="sequences per trainer forward/backward (same loss; bounds the activation peak: "
                        "64 sequences at once took ~28 GB per run on the H200)")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-problems", type=int, default=64)
    p.add_argument("--model", default=None, help="SmolLM2 directory (default: the quads cache)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--engine", choices=("auto",) + ENGINES, default="auto",
                   help="rollout sampling: GraphedDecoder ('graphed', the default on CUDA) or generate (elsewhere)")
    p.add_argument("--out", default="runs/real_grpo")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
