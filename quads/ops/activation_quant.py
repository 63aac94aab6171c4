"""Online NVFP4 activation quantization with residual compensation: the op, reference and kernel glue.

QUADS rollout activations: ``x_hat = DQ(Q(x))``; the residual ``r = x - x_hat``; a channel
mask ``S`` (per token: the channels whose |r| is among the top ``k`` of that row, all of them at
k = 100%; static: a calibrated per-layer channel set); ``r_hat = DQ(Q(r * 1_S))`` with the *same*
global scale as ``x`` (its E4M3 block scales absorb the residual's ~10x smaller range; measured:
the same error as a global scale of its own, docs/design.md); the GEMM then uses
``x_hat + r_hat`` (two W4A4 products with one epilogue scale, see :mod:`quads.ops.linear_op`).

Global activation scales are per row (per token) by default, so a token's quantization, and
hence its log-probs, never depend on which other tokens share the batch (batch invariance;
the Triton kernel gets the whole row in one pass for free). ``"tensor"`` is available for
comparison. The reference calls :mod:`quads.tensor.nvfp4_math`; the Triton kernel
(:func:`quads.kernels.quantize_activations.quantize_rows`) is checked bit-exact against it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from quads.ops.backend_registry import Backend, select_backend
from quads.tensor.nvfp4_math import BLOCK_SCALINGS, NVFP4Parts, check_quantizable, nvfp4_dequantize, nvfp4_quantize

__all__ = [
    "fixed_operand_row_args",
    "ActivationQuant",
    "ActivationOperands",
    "QuantizedActivation",
    "RESIDUAL_SELECTIONS",
    "ACTIVATION_GRANULARITIES",
    "num_residual_channels",
    "quantize_activation",
    "per_token_residual_mask",
    "quantize_activation_reference",
    "quantize_activation_triton",
    "activation_operands_triton",
    "as_operands",
    "operand_row_args",
    "summed_operand_triton",
    "summed_row_args",
    "per_row_scales",
    "dequantize_activation",
]

RESIDUAL_SELECTIONS = ("per_token", "static")
ACTIVATION_GRANULARITIES = ("row", "tensor")


@dataclass(frozen=True)
class ActivationQuant:
    """How a rollout layer quantizes its input (the defaults are the QUADS policy's defaults).

    residual_fraction: fraction k of the K channels whose residual is re-quantized and added
        back (0 = naive W4A4). The per-token channel count is ``round_half_up(k*K)``. Default
        1.0 (every channel: no selection at all): measured more accurate than the paper's 50%
        (real-model mean log-prob gap 1.5x the BF16 floor vs 2.2-2.5x) and faster (no per-row
        top-k search; docs/kernels.md). Fractions < 1 select per token or statically.
    selection: ``"per_token"`` (top-k |r| of each row, ties at the threshold all included) or
        ``"static"`` (the layer's calibrated channel mask, see ``quads.calibrate_residual_channels``).
    granularity: global-scale groups of the activation: ``"row"`` (one NVFP4 global scale per
        token, batch invariant) or ``"tensor"``.
    block_scaling: ``"6"`` (NVIDIA's) or ``"4over6"`` (Four Over Six, docs/nvfp4_spec.md), for
        the main term and the residual alike (the residual shares the row's global scale, whose
        numerator the block scaling sets).
    """

    residual_fraction: float = 1.0
    selection: str = "per_token"
    granularity: str = "row"
    block_scaling: str = "6"

    def __post_init__(self):
        f = self.residual_fraction
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not math.isfinite(f) or not 0.0 <= f <= 1.0:
            raise ValueError(f"residual_fraction must be a number in [0, 1], got {f!r}")
        object.__setattr__(self, "residual_fraction", float(f))  # numpy / Fraction numbers as a float
        if self.selection not in RESIDUAL_SELECTIONS:
            raise ValueError(f"selection must be one of {RESIDUAL_SELECTIONS}, got {self.selection!r}")
        if self.granularity not in ACTIVATION_GRANULARITIES:
            raise ValueError(f"granularity must be one of {ACTIVATION_GRANULARITIES}, got {self.granularity!r}")
        if not isinstance(self.block_scaling, str) or self.block_scaling not in BLOCK_SCALINGS:
            raise ValueError(f"block_scaling must be one of {BLOCK_SCALINGS}, got {self.block_scaling!r}")

    @property
    def has_residual(self) -> bool:
        return self.residual_fraction > 0.0


class QuantizedActivation(NamedTuple):
    main: NVFP4Parts  # Q(x)
    residual: NVFP4Parts | None  # Q(r * 1_S), or None without compensation


class ActivationOperands(NamedTuple):
    """The GEMM-side form of a quantized activation: fp16 ``e2m1 * f32(scale)`` (exact, unscaled)
    and per-row fp32 global scales, for the main term and the residual (or None; it shares the
    rows' global scales). ``stacked``: the same rows in one buffer, residual rows after the main
    ones (the decode GEMMs multiply both with one MMA); ``main``/``residual`` are views of it.
    ``main_scale``: the rows' global scales (M,)."""

    main: torch.Tensor
    main_scale: torch.Tensor
    residual: torch.Tensor | None
    stacked: torch.Tensor


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
    if k == residual.shape[-1]:
        return torch.ones_like(mag, dtype=torch.bool)  # every channel (NaN rows too): no search
    threshold = torch.topk(mag, k, dim=-1).values[..., -1:]
    return mag >= threshold


def _static_mask_for(x2d: torch.Tensor, static_mask: torch.Tensor | None) -> torch.Tensor:
    if static_mask is None:
        raise ValueError(
            "selection='static' needs a calibrated channel mask: run "
            "quads.calibrate_residual_channels(model, batches) first"
        )
    mask = static_mask.to(device=x2d.device, dtype=torch.bool)
    if mask.numel() != x2d.shape[-1]:
        raise ValueError(
            f"the static residual mask must be one channel set of K={x2d.shape[-1]} per layer, "
            f"got shape {tuple(mask.shape)}"
        )
    return mask.reshape(-1)


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"quantize_activation expects (M, K), got {tuple(x.shape)}")
    check_quantizable(x, "activation")


def quantize_activation_reference(
    x: torch.Tensor,
    config: ActivationQuant,
    static_mask: torch.Tensor | None = None,
) -> QuantizedActivation:
    """Quantize a 2-D activation ``x`` (M, K) per ``config`` (torch reference: the spec)."""
    if x.dim() != 2:
        _check_2d(x)
    check_quantizable(x, "activation")
    main = nvfp4_quantize(x, config.granularity, None, config.block_scaling)
    if not config.has_residual:
        return QuantizedActivation(main, None)
    residual = x.to(torch.float32) - nvfp4_dequantize(*main, dtype=torch.float32)
    if config.selection == "per_token":
        mask = per_token_residual_mask(residual, config.residual_fraction)
    else:
        mask = _static_mask_for(x, static_mask).expand_as(residual)
    selected = torch.where(mask, residual, torch.zeros_like(residual))
    residual_parts = nvfp4_quantize(selected, config.granularity, main.global_encode_scale, config.block_scaling,
                                    check_values=False)
    return QuantizedActivation(main, residual_parts)


def dequantize_activation(qa: QuantizedActivation) -> torch.Tensor:
    """``x_hat + r_hat`` in float32 (what the rollout GEMM effectively multiplies)."""
    out = nvfp4_dequantize(*qa.main, dtype=torch.float32)
    if qa.residual is not None:
        out = out + nvfp4_dequantize(*qa.residual, dtype=torch.float32)
    return out


# ---------------------------------------------------------------------------------------------
# Triton glue
# ---------------------------------------------------------------------------------------------


def _kernel_residual_args(x2d: torch.Tensor, config: ActivationQuant, static_mask):
    """(residual mode, k_top, static mask) as the row kernel takes them."""
    if not config.has_residual:
        return "none", 0, None
    if config.selection == "static":
        return "static", 0, _static_mask_for(x2d, static_mask)
    k_top = num_residual_channels(x2d.shape[-1], config.residual_fraction)
    if k_top == x2d.shape[-1]:
        return "all", 0, None
    return "per_token", k_top, None


def quantize_activation_triton(
    x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None
) -> QuantizedActivation:
    """Kernel twin of :func:`quantize_activation_reference` (same bits)."""
    from quads.kernels.quantize_activations import quantize_rows

    _check_2d(x2d)
    residual, k_top, mask = _kernel_residual_args(x2d, config, static_mask)
    q = quantize_rows(x2d, residual=residual, k_top=k_top, static_mask=mask,
                      granularity=config.granularity, write_packed=True, block_scaling=config.block_scaling)
    return QuantizedActivation(q.main.parts(), None if q.residual is None else q.residual.parts())


def per_row_scales(s: torch.Tensor, m: int) -> torch.Tensor:
    return s.reshape(1).expand(m).contiguous() if s.dim() == 0 else s


def operand_row_args(x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None) -> dict:
    """The keyword arguments of ``quantize_rows`` that write the GEMM operands of ``x2d`` (stacked:
    main rows, then residual rows); :func:`as_operands` reads its result."""
    residual, k_top, mask = _kernel_residual_args(x2d, config, static_mask)
    return dict(residual=residual, k_top=k_top, static_mask=mask, granularity=config.granularity,
                write_packed=False, write_operand=True, stacked=True, block_scaling=config.block_scaling)


def fixed_operand_row_args(k: int, device: torch.device, config: ActivationQuant | None,
                           static_mask: torch.Tensor | None = None) -> dict | None:
    """:func:`operand_row_args` for every input of ``k`` channels on ``device``, made once with a
    kernel; None where there is nothing to fix (no ``config``, a weight on the meta device) or it
    cannot be fixed ahead (``"static"`` selection before calibration: the call raises then)."""
    if config is None or device.type == "meta" or (
            config.has_residual and config.selection == "static" and static_mask is None):
        return None
    return operand_row_args(torch.empty((0, k), device=device), config, static_mask)


def as_operands(q, m: int) -> ActivationOperands:
    """``quantize_rows``' result (with :func:`operand_row_args`) of ``m`` rows as :class:`ActivationOperands`."""
    main, main_scale = q.main.operand, per_row_scales(q.main.global_encode_scale, m)
    if q.residual is None:
        return ActivationOperands(main, main_scale, None, main)
    # the kernel wrote both halves of one buffer; the residual rows share the rows' scales
    return ActivationOperands(main, main_scale, q.residual.operand, q.stacked_operand)


def activation_operands_triton(
    x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None
) -> ActivationOperands:
    """Quantize rows straight into the GEMM operands (fp16 unscaled values, per-row scales)."""
    from quads.kernels.quantize_activations import quantize_rows

    return as_operands(quantize_rows(x2d, **operand_row_args(x2d, config, static_mask)), x2d.shape[0])


def summed_row_args(x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None,
                    row_idx: torch.Tensor | None = None) -> dict:
    """The keyword arguments of ``quantize_rows`` that write the summed operand of ``x2d`` (or of
    ``x2d[row_idx]``): see :func:`summed_operand_triton`."""
    residual, k_top, mask = _kernel_residual_args(x2d, config, static_mask)
    return dict(residual=residual, k_top=k_top, static_mask=mask, granularity=config.granularity,
                write_packed=False, write_sum=True, row_idx=row_idx, block_scaling=config.block_scaling)


def summed_operand_triton(
    x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None,
    row_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 (R, K) ``fp16(main + residual)`` operand, fp32 (R,) per-row global scales) in one
    kernel launch: the quantization writes the summed operand itself (the main operand alone
    without a residual). ``row_idx``: quantize ``x2d[row_idx]`` (e.g. rows gathered per expert)
    without materializing it; quantization is row-local, so a gathered row has its token's bits."""
    from quads.kernels.quantize_activations import quantize_rows

    q = quantize_rows(x2d, **summed_row_args(x2d, config, static_mask, row_idx))
    rows = x2d.shape[0] if row_idx is None else row_idx.shape[0]
    return q.summed_operand, per_row_scales(q.main.global_encode_scale, rows)


def quantize_activation(
    x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None, backend: Backend | None = None
) -> QuantizedActivation:
    """Quantize a 2-D activation (+ residual) per ``config``; identical bits whichever backend runs
    (None: picked for ``x2d``'s device)."""
    return (backend or select_backend(x2d.device)).quantize_activation(x2d, config, static_mask)
