"""Named precision configurations: a trainer policy and a rollout policy (None = left in BF16).

Shared by the TRL integration (``QuadsGRPOTrainer(quads_policy=...)``), the main example
(``--policy``) and ``quads diagnose``, so a configuration means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quads.policies.policy import QuadsPolicy

__all__ = ["PolicyPreset", "POLICY_PRESETS", "get_preset", "preset_from_pair", "with_residual_fraction"]


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
    )
}


PolicyPair = tuple["QuadsPolicy | None", "QuadsPolicy | None"]


def get_preset(policy: str | PolicyPreset | PolicyPair) -> PolicyPreset:
    """A :class:`PolicyPreset`: by name (``bf16``, ``naive``, ``w4a16-qat``, ``sym-qat``, ``quads``),
    as given, or from a ``(trainer, rollout)`` pair of :class:`QuadsPolicy` (None: that side in BF16)."""
    if isinstance(policy, PolicyPreset):
        return policy
    if isinstance(policy, QuadsPolicy):
        raise TypeError(
            f"a single QuadsPolicy(side={policy.side!r}) is one side of a configuration; pass the (trainer, rollout) "
            "pair, e.g. (QuadsPolicy(side='trainer'), QuadsPolicy(side='rollout', residual_fraction=0.5)), "
            f"a PolicyPreset or a preset name from {sorted(POLICY_PRESETS)}"
        )
    if isinstance(policy, (tuple, list)):
        return preset_from_pair(policy)
    try:
        return POLICY_PRESETS[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quads policy preset {policy!r}; choose one of {sorted(POLICY_PRESETS)}, "
                         "or pass a (trainer, rollout) pair of QuadsPolicy") from None


def _describe(policy: QuadsPolicy | None) -> str:
    if policy is None:
        return "BF16"
    text = "NVFP4 W4A4" if policy.activations == "nvfp4" else "NVFP4 W4A16"
    if policy.side == "rollout" and policy.activations == "nvfp4" and policy.residual_fraction > 0:
        text += f" + residual {policy.residual_fraction:.0%}"
    return text


def preset_from_pair(pair, name: str = "custom") -> PolicyPreset:
    """The preset of a ``(trainer, rollout)`` pair of :class:`QuadsPolicy` (None: that side in BF16),
    checked: each policy on its side, both sides with one ``weight_global_scale`` (the sync needs it)."""
    if len(pair) != 2:
        raise ValueError(f"a quads policy pair is (trainer, rollout), got {len(pair)} items")
    for side, policy in zip(("trainer", "rollout"), pair):
        if policy is not None and not isinstance(policy, QuadsPolicy):
            raise TypeError(f"the {side} entry of the quads policy pair must be a QuadsPolicy or None, "
                            f"got {type(policy).__name__}")
        if policy is not None and policy.side != side:
            raise ValueError(f"the {side} entry of the quads policy pair has side={policy.side!r}; "
                             f"use QuadsPolicy(side={side!r}, ...)")
    trainer, rollout = pair
    if trainer is not None and rollout is not None and trainer.weight_global_scale != rollout.weight_global_scale:
        raise ValueError(f"the quads policy pair's weight_global_scale differs (trainer {trainer.weight_global_scale!r}, "
                         f"rollout {rollout.weight_global_scale!r}); both sides must agree for an exact sync")
    sides = [f"{side} {_describe(p)}" for side, p in (("trainer", trainer), ("rollout", rollout))]
    return PolicyPreset(name, trainer, rollout, "custom policy pair: " + ", ".join(sides))


def with_residual_fraction(preset: PolicyPreset, fraction: float, name: str | None = None) -> PolicyPreset:
    """``preset`` with its rollout's residual fraction replaced (e.g. the quads-25/50/75 rows)."""
    if preset.rollout is None:
        raise ValueError(f"preset {preset.name!r} has no rollout policy")
    rollout = dataclasses.replace(preset.rollout, residual_fraction=fraction)
    label = name or f"{preset.name}-{round(fraction * 100)}"
    return PolicyPreset(label, preset.trainer, rollout, f"{preset.description} (k = {fraction:.0%})")
