"""The ``quads::grouped_linear`` custom op (one projection of the MoE experts, opaque to ``torch.compile``) and its fake.

Rows arrive sorted by expert (:class:`quads.ops.experts_op.Routing`): rows ``offsets[e] ..
offsets[e+1]`` belong to expert ``e``, rows from ``offsets[E]`` on to no expert (their output is
zero). ``rows`` maps each sorted row to its activation row (the token, for the ``gate_up``
projection; None = identity, for ``down``). Row ``p`` of the result is ``linear(x[rows[p]],
W[e(p)])`` with the semantics of :mod:`quads.ops.linear_op`. The experts kernels
(:mod:`quads.ops.experts_op`) call the op per projection inside compiled graphs; its body runs the
backend's ``grouped_linear`` (the same kernel, eagerly: the reference's host loop, which
synchronizes with the device, runs inside it).
"""

from __future__ import annotations

import torch

from quads.ops.backend_registry import get_backend
from quads.ops.compile_alignment import align_this_compile
from quads.ops.linear_op import act_from_fields, prepared_from_fields
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["grouped_linear_op"]


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
