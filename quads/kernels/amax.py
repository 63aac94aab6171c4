"""Per-row amax (Triton): ``max |x|`` of each row as a max over the ``|x|`` bit patterns, exact,
order-independent and NaN-propagating (the global scale's input for weight quantization and for
``granularity="tensor"`` activations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreter_safe_input, interpreting
from quads.kernels.nvfp4_blocks import abs_bits

__all__ = ["amax_rows"]


@triton.jit
def _amax_rows_kernel(X, stride_xm, K, OUT, n_rows, BR: tl.constexpr, BC: tl.constexpr):
    """OUT[row] = max |X[row, :]| (as float32; NaN if any NaN), for BR rows per program."""
    pid = tl.program_id(0)
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BC)
    rmask = rows < n_rows
    acc = tl.zeros((BR, BC), dtype=tl.int32)
    for c0 in range(0, K, BC):
        m = rmask[:, None] & ((c0 + cols)[None, :] < K)
        x = tl.load(X + rows[:, None] * stride_xm + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    tl.store(OUT + rows, tl.max(acc, axis=1).to(tl.float32, bitcast=True), mask=rmask)


def amax_rows(x2d: torch.Tensor) -> torch.Tensor:
    """float32 (rows,) = max |x| per row (NaN-propagating)."""
    x2d = interpreter_safe_input(x2d)
    n_rows, k = x2d.shape
    out = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    br = 32 if interpreting() else 4  # per-row results: the tile changes no bit
    bc = min(1024, triton.next_power_of_2(max(k, 16)))
    _amax_rows_kernel[(triton.cdiv(n_rows, br),)](x2d, x2d.stride(0), k, out, n_rows, BR=br, BC=bc, num_warps=4)
    return out
