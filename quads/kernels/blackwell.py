"""Native NVFP4 W4A4 on Blackwell (sm_100+) through cuBLASLt FP4 (``torch._scaled_mm``).

**NOT RUN: no Blackwell GPU was available to this project (only H200s).** Written to the
documented interfaces; used only when the ``blackwell`` backend is asked for explicitly
(``QUADS_BACKEND=blackwell`` or ``quads.use_backend("blackwell")``): ``auto`` never picks it
until it has run on such hardware. Its first run must pass
``tests/kernels/test_kernel_blackwell.py::test_fp4_unscaled_mm_matches_emulation`` (skipped here).

Math: the FP4 tensor-core MMA computes ``sum_k e2m1 * s_x * e2m1 * s_w`` (block scales E4M3,
block 16) in fp32, exactly the unscaled product of docs/background.md section 2; the caller applies the
per-row activation and per-tensor weight global scales in the epilogue. cuBLASLt wants the block
scales in the 128x4 "swizzled" layout (:func:`to_blocked`), a kernel-time transform of the plain
``(rows, K/16)`` storage.
"""

from __future__ import annotations

import torch

from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["to_blocked", "fp4_unscaled_mm", "is_blackwell"]


def is_blackwell(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """(rows, K/16) E4M3 scales -> cuBLASLt's 128x4-tiled layout (flat), zero padded."""
    rows, cols = scale.shape
    nrb, ncb = _ceil_div(rows, 128), _ceil_div(cols, 4)
    padded = scale.new_zeros((nrb * 128, ncb * 4))
    padded[:rows, :cols] = scale
    blocks = padded.view(nrb, 128, ncb, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def fp4_unscaled_mm(a: NVFP4Parts, w: NVFP4Parts) -> torch.Tensor:
    """fp32 (M, N) = sum_k (e2m1 * s)_a (e2m1 * s)_w, no global scales (NOT RUN)."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        raise RuntimeError("this torch has no float4_e2m1fn_x2 dtype (needs torch >= 2.8)")
    a_fp4 = a.qdata.view(fp4)
    w_fp4 = w.qdata.view(fp4)
    sa = to_blocked(a.scale.view(torch.float8_e4m3fn))
    sb = to_blocked(w.scale.view(torch.float8_e4m3fn))
    return torch._scaled_mm(a_fp4, w_fp4.t(), sa, sb, out_dtype=torch.float32)
