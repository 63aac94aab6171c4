"""The rollout linear layer: W4A4 (+ residual compensation) or W4A16, and its torch reference.

``y = x Wᵀ`` with W a packed :class:`NVFP4Tensor`. With an :class:`ActivationQuant` config the
activations are quantized online and the product is W4A4 with residual compensation:
``y = x̂ Ŵᵀ + r̂ Ŵᵀ``. The reference mirrors the exact Hopper emulation (QUADS.md section 3):
E2M1 x E4M3 products are exact, sums are float32, the global scales are divided out in the
epilogue. Kernels agree with it up to float32 summation order. Without a config the layer is
weight-only (W4A16): ``F.linear(x, DQ(W))``, bit-identical to the trainer's QAT forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quads.ops.activation_quant import ActivationQuant, QuantizedActivation, quantize_activation_reference
from quads.ops.dispatch import select_backend
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["rollout_linear", "w4a4_matmul_reference", "quantize_activation"]


def _unscaled(parts: NVFP4Parts) -> torch.Tensor:
    """e2m1 * block scale, without the global scale: exact in float32 (and in bf16/fp16)."""
    one = torch.ones((), dtype=torch.float32, device=parts.qdata.device)
    return nvfp4_dequantize(parts.qdata, parts.scale, one, torch.float32)


def _row_scale(gs: torch.Tensor, rows: int) -> torch.Tensor:
    return gs.reshape(-1, 1).expand(rows, 1) if gs.dim() else gs.reshape(1, 1)


def w4a4_matmul_reference(qa: QuantizedActivation, weight: NVFP4Parts) -> torch.Tensor:
    """float32 (M, N) = x̂ Ŵᵀ (+ r̂ Ŵᵀ) with global scales applied in the epilogue."""
    w = _unscaled(weight)
    m = qa.main.qdata.shape[0]
    y = (_unscaled(qa.main) @ w.T) / (_row_scale(qa.main.global_encode_scale, m) * weight.global_encode_scale)
    if qa.residual is not None:
        r = qa.residual
        y = y + (_unscaled(r) @ w.T) / (_row_scale(r.global_encode_scale, m) * weight.global_encode_scale)
    return y


def quantize_activation(x2d: torch.Tensor, config: ActivationQuant, static_mask=None) -> QuantizedActivation:
    """Dispatching front of the activation quantizer (kernel on GPU, reference elsewhere)."""
    backend = select_backend(x2d.device)
    if backend == "torch":
        return quantize_activation_reference(x2d, config, static_mask)
    from quads.kernels import quantize_activation_kernel

    return quantize_activation_kernel(x2d, config, static_mask)


def rollout_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    act: ActivationQuant | None = None,
    static_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x (..., K) -> (..., N)`` through a packed NVFP4 weight (N, K); see module doc."""
    if not isinstance(weight, NVFP4Tensor) or weight.dim() != 2 or weight.transposed:
        raise TypeError("rollout_linear expects a 2-D, untransposed NVFP4Tensor weight (N, K)")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rollout_linear: x has K={x.shape[-1]}, weight has K={weight.shape[-1]}")
    if act is None:
        return F.linear(x, weight.dequantize(x.dtype), bias)
    x2 = x.reshape(-1, x.shape[-1])
    backend = select_backend(x.device)
    if backend == "torch":
        qa = quantize_activation_reference(x2, act, static_mask)
        y = w4a4_matmul_reference(qa, weight.parts)
        if bias is not None:
            y = y + bias.to(torch.float32)
        y = y.to(x.dtype)
    else:
        from quads.kernels import rollout_linear_kernel

        y = rollout_linear_kernel(x2, weight.parts, bias, act, static_mask, backend=backend)
    return y.reshape(*x.shape[:-1], weight.shape[0])
