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

from quads.ops.compile_alignment import align_this_compile
from quads.ops.kernel_op_args import KernelOpArgs

__all__ = ["grouped_linear_op"]


@torch.library.custom_op(
    "quads::grouped_linear", mutates_args=(),
    schema=f"(Tensor x, Tensor? rows, Tensor offsets, Tensor? bias, int num_rows, int out_features, "
           f"{KernelOpArgs.SCHEMA}) -> Tensor")
def grouped_linear_op(x: torch.Tensor, rows: torch.Tensor | None, offsets: torch.Tensor, bias: torch.Tensor | None,
                      num_rows: int, out_features: int, *fields) -> torch.Tensor:
    """(num_rows, N): ``backend.grouped_linear`` over the 3-D weight of a kernel's plain fields
    (:class:`KernelOpArgs`) as an op opaque to ``torch.compile`` (the reference's host loop, which
    synchronizes with the device, runs inside it)."""
    backend, a = KernelOpArgs.from_op_args(*fields).kernel_args()
    return backend.grouped_linear(x, rows, offsets, a.weight, bias, a.act, a.static_mask, num_rows,
                                  prepared=a.prepared)


@grouped_linear_op.register_fake
def _(x, rows, offsets, bias, num_rows, out_features, *fields):
    align_this_compile()
    return x.new_empty(num_rows, out_features)
