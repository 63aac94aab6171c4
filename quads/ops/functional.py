"""The rollout ops as functions of tensors (what the quads modules call).

Each takes an optional ``backend``; modules pass the one they stored at conversion, direct
callers may leave it out (then :func:`~quads.ops.backend.select_backend` picks for the input's
device, honouring ``QUADS_BACKEND`` / ``use_backend``). Inside ``torch.compile`` the GEMMs go
through the custom ops of :mod:`quads.ops.library` (same bits).
"""

from __future__ import annotations

from typing import Callable

import torch

from quads.ops.activation_quant import ActivationQuant, QuantizedActivation
from quads.ops.backend import Backend, select_backend
from quads.ops import library
from quads.ops.experts import rollout_experts as _rollout_experts
from quads.tensor.nvfp4_math import NVFP4Parts
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["quantize_weight", "quantize_activation", "rollout_linear", "rollout_experts"]


def quantize_weight(x: torch.Tensor, granularity: str | None = None, backend: Backend | None = None) -> NVFP4Parts:
    """NVFP4 parts of a weight; identical bits whichever backend runs."""
    return (backend or select_backend(x.device)).quantize_weight(x, granularity)


def quantize_activation(
    x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None, backend: Backend | None = None
) -> QuantizedActivation:
    """Quantize a 2-D activation (+ residual) per ``config``; identical bits whichever backend runs."""
    return (backend or select_backend(x2d.device)).quantize_activation(x2d, config, static_mask)


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
    """``x (..., K) -> (..., N)`` through a packed NVFP4 weight (N, K).

    With ``act``: W4A4 (+ residual compensation); without: weight-only W4A16 (see :mod:`quads.ops.linear`).
    ``prepared``: ``backend.prepare_weight(weight.parts)``, if the caller keeps it.
    """
    _check_linear_weight(x, weight)
    backend = backend or select_backend(x.device)
    y = library.linear(backend, x.reshape(-1, x.shape[-1]), weight.parts, bias, act, static_mask, prepared)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rollout_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: NVFP4Tensor,
    down: NVFP4Tensor,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    act: ActivationQuant | None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    static_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    backend: Backend | None = None,
    prepared: tuple = (None, None),
) -> torch.Tensor:
    """MoE experts with packed NVFP4 ``gate_up (E, 2I, H)`` and ``down (E, H, I)`` (see :mod:`quads.ops.experts`)."""
    return _rollout_experts(hidden, top_k_index, top_k_weights, gate_up.parts, down.parts, apply_gate, act,
                            backend or select_backend(hidden.device), gate_up_bias, down_bias, static_masks,
                            prepared)
