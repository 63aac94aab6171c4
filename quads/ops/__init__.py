"""Rollout-side ops: activation quantization, the W4A4 linear and the MoE experts.

Each op has a torch reference (the spec the kernels are tested against) and a dispatching
front that picks a Triton kernel on supported GPUs (see :mod:`quads.ops.dispatch`).
"""

from quads.ops.activation_quant import ActivationQuant, QuantizedActivation, dequantize_activation
from quads.ops.dispatch import select_backend, use_backend
from quads.ops.rollout_linear import quantize_activation, rollout_linear, w4a4_matmul_reference

__all__ = [
    "ActivationQuant",
    "QuantizedActivation",
    "dequantize_activation",
    "quantize_activation",
    "rollout_linear",
    "select_backend",
    "use_backend",
    "w4a4_matmul_reference",
]
