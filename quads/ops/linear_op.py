"""The rollout linear's op: its torch reference, its custom ops (``torch.compile``) and its front.

``y = x Wᵀ`` with W packed NVFP4 parts (N, K). With an :class:`ActivationQuant` config the
activations are quantized online and the product is W4A4 with residual compensation:
``y = x̂ Ŵᵀ + r̂ Ŵᵀ``. The reference (:func:`linear_reference`, its product :func:`w4a4_matmul_reference`) mirrors the exact Hopper
emulation (docs/background.md): E2M1 x E4M3 products are exact, sums are float32, the global
scales are divided out in the epilogue. Kernels agree with it up to float32 summation order.
Without a config the layer is weight-only (W4A16): ``F.linear(x, DQ(W))``, bit-identical to the
trainer's QAT forward.

The linear kernels (one per rollout module, made when its weights are set) live with their
backends (:mod:`quads.ops.backends`). A module's forward calls ``kernel.apply(x, bias)``; inside
``torch.compile`` that is one custom op here (``quads::linear_kernel`` over the kernel object, or
``quads::linear`` over its plain arguments, the prepared layout passed as its tensors,
:meth:`Backend.op_prepared`), whose body runs the same kernel eagerly. Sibling linears
(:class:`~quads.ops.sibling_linear.SiblingSet`) pass ``operands`` computed once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import NamedTuple

from quads.ops.activation_quant import ActivationQuant, QuantizedActivation, quantize_activation_reference
from quads.ops.backend_registry import KERNEL_OPS, Backend, KernelHandle, LinearArgs, LinearKernel, get_backend, select_backend
from quads.ops.compile_alignment import align_this_compile
from quads.ops.weight_cache import dequantized_weight
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = [
    "ReferenceOperands",
    "rollout_linear",
    "linear_op",
    "act_fields",
    "compiled_linear",
    "prepared_fields",
    "linear_op_args",
    "reference_operands",
    "unscaled_values",
    "w4a4_matmul_reference",
    "linear_reference",
    "w4a4_linear_reference",
    "w4a16_linear",
]


def unscaled_values(parts: NVFP4Parts) -> torch.Tensor:
    """``e2m1 * f32(block scale)`` in float32, without the global scale: exact (6 significant bits)."""
    one = torch.ones((), dtype=torch.float32, device=parts.qdata.device)
    return nvfp4_dequantize(parts.qdata, parts.scale, one, torch.float32)


def _row_scale(gs: torch.Tensor, rows: int) -> torch.Tensor:
    """A global-scale tensor (per row ``(M,)`` or per tensor ``()``) as an (M, 1) column."""
    return gs.reshape(-1, 1).expand(rows, 1) if gs.dim() else gs.reshape(1, 1)


class ReferenceOperands(NamedTuple):
    """The reference backend's activation operands: the quantized activation and its exact float32
    expansions without global scales (computed once for sibling linears)."""

    qa: QuantizedActivation
    main: torch.Tensor  # float32 (M, K) = unscaled_values(qa.main)
    residual: torch.Tensor | None


def reference_operands(x2: torch.Tensor, act: ActivationQuant | None, static_mask=None):
    """``Backend("torch").activation_operands``: :class:`ReferenceOperands` (None without ``act``:
    the weight-only reference multiplies ``x`` itself)."""
    if act is None:
        return None
    qa = quantize_activation_reference(x2, act, static_mask)
    return ReferenceOperands(qa, unscaled_values(qa.main), None if qa.residual is None else unscaled_values(qa.residual))


def _matmul_operands(ops: ReferenceOperands, weight: NVFP4Parts) -> torch.Tensor:
    w = dequantized_weight(weight, torch.float32, unscaled=True)  # = unscaled_values(weight), cached
    acc = ops.main @ w.T
    if ops.residual is not None:
        acc = acc + ops.residual @ w.T
    return acc / (_row_scale(ops.qa.main.global_encode_scale, ops.main.shape[0]) * weight.global_encode_scale)


def w4a4_matmul_reference(qa: QuantizedActivation, weight: NVFP4Parts) -> torch.Tensor:
    """float32 (M, N) = (x̂ Ŵᵀ [+ r̂ Ŵᵀ]) / (S_x S_w): fp32 sums of exact products, the global
    scales (the residual shares S_x) divided out once in the epilogue."""
    res = None if qa.residual is None else unscaled_values(qa.residual)
    return _matmul_operands(ReferenceOperands(qa, unscaled_values(qa.main), res), weight)


def linear_reference(x2, weight: NVFP4Parts, bias, act, static_mask=None, prepared=None, operands=None):
    """One call of :class:`~quads.ops.backends.reference.ReferenceLinearKernel` (the torch backend's ``linear``)."""
    return get_backend("torch").linear(x2, weight, bias, act, static_mask, prepared, operands)


def w4a4_linear_reference(x2, weight: NVFP4Parts, bias, act: ActivationQuant, static_mask=None) -> torch.Tensor:
    """The W4A4 (+ residual) reference (:func:`linear_reference` with an ``act``)."""
    return linear_reference(x2, weight, bias, act, static_mask)


def w4a16_linear(x2: torch.Tensor, weight: NVFP4Parts, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only: ``F.linear(x, DQ(W))`` with DQ in ``x.dtype`` (the trainer's QAT forward weight)."""
    w = dequantized_weight(weight, x2.dtype)  # nvfp4_dequantize, cached until the weight changes
    return F.linear(x2, w, bias)


# ---------------------------------------------------------------------------------------------
# The custom ops (torch.compile) and the front
# ---------------------------------------------------------------------------------------------


def _op_args(kernel: LinearKernel, x2: torch.Tensor, bias) -> tuple:
    """A linear kernel's call as the ``quads::linear`` custom op's plain arguments."""
    held = getattr(kernel.prepared, "holds_parts", False)  # then the weight is not read (in a trace: no parts)
    return linear_op_args(kernel.backend, x2, None if held else kernel.parts, bias, kernel.prepared, kernel.act,
                          kernel.static_mask)


def compiled_linear(kernel: LinearKernel, x: torch.Tensor, bias) -> torch.Tensor:
    """``kernel.apply`` as ``torch.compile`` traces it: one opaque custom op over the kernel object
    itself (``quads::linear_kernel``, whose body runs ``kernel.apply`` eagerly), or where this torch
    has no opaque objects ``quads::linear`` over its plain arguments."""
    x2 = x.reshape(-1, x.shape[-1])
    if KERNEL_OPS:
        y = torch.ops.quads.linear_kernel(x2, bias, kernel.op_handle, kernel.n)
    else:
        y = torch.ops.quads.linear(*_op_args(kernel, x2, bias))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def act_fields(act: ActivationQuant | None) -> tuple[bool, float, str, str, str]:
    """``ActivationQuant`` (or None: weight-only) as a custom op's five plain arguments."""
    if act is None:
        return False, 0.0, "per_token", "row", "6"
    return True, float(act.residual_fraction), act.selection, act.granularity, act.block_scaling


def act_from_fields(quantize_activations: bool, residual_fraction: float, selection: str, granularity: str,
                    block_scaling: str = "6"):
    return ActivationQuant(residual_fraction, selection, granularity, block_scaling) if quantize_activations else None


def prepared_fields(prepared) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A prepared weight as two optional tensors (the Hopper layout's values and scales)."""
    if prepared is not None and not hasattr(prepared, "values"):
        raise TypeError(f"{type(prepared).__name__} is no Hopper layout: pass it as Backend.op_prepared's tensors")
    return (None, None) if prepared is None else (prepared.values, prepared.scales)


def prepared_from_fields(values, scales, n: int, k: int):
    if values is None:
        return None
    from quads.kernels.hopper.weight_layout import HopperWeight  # a kernel backend is in use: Triton is there

    return HopperWeight(values, scales, n, k)


def linear_op_args(backend: Backend, x2: torch.Tensor, weight: NVFP4Parts | None, bias, prepared, act,
                   static_mask) -> tuple:
    """One linear's call as ``quads::linear``'s plain arguments: the prepared layout as its tensors
    and their static description (:meth:`Backend.op_prepared`). ``weight`` None: the layout holds
    the packed parts (``prepared.holds_parts``, the humming layout), its ``global_encode_scale``
    and packed ``shape`` stand for them."""
    tensors, config = backend.op_prepared(prepared)
    if weight is None:
        q = s = None
        gs, n = prepared.global_encode_scale, prepared.shape[-2]
    else:
        q, s, gs, n = weight.qdata, weight.scale, weight.global_encode_scale, weight.qdata.shape[0]
    return (x2, q, s, gs, bias, tensors, config, n, *act_fields(act), static_mask, backend.name)


@torch.library.custom_op("quads::linear", mutates_args=())
def linear_op(
    x: torch.Tensor,
    qdata: torch.Tensor | None,
    scale: torch.Tensor | None,
    global_encode_scale: torch.Tensor,
    bias: torch.Tensor | None,
    prepared: list[torch.Tensor],
    prepared_config: str,
    out_features: int,
    quantize_activations: bool,
    residual_fraction: float,
    selection: str,
    granularity: str,
    act_block_scaling: str,
    static_mask: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """(M, K) -> (M, N): ``backend.linear`` as an op opaque to ``torch.compile`` (same bits as
    eager). Arguments are tensors and plain values (:func:`linear_op_args`): the backend by name,
    the activation quantizer as its fields, the prepared layout as its tensors and a static
    description the backend makes it back from (:meth:`Backend.prepared_from_op`: nothing is
    looked up by identity), the packed parts None where that layout holds them. Its body never
    shares an activation quantization with another call (compiled code reuses buffers without
    version bumps, so tensor identity says nothing about values there)."""
    be = get_backend(backend)
    weight = None if qdata is None else NVFP4Parts(qdata, scale, global_encode_scale)
    prepared = be.prepared_from_op(prepared, prepared_config, weight, global_encode_scale)
    if weight is None:  # the layout holds the parts: their shapes (meta) and the global scale
        weight = NVFP4Parts(*prepared.shape_parts[:2], global_encode_scale)
    args = LinearArgs(weight, act_from_fields(quantize_activations, residual_fraction, selection, granularity,
                                              act_block_scaling), static_mask, prepared)
    return be.linear_kernel(args).apply(x, bias)


if KERNEL_OPS:
    @torch.library.custom_op("quads::linear_kernel", mutates_args=())
    def linear_kernel_op(x: torch.Tensor, bias: torch.Tensor | None, kernel: KernelHandle, out_features: int
                         ) -> torch.Tensor:
        """(M, K) -> (M, N): a linear kernel object's ``apply``, run eagerly, as an op opaque to
        ``torch.compile`` (the compiled path's kernel is the module's own: nothing is rebuilt per call)."""
        return kernel.kernel.apply(x, bias)

    @linear_kernel_op.register_fake
    def _(x, bias, kernel, out_features):
        align_this_compile()
        return x.new_empty(x.shape[0], out_features)


@linear_op.register_fake
def _(x, qdata, scale, global_encode_scale, bias, prepared, prepared_config, out_features, quantize_activations,
      residual_fraction, selection, granularity, act_block_scaling, static_mask, backend):
    align_this_compile()
    return x.new_empty(x.shape[0], out_features)


def _check_linear_weight(x: torch.Tensor, weight: NVFP4Tensor) -> None:
    if not isinstance(weight, NVFP4Tensor) or weight.dim() != 2 or weight.transposed:
        raise TypeError("rollout_linear expects a 2-D, untransposed NVFP4Tensor weight (N, K)")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rollout_linear: x has K={x.shape[-1]}, weight has K={weight.shape[-1]}")


def rollout_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    act: ActivationQuant | None = None,
    static_mask: torch.Tensor | None = None,
    backend: Backend | None = None,
    prepared=None,
) -> torch.Tensor:
    """``x (..., K) -> (..., N)`` through a packed NVFP4 weight (N, K), for callers that keep no
    kernel (a rollout module calls its :class:`~quads.ops.backend_registry.LinearKernel` instead).

    With ``act``: W4A4 (+ residual compensation); without: weight-only W4A16. ``backend``: None
    picks one for ``x``'s device (``QUADS_BACKEND``, ``use_backend``). ``prepared``:
    ``backend.prepare_weight(weight.parts)``, if the caller keeps it."""
    if not (torch.compiler.is_compiling() and getattr(prepared, "holds_parts", False)):  # compiled: not read
        _check_linear_weight(x, weight)
    backend = backend or select_backend(x.device)
    return backend.linear_kernel(LinearArgs(weight, act, static_mask, prepared)).apply(x, bias)
