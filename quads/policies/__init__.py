"""Precision policies: `QuadsPolicy`, `quantize_`, trainer->rollout weight sync, calibration."""

from quads.policies.calibrate import calibrate_residual_channels
from quads.policies.policy import DEFAULT_SKIP_PATTERNS, QuadsPolicy
from quads.policies.quantize import quantize_, quantized_modules
from quads.policies.sync import sync_weights_

__all__ = [
    "DEFAULT_SKIP_PATTERNS",
    "QuadsPolicy",
    "calibrate_residual_channels",
    "quantize_",
    "quantized_modules",
    "sync_weights_",
]
