"""Named precision configurations (plans): a trainer policy and a rollout policy (None = left in BF16).

Shared by the TRL integration (``QuadsGRPOTrainer(quads_policy=...)``), the main example
(``--policy``), ``quads diagnose`` (one row per preset) and the benchmarks, which iterate over
:data:`POLICY_PRESETS`, so a configuration means the same thing everywhere.

The plans besides QUADS's W4A4 + residual on every linear (``quads``):

* ``w4a16``: the W4A16 QAT trainer and an NVFP4 W4A16 rollout (packed NVFP4 weights, BF16
  activations): the weights are aligned exactly and the activations are BF16 on both sides, so
  the rollout's logits are the trainer's bit for bit on the same forward (tested); what remains is
  engine drift (another attention kernel, incremental decoding). On Hopper, which has no FP4 MMA,
  its GEMMs are the same dequantize-then-MMA kernels without the activation quantization.
* ``quads-experts`` / ``w4a16-experts``: those numerics on the routed experts only
  (``scope="routed_experts"``): attention, shared experts, routers and ``lm_head`` in BF16, the
  scope of NeMo-RL's and verl's NVFP4 MoE recipes. MoE models only (a dense model is refused:
  :func:`preset_problem`).
* ``quads-boundary``: QUADS with the first 2 and last 4 decoder layers wholly in BF16 (the
  counts of verl's Qwen3 example); models with more than 6 decoder layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from quads.policies.policy import QuadsPolicy
from quads.policies.scope import scope_problem

__all__ = ["PolicyPreset", "POLICY_PRESETS", "get_preset", "preset_problem", "weight_only_rollout",
           "with_residual_fraction", "BOUNDARY_LAYERS"]


@dataclass(frozen=True)
class PolicyPreset:
    """A named pair of precision policies: ``trainer`` / ``rollout`` (None = left in BF16)."""

    name: str
    trainer: QuadsPolicy | None
    rollout: QuadsPolicy | None
    description: str


_W4A16_QAT = QuadsPolicy(side="trainer", activations="bf16")
_W4A4_NAIVE = QuadsPolicy(side="rollout", activations="nvfp4", residual_fraction=0.0)
_QUADS_ROLLOUT = QuadsPolicy(side="rollout")
_W4A16_ROLLOUT = QuadsPolicy(side="rollout", activations="bf16")
_EXPERTS = {"scope": "routed_experts"}
#: ``quads-boundary``'s decoder layers kept in BF16 at each end (verl's Qwen3 example: 2 and 4)
BOUNDARY_LAYERS = {"skip_first_layers": 2, "skip_last_layers": 4}


def _scoped(policy: QuadsPolicy, scope: dict) -> QuadsPolicy:
    return dataclasses.replace(policy, **scope)


POLICY_PRESETS: dict[str, PolicyPreset] = {
    p.name: p
    for p in (
        PolicyPreset("bf16", None, None, "no quantization: BF16 trainer, BF16 rollout (engine-drift floor)"),
        PolicyPreset("naive", None, _W4A4_NAIVE, "BF16 trainer, NVFP4 W4A4 rollout without compensation"),
        PolicyPreset("w4a16-qat", _W4A16_QAT, _W4A4_NAIVE,
                     "asymmetric QAT (W4A16 trainer), NVFP4 W4A4 rollout without compensation"),
        PolicyPreset("sym-qat", QuadsPolicy(side="trainer", activations="nvfp4"), _W4A4_NAIVE,
                     "symmetric QAT (W4A4 trainer, ablation), NVFP4 W4A4 rollout without compensation"),
        PolicyPreset("quads", _W4A16_QAT, _QUADS_ROLLOUT,
                     "QUADS: W4A16 QAT trainer, NVFP4 W4A4 rollout + residual compensation (policy default)"),
        PolicyPreset("w4a16", _W4A16_QAT, _W4A16_ROLLOUT,
                     "W4A16 QAT trainer, NVFP4 W4A16 rollout (BF16 activations): the trainer's forward exactly"),
        PolicyPreset("quads-experts", _scoped(_W4A16_QAT, _EXPERTS), _scoped(_QUADS_ROLLOUT, _EXPERTS),
                     "QUADS on the routed experts only; attention, shared experts, router, lm_head in BF16 (MoE)"),
        PolicyPreset("w4a16-experts", _scoped(_W4A16_QAT, _EXPERTS), _scoped(_W4A16_ROLLOUT, _EXPERTS),
                     "W4A16 (QAT trainer, BF16-activation rollout) on the routed experts only (MoE)"),
        PolicyPreset("quads-boundary", _scoped(_W4A16_QAT, BOUNDARY_LAYERS), _scoped(_QUADS_ROLLOUT, BOUNDARY_LAYERS),
                     "QUADS with the first 2 and last 4 decoder layers in BF16"),
    )
}


def get_preset(policy: str | PolicyPreset) -> PolicyPreset:
    """A :class:`PolicyPreset` by name (a key of :data:`POLICY_PRESETS`)."""
    if isinstance(policy, PolicyPreset):
        return policy
    try:
        return POLICY_PRESETS[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quads policy preset {policy!r}; choose one of {sorted(POLICY_PRESETS)}") from None


def preset_problem(preset: str | PolicyPreset, model: nn.Module) -> str | None:
    """Why ``preset`` cannot apply to ``model`` (one line: a routed-experts plan on a dense
    model, boundary layers the model does not have), or None. ``quantize_`` raises with this
    message; callers iterating over :data:`POLICY_PRESETS` skip such a preset and say so."""
    preset = get_preset(preset)
    for policy in (preset.trainer, preset.rollout):
        problem = None if policy is None else scope_problem(model, policy)
        if problem:
            return f"preset {preset.name!r}: {problem}"
    return None


def weight_only_rollout(policy: QuadsPolicy) -> QuadsPolicy:
    """The rollout policy with BF16 activations that holds the weights ``policy`` (either side)
    quantizes: the same modules (scope, boundary layers, skip patterns) and global scales."""
    return dataclasses.replace(policy, side="rollout", activations="bf16")


def with_residual_fraction(preset: PolicyPreset, fraction: float, name: str | None = None) -> PolicyPreset:
    """``preset`` with its rollout's residual fraction replaced (e.g. the quads-25/50/75 rows)."""
    if preset.rollout is None:
        raise ValueError(f"preset {preset.name!r} has no rollout policy")
    rollout = dataclasses.replace(preset.rollout, residual_fraction=fraction)
    label = name or f"{preset.name}-{round(fraction * 100)}"
    return PolicyPreset(label, preset.trainer, rollout, f"{preset.description} (k = {fraction:.0%})")
