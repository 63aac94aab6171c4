"""Online NVFP4 activation quantization with residual compensation (torch reference).

QUADS rollout activations: ``x_hat = DQ(Q(x))``; the residual ``r = x - x_hat``; a channel
mask ``S`` (per token: the channels whose |r| is among the top ``k`` of that row; static: a
calibrated per-layer channel set); ``r_hat = DQ(Q(r * 1_S))`` with its own global scale;
the GEMM then uses ``x_hat + r_hat`` (computed as two W4A4 products, see rollout_linear).

Global activation scales are per row (per token) by default, so a token's quantization, and
hence its log-probs, never depend on which other tokens share the batch (batch invariance;
the Triton kernels get the whole row in one pass for free). ``"tensor"`` is available for
comparison. Everything here calls :mod:`quads.tensor.nvfp4_math`; the Triton kernels are
checked bit-exact against these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize, nvfp4_quantize

__all__ = [
    "ActivationQuant",
    "QuantizedActivation",
    "num_residual_channels",
    "per_token_residual_mask",
    "quantize_activation_reference",
    "dequantize_activation",
]

RESIDUAL_SELECTIONS = ("per_token", "static")
ACTIVATION_SCALE_GRANULARITIES = ("row", "tensor")


@dataclass(frozen=True)
class ActivationQuant:
    """How a rollout layer quantizes its input.

    residual_fraction: fraction k of the K channels whose residual is re-quantized and added
        back (0 = naive W4A4). The per-token channel count is ``round_half_up(k*K)``.
    selection: ``"per_token"`` (top-k |r| of each row, ties at the threshold all included) or
        ``"static"`` (the layer's calibrated channel mask, see ``quads.calibrate_residual_channels``).
    global_scale: ``"row"`` (one NVFP4 global scale per token, batch invariant) or ``"tensor"``.
    """

    residual_fraction: float = 0.5
    selection: str = "per_token"
    global_scale: str = "row"

    def __post_init__(self):
        if not 0.0 <= self.residual_fraction <= 1.0:
            raise ValueError(f"residual_fraction must be in [0, 1], got {self.residual_fraction}")
        if self.selection not in RESIDUAL_SELECTIONS:
            raise ValueError(f"selection must be one of {RESIDUAL_SELECTIONS}, got {self.selection!r}")
        if self.global_scale not in ACTIVATION_SCALE_GRANULARITIES:
            raise ValueError(
                f"global_scale must be one of {ACTIVATION_SCALE_GRANULARITIES}, got {self.global_scale!r}"
            )


class QuantizedActivation(NamedTuple):
    main: NVFP4Parts  # Q(x)
    residual: NVFP4Parts | None  # Q(r * 1_S), or None without compensation


def num_residual_channels(k_dim: int, fraction: float) -> int:
    """Channels compensated per token: round-half-up(fraction * K), within [0, K]."""
    return max(0, min(k_dim, int(fraction * k_dim + 0.5)))


def per_token_residual_mask(residual: torch.Tensor, fraction: float) -> torch.Tensor:
    """Boolean mask (M, K): per row, channels whose |r| >= the k-th largest |r| of that row.

    Ties at the threshold are all included, which makes the selection a pure function of the
    values (no index-order tie breaking), so a kernel can reproduce it exactly.
    """
    k = num_residual_channels(residual.shape[-1], fraction)
    mag = residual.abs()
    if k == 0:
        return torch.zeros_like(mag, dtype=torch.bool)
    threshold = torch.topk(mag, k, dim=-1).values[..., -1:]
    return mag >= threshold


def quantize_activation_reference(
    x: torch.Tensor,
    config: ActivationQuant,
    static_mask: torch.Tensor | None = None,
) -> QuantizedActivation:
    """Quantize a 2-D activation ``x`` (M, K) per ``config`` (torch reference)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activation expects (M, K), got {tuple(x.shape)}")
    main = nvfp4_quantize(x, config.global_scale)
    if config.residual_fraction == 0.0:
        return QuantizedActivation(main, None)
    residual = x.to(torch.float32) - nvfp4_dequantize(*main, dtype=torch.float32)
    if config.selection == "per_token":
        mask = per_token_residual_mask(residual, config.residual_fraction)
    else:
        if static_mask is None:
            raise ValueError(
                "selection='static' needs a calibrated channel mask: run "
                "quads.calibrate_residual_channels(model, batches) first"
            )
        mask = static_mask.to(device=x.device, dtype=torch.bool).expand_as(residual)
    selected = torch.where(mask, residual, torch.zeros_like(residual))
    return QuantizedActivation(main, nvfp4_quantize(selected, config.global_scale))


def dequantize_activation(qa: QuantizedActivation) -> torch.Tensor:
    """``x_hat + r_hat`` in float32 (what the rollout GEMM effectively multiplies)."""
    out = nvfp4_dequantize(*qa.main, dtype=torch.float32)
    if qa.residual is not None:
        out = out + nvfp4_dequantize(*qa.residual, dtype=torch.float32)
    return out
