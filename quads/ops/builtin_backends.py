"""The built-in backends: each entry of the :class:`~quads.ops.backend_registry.Backend` interface bound
to one op file's implementation (the reference, or that op's kernel glue).

Registered when :mod:`quads.ops` is imported. A new backend (for instance one on other
kernels) is a class like these, in its own module, registered with
:func:`~quads.ops.backend_registry.register_backend` (see :mod:`quads.ops.backend_registry`).
"""

from __future__ import annotations

from quads.ops.activation_quant import quantize_activation_reference, quantize_activation_triton
from quads.ops.backend_registry import Backend, register_backend
from quads.ops.experts import ExpertsKernel, HopperExpertsKernel, ReferenceExpertsKernel, grouped_linear
from quads.ops.linear import (
    BlackwellLinearKernel,
    HopperLinearKernel,
    ReferenceLinearKernel,
    hopper_operands,
    prepare_weight_hopper,
    prepared_fields,
    prepared_from_fields,
    reference_operands,
)
from quads.ops.sibling_linear import HopperSiblingKernel, SiblingKernel, stack_prepared_hopper
from quads.ops.weight_quant import group_amax_bits_triton, quantize_weight_reference, quantize_weight_triton

__all__ = ["TorchBackend", "HopperBackend", "BlackwellBackend"]

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
    grouped_linear = grouped_linear  # through the experts kernel (self: the backend)


class HopperBackend(Backend):
    """The exact-emulation Triton kernels (sm_90; any device under ``TRITON_INTERPRET=1``)."""

    name = "hopper"

    def prepare_weight(self, weight, out=None):
        return prepare_weight_hopper(weight, out)

    def op_prepared(self, prepared):
        return ([], "") if prepared is None else (list(prepared_fields(prepared)), "hopper")

    def prepared_from_op(self, tensors, config, weight, global_encode_scale):
        return prepared_from_fields(*tensors, weight.qdata.shape[0], weight.qdata.shape[1] * 2) if config else None

    def quantize_weight(self, x, granularity=None, global_encode_scale=None, block_scaling="6"):
        return quantize_weight_triton(x, granularity, global_encode_scale, block_scaling)

    def quantize_activation(self, x2d, act, static_mask=None):
        return quantize_activation_triton(x2d, act, static_mask)

    def group_scale(self, masters, block_scaling="6"):
        """The group's amax bits (one amax kernel pass per master into one buffer); the fused
        fake quantizer derives ``S_enc`` from them (with the numerator of its block scaling)."""
        return group_amax_bits_triton(masters)

    activation_operands = staticmethod(hopper_operands)
    linear_kernel_class = HopperLinearKernel
    experts_kernel_class = HopperExpertsKernel
    sibling_kernel_class = HopperSiblingKernel
    stack_prepared = staticmethod(stack_prepared_hopper)
    grouped_linear = grouped_linear


class BlackwellBackend(HopperBackend):
    """Native FP4 W4A4 on sm_100+ through ``torch._scaled_mm``, the Hopper kernels for the rest.
    NOT RUN (no Blackwell GPU here): selectable, never ``auto``; no stacked GEMM."""

    name = "blackwell"

    linear_kernel_class = BlackwellLinearKernel

    def stack_prepared(self, prepared, shared_scale=False):
        return None


# the defaults (experts.py and sibling_linear.py import the registry, not the reverse)
Backend.experts_kernel_class = ExpertsKernel
Backend.sibling_kernel_class = SiblingKernel

for _backend in (TorchBackend(), HopperBackend(), BlackwellBackend()):
    register_backend(_backend)
del _backend
