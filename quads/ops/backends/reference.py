"""The ``torch`` backend: the references (any device), the spec every kernel backend is tested against.

Its linear kernel runs the exact-emulation product of :mod:`quads.ops.linear_op` (W4A4 + residual)
or ``F.linear`` with ``DQ(W)`` (W4A16); its experts kernel is a host loop over the experts through
the same products; sibling sets share the input's reference operands (:class:`SiblingKernel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quads.ops.activation_quant import quantize_activation_reference
from quads.ops.backend_registry import Backend, LinearKernel, register_backend
from quads.ops.experts_op import ExpertsKernel, grouped_linear
from quads.ops.linear_op import _matmul_operands, compiled_linear, reference_operands
from quads.ops.sibling_linear import SiblingKernel
from quads.ops.weight_cache import dequantized_weight
from quads.ops.weight_quant import quantize_weight_reference
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["ReferenceExpertsKernel", "ReferenceLinearKernel", "TorchBackend"]


class ReferenceLinearKernel(LinearKernel):
    """The torch backend's linear: with ``act`` quantize (+ residual), the exact-emulation product
    (:func:`~quads.ops.linear_op.w4a4_matmul_reference`), bias; without: :func:`~quads.ops.linear_op.w4a16_linear`.
    ``operands``: :func:`~quads.ops.linear_op.reference_operands` of the input, computed once for sibling linears."""

    def apply(self, x, bias=None, operands=None):
        if torch.compiler.is_compiling():
            return compiled_linear(self, x, bias)
        if x.shape[-1] != self.k:
            self.check_input(x)
        x2 = x.reshape(-1, x.shape[-1])
        if self.act is None:
            y = F.linear(x2, dequantized_weight(self.parts, x2.dtype), bias)  # cached until the weight changes
        else:
            ops = operands if operands is not None else reference_operands(x2, self.act, self.static_mask)
            y = _matmul_operands(ops, self.parts)
            if bias is not None:
                y = y + bias.to(torch.float32)
            y = y.to(x2.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class ReferenceExpertsKernel(ExpertsKernel):
    """The torch backend's experts: each projection a host loop over the experts (``.tolist()``
    synchronizes with the device), each expert's rows through the reference linear's product
    (W4A4 + residual: the exact-emulation product of :mod:`quads.ops.linear_op`; W4A16: ``F.linear``
    with ``DQ(W)`` in the input's dtype)."""

    def gemm(self, i, x, rows, route, bias, w=None):
        a = self.projections[i]
        w = self.parts[i] if w is None else w
        out = x.new_zeros(route.num_rows, w.qdata.shape[1])
        bounds = route.offsets.tolist()
        for e in range(len(bounds) - 1):
            lo, hi = bounds[e], bounds[e + 1]
            if hi == lo:
                continue
            src = x[rows[lo:hi].long()] if rows is not None else x[lo:hi]
            we = NVFP4Parts(w.qdata[e], w.scale[e], w.global_encode_scale[e])
            b = None if bias is None else bias[e]
            if a.act is None:
                y = F.linear(src, dequantized_weight(we, src.dtype), b)
            else:
                y = _matmul_operands(reference_operands(src, a.act, a.static_mask), we)
                y = (y if b is None else y + b.to(torch.float32)).to(src.dtype)
            out[lo:hi] = y.to(out.dtype)
        return out


class TorchBackend(Backend):
    """The references (any device): the spec every kernel backend is tested against."""

    name = "torch"

    def prepare_weight(self, weight, out=None):
        return None  # the reference reads the packed parts

    def quantize_weight(self, x, granularity=None, global_encode_scale=None, block_scaling="6"):
        return quantize_weight_reference(x, granularity, global_encode_scale, block_scaling)

    def quantize_activation(self, x2d, act, static_mask=None):
        return quantize_activation_reference(x2d, act, static_mask)

    activation_operands = staticmethod(reference_operands)
    linear_kernel_class = ReferenceLinearKernel
    experts_kernel_class = ReferenceExpertsKernel
    sibling_kernel_class = SiblingKernel
    grouped_linear = grouped_linear  # through the experts kernel (self: the backend)


register_backend(TorchBackend())
