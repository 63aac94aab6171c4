"""Rollout-side ops: weight and activation quantization, the W4A4/W4A16 linear, MoE experts.

One op per file, each with its torch reference and the glue to its Triton kernels
(:mod:`.weight_quant`, :mod:`.activation_quant`, :mod:`.linear`, :mod:`.grouped_linear`,
:mod:`.experts`); :mod:`.backend` gathers the implementations into backend objects chosen once
per module; :mod:`.functional` is the tensor-level front. Imports only ``tensor`` and ``kernels``.
"""

from quads.ops.activation_quant import ActivationQuant, QuantizedActivation, dequantize_activation
from quads.ops.backend import Backend, get_backend, select_backend, use_backend
from quads.ops.functional import quantize_activation, quantize_weight, rollout_experts, rollout_linear
from quads.ops.linear import w4a4_matmul_reference

__all__ = [
    "ActivationQuant",
    "Backend",
    "QuantizedActivation",
    "dequantize_activation",
    "get_backend",
    "quantize_activation",
    "quantize_weight",
    "rollout_experts",
    "rollout_linear",
    "select_backend",
    "use_backend",
    "w4a4_matmul_reference",
]
