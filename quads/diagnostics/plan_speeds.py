"""How fast each plan's whole RL step is, per hardware and model kind: the speed side of the plan
``quads diagnose`` recommends (:mod:`quads.diagnostics.recommend`).

Every value is a measurement in this repository: one whole RL step (rollout generation, the
trainer's forward + backward + optimizer step, the weight sync) of a plan, against BF16's step in
the same run, each configuration alone on the GPU, with the result file it came from. A plan
absent from a ``(hardware, model kind)`` table is **unmeasured** there; the recommendation says so
and never guesses. ``bf16`` is the reference (speed 1 by definition).

Filled from:

* ``("hopper", "dense")``: ``python -m benchmarks.real_grpo --config C --seed 0 --steps 8
  --eval-problems 4 --device cuda`` on the H200, SmolLM2-135M-Instruct (30 layers, a host-bound
  model at this size: every phase is a chain of small kernels), means over steps 1-7;
  ``docs/real_model.md``, "The step, each configuration alone". The other plans (``w4a16``,
  ``quads-boundary``, the ``-experts`` plans) are unmeasured there.
* ``("hopper", "moe")``: unmeasured (no whole-RL-step MoE run is in the repository yet).
* ``("blackwell", ...)``: unmeasured: the native-FP4 backend is written, never run.

To add a measurement, add a :class:`StepTime` under its key with the result file (the
whole-RL-step benchmark's output under ``benchmarks/results/``) and the row it read.
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


_SMOLLM2_H200 = ("benchmarks/results/h200_2026-12-02_s6/call4_real_grpo/ (SmolLM2-135M GRPO step, H200, "
                 "docs/real_model.md)")

PLAN_SPEEDS: dict[tuple[str, str], dict[str, StepTime]] = {
    ("hopper", "dense"): {
        "naive": StepTime(1.71, 1.29, _SMOLLM2_H200),
        "sym-qat": StepTime(1.97, 1.29, _SMOLLM2_H200),
        "w4a16-qat": StepTime(1.84, 1.29, _SMOLLM2_H200),
        "quads": StepTime(2.09, 1.29, _SMOLLM2_H200),
    },
    ("hopper", "moe"): {},
    ("blackwell", "dense"): {},
    ("blackwell", "moe"): {},
}


def measured_speed(plan: str, hardware: str, model_kind: str) -> float | None:
    """``plan``'s measured whole-RL-step speed relative to BF16, or None (unmeasured)."""
    if plan == "bf16":
        return 1.0
    entry = PLAN_SPEEDS.get((hardware, model_kind), {}).get(plan)
    return None if entry is None else entry.speedup
