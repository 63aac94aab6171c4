"""Activations as the fp16 operand of the weight-only (W4A16) decode GEMM.

The Hopper GEMMs multiply fp16 operands (the NVFP4 weight as ``e2m1 * s * 2^-14``). A bf16
activation row ``x`` is handed over as ``x * 2^j`` in fp16, with one power of two per row chosen
so that the row's max lands in [2^14, 2^15): every element whose magnitude is above
``amax * 2^-28`` converts exactly (bf16 has 8 significant bits, fp16 11), smaller ones round to
the fp16 subnormal grid (an absolute error below ``amax * 2^-38``). The per-row factor plays
the role of the activation global scale in the GEMM epilogue (``y = acc * 2^14 / (2^j * S_w)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreter_safe_input

__all__ = ["scaled_fp16_rows"]


@triton.jit
def _scaled_fp16_rows_kernel(X, stride_xm, K, OUT, SCALE, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    e = (amax_bits >> 23) & 0xFF  # biased exponent of the row max
    # 2^(14 - (e - 127)) = 2^(141 - e) as float bits; zero rows use 1, tiny rows are capped at 2^127
    p = tl.minimum(tl.maximum(268 - e, 1), 254)
    s = tl.where(amax_bits == 0, 1.0, (p << 23).to(tl.float32, bitcast=True))
    tl.store(OUT + row * K + k, (x * s).to(tl.float16), mask=k < K)
    tl.store(SCALE + row, s)


def scaled_fp16_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 (M, K) = x * 2^j per row, fp32 (M,) = 2^j) -- see the module doc."""
    x2d = interpreter_safe_input(x2d)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    out = torch.empty((m, k), dtype=torch.float16, device=x2d.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m:
        block = triton.next_power_of_2(max(k, 16))
        _scaled_fp16_rows_kernel[(m,)](x2d, x2d.stride(0), k, out, scale, BLOCK=block,
                                       num_warps=4 if block <= 4096 else 8)
    return out, scale
