"""``load_state_dict`` into a quads rollout: every value is checked before any is loaded.

torch loads a state dict tensor by tensor (``param.copy_``), so a bad value met halfway leaves
the model half loaded, and some bad values are not refused at all: a float32 master of 1e6
loaded into a float16 rollout becomes Inf (a dense norm or embedding) or a packed weight whose
dequantization is Inf, and every logit is NaN. :class:`RolloutLoadCheck`, the pre-hook
``quantize_`` registers on every rollout model, runs once before anything is loaded and refuses,
naming the tensors:

* dense values for dense parameters and buffers that hold NaN/Inf or overflow the parameter's
  dtype (float16: ``|x| >= 65520``): :func:`quads.tensor.finite.check_fits_dtype`;
* dense values for packed weights that hold NaN/Inf; they are quantized here (what ``copy_``
  would do, at the weight's granularity), so their range is known up front;
* packed values with NaN or negative block scales, non-positive global scales or part shapes
  that do not fit the weight's (another granularity or orientation);
* packed weights (given or just quantized) that dequantize beyond the rollout's dtype:
  :func:`quads.tensor.finite.check_dequantized_range`.

The checks cost what ``copy_`` spends on them anyway (one reduction per tensor) plus one host
sync per device for the dense values; sibling groups' shared scales are handled first, by
:class:`~quads.policies.scale_groups.GroupScaleLoadCheck`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from quads.tensor.finite import check_all_finite, check_dequantized_range, check_fits_dtype
from quads.tensor.nvfp4_math import nvfp4_quantize
from quads.tensor.nvfp4_tensor import NVFP4Tensor, check_nvfp4_values

__all__ = ["RolloutLoadCheck"]

_WHAT = "load_state_dict (nothing was loaded)"


def _destinations(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    out = {f"{prefix}{n}": p for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({f"{prefix}{n}": b for n, b in module.named_buffers(remove_duplicate=False) if b is not None})
    return out


def _fits(key: str, src: NVFP4Tensor, dst: NVFP4Tensor) -> None:
    if src.transposed != dst.transposed:
        raise ValueError(f"{_WHAT}: {key} is a packed weight of another orientation (transposed={src.transposed})")
    for part, have, want in zip(("qdata", "scale", "global_encode_scale"), src.parts, dst.parts):
        if tuple(have.shape) != tuple(want.shape):
            raise ValueError(f"{_WHAT}: {key}.{part} has shape {tuple(have.shape)}, the rollout's {tuple(want.shape)} "
                             f"(global scales per {src.granularity}, the rollout's per {dst.granularity})")


class RolloutLoadCheck:
    """``load_state_dict`` pre-hook of a quads rollout model (see the module doc)."""

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        dense, to_pack, packed = [], [], []
        for key, dst in _destinations(module, prefix).items():
            src = state_dict.get(key)
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
                continue  # absent, or a size mismatch torch itself reports
            if isinstance(dst, NVFP4Tensor):
                if isinstance(src, NVFP4Tensor):
                    _fits(key, src, dst)
                    packed.append((key, src, dst))
                elif src.is_floating_point():
                    to_pack.append((key, src, dst))
            elif dst.is_floating_point() and not isinstance(src, NVFP4Tensor) and src.is_floating_point():
                dense.append((key, src, dst.dtype))
        check_fits_dtype(dense, _WHAT)
        check_all_finite([(k, s) for k, s, _ in to_pack], _WHAT)
        for key, src, dst in packed:
            check_nvfp4_values(src.scale, src.global_encode_scale, f"{_WHAT}: {key}")
        for key, src, dst in to_pack:
            w = src.detach().to(dst.device)
            try:
                parts = nvfp4_quantize(w.transpose(-2, -1) if dst.transposed else w, dst.granularity,
                                       block_scaling=dst.block_scaling)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{_WHAT}: {key}: {err}") from None
            state_dict[key] = NVFP4Tensor(*parts, orig_dtype=w.dtype, transposed=dst.transposed, check_values=False,
                                          block_scaling=dst.block_scaling)
            packed.append((key, state_dict[key], dst))
        check_dequantized_range([(k, s.parts, d.orig_dtype) for k, s, d in packed], _WHAT)
