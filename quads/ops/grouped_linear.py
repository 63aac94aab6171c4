"""Grouped linear over packed 3-D expert weights (the MoE experts' GEMMs): reference and kernel glue.

Rows arrive sorted by expert (:func:`quads.ops.experts.route_by_expert`): rows
``offsets[e] .. offsets[e+1]`` belong to expert ``e``, rows from ``offsets[E]`` on to no expert
(their output is zero). ``rows`` maps each sorted row to its activation row (the token, for the
``gate_up`` projection; None = identity, for ``down``), so token activations are quantized once.
Row ``p`` of the result is ``linear(x[rows[p]], W[e(p)])`` with the semantics of
:mod:`quads.ops.linear` (W4A4 + residual with an :class:`ActivationQuant`, W4A16 without).
"""

from __future__ import annotations

import torch

from quads.ops.activation_quant import ActivationQuant, activation_operands_triton
from quads.ops.linear import prepare_weight_hopper, w4a4_linear_hopper, w4a4_linear_reference, w4a16_linear
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["grouped_linear_reference", "grouped_linear_hopper"]


def _expert(parts: NVFP4Parts, e: int) -> NVFP4Parts:
    return NVFP4Parts(parts.qdata[e], parts.scale[e], parts.global_encode_scale[e])


def _per_expert_loop(linear, x, rows, offsets, weight, bias, act, static_mask, num_rows):
    """Run ``linear`` on each expert's rows (host loop over experts: the reference structure;
    its ``.tolist()`` synchronizes with the device: not CUDA-graph capturable)."""
    out = x.new_zeros(num_rows, weight.qdata.shape[1])
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        src = x[rows[lo:hi].long()] if rows is not None else x[lo:hi]
        b = None if bias is None else bias[e]
        if act is None:
            y = w4a16_linear(src, _expert(weight, e), b)
        else:
            y = linear(src, _expert(weight, e), b, act, static_mask)
        out[lo:hi] = y.to(out.dtype)
    return out


def grouped_linear_reference(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    offsets: torch.Tensor,
    weight: NVFP4Parts,
    bias: torch.Tensor | None,
    act: ActivationQuant | None,
    static_mask: torch.Tensor | None,
    num_rows: int,
    prepared=None,
) -> torch.Tensor:
    """(num_rows, N) in ``x.dtype``; a loop of :func:`w4a4_linear_reference` over experts."""
    return _per_expert_loop(w4a4_linear_reference, x, rows, offsets, weight, bias, act, static_mask, num_rows)


def grouped_linear_hopper(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    offsets: torch.Tensor,
    weight: NVFP4Parts,
    bias: torch.Tensor | None,
    act: ActivationQuant | None,
    static_mask: torch.Tensor | None,
    num_rows: int,
    prepared=None,
) -> torch.Tensor:
    """Triton twin: one grouped W4A4 GEMM over all experts (weights in the layout ``prepared``
    by :func:`~quads.ops.linear.prepare_weight_hopper`, built here if not given), no host
    synchronisation.

    Weight-only activations (``act=None``, W4A16) go through the same kernel with ``x`` as fp16
    rows times a per-row power of two (:mod:`quads.kernels.fp16_operand`), as the dense W4A16
    Hopper path does: each row has the bits of :func:`~quads.ops.linear.w4a16_linear_hopper`
    on its expert.

    Falls back to the per-expert loop where the grouped kernel does not reproduce the reference:
    a ``"tensor"`` activation scale (the reference takes it over each expert's rows) or biases.
    """
    if bias is not None or (act is not None and act.granularity != "row"):
        return _per_expert_loop(w4a4_linear_hopper, x, rows, offsets, weight, bias, act, static_mask, num_rows)
    from quads.kernels.moe_grouped_gemm import moe_w4a4_gemm

    x = x if x.stride(-1) == 1 else x.contiguous()
    if act is None:
        from quads.kernels.fp16_operand import scaled_fp16_rows

        stacked, row_scale = scaled_fp16_rows(x)
        has_residual = False
    else:
        ops = activation_operands_triton(x, act, static_mask)
        stacked, row_scale, has_residual = ops.stacked, ops.main_scale, ops.residual is not None
    rows32 = None if rows is None else rows.to(torch.int32)
    prepared = prepared if prepared is not None else prepare_weight_hopper(weight)
    return moe_w4a4_gemm(stacked, row_scale, rows32, offsets.to(torch.int32), prepared,
                         weight.global_encode_scale.float(), num_rows, x.shape[0], has_residual,
                         out_dtype=x.dtype)
