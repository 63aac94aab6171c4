"""Named precision configurations: a trainer policy and a rollout policy (None = left in BF16).

Shared by the TRL integration (``QuadsGRPOTrainer(quads_policy=...)``), the main example
(``--policy``) and ``quads diagnose``, so a configuration means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quads.policies.policy import QuadsPolicy

__all__ = ["PolicyPreset", "POLICY_PRESETS", "get_preset", "with_residual_fraction"]


@dataclass(frozen=True)
class PolicyPreset:
    """A named pair of precision policies: ``trainer`` / ``rollout`` (None = left in BF16)."""

    name: str
    trainer: QuadsPolicy | None
    rollout: QuadsPolicy | None
    description: str


_W4A16_QAT = QuadsPolicy(side="trainer", activations="bf16")
_W4A4_NAIVE = QuadsPolicy(side="rollout", activations="nvfp4", residual_fraction=0.0)

POLICY_PRESETS: dict[str, PolicyPreset] = {
    p.name: p
    for p in (
        PolicyPreset("bf16", None, None, "no quantization: BF16 trainer, BF16 rollout (engine-drift floor)"),
        PolicyPreset("naive", None, _W4A4_NAIVE, "BF16 trainer, NVFP4 W4A4 rollout without compensation"),
        PolicyPreset("w4a16-qat", _W4A16_QAT, _W4A4_NAIVE,
                     "asymmetric QAT (W4A16 trainer), NVFP4 W4A4 rollout without compensation"),
        PolicyPreset("sym-qat", QuadsPolicy(side="trainer", activations="nvfp4"), _W4A4_NAIVE,
                     "symmetric QAT (W4A4 trainer, ablation), NVFP4 W4A4 rollout without compensation"),
        PolicyPreset("quads", _W4A16_QAT, QuadsPolicy(side="rollout"),
                     "QUADS: W4A16 QAT trainer, NVFP4 W4A4 rollout + residual compensation (policy default)"),
        PolicyPreset("quads-4over6", QuadsPolicy(side="trainer", weight_block_scaling="4over6"),
                     QuadsPolicy(side="rollout", weight_block_scaling="4over6"),
                     "QUADS with Four Over Six weight block scaling (each block's max to 4 or 6) on both sides"),
    )
}


def get_preset(policy: str | PolicyPreset) -> PolicyPreset:
    """A :class:`PolicyPreset` by name (``bf16``, ``naive``, ``w4a16-qat``, ``sym-qat``, ``quads``,
    ``quads-4over6``)."""
    if isinstance(policy, PolicyPreset):
        return policy
    try:
        return POLICY_PRESETS[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quads policy preset {policy!r}; choose one of {sorted(POLICY_PRESETS)}") from None


def with_residual_fraction(preset: PolicyPreset, fraction: float, name: str | None = None) -> PolicyPreset:
    """``preset`` with its rollout's residual fraction replaced (e.g. the quads-25/50/75 rows)."""
    if preset.rollout is None:
        raise ValueError(f"preset {preset.name!r} has no rollout policy")
    rollout = dataclasses.replace(preset.rollout, residual_fraction=fraction)
    label = name or f"{preset.name}-{round(fraction * 100)}"
    return PolicyPreset(label, preset.trainer, rollout, f"{preset.description} (k = {fraction:.0%})")
