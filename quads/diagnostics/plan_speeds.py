"""How fast each plan's whole RL step is, per hardware and model kind: the speed side of the plan
``quads diagnose`` recommends (:mod:`quads.diagnostics.recommend`).

Every value is a measurement in this repository: one whole RL step (rollout generation, the
trainer's forward + backward + optimizer step, the weight sync) of a plan, against BF16's step in
the same run, each configuration alone on the GPU, with the result file it came from. A plan
absent from a ``(hardware, model kind)`` table is **unmeasured** there; the recommendation says so
and never guesses. ``bf16`` is the reference (speed 1 by definition).

Filled from ``python -m benchmarks.rl.rl_step`` on the H200 (``docs/engine.md`` section 6): one
GRPO step of ``QuadsGRPOTrainer`` (64 sequences of 64 + 192 tokens) on models whose GEMMs bound the
step, against BF16 with BF16 parameters (the fair peer: transformers' ``grouped_mm`` experts are
not autocast), median of 3-5 steps after one warm-up, one process. Each entry is the plan's
fastest measured configuration, named in its source: the kernel (``exact``, or ``fast``:
humming's GEMMs, ``QuadsPolicy(kernel="fast")``) and the trainer's parameters (FP32 masters under
BF16 autocast, the example's recipe, or BF16 parameters as the peer's):

* ``("hopper", "moe")``: Qwen3-MoE, 4 layers, hidden 2048, 64 experts top-6 of width 1408;
* ``("hopper", "dense")``: Qwen3, 6 layers, hidden 3072, MLP 8192. The plans with a W4A4 QAT
  trainer or a naive rollout (``naive``, ``sym-qat``, ``w4a16-qat``) and ``quads-boundary``
  (the benchmark's models have 4-6 layers) are unmeasured there.
* ``("blackwell", ...)``: unmeasured: the native-FP4 backend is written, never run.

To add a measurement, add a :class:`StepTime` under its key with the result file (the
whole-RL-step benchmark's output under ``results/``) and the row it read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTime", "HARDWARE", "MODEL_KINDS", "PLAN_SPEEDS", "measured_speed"]

#: hardware kinds the table covers (what ``quads diagnose`` recommends for)
HARDWARE = ("hopper", "blackwell")
MODEL_KINDS = ("dense", "moe")


@dataclass(frozen=True)
class StepTime:
    """One plan's measured whole-RL-step time against BF16's in the same run."""

    plan_s: float
    bf16_s: float
    source: str  # the result file (and row) the two times come from

    @property
    def speedup(self) -> float:
        """BF16's step time over the plan's (> 1: the plan's step is faster)."""
        return self.bf16_s / self.plan_s


_RL_STEP_MOE = "results/h200_2026-12-03_rl_step/rl_step/moe.json (Qwen3-MoE 2.4B, H200, exact kernels, FP32 masters)"
_RL_STEP_DENSE = "results/h200_2026-12-03_rl_step/rl_step/dense.json (Qwen3 dense 0.8B, H200, exact kernels, FP32 masters)"
_RL_STEP_DAY2 = ("results/h200_2026-12-04b_stack_sync/NOTES.md (its rl_step.json files; H200, kernel='fast', "
                 "BF16 parameters, stacked humming siblings, the sorting routing kernel; the mean of the "
                 "same-run pairs: MoE 2.4B four pairs (w4a16 two), dense 0.8B three)")
_RL_STEP_MOE_W4A16 = ("results/h200_2026-12-04_rl_step_profile/moe/rl_step.json (Qwen3-MoE 2.4B, H200, kernel='fast', "
                      "BF16 parameters)")

PLAN_SPEEDS: dict[tuple[str, str], dict[str, StepTime]] = {
    ("hopper", "dense"): {
        "quads": StepTime(0.879, 0.646, _RL_STEP_DENSE),
        "w4a16": StepTime(0.7303, 0.6443, _RL_STEP_DAY2),
    },
    ("hopper", "moe"): {
        "quads": StepTime(0.830, 0.849, _RL_STEP_MOE),
        "quads-experts": StepTime(0.6655, 0.8348, _RL_STEP_DAY2),
        "w4a16": StepTime(0.6795, 0.8245, _RL_STEP_DAY2),
        "w4a16-experts": StepTime(0.768, 0.860, _RL_STEP_MOE_W4A16),
    },
    ("blackwell", "dense"): {},
    ("blackwell", "moe"): {},
}


def measured_speed(plan: str, hardware: str, model_kind: str) -> float | None:
    """``plan``'s measured whole-RL-step speed relative to BF16, or None (unmeasured)."""
    if plan == "bf16":
        return 1.0
    entry = PLAN_SPEEDS.get((hardware, model_kind), {}).get(plan)
    return None if entry is None else entry.speedup
