"""Per-rank body of the multi-process TRL GRPO test (2 CPU processes, gloo, accelerate's DDP).

Each rank runs ``QuadsGRPOTrainer`` with its own rollout replica (the engine TRL sees as
``vllm_generation``), which samples that rank's share of the prompts. Every sync is checked
for exact alignment with the rank's trainer, and the ranks compare fingerprints of their
trainer masters and rollout weights.
"""

from __future__ import annotations

import hashlib
import math
import os

import datasets
import torch
import torch.distributed as dist
from trl import GRPOConfig

from quads.integrations.trl import QuadsGRPOTrainer
from quads.tasks import make_prompts, make_tokenizer
from quads.tensor import NVFP4Tensor
from tests.integrations.test_trl_integration import QUADS_KEYS, _check_exact, tiny_model


def reward_char_codes(completions, **kwargs):
    """A reward that differs between almost any two completions (so every step has a gradient)."""
    return [sum(map(ord, c)) % 11 / 10 for c in completions]


def fingerprint(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rollout_fingerprint(model) -> str:
    parts = []
    for _, p in sorted(model.named_parameters()):
        parts += [p.qdata, p.scale, p.global_encode_scale] if isinstance(p, NVFP4Tensor) else [p]
    return fingerprint(parts)


def grpo_steps(rank: int, world: int, output_dir: str, steps: int = 3) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = make_tokenizer()
    model = tiny_model(tok, seed=rank)  # different inits per rank: DDP's broadcast + the first sync fix it
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=True, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, max_steps=steps, logging_steps=1, report_to=[], learning_rate=1e-2,
        save_strategy="no", seed=0, disable_tqdm=True,
    )
    trainer = QuadsGRPOTrainer(
        model, reward_char_codes, args, train_dataset=datasets.Dataset.from_list(make_prompts(64, seed=0)),
        processing_class=tok, quads_policy="quads",
    )
    engine = trainer.quads_rollout
    syncs, prompts_seen = [], []
    real_sync, real_generate = engine.sync_weights, engine.generate

    def sync_spy():
        n = real_sync()
        trainer_model = trainer.accelerator.unwrap_model(trainer.model)
        syncs.append({
            "step": trainer.state.global_step,
            "n_packed_exact": _check_exact(engine.model, trainer_model),  # asserts bit-exactness
            "rollout": rollout_fingerprint(engine.model),
        })
        return n

    def generate_spy(prompts, *a, **k):
        prompts_seen.append(fingerprint([torch.tensor(p) for p in prompts]))
        return real_generate(prompts, *a, **k)

    engine.sync_weights, engine.generate = sync_spy, generate_spy
    trainer.train()

    trainer_model = trainer.accelerator.unwrap_model(trainer.model)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    gathered = [None] * world
    dist.all_gather_object(gathered, {
        "masters": fingerprint(p for _, p in sorted(trainer_model.named_parameters())),
        "syncs": [s["rollout"] for s in syncs],
        "prompts": prompts_seen,
    })
    return {
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapped": type(trainer.model_wrapped).__name__,
        "sync_steps": [s["step"] for s in syncs],
        "n_packed_exact": [s["n_packed_exact"] for s in syncs],
        "num_syncs": engine.num_syncs,
        "n_logs": len(logs),
        "quads_metrics_finite": all(k in h and math.isfinite(h[k]) for h in logs for k in QUADS_KEYS),
        "trl_is_metrics": all("sampling/importance_sampling_ratio/mean" in h for h in logs),
        "rewards": [h["reward"] for h in logs],
        "masters_equal_across_ranks": len({g["masters"] for g in gathered}) == 1,
        "rollouts_equal_across_ranks": all(len(set(s)) == 1 for s in zip(*[g["syncs"] for g in gathered], strict=True)),
        "rollout_changed_between_syncs": len(set(gathered[0]["syncs"])) == len(syncs),
        "prompts_differ_across_ranks": all(len(set(p)) == world for p in zip(*[g["prompts"] for g in gathered], strict=True)),
    }
