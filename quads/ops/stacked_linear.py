"""Several W4A4 linears reading one input, as one decode GEMM over their weights stacked along N.

Sibling projections (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) read the same
activations. Run separately, each quantizes the input and launches its own decode GEMM: a few
tokens per call make each launch latency-bound (~6 us of fixed cost on the H200 whatever the
weight size, docs/kernels.md), so three small GEMMs cost about three times one. Stacked, the
input is quantized once and one GEMM streams every weight; each weight keeps its own global
scale (one ``S_w`` per output row), so every output column has the bits of its own linear's
GEMM (the decode kernel's arithmetic per output row does not depend on the tile it sits in).

:func:`stacked_linear_reference` is the torch spec (each linear on its own, concatenated);
:func:`stacked_linear_hopper` the kernel path. Decode only (few tokens): many-token calls go
through each linear's own prefill GEMM, which reads the plain packed parts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from quads.ops.activation_quant import ActivationQuant, activation_operands_triton
from quads.ops.linear import w4a4_linear_reference
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["stacked_fits_decode", "stacked_linear_reference", "stacked_linear_hopper"]


def stacked_fits_decode(rows: int) -> bool:
    """Whether ``rows`` tokens (with residual rows, if any) fit one decode-GEMM launch."""
    from quads.kernels.w4a4_decode_hopper import max_decode_columns

    return 2 * rows <= max_decode_columns()


def stacked_linear_reference(x2: torch.Tensor, weights: Sequence[NVFP4Parts], act: ActivationQuant) -> torch.Tensor:
    """(M, K) -> (M, sum N_i): each weight's reference W4A4 linear, concatenated."""
    return torch.cat([w4a4_linear_reference(x2, w, None, act) for w in weights], dim=-1)


def stacked_linear_hopper(x2: torch.Tensor, prepared, row_scales: torch.Tensor, act: ActivationQuant) -> torch.Tensor:
    """(M, K) -> (M, N) in ``x2.dtype``: one quantization, one decode GEMM over ``prepared`` (the
    stacked weights' Hopper layout, N = sum of theirs) with ``row_scales`` (N,) fp32, each
    row's weight's global scale. ``M`` must fit :func:`stacked_fits_decode`."""
    from quads.kernels.w4a4_decode_hopper import decode_gemm

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    ops = activation_operands_triton(x2, act)
    return decode_gemm(ops.stacked, ops.main_scale, prepared, row_scales, x2.shape[0], ops.residual is not None,
                       None, x2.dtype)
