"""``prepare_trainer_(model, preset)``: a trainer model made ready for a preset, in place.

The one place a trainer (and a reference model) gets its side of a plan: the preset's trainer
policy (:func:`quads.quantize_`, none for a BF16 trainer) and, unless the preset is the
``bf16-fp32-experts`` ablation, the unquantized experts switched to the autocast dtype
(:func:`quads.policies.autocast_experts.autocast_experts_`).
"""

from __future__ import annotations

import torch.nn as nn

from quads.policies.autocast_experts import autocast_experts_
from quads.policies.presets import PolicyPair, PolicyPreset, get_preset
from quads.policies.quantize import quantize_, quantized_modules

__all__ = ["prepare_trainer_"]


def prepare_trainer_(model: nn.Module, preset: str | PolicyPreset | PolicyPair) -> nn.Module:
    """Apply ``preset``'s trainer side to ``model`` in place and return it.

    A model already carrying quads trainer layers is taken as converted (its policy is not
    re-applied); one carrying rollout layers, or quads layers under a BF16-trainer preset, is
    refused before anything changes.
    """
    preset = get_preset(preset)
    existing = quantized_modules(model)
    if existing:
        sides = {m.quads_policy.side for m in existing.values()}
        if sides != {"trainer"}:
            raise ValueError(f"the trainer model carries quads layers of side(s) {sorted(sides)}")
        if preset.trainer is None:
            raise ValueError(f"preset {preset.name!r} wants a BF16 trainer but the model is quads-quantized")
        rollout = preset.rollout  # a plan mismatch now, not at the first sync
        mismatch = rollout.weight_mismatch(next(iter(existing.values())).quads_policy) if rollout else None
        if mismatch:
            raise ValueError(f"the model is already quantized by quads, and preset {preset.name!r} does not fit it: "
                             f"{mismatch}")
    elif preset.trainer is not None:
        quantize_(model, preset.trainer)
    if preset.trainer_experts_autocast:
        autocast_experts_(model)
    return model
