"""The two small Triton kernels around a humming GEMM (:mod:`quads.ops.backends.humming.library`): operand sum, epilogue.

quads hands humming its exact fp16 activation operands ``e2m1 * f32(block scale)`` (unscaled:
the per-row global scale ``S_x`` is divided out afterwards; the residual shares ``S_x``):

* :func:`sum_stacked_rows`: the *summed* operand ``fp16(main + residual)`` of a stacked (2M, K)
  buffer (main rows first): one fp32 add, one fp16 rounding per element (relative error <= 2^-11
  of the sum; both terms are exact fp16 values < 2^12, so the sum is finite);
* :func:`unscale_rows`: the epilogue ``y = (o[i] [+ o[M+i]]) * u / s[i] [+ bias]`` in fp32, stored
  in the output dtype: ``o`` the GEMM's fp16 output (M or 2M rows), ``u`` the power of two that
  undoes the GEMM's output shift (a (1,) device tensor: refreshed in place by weight syncs), ``s``
  the per-row scales (``S_x``, or the W4A16 operand's ``2^j``). ``o`` may be a view of wider
  rows (a padded humming layout's first N columns): read through its row stride, no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreter_safe_input, interpreting

__all__ = ["sum_stacked_rows", "unscale_rows"]

_BLOCK = 1024


@triton.jit
def _sum_rows_kernel(S, M, K, OUT, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = k < K
    a = tl.load(S + row * K + k, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(S + (row + M) * K + k, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * K + k, (a + b).to(tl.float16), mask=mask)


@triton.jit
def _unscale_kernel(O, M, N, O_STRIDE, U, SCALE, BIAS, Y, STACKED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.load(O + row * O_STRIDE + n, mask=mask, other=0.0).to(tl.float32)
    if STACKED:
        acc += tl.load(O + (row + M) * O_STRIDE + n, mask=mask, other=0.0).to(tl.float32)
    y = acc * tl.load(U) / tl.load(SCALE + row)
    if HAS_BIAS:
        y += tl.load(BIAS + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + n, y.to(Y.dtype.element_ty), mask=mask)


def sum_stacked_rows(stacked: torch.Tensor, m: int) -> torch.Tensor:
    """fp16 (M, K) = ``stacked[:M] + stacked[M:]`` (fp32 add, one rounding); ``stacked`` fp16 (2M, K)."""
    if stacked.dtype != torch.float16 or stacked.dim() != 2 or stacked.shape[0] != 2 * m:
        raise ValueError(f"sum_stacked_rows expects fp16 (2*{m}, K), got {stacked.dtype} {tuple(stacked.shape)}")
    stacked = interpreter_safe_input(stacked).contiguous()
    k = stacked.shape[1]
    out = torch.empty((m, k), dtype=torch.float16, device=stacked.device)
    if m:
        _sum_rows_kernel[(m, triton.cdiv(k, _BLOCK))](stacked, m, k, out, BLOCK=_BLOCK)
    return out


def unscale_rows(o: torch.Tensor, m: int, unshift: torch.Tensor, row_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, stacked: bool) -> torch.Tensor:
    """(M, N) ``out_dtype`` = ``(o[i] [+ o[M+i]]) * unshift / row_scale[i] [+ bias]`` in fp32 (module doc);
    ``o``'s rows may be strided (a view of a padded GEMM output)."""
    rows = 2 * m if stacked else m
    if o.dim() != 2 or o.shape[0] != rows:
        raise ValueError(f"unscale_rows expects ({rows}, N) GEMM output rows, got {tuple(o.shape)}")
    if row_scale.numel() != m or unshift.numel() != 1:
        raise ValueError(f"unscale_rows: {row_scale.numel()} row scales for {m} rows / unshift of "
                         f"{unshift.numel()} values (want 1)")
    n = o.shape[1]
    o = interpreter_safe_input(o)
    o = o if o.stride(-1) == 1 else o.contiguous()
    # the interpreter truncates fp32 -> bf16 stores: write fp32 there and round on the host
    store_dtype = torch.float32 if interpreting() and out_dtype == torch.bfloat16 else out_dtype
    y = torch.empty((m, n), dtype=store_dtype, device=o.device)
    if m:
        scale = row_scale.reshape(-1).to(torch.float32).contiguous()
        b = interpreter_safe_input(bias).contiguous() if bias is not None else scale
        _unscale_kernel[(m, triton.cdiv(n, _BLOCK))](
            o, m, n, o.stride(0), unshift.to(torch.float32), scale, b, y,
            STACKED=stacked, HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    return y.to(out_dtype)
