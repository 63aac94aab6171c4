"""Archived experiment: the prefill product through cuBLAS on the kernels' exact fp16 operands.

Moved out of ``quads/kernels/hopper/w4a4_gemm.py`` (no library caller: it is **not batch
invariant**, so no policy selects it). Kept because docs/kernel_log.md compares against it and
its test (tests/kernels/test_kernel_w4a4_gemm.py) still checks the fp32-order bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreting
from quads.kernels.hopper.w4a4_gemm import _residual_row_offset, dequant_weight_fp16

__all__ = ["cublas_prefill"]


@triton.jit
def _cublas_epilogue_kernel(ACC, SX, SW, BIAS, Y, M, N, stride_ym,
                            HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``m`` of :func:`cublas_prefill`: ``(acc[m] [+ acc[M + m]]) * 2^14 / (Sx[m] Sw) [+ bias]``,
    the kernels' epilogue formula on the stacked fp32 product (main rows, then residual rows)."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(ACC + m * N + offs, mask=mask, other=0.0)
    if HAS_RES:
        acc = acc + tl.load(ACC + (M + m) * N + offs, mask=mask, other=0.0)
    den = tl.load(SX + m) * tl.load(SW)
    y = tl.math.div_rn(acc * 16384.0, den + tl.zeros_like(acc))
    if HAS_BIAS:
        y = y + tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, y.to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _stacked_rows(x16: torch.Tensor, r16: torch.Tensor | None) -> torch.Tensor:
    """(M or 2M, K): the main rows, then the residual rows; a view of the stacked operand when
    the residual rows directly follow the main ones, else a copy."""
    if r16 is None:
        return x16
    m = x16.shape[0]
    if _residual_row_offset(x16, r16) == m:
        return x16.as_strided((2 * m, x16.shape[1]), x16.stride())
    return torch.cat([x16, r16])


def _fp16_mm_fp32(a: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """``a @ w16ᵀ`` of fp16 operands with fp32 accumulation and an fp32 result (every product
    of two fp16 values is exact in fp32). CUDA: cuBLAS fp16 GEMM with fp32 output
    (``torch.mm(..., out_dtype=torch.float32)``, torch >= 2.8: tensor-core speed, no rounding of
    the sums to fp16); CPU (no such kernel): an fp32 matmul of the exact fp32 copies."""
    if a.is_cuda:
        return torch.mm(a, w16.t(), out_dtype=torch.float32)
    return torch.mm(a.float(), w16.float().t())


def cublas_prefill(
    x16: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    sw: torch.Tensor,
    r16: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    w16: torch.Tensor | None = None,
) -> torch.Tensor:
    """OPT-IN fast prefill, **not batch invariant**: :func:`w4a4_gemm`'s product through cuBLAS.

    The same exact fp16 operands (activations ``e2m1 * s``, weight ``e2m1 * s * 2^-14`` from
    :func:`dequant_weight_fp16` or the caller's cached ``w16``), the residual rows stacked under
    the main rows (one GEMM of 2M rows, fp32 output), then the kernels' epilogue
    ``(acc_main + acc_res) * 2^14 / (S_x S_w) [+ bias]`` in fp32 (:func:`_cublas_epilogue_kernel`).

    Exactness: every product is exact in fp32 (fp16 x fp16 has 22 significant bits; the
    products lie in [2^-34, 2^9]), so only the fp32 summation order differs from the reference:
    ``|y - ref| <= 2 K 2^-24 (|x̂| + |r̂|) |Ŵ|ᵀ / (S_x S_w)`` elementwise, the bound the kernels
    meet. But cuBLAS picks its kernel (tile shape, split-K) by M, so a row's bits depend on the
    batch it is in, and differ from the decode / grouped kernels' bits: use it only where batch
    invariance is not needed. Arguments as :func:`w4a4_gemm`.
    """
    m, k = x16.shape
    n = wq.shape[0]
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even
        return cublas_prefill(x16, sx, wq, ws, sw, r16, bias, torch.float32, w16).to(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x16.device)
    if m == 0:
        return y
    acc = _fp16_mm_fp32(_stacked_rows(x16, r16), w16 if w16 is not None else dequant_weight_fp16(wq, ws))
    block = min(1024, triton.next_power_of_2(n))
    _cublas_epilogue_kernel[(m, triton.cdiv(n, block))](
        acc, sx, sw.reshape(1), bias if bias is not None else sx, y, m, n, y.stride(0),
        HAS_RES=r16 is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y
