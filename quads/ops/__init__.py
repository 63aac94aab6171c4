"""Rollout-side ops: weight and activation quantization, the W4A4/W4A16 linear, sibling linears,
MoE experts. Imports only ``tensor`` and ``kernels``.

One op per file, each with its torch reference, its ``torch.library`` custom op (with a fake
implementation, for ``torch.compile``) and its front function: :mod:`.weight_quant`
(``quantize_weight``), :mod:`.activation_quant` (``quantize_activation``), :mod:`.linear_op`
(``rollout_linear``), :mod:`.grouped_linear_op`, :mod:`.experts_op` (routing, the experts kernels'
base, ``rollout_experts``), :mod:`.sibling_linear` (``SiblingSet``: one quantization and one stacked
GEMM for q/k/v, gate/up). :mod:`.backend_registry` is the backend interface, the kernel base, the
registry and the choice; :mod:`.backends` holds each backend's kernel classes, one module per
backend (reference, hopper, blackwell, humming); :mod:`.kernel_op_args` is a kernel's fields as the
plain-field custom ops' arguments (a torch without opaque custom-op objects).
"""

from quads.ops.activation_quant import ActivationQuant, QuantizedActivation, dequantize_activation, quantize_activation
from quads.ops.backend_registry import Backend, get_backend, register_backend, select_backend, use_backend
from quads.ops.backends import BlackwellBackend, HopperBackend, TorchBackend  # registers the three
from quads.ops.experts_op import rollout_experts
from quads.ops.linear_op import rollout_linear, w4a4_matmul_reference
from quads.ops.sibling_linear import SiblingSet
from quads.ops.weight_quant import quantize_weight

__all__ = [
    "ActivationQuant",
    "Backend",
    "BlackwellBackend",
    "HopperBackend",
    "QuantizedActivation",
    "SiblingSet",
    "TorchBackend",
    "dequantize_activation",
    "get_backend",
    "quantize_activation",
    "quantize_weight",
    "register_backend",
    "rollout_experts",
    "rollout_linear",
    "select_backend",
    "use_backend",
    "w4a4_matmul_reference",
]
