"""Grouped linear over packed 3-D expert weights (the MoE experts' GEMMs): reference and kernel glue.

Rows arrive sorted by expert (:func:`quads.ops.experts.route_by_expert`): rows
``offsets[e] .. offsets[e+1]`` belong to expert ``e``, rows from ``offsets[E]`` on to no expert
(their output is zero). ``rows`` maps each sorted row to its activation row (the token, for the
``gate_up`` projection; None = identity, for ``down``), so token activations are quantized once.
Row ``p`` of the result is ``linear(x[rows[p]], W[e(p)])`` with the semantics of
:mod:`quads.ops.linear` (W4A4 + residual with an :class:`ActivationQuant`, W4A16 without).

Here: the reference (a loop over experts), the Hopper glue (one grouped launch), the
``quads::grouped_linear`` custom op with its fake, and the front :func:`grouped_linear` that
:func:`quads.ops.experts.rollout_experts` calls.
"""

from __future__ import annotations

import torch

from quads.ops.activation_quant import ActivationQuant, activation_operands_triton
from quads.ops.backend_registry import Backend, get_backend
from quads.ops.compile_alignment import align_this_compile
from quads.ops.linear import (
    act_fields,
    act_from_fields,
    prepare_weight_hopper,
    prepared_fields,
    prepared_from_fields,
    w4a4_linear_hopper,
    w4a4_linear_reference,
    w4a16_linear,
)
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["grouped_linear", "grouped_linear_op", "grouped_linear_reference", "grouped_linear_hopper"]


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


@torch.library.custom_op("quads::grouped_linear", mutates_args=())
def grouped_linear_op(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    offsets: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    global_encode_scale: torch.Tensor,
    bias: torch.Tensor | None,
    prepared_values: torch.Tensor | None,
    prepared_scales: torch.Tensor | None,
    quantize_activations: bool,
    residual_fraction: float,
    selection: str,
    granularity: str,
    act_block_scaling: str,
    static_mask: torch.Tensor | None,
    num_rows: int,
    backend: str,
) -> torch.Tensor:
    """(num_rows, N): ``backend.grouped_linear`` as an op opaque to ``torch.compile`` (the
    reference's host loop, which synchronizes with the device, runs inside it)."""
    n, k = qdata.shape[1], qdata.shape[2] * 2
    return get_backend(backend).grouped_linear(
        x, rows, offsets, NVFP4Parts(qdata, scale, global_encode_scale), bias,
        act_from_fields(quantize_activations, residual_fraction, selection, granularity, act_block_scaling),
        static_mask, num_rows,
        prepared=prepared_from_fields(prepared_values, prepared_scales, n, k))


@grouped_linear_op.register_fake
def _(x, rows, offsets, qdata, scale, global_encode_scale, bias, prepared_values, prepared_scales,
      quantize_activations, residual_fraction, selection, granularity, act_block_scaling, static_mask, num_rows,
      backend):
    align_this_compile()
    return x.new_empty(num_rows, qdata.shape[1])


def grouped_linear(backend: Backend, x, rows, offsets, weight: NVFP4Parts, bias, act, static_mask, num_rows,
                   prepared=None) -> torch.Tensor:
    """``backend.grouped_linear``, through the custom op inside compiled graphs (same bits either way)."""
    if not torch.compiler.is_compiling():
        return backend.grouped_linear(x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared=prepared)
    if getattr(prepared, "backend_name", None) == "humming":
        raise NotImplementedError("torch.compile of humming-prepared experts (kernel='fast' MoE) is not wired yet: "
                                  "run the experts eagerly, or kernel='exact' (docs/humming.md, Not done yet)")
    return torch.ops.quads.grouped_linear(x, rows, offsets, weight.qdata, weight.scale, weight.global_encode_scale,
                                          bias, *prepared_fields(prepared), *act_fields(act), static_mask, num_rows,
                                          backend.name)
