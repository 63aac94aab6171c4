"""The ``blackwell`` backend: native FP4 W4A4 on sm_100+ through ``torch._scaled_mm``, the Hopper kernels for the rest.

NOT RUN (no Blackwell GPU here): selectable, never ``auto``; no stacked GEMM.
"""

from __future__ import annotations

import torch

from quads.ops.activation_quant import quantize_activation_triton
from quads.ops.backend_registry import register_backend
from quads.ops.backends.hopper import HopperBackend, HopperLinearKernel
from quads.ops.linear_op import _row_scale

__all__ = ["BlackwellBackend", "BlackwellLinearKernel"]


class BlackwellLinearKernel(HopperLinearKernel):
    """W4A4 (+ residual) through native FP4 GEMMs on sm_100+ (NOT RUN here, see kernels.blackwell);
    weight-only and CPU tensors (the interpreter) take the Hopper emulation."""

    def apply(self, x, bias=None, operands=None):
        if self.act is None or not x.is_cuda or torch.compiler.is_compiling():
            return super().apply(x, bias, operands)
        from quads.kernels.blackwell import fp4_unscaled_mm

        self.check_input(x)
        x2 = x.reshape(-1, x.shape[-1])
        qa = quantize_activation_triton(x2, self.act, self.static_mask)  # packed operands, its own quantization
        w = self.parts
        acc = fp4_unscaled_mm(qa.main, w)
        if qa.residual is not None:
            acc = acc + fp4_unscaled_mm(qa.residual, w)
        y = acc / (_row_scale(qa.main.global_encode_scale, x2.shape[0]) * w.global_encode_scale.to(torch.float32))
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x2.dtype).reshape(*x.shape[:-1], y.shape[-1])


class BlackwellBackend(HopperBackend):
    """Native FP4 W4A4 on sm_100+ through ``torch._scaled_mm``, the Hopper kernels for the rest.
    NOT RUN (no Blackwell GPU here): selectable, never ``auto``; no stacked GEMM."""

    name = "blackwell"

    linear_kernel_class = BlackwellLinearKernel

    def stack_prepared(self, prepared, shared_scale=False, weight_only=False):
        return None


register_backend(BlackwellBackend())
