"""Precision policies: `QuadsPolicy`, `quantize_`, trainer->rollout weight sync, calibration,
named presets and rollout copies. Imports ``tensor``, ``kernels`` (through ``ops``) and ``ops``."""

from quads.policies.autocast_experts import autocast_experts_
from quads.policies.calibrate import calibrate_residual_channels
from quads.policies.fused_projections import fuse_projections_, unfuse_projections_
from quads.policies.policy import DEFAULT_SKIP_PATTERNS, QuadsPolicy
from quads.policies.prepare import prepare_trainer_
from quads.policies.presets import POLICY_PRESETS, PolicyPreset, get_preset
from quads.policies.quantize import quantize_, quantized_modules
from quads.policies.rollout_copy import build_rollout_model, copy_model
from quads.policies.sync import sync_weights_

__all__ = [
    "DEFAULT_SKIP_PATTERNS",
    "POLICY_PRESETS",
    "PolicyPreset",
    "QuadsPolicy",
    "autocast_experts_",
    "build_rollout_model",
    "calibrate_residual_channels",
    "copy_model",
    "fuse_projections_",
    "get_preset",
    "prepare_trainer_",
    "quantize_",
    "quantized_modules",
    "sync_weights_",
    "unfuse_projections_",
]
