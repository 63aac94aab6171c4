"""The plan ``quads diagnose`` recommends for the model it measured, and why.

The rule, from what the run measured on this model and what the repository measured on the
hardware (:mod:`quads.diagnostics.plan_speeds`):

1. **accurate enough**: a plan (a :data:`~quads.policies.POLICY_PRESETS` row) qualifies when its
   mean rollout-vs-trainer gap is within :data:`GAP_FACTOR` (1.5x) of the BF16 floor's (the
   engine drift every rollout engine has). 1.5x is the project's target for its default on the
   diagnose table; the mean is used because the max over a few hundred tokens is one token's
   value and moves several-fold between samples (``docs/real_model.md``);
2. **fastest**: of the qualifying plans, the one whose whole RL step is measured fastest on this
   hardware for this model kind (BF16 counts as 1x); ties go to the smaller gap;
3. qualifying plans with no measurement there are named: their speed would decide, and it is
   never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from quads.diagnostics.plan_speeds import PLAN_SPEEDS, measured_speed

__all__ = ["GAP_FACTOR", "PLAN_TABLE", "Recommendation", "recommend"]

#: a plan qualifies when its mean gap is at most this many times the BF16 floor's
GAP_FACTOR = 1.5
#: where every plan's measured gap, accuracy and step speed are tabulated (rendered from the same sources)
PLAN_TABLE = "docs/plans.md#5-the-plan-table"


@dataclass(frozen=True)
class Recommendation:
    hardware: str
    model_kind: str
    plan: str
    reason: str
    qualifying: tuple[str, ...]  # plans within GAP_FACTOR of the floor, best gap first
    unmeasured: tuple[str, ...]  # ... of which have no measured speed on this hardware

    def line(self) -> str:
        return f"recommended plan ({self.hardware}, {self.model_kind} model): {self.plan}: {self.reason}"


def _ratio(row: dict, floor: float) -> float:
    return row["gap_mean"] / floor if floor > 0 else (1.0 if row["gap_mean"] == 0 else float("inf"))


def recommend(rows: list[dict], hardware: str, model_kind: str) -> Recommendation:
    """The recommendation for ``rows`` (``quads diagnose`` report rows; those with a ``preset``
    are plans, the ``bf16`` one is the floor) on ``hardware`` for a ``model_kind`` model."""
    plans = {r["preset"]: r for r in rows if r.get("preset")}
    if "bf16" not in plans:
        raise ValueError("recommend: the rows hold no BF16 floor (preset 'bf16')")
    floor = plans["bf16"]["gap_mean"]
    ratios = {name: _ratio(r, floor) for name, r in plans.items()}
    qualifying = sorted((n for n, q in ratios.items() if q <= GAP_FACTOR), key=lambda n: (ratios[n], n))
    speeds = {n: measured_speed(n, hardware, model_kind) for n in qualifying}
    measured = [n for n in qualifying if speeds[n] is not None]
    unmeasured = tuple(n for n in qualifying if speeds[n] is None)
    best = max(measured, key=lambda n: (speeds[n], -ratios[n]))
    where = f"{hardware} for {model_kind} models"
    if qualifying == ["bf16"]:
        others = sorted((n for n in ratios if n != "bf16"), key=lambda n: (ratios[n], n))
        reason = (f"no other plan's mean gap is within {GAP_FACTOR}x the BF16 floor"
                  + (f" (closest: {others[0]} {ratios[others[0]]:.2f}x)" if others else ""))
        return Recommendation(hardware, model_kind, best, reason, tuple(qualifying), unmeasured)
    reason = (f"mean gap {ratios[best]:.2f}x the BF16 floor (within {GAP_FACTOR}x: "
              f"{', '.join(f'{n} {ratios[n]:.2f}x' for n in qualifying)})")
    if best == "bf16":
        slower = [n for n in measured if n != "bf16"]
        reason += ("; no plan within that is measured faster than BF16 on " + where
                   + (f" ({', '.join(f'{n} {speeds[n]:.2f}x' for n in slower)} BF16's whole RL step)" if slower else ""))
    else:
        source = PLAN_SPEEDS[(hardware, model_kind)][best].source
        reason += f"; the fastest of them measured on {where}: {speeds[best]:.2f}x BF16's whole RL step ({source})"
    if unmeasured:
        reason += f"; not measured on {where}, their speed would decide: {', '.join(unmeasured)}"
    return Recommendation(hardware, model_kind, best, reason, tuple(qualifying), unmeasured)
