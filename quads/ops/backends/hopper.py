"""The ``hopper`` backend: the exact-emulation Triton kernels (sm_90; any device under ``TRITON_INTERPRET=1``).

Its weights are read in the Hopper layout (:mod:`quads.kernels.hopper.weight_layout`, built once
per weight write: :func:`prepare_weight_hopper`); its GEMMs are the decode and prefill kernels of
:mod:`quads.kernels.hopper` (linear, stacked siblings) and the grouped one (experts). Each kernel
here is the Triton twin of the torch backend's (:mod:`quads.ops.backends.reference`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from quads.ops.activation_quant import (ActivationQuant, as_operands, fixed_operand_row_args, operand_row_args,
                                        quantize_activation_triton)
from quads.ops.backend_registry import Backend, LinearArgs, LinearKernel, get_backend, register_backend
from quads.ops.backends.reference import ReferenceExpertsKernel
from quads.ops.experts_op import ExpertsKernel, grouped_linear
from quads.ops.linear_op import compiled_linear
from quads.ops.sibling_linear import SiblingKernel
from quads.ops.weight_quant import group_amax_bits_triton, quantize_weight_triton
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["HopperBackend", "HopperExpertsKernel", "HopperLinearKernel", "HopperSiblingKernel", "hopper_operands",
           "linear_hopper", "prepare_weight_hopper", "stack_prepared_hopper", "w4a4_linear_hopper",
           "w4a16_linear_hopper"]


def hopper_operands(x2: torch.Tensor, act: ActivationQuant | None, static_mask=None):
    """``Backend("hopper").activation_operands``: the fused quantization's GEMM operands
    (:class:`~quads.ops.activation_quant.ActivationOperands`), or without ``act`` (W4A16) the
    fp16 rows and their per-row powers of two (:mod:`quads.kernels.hopper.fp16_operand`)."""
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if act is None:
        from quads.kernels.hopper.fp16_operand import scaled_fp16_rows

        return scaled_fp16_rows(x2)
    from quads.kernels.quantize_activations import quantize_rows

    return as_operands(quantize_rows(x2, **operand_row_args(x2, act, static_mask)), x2.shape[0])


def prepare_weight_hopper(weight: NVFP4Parts, out=None):
    """The packed weight (2-D, or 3-D experts) in the decode kernels' layout
    (:mod:`quads.kernels.hopper.weight_layout`): built once per weight write, not per call;
    written into ``out`` (an earlier layout) when it fits, so its tensors keep their addresses."""
    from quads.kernels.hopper.weight_layout import hopper_layout_fits, to_hopper_layout

    if out is not None and not hopper_layout_fits(out, weight.qdata, weight.scale):
        out = None
    return to_hopper_layout(weight.qdata, weight.scale, out)


class HopperLinearKernel(LinearKernel):
    """The Hopper backend's linear, the Triton twin of :class:`~quads.ops.backends.reference.ReferenceLinearKernel`: the input's
    GEMM operands (``operands``, :meth:`Backend.activation_operands` computed by a sibling set,
    else here: the fused quantization, or W4A16's fp16 rows), then the exact decode GEMM (few
    tokens: the weight streamed once in the layout ``prepared``, built per call if absent)
    or the prefill GEMM (many tokens).

    Weight-only (``act=None``): ``x`` goes in as fp16 with a per-row power of two
    (:mod:`quads.kernels.hopper.fp16_operand`), the weight as the exact ``e2m1 * s * 2^-14`` operand, the
    global scale divided out in fp32 at the end. Compared with :func:`~quads.ops.linear_op.w4a16_linear` (bf16
    ``DQ(W)``, a cuBLAS product) the weight is not rounded to bf16 and the fp32 sums run in
    another order: differences of that size."""

    #: the quantization's row arguments made with the kernel (a subclass whose own GEMM reads
    #: none, humming's, makes none: its exact path passes the parts and computes them per call)
    fixed_row_args = True

    def __init__(self, backend, args: LinearArgs):
        super().__init__(backend, args)
        self.row_args_device = None if self.parts is None else self.parts.qdata.device
        self.row_args = (None if self.k is None or not self.fixed_row_args else
                         fixed_operand_row_args(self.k, self.row_args_device, self.act, self.static_mask))

    def apply(self, x, bias=None, operands=None, parts=None, prepared=None):
        """``parts``/``prepared``: read instead of the kernel's own (the humming kernel's exact path
        for fp32 inputs: parts derived from its layout, the Hopper layout built per call)."""
        if torch.compiler.is_compiling():
            return compiled_linear(self, x, bias)
        if x.shape[-1] != self.k:
            self.check_input(x)
        from quads.kernels.hopper.fp16_operand import scaled_fp16_rows
        from quads.kernels.quantize_activations import quantize_rows
        from quads.kernels.hopper.w4a4_decode import decode_gemm, max_decode_columns
        from quads.kernels.hopper.w4a4_gemm import w4a4_gemm

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


def linear_hopper(x2, weight: NVFP4Parts, bias, act, static_mask=None, prepared=None, operands=None):
    """One call of :class:`HopperLinearKernel` (the hopper backend's ``linear``)."""
    return get_backend("hopper").linear(x2, weight, bias, act, static_mask, prepared, operands)


def w4a4_linear_hopper(x2, weight: NVFP4Parts, bias, act: ActivationQuant, static_mask=None, prepared=None):
    """W4A4 (+ residual) on the Hopper kernels (:func:`linear_hopper` with an ``act``)."""
    return linear_hopper(x2, weight, bias, act, static_mask, prepared)


def w4a16_linear_hopper(x2, weight: NVFP4Parts, bias, prepared=None) -> torch.Tensor:
    """Weight-only on the Hopper kernels, reading the packed weight (no dequantized copy)."""
    return linear_hopper(x2, weight, bias, None, None, prepared)


class HopperExpertsKernel(ExpertsKernel):
    """The Hopper backend's experts: each projection one grouped W4A4 launch over all experts
    (weights in the layout ``prepared``, built per call if absent), each row with the bits of
    the dense Hopper linear on its expert; no host synchronisation. ``act=None`` (W4A16) feeds the
    same kernel fp16 rows times a per-row power of two. Expert biases are added to the fp32 rows
    before the one rounding (as the dense kernels' epilogue does); ``"tensor"`` activation scales
    quantize each expert's rows as one tensor (a host loop over experts, as the reference). W4A16
    with biases runs the reference's per-expert ``F.linear`` (:class:`~quads.ops.backends.reference.ReferenceExpertsKernel`)."""

    def __init__(self, backend, gate_up: LinearArgs, down: LinearArgs | None = None):
        super().__init__(backend, gate_up, down)
        self.row_args_device = None if self.parts[0] is None else self.parts[0].qdata.device
        self.row_args = tuple(None if p is None else fixed_operand_row_args(p.qdata.shape[-1] * 2, self.row_args_device,
                                                                            a.act, a.static_mask)
                              for a, p in zip(self.projections, self.parts))

    def gemm(self, i, x, rows, route, bias, w=None):
        a = self.projections[i]
        if a.act is None and bias is not None:
            return ReferenceExpertsKernel.gemm(self, i, x, rows, route, bias, w)
        from quads.kernels.hopper.fp16_operand import scaled_fp16_rows
        from quads.kernels.hopper.moe_grouped_gemm import moe_w4a4_gemm
        from quads.kernels.quantize_activations import quantize_rows

        own = w is None  # the kernel's own weight (else parts derived for the exact path)
        prepared, w = (a.prepared, self.parts[i]) if own else (None, w)
        x = x if x.stride(-1) == 1 else x.contiguous()
        src_rows, rows_x, has_residual = rows, x.shape[0], False
        if a.act is None:
            stacked, row_scale = scaled_fp16_rows(x)
        elif a.act.granularity == "row":
            row_args = self.row_args[i] if own and x.device == self.row_args_device else None
            ops = as_operands(quantize_rows(x, **(row_args or operand_row_args(x, a.act, a.static_mask))), x.shape[0])
            stacked, row_scale, has_residual = ops.stacked, ops.main_scale, ops.residual is not None
        else:  # each expert's rows one tensor, the operand rows in expert order
            bounds = route.offsets.tolist()
            parts = [x[rows[lo:hi]] if rows is not None else x[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])
                     if hi > lo]
            ops = [as_operands(quantize_rows(p, **operand_row_args(p, a.act, a.static_mask)), p.shape[0])
                   for p in parts]
            if not ops:  # no row routed to an expert
                return x.new_zeros(route.num_rows, w.qdata.shape[1])
            has_residual = ops[0].residual is not None
            stacked = torch.cat([o.main for o in ops] + ([o.residual for o in ops] if has_residual else []))
            row_scale, src_rows, rows_x = torch.cat([o.main_scale for o in ops]), None, bounds[-1]
        prepared = prepared if prepared is not None else prepare_weight_hopper(w)
        y = moe_w4a4_gemm(stacked, row_scale, None if src_rows is None else src_rows.to(torch.int32),
                          route.offsets.to(torch.int32), prepared, w.global_encode_scale.float(), route.num_rows,
                          rows_x, has_residual, out_dtype=x.dtype if bias is None else torch.float32)
        if bias is not None:  # fp32 rows + their expert's bias, one rounding; rows of no expert stay zero
            expert = torch.searchsorted(route.offsets[1:].contiguous(), torch.arange(
                route.num_rows, device=y.device, dtype=route.offsets.dtype), right=True)
            valid = (expert < bias.shape[0])[:, None]
            y = torch.where(valid, y + bias.index_select(0, expert.clamp(max=bias.shape[0] - 1)).float(),
                            y).to(x.dtype)
        return y


class HopperSiblingKernel(SiblingKernel):
    """The Hopper backend's: the fused quantization's operands (or W4A16's fp16 rows) once, then
    one decode GEMM over the stacked layout with the per-row global scales where the set has one,
    no output has a bias and the tokens (with their residual rows) fit one decode launch."""

    def apply(self, x, i=None, bias=None):
        hit, biased = self.siblings.begin(i, x, bias)
        if hit is not None:
            return hit
        from quads.kernels.hopper.fp16_operand import scaled_fp16_rows
        from quads.kernels.quantize_activations import quantize_rows
        from quads.kernels.hopper.w4a4_decode import decode_gemm, max_decode_columns

        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        m = x2.shape[0]
        if self.act is None:
            return self.siblings.keep(i, x, None, scaled_fp16_rows(x2))
        ops = as_operands(quantize_rows(x2, **operand_row_args(x2, self.act)), m)
        y = None
        if self.stacked is not None and not biased and 2 * m <= max_decode_columns():
            y = decode_gemm(ops.stacked, ops.main_scale, self.stacked, self.row_scales, m, ops.residual is not None,
                            None, x.dtype)
        return self.siblings.keep(i, x, y, ops)


def stack_prepared_hopper(prepared: Sequence, shared_scale: bool = False, weight_only: bool = False):
    """The Hopper layouts of sibling weights (each N a multiple of 64, one K, one device) as one
    layout stacked along N, and each member's view of it; None when they do not qualify or the set
    is weight-only (the W4A16 siblings share their fp16 rows; each member runs its own GEMM)."""
    from quads.kernels.hopper.weight_layout import ROW_PAD, HopperWeight

    if weight_only or not all(isinstance(p, HopperWeight) and p.values.dim() == 4 for p in prepared):
        return None
    first = prepared[0]
    if any(p.n % ROW_PAD or p.k != first.k or p.values.device != first.values.device for p in prepared):
        return None
    n = sum(p.n for p in prepared)
    stacked = HopperWeight(
        torch.empty((n // 16, *first.values.shape[1:]), dtype=torch.uint8, device=first.values.device),
        torch.empty((n // 16, *first.scales.shape[1:]), dtype=torch.uint8, device=first.scales.device), n, first.k)
    views, lo = [], 0
    for p in prepared:
        hi = lo + p.n // 16
        view = HopperWeight(stacked.values[lo:hi], stacked.scales[lo:hi], p.n, p.k)
        view.values.copy_(p.values)
        view.scales.copy_(p.scales)
        views.append(view)
        lo = hi
    return stacked, views


class HopperBackend(Backend):
    """The exact-emulation Triton kernels (sm_90; any device under ``TRITON_INTERPRET=1``)."""

    name = "hopper"

    def prepare_weight(self, weight, out=None):
        return prepare_weight_hopper(weight, out)

    def op_prepared(self, prepared):
        """The Hopper layout as its two tensors (values, scales)."""
        if prepared is None:
            return [], ""
        if not hasattr(prepared, "values"):
            raise TypeError(f"{type(prepared).__name__} is no Hopper layout: pass it as its backend's op_prepared")
        return [prepared.values, prepared.scales], "hopper"

    def prepared_from_op(self, tensors, config, weight, global_encode_scale):
        """The Hopper layout of ``tensors``; N and K (per expert for 3-D weights) from the parts."""
        from quads.kernels.hopper.weight_layout import HopperWeight

        return HopperWeight(*tensors, weight.qdata.shape[-2], weight.qdata.shape[-1] * 2) if config else None

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


register_backend(HopperBackend())
