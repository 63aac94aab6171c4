"""The rollout linear layer: W4A4 (+ residual compensation) or W4A16, reference and kernel glue.

``y = x Wᵀ`` with W packed NVFP4 parts (N, K). With an :class:`ActivationQuant` config the
activations are quantized online and the product is W4A4 with residual compensation:
``y = x̂ Ŵᵀ + r̂ Ŵᵀ``. The reference (:func:`w4a4_linear_reference`) mirrors the exact Hopper
emulation (QUADS.md section 3): E2M1 x E4M3 products are exact, sums are float32, the global
scales are divided out in the epilogue. Kernels agree with it up to float32 summation order.
Without a config the layer is weight-only (W4A16): ``F.linear(x, DQ(W))``, bit-identical to the
trainer's QAT forward.

Every function here takes 2-D activations ``(M, K)``; :mod:`quads.ops.functional` reshapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quads.ops.activation_quant import (
    ActivationQuant,
    QuantizedActivation,
    activation_operands_triton,
    quantize_activation_reference,
    quantize_activation_triton,
)
from quads.ops.activation_memo import memo_last, shared_operands
from quads.ops.weight_cache import dequantized_weight
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize

__all__ = [
    "prepare_weight_hopper",
    "unscaled_values",
    "w4a4_matmul_reference",
    "w4a4_linear_reference",
    "w4a4_linear_hopper",
    "w4a4_linear_blackwell",
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


def w4a4_matmul_reference(qa: QuantizedActivation, weight: NVFP4Parts) -> torch.Tensor:
    """float32 (M, N) = (x̂ Ŵᵀ [+ r̂ Ŵᵀ]) / (S_x S_w): fp32 sums of exact products, the global
    scales (the residual shares S_x) divided out once in the epilogue."""
    w = dequantized_weight(weight, torch.float32, unscaled=True)  # = unscaled_values(weight), cached
    m = qa.main.qdata.shape[0]
    acc = memo_last("unscaled_main", qa.main.qdata, None, lambda: unscaled_values(qa.main)) @ w.T
    if qa.residual is not None:
        r = qa.residual
        acc = acc + memo_last("unscaled_residual", r.qdata, None, lambda: unscaled_values(r)) @ w.T
    return acc / (_row_scale(qa.main.global_encode_scale, m) * weight.global_encode_scale)


def w4a4_linear_reference(
    x2: torch.Tensor,
    weight: NVFP4Parts,
    bias: torch.Tensor | None,
    act: ActivationQuant,
    static_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, K) -> (M, N) in ``x2.dtype``: quantize (+ residual), exact-emulation product, bias.

    Linears reading the same input (q/k/v, gate/up) reuse its quantization (:mod:`.activation_memo`)."""
    if static_mask is None:
        qa = memo_last("quantized", x2, act, lambda: quantize_activation_reference(x2, act))
    else:
        qa = quantize_activation_reference(x2, act, static_mask)
    y = w4a4_matmul_reference(qa, weight)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2.dtype)


def prepare_weight_hopper(weight: NVFP4Parts, out=None):
    """The packed weight (2-D, or 3-D experts) in the decode kernels' layout
    (:mod:`quads.kernels.hopper_weight_layout`): built once per weight write, not per call;
    written into ``out`` (an earlier layout) when it fits, so its tensors keep their addresses."""
    from quads.kernels.hopper_weight_layout import hopper_layout_fits, to_hopper_layout

    if out is not None and not hopper_layout_fits(out, weight.qdata, weight.scale):
        out = None
    return to_hopper_layout(weight.qdata, weight.scale, out)


def w4a4_linear_hopper(
    x2: torch.Tensor,
    weight: NVFP4Parts,
    bias: torch.Tensor | None,
    act: ActivationQuant,
    static_mask: torch.Tensor | None = None,
    prepared=None,
) -> torch.Tensor:
    """Triton twin of :func:`w4a4_linear_reference`: fused quantization, then the exact W4A4
    decode GEMM (few tokens: weight streamed once in the layout ``prepared`` by
    :func:`prepare_weight_hopper`, built here if not given) or the prefill GEMM (many tokens).
    Inside :func:`~quads.ops.activation_memo.share_activation_quantization`, consecutive calls
    on the same input tensor and configuration quantize it once (q/k/v, gate/up)."""
    from quads.kernels.w4a4_decode_hopper import decode_gemm, max_decode_columns
    from quads.kernels.w4a4_gemm_hopper import w4a4_gemm

    if static_mask is None:  # siblings reading this input share one quantization (activation_memo)
        ops = shared_operands(x2, ("w4a4_operands", act),
                              lambda: activation_operands_triton(x2 if x2.stride(-1) == 1 else x2.contiguous(), act))
    else:  # a calibrated channel set of this layer's own
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        ops = activation_operands_triton(x2, act, static_mask)
    sw = weight.global_encode_scale.to(torch.float32)
    m = x2.shape[0]
    has_res = ops.residual is not None
    if (2 * m if has_res else m) <= max_decode_columns():
        prepared = prepared if prepared is not None else prepare_weight_hopper(weight)
        return decode_gemm(ops.stacked, ops.main_scale, prepared, sw, m, has_res, bias, x2.dtype)
    return w4a4_gemm(ops.main, ops.main_scale, weight.qdata, weight.scale, sw,
                     r16=ops.residual, bias=bias, out_dtype=x2.dtype)


def w4a4_linear_blackwell(
    x2: torch.Tensor,
    weight: NVFP4Parts,
    bias: torch.Tensor | None,
    act: ActivationQuant,
    static_mask: torch.Tensor | None = None,
    prepared=None,
) -> torch.Tensor:
    """W4A4 (+ residual) through native FP4 GEMMs on sm_100+ (NOT RUN here, see kernels.blackwell)."""
    from quads.kernels.blackwell import fp4_unscaled_mm

    qa = quantize_activation_triton(x2, act, static_mask)
    m = x2.shape[0]
    sw = weight.global_encode_scale.to(torch.float32)
    acc = fp4_unscaled_mm(qa.main, weight)
    if qa.residual is not None:
        acc = acc + fp4_unscaled_mm(qa.residual, weight)
    y = acc / (_row_scale(qa.main.global_encode_scale, m) * sw)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2.dtype)


def w4a16_linear(x2: torch.Tensor, weight: NVFP4Parts, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only: ``F.linear(x, DQ(W))`` with DQ in ``x.dtype`` (the trainer's QAT forward weight)."""
    w = dequantized_weight(weight, x2.dtype)  # nvfp4_dequantize, cached until the weight changes
    return F.linear(x2, w, bias)


def w4a16_linear_hopper(x2: torch.Tensor, weight: NVFP4Parts, bias: torch.Tensor | None, prepared=None) -> torch.Tensor:
    """Weight-only on the Hopper GEMMs, reading the packed weight (no dequantized copy).

    ``x`` goes in as fp16 with a per-row power of two (:mod:`quads.kernels.fp16_operand`); the
    weight as the exact ``e2m1 * s * 2^-14`` operand, the global scale divided out in fp32 at
    the end. Compared with :func:`w4a16_linear` (bf16 ``DQ(W)``, a cuBLAS product) the weight is
    not rounded to bf16 and the fp32 sums run in another order: differences of that size."""
    from quads.kernels.fp16_operand import scaled_fp16_rows
    from quads.kernels.w4a4_decode_hopper import decode_gemm, max_decode_columns
    from quads.kernels.w4a4_gemm_hopper import w4a4_gemm

    x16, sx = shared_operands(x2, "fp16_rows", lambda: scaled_fp16_rows(x2))  # shared by siblings, as W4A4
    sw = weight.global_encode_scale.to(torch.float32)
    if x2.shape[0] <= max_decode_columns():
        prepared = prepared if prepared is not None else prepare_weight_hopper(weight)
        return decode_gemm(x16, sx, prepared, sw, x2.shape[0], False, bias, x2.dtype)
    return w4a4_gemm(x16, sx, weight.qdata, weight.scale, sw, bias=bias, out_dtype=x2.dtype)
