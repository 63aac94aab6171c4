"""The humming backend's dense prefill candidate: W4A4 (+ residual) as one cuBLAS GEMM on the weight
dequantized exactly to fp16 (per call, or held per sync at 3.6x the packed bytes).

Measured by ``benchmarks/ops/bench_humming.py`` on the H200 (docs/humming.md): it never beat
humming's summed layout at any M up to 2048 on the five linear shapes (0.37-0.71x BF16 against
0.39-0.76x), so the backend does not take it. Used by that benchmark only; not part of the package.
"""

from __future__ import annotations

import torch

from quads.ops.activation_quant import activation_operands_triton, summed_operand_triton
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["DENSE_LAYOUTS", "dense_w4a4", "dense_weight_fp16"]

DENSE_LAYOUTS = ("summed", "stacked")


def dense_weight_fp16(weight: NVFP4Parts) -> torch.Tensor:
    """(N, K) fp16 ``e2m1 * f32(s) * 2^-14`` of a 2-D NVFP4 weight (exact: the values the exact
    path's GEMMs multiply; one Triton kernel). Per call (prefill) or held per sync (3.6x the
    packed NVFP4 bytes: over the rollout-memory target, measured as an upper bound)."""
    from quads.kernels.hopper.w4a4_gemm import dequant_weight_fp16

    return dequant_weight_fp16(weight.qdata, weight.scale)


def dense_w4a4(x2d: torch.Tensor, weight: NVFP4Parts, bias, act, static_mask=None, w16: torch.Tensor | None = None,
               layout: str = "summed", operands=None) -> torch.Tensor:
    """W4A4 (+ residual) as a dense cuBLAS GEMM: fp16 operand rows (``summed``: one fused
    quantization kernel writes ``fp16(x̂ + r̂)``; ``stacked``: the exact 2M rows) times the exact
    fp16 weight ``w16`` (:func:`dense_weight_fp16`; built here when None), fp32 output
    (``torch.mm(..., out_dtype=float32)``: no fp16 output rounding, no output shift), then
    ``y = o * 2^14 / (S_w S_x)`` per row (:func:`unscale_rows`).

    Error vs the exact path: ``stacked`` = fp32 summation order only (every product exact);
    ``summed`` = + one fp16 rounding per operand element, ``|Δy| <= 2^-11 (|x̂+r̂| @ |W|ᵀ)``."""
    from quads.kernels.humming.operands import unscale_rows

    if layout not in DENSE_LAYOUTS:
        raise ValueError(f"layout must be one of {DENSE_LAYOUTS}, got {layout!r}")
    if weight.qdata.dim() != 2 or weight.global_encode_scale.numel() != 1:
        raise ValueError("dense_w4a4 takes a 2-D weight with one global scale")
    x2 = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    m = x2.shape[0]
    w16 = dense_weight_fp16(weight) if w16 is None else w16
    stacked = layout == "stacked" and act.has_residual
    if operands is not None:  # computed once by a sibling group: stacked rows (main, then residual)
        from quads.kernels.humming.operands import sum_stacked_rows

        scale = operands.main_scale
        if operands.residual is None:
            a = operands.main
        else:
            a = operands.stacked if stacked else sum_stacked_rows(operands.stacked, m)
    elif stacked:
        ops = activation_operands_triton(x2, act, static_mask)
        a, scale = ops.stacked, ops.main_scale
    else:
        a, scale = summed_operand_triton(x2, act, static_mask)
    if a.is_cuda:
        o = torch.mm(a, w16.t(), out_dtype=torch.float32)
    else:  # CPU (tests): the same exact products, fp32 sums
        o = a.float() @ w16.float().t()
    unshift = (16384.0 / weight.global_encode_scale.reshape(1).to(torch.float32))
    return unscale_rows(o, m, unshift, scale, bias, x2.dtype, stacked=stacked)
