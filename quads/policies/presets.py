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
* ``bf16``: BF16 on both sides, the engine-drift floor: the trainer's unquantized experts
  multiply in the autocast dtype as its linears do (:mod:`quads.policies.autocast_experts`).
* ``bf16-fp32-experts`` (ablation): ``bf16`` with the trainer's experts left to transformers'
  ``grouped_mm``, which autocast does not cast: FP32 expert GEMMs in the trainer against BF16
  ones in the rollout; the gap grows as the masters move (``trainer_experts_autocast=False``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from quads.policies.policy import QuadsPolicy
from quads.policies.scope import scope_problem

__all__ = ["PolicyPreset", "POLICY_PRESETS", "get_preset", "preset_from_pair", "preset_problem",
           "weight_only_rollout", "with_kernel", "with_residual_fraction", "with_routing_replay", "BOUNDARY_LAYERS",
           "ROUTING_REPLAY_SUFFIX"]

#: the name suffix of a preset whose trainer routes by the rollout's recorded experts (R3)
ROUTING_REPLAY_SUFFIX = "+r3"


@dataclass(frozen=True)
class PolicyPreset:
    """A named pair of precision policies: ``trainer`` / ``rollout`` (None = left in BF16).

    ``routing_replay``: the trainer's forwards route an MoE model's tokens by the experts the
    rollout recorded (rollout routing replay, R3; :mod:`quads.policies.routing`).
    ``trainer_experts_autocast``: the trainer's experts that quads does not quantize multiply
    in the autocast dtype (:func:`quads.policies.autocast_experts.autocast_experts_`); False
    only for the ``bf16-fp32-experts`` ablation."""

    name: str
    trainer: QuadsPolicy | None
    rollout: QuadsPolicy | None
    description: str
    routing_replay: bool = False
    trainer_experts_autocast: bool = True


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
        PolicyPreset("bf16", None, None,
                     "no quantization: BF16 on both sides, experts included (engine-drift floor)"),
        PolicyPreset("bf16-fp32-experts", None, None,
                     "ablation: BF16 rollout, trainer experts in FP32 under autocast (transformers' grouped_mm)",
                     trainer_experts_autocast=False),
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
        PolicyPreset("quads-4over6", QuadsPolicy(side="trainer", weight_block_scaling="4over6"),
                     QuadsPolicy(side="rollout", weight_block_scaling="4over6"),
                     "QUADS with Four Over Six weight block scaling (each block's max to 4 or 6) on both sides"),
    )
}


PolicyPair = tuple["QuadsPolicy | None", "QuadsPolicy | None"]


def get_preset(policy: str | PolicyPreset | PolicyPair) -> PolicyPreset:
    """A :class:`PolicyPreset`: by name (a key of :data:`POLICY_PRESETS`),
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
    if isinstance(policy, str) and policy.endswith(ROUTING_REPLAY_SUFFIX):
        return with_routing_replay(get_preset(policy.removesuffix(ROUTING_REPLAY_SUFFIX)))
    try:
        return POLICY_PRESETS[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quads policy preset {policy!r}; choose one of {sorted(POLICY_PRESETS)} "
                         f"(each also as <name>{ROUTING_REPLAY_SUFFIX}: routing replay), "
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


def with_kernel(preset: PolicyPreset, kernel: str) -> PolicyPreset:
    """``preset`` with its rollout on ``kernel`` (``QuadsPolicy.kernel``: ``"exact"`` or ``"fast"``);
    named ``<preset>-fast`` for the fast path. Raises for a preset without a quantized rollout."""
    if kernel == preset_kernel(preset):
        return preset
    if preset.rollout is None:
        raise ValueError(f"preset {preset.name!r} has no quantized rollout to run on kernel={kernel!r}")
    rollout = dataclasses.replace(preset.rollout, kernel=kernel)
    name = f"{preset.name}-fast" if kernel == "fast" else preset.name.removesuffix("-fast")
    how = ", humming fast path" if kernel == "fast" else ", exact kernels"
    return dataclasses.replace(preset, name=name, rollout=rollout, description=preset.description + how)


def preset_kernel(preset: PolicyPreset) -> str:
    """The rollout kernel preference of ``preset`` (``"exact"`` for a BF16 rollout)."""
    return preset.rollout.kernel if preset.rollout is not None else "exact"


def with_residual_fraction(preset: PolicyPreset, fraction: float, name: str | None = None) -> PolicyPreset:
    """``preset`` with its rollout's residual fraction replaced (e.g. the quads-25/50/75 rows)."""
    if preset.rollout is None:
        raise ValueError(f"preset {preset.name!r} has no rollout policy")
    rollout = dataclasses.replace(preset.rollout, residual_fraction=fraction)
    label = name or f"{preset.name}-{round(fraction * 100)}"
    return dataclasses.replace(preset, name=label, rollout=rollout,
                               description=f"{preset.description} (k = {fraction:.0%})")


def with_routing_replay(preset: str | PolicyPreset) -> PolicyPreset:
    """``preset`` with rollout routing replay (R3) on, named ``<preset>+r3`` (``get_preset`` reads
    that name too): the trainer's scoring and loss forwards route by the rollout's recorded experts."""
    preset = get_preset(preset)
    if preset.routing_replay:
        return preset
    return dataclasses.replace(preset, name=preset.name + ROUTING_REPLAY_SUFFIX, routing_replay=True,
                               description=preset.description + "; trainer routes by the rollout's experts (R3)")
