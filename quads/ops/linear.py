"""The rollout linear: its reference, its backend glue, its custom op and its front, in one file.

``y = x Wᵀ`` with W packed NVFP4 parts (N, K). With an :class:`ActivationQuant` config the
activations are quantized online and the product is W4A4 with residual compensation:
``y = x̂ Ŵᵀ + r̂ Ŵᵀ``. The reference (:func:`w4a4_linear_reference`) mirrors the exact Hopper
emulation (docs/background.md): E2M1 x E4M3 products are exact, sums are float32, the global
scales are divided out in the epilogue. Kernels agree with it up to float32 summation order.
Without a config the layer is weight-only (W4A16): ``F.linear(x, DQ(W))``, bit-identical to the
trainer's QAT forward.

The linear kernels (one per rollout module, made when its weights are set; ``LinearArgs`` holds
the weight, the activation config, the static mask and the prepared layout):
:class:`ReferenceLinearKernel` (torch), :class:`HopperLinearKernel` (hopper),
:class:`BlackwellLinearKernel` (blackwell). A module's forward calls ``kernel.apply(x, bias)``,
which calls the launchers (``quantize_rows``, ``decode_gemm``, ``w4a4_gemm``) itself; inside
``torch.compile`` it calls the ``quads::linear`` custom op (the prepared layout passed as its
tensors, :meth:`Backend.op_prepared`), whose body runs the same kernel eagerly. Sibling linears
(:class:`~quads.ops.sibling_linear.SiblingSet`) pass ``operands`` computed once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import NamedTuple

from quads.ops.activation_quant import (
    ActivationQuant,
    QuantizedActivation,
    as_operands,
    fixed_operand_row_args,
    operand_row_args,
    quantize_activation_reference,
    quantize_activation_triton,
)
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
    "prepared_fields",
    "linear_op_args",
    "reference_operands",
    "hopper_operands",
    "prepare_weight_hopper",
    "unscaled_values",
    "w4a4_matmul_reference",
    "linear_reference",
    "linear_hopper",
    "w4a4_linear_reference",
    "w4a4_linear_hopper",
    "ReferenceLinearKernel",
    "HopperLinearKernel",
    "BlackwellLinearKernel",
    "w4a16_linear",
    "w4a16_linear_hopper",
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


def hopper_operands(x2: torch.Tensor, act: ActivationQuant | None, static_mask=None):
    """``Backend("hopper").activation_operands``: the fused quantization's GEMM operands
    (:class:`~quads.ops.activation_quant.ActivationOperands`), or without ``act`` (W4A16) the
    fp16 rows and their per-row powers of two (:mod:`quads.kernels.fp16_operand`)."""
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if act is None:
        from quads.kernels.fp16_operand import scaled_fp16_rows

        return scaled_fp16_rows(x2)
    from quads.kernels.quantize_activations import quantize_rows

    return as_operands(quantize_rows(x2, **operand_row_args(x2, act, static_mask)), x2.shape[0])


def prepare_weight_hopper(weight: NVFP4Parts, out=None):
    """The packed weight (2-D, or 3-D experts) in the decode kernels' layout
    (:mod:`quads.kernels.hopper_weight_layout`): built once per weight write, not per call;
    written into ``out`` (an earlier layout) when it fits, so its tensors keep their addresses."""
    from quads.kernels.hopper_weight_layout import hopper_layout_fits, to_hopper_layout

    if out is not None and not hopper_layout_fits(out, weight.qdata, weight.scale):
        out = None
    return to_hopper_layout(weight.qdata, weight.scale, out)


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


class ReferenceLinearKernel(LinearKernel):
    """The torch backend's linear: with ``act`` quantize (+ residual), the exact-emulation product
    (:func:`w4a4_matmul_reference`), bias; without: :func:`w4a16_linear`. ``operands``:
    :func:`reference_operands` of the input, computed once for sibling linears."""

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


class HopperLinearKernel(LinearKernel):
    """The Hopper backend's linear, the Triton twin of :class:`ReferenceLinearKernel`: the input's
    GEMM operands (``operands``, :meth:`Backend.activation_operands` computed by a sibling set,
    else here: the fused quantization, or W4A16's fp16 rows), then the exact decode GEMM (few
    tokens: the weight streamed once in the layout ``prepared``, built per call if absent)
    or the prefill GEMM (many tokens).

    Weight-only (``act=None``): ``x`` goes in as fp16 with a per-row power of two
    (:mod:`quads.kernels.fp16_operand`), the weight as the exact ``e2m1 * s * 2^-14`` operand, the
    global scale divided out in fp32 at the end. Compared with :func:`w4a16_linear` (bf16
    ``DQ(W)``, a cuBLAS product) the weight is not rounded to bf16 and the fp32 sums run in
    another order: differences of that size."""

    def __init__(self, backend, args: LinearArgs):
        super().__init__(backend, args)
        self.row_args_device = None if self.parts is None else self.parts.qdata.device
        self.row_args = None if self.k is None else fixed_operand_row_args(self.k, self.row_args_device, self.act,
                                                                           self.static_mask)

    def apply(self, x, bias=None, operands=None, parts=None, prepared=None):
        """``parts``/``prepared``: read instead of the kernel's own (the humming kernel's exact path
        for fp32 inputs: parts derived from its layout, the Hopper layout built per call)."""
        if torch.compiler.is_compiling():
            return compiled_linear(self, x, bias)
        if x.shape[-1] != self.k:
            self.check_input(x)
        from quads.kernels.fp16_operand import scaled_fp16_rows
        from quads.kernels.quantize_activations import quantize_rows
        from quads.kernels.w4a4_decode_hopper import decode_gemm, max_decode_columns
        from quads.kernels.w4a4_gemm_hopper import w4a4_gemm

        x2 = x.reshape(-1, x.shape[-1])
        act, m = self.act, x2.shape[0]
        if operands is None:
            x2c = x2 if x2.stride(-1) == 1 else x2.contiguous()
            if act is None:
                operands = scaled_fp16_rows(x2c)
            else:
                row_args = self.row_args if parts is None and x2c.device == self.row_args_device else None
                operands = as_operands(quantize_rows(x2c, **(row_args or operand_row_args(x2c, act, self.static_mask))),
                                       m)
        if act is None:
            main = stacked = operands[0]
            row_scale, residual = operands[1], None
        else:
            main, stacked, row_scale, residual = operands.main, operands.stacked, operands.main_scale, operands.residual
        w = self.parts if parts is None else parts
        sw = w.global_encode_scale.to(torch.float32)
        has_res = residual is not None
        if (2 * m if has_res else m) <= max_decode_columns():
            if parts is None:
                prepared = self.prepared
            y = decode_gemm(stacked, row_scale, prepared if prepared is not None else prepare_weight_hopper(w), sw, m,
                            has_res, bias, x2.dtype)
        else:
            y = w4a4_gemm(main, row_scale, w.qdata, w.scale, sw, r16=residual, bias=bias, out_dtype=x2.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


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


def linear_reference(x2, weight: NVFP4Parts, bias, act, static_mask=None, prepared=None, operands=None):
    """One call of :class:`ReferenceLinearKernel` (the torch backend's ``linear``)."""
    return get_backend("torch").linear(x2, weight, bias, act, static_mask, prepared, operands)


def linear_hopper(x2, weight: NVFP4Parts, bias, act, static_mask=None, prepared=None, operands=None):
    """One call of :class:`HopperLinearKernel` (the hopper backend's ``linear``)."""
    return get_backend("hopper").linear(x2, weight, bias, act, static_mask, prepared, operands)


def w4a4_linear_reference(x2, weight: NVFP4Parts, bias, act: ActivationQuant, static_mask=None) -> torch.Tensor:
    """The W4A4 (+ residual) reference (:func:`linear_reference` with an ``act``)."""
    return linear_reference(x2, weight, bias, act, static_mask)


def w4a4_linear_hopper(x2, weight: NVFP4Parts, bias, act: ActivationQuant, static_mask=None, prepared=None):
    """W4A4 (+ residual) on the Hopper kernels (:func:`linear_hopper` with an ``act``)."""
    return linear_hopper(x2, weight, bias, act, static_mask, prepared)


def w4a16_linear_hopper(x2, weight: NVFP4Parts, bias, prepared=None) -> torch.Tensor:
    """Weight-only on the Hopper kernels, reading the packed weight (no dequantized copy)."""
    return linear_hopper(x2, weight, bias, None, None, prepared)


def w4a16_linear(x2: torch.Tensor, weight: NVFP4Parts, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only: ``F.linear(x, DQ(W))`` with DQ in ``x.dtype`` (the trainer's QAT forward weight)."""
    w = dequantized_weight(weight, x2.dtype)  # nvfp4_dequantize, cached until the weight changes
    return F.linear(x2, w, bias)


# ---------------------------------------------------------------------------------------------
# The custom op (torch.compile) and the front
# ---------------------------------------------------------------------------------------------


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
    from quads.kernels.hopper_weight_layout import HopperWeight  # a kernel backend is in use: Triton is there

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
