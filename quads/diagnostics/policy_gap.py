"""Mismatch metrics of a policy preset on fixed completions (teacher forcing), without TRL."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from quads.diagnostics.mismatch import mismatch_metrics
from quads.diagnostics.scoring import score_teacher_forced
from quads.policies import PolicyPreset, build_rollout_model, copy_model, get_preset, prepare_trainer_

__all__ = ["measure_policy_gap"]


@torch.no_grad()
def measure_policy_gap(
    model: nn.Module,
    policy: str | PolicyPreset,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    rollout_dtype: torch.dtype = torch.bfloat16,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    is_mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Builds the preset's trainer (float32 masters of ``model``, trainer policy, forward under
    ``autocast_dtype`` autocast like ``GRPOConfig(bf16=True)``) and its rollout model
    (:func:`~quads.policies.build_rollout_model`), scores the same sequences with both and returns
    :func:`~quads.diagnostics.mismatch_metrics` (names ``sampling/quads/...``). ``model`` is not
    modified. Use it to compare presets on identical prompts and completions.
    """
    preset = get_preset(policy)
    trainer = copy_model(model, torch.float32)
    prepare_trainer_(trainer, preset)
    rollout = build_rollout_model(trainer, preset.rollout, dtype=rollout_dtype)
    keep = completion_mask.size(1)
    device_type = input_ids.device.type
    ctx = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    with ctx:
        trainer_lp = score_teacher_forced(trainer, input_ids, attention_mask, keep, temperature, batch_size)
    rollout_lp = score_teacher_forced(rollout, input_ids, attention_mask, keep, temperature, batch_size)
    return mismatch_metrics(
        rollout_lp, trainer_lp, completion_mask, is_mode=is_mode, clip_min=clip_min, clip_max=clip_max
    )
