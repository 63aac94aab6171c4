"""Triton kernels behind the rollout ops (dispatched by :mod:`quads.ops.dispatch`).

The four entry points the dispatchers call:

* :func:`quantize_activation_kernel` — fused NVFP4 activation quantization + residual
  compensation, bit-exact with ``quantize_activation_reference``;
* :func:`rollout_linear_kernel` — W4A4 (+ residual) linear: the quantization kernel writes the
  exact unscaled fp16 operands, the Hopper GEMM multiplies them with the packed weight;
* :func:`rollout_experts_kernel` — MoE experts: grouped GEMMs over packed 3-D experts;
* :func:`quantize_weight_kernel` — weight quantization (weight sync), bit-exact with
  ``nvfp4_quantize``.

Backends: ``"hopper"`` is the exact-emulation path (sm_90, and any device under
``TRITON_INTERPRET=1``); ``"blackwell"`` uses the native FP4 path of :mod:`.blackwell` on sm_100+
(NOT RUN here) and the emulation kernels elsewhere (e.g. CPU tensors under the interpreter).
See ``docs/kernels.md`` for the design and the H200 measurements.
"""

from __future__ import annotations

from typing import Callable

import torch

from quads.ops.moe_experts import route_by_expert
from quads.ops.activation_quant import ActivationQuant, QuantizedActivation, num_residual_channels
from quads.tensor.nvfp4_math import (
    NVFP4Parts,
    check_quantizable,
    global_encode_scale_from_amax,
)

from quads.kernels.quantize_nvfp4 import amax_rows, quantize_given_scale, quantize_rows
from quads.kernels.w4a4_gemm_hopper import w4a4_gemm
from quads.kernels.moe_grouped_gemm import moe_w4a4_gemm

__all__ = [
    "quantize_activation_kernel",
    "rollout_linear_kernel",
    "rollout_experts_kernel",
    "quantize_weight_kernel",
    "quantize_rows",
    "w4a4_gemm",
    "moe_w4a4_gemm",
]


def _residual_args(x2d: torch.Tensor, config: ActivationQuant, static_mask):
    if config.residual_fraction == 0.0:
        return "none", 0, None
    if config.selection == "static":
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
        return "static", 0, mask.reshape(-1)
    return "per_token", num_residual_channels(x2d.shape[-1], config.residual_fraction), None


def quantize_activation_kernel(
    x2d: torch.Tensor, config: ActivationQuant, static_mask: torch.Tensor | None = None
) -> QuantizedActivation:
    """Kernel twin of ``quantize_activation_reference`` (same bits)."""
    if x2d.dim() != 2:
        raise ValueError(f"quantize_activation expects (M, K), got {tuple(x2d.shape)}")
    check_quantizable(x2d, "activation")
    residual, k_top, mask = _residual_args(x2d, config, static_mask)
    out = quantize_rows(
        x2d, residual=residual, k_top=k_top, static_mask=mask,
        global_scale=config.global_scale, write_packed=True, write_dq=False,
    )
    return QuantizedActivation(out.main_parts(), out.residual_parts() if residual != "none" else None)


def _per_row(s: torch.Tensor, m: int) -> torch.Tensor:
    return s.reshape(1).expand(m).contiguous() if s.dim() == 0 else s


def _quantize_for_gemm(x2: torch.Tensor, act: ActivationQuant, static_mask, row_idx=None):
    """Quantize rows and return the GEMM operands (fp16 unscaled x, S_x, r or None, S_r)."""
    residual, k_top, mask = _residual_args(x2, act, static_mask)
    q = quantize_rows(
        x2, residual=residual, k_top=k_top, static_mask=mask, global_scale=act.global_scale,
        write_packed=False, write_dq=True, row_idx=row_idx,
    )
    m = q.dx.shape[0]
    if residual == "none":
        return q.dx, _per_row(q.gx, m), None, None
    return q.dx, _per_row(q.gx, m), q.dr, _per_row(q.gr, m)


def rollout_linear_kernel(
    x2: torch.Tensor,
    weight: NVFP4Parts,
    bias: torch.Tensor | None,
    act: ActivationQuant,
    static_mask: torch.Tensor | None = None,
    backend: str = "hopper",
) -> torch.Tensor:
    """(M, K) -> (M, N) in ``x2.dtype``: quantize (+ residual), exact W4A4 GEMM, bias."""
    if backend == "blackwell" and x2.is_cuda:
        from quads.kernels.blackwell import is_blackwell, rollout_linear_blackwell

        if is_blackwell(x2.device):
            return rollout_linear_blackwell(x2, weight, bias, act, static_mask)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x16, sx, r16, sr = _quantize_for_gemm(x2, act, static_mask)
    return w4a4_gemm(
        x16, sx, weight.qdata, weight.scale, weight.global_encode_scale.to(torch.float32),
        r16=r16, sr=sr, bias=bias, out_dtype=x2.dtype,
    )


def quantize_weight_kernel(x: torch.Tensor, granularity: str | None = None) -> NVFP4Parts:
    """Kernel twin of ``nvfp4_quantize`` (same bits): amax pass + quantization pass."""
    check_quantizable(x, "weight")
    gran = granularity or ("expert" if x.dim() == 3 else "tensor")
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    x2 = x.detach().reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != k):
        x2 = x2.contiguous()
    rows = x2.shape[0]
    dev = x.device
    if gran == "tensor":
        amax = amax_rows(x2).amax() if rows else torch.zeros((), dtype=torch.float32, device=dev)
        gs = global_encode_scale_from_amax(amax)
        per_group = max(rows, 1)
    elif gran == "expert":
        if x.dim() != 3:
            raise ValueError(f"'expert' global scales need a 3-D tensor, got {tuple(x.shape)}")
        e = x.shape[0]
        per_group = max(rows // max(e, 1), 1)
        amax = amax_rows(x2).view(e, -1).amax(dim=1) if rows else torch.zeros(e, dtype=torch.float32, device=dev)
        gs = global_encode_scale_from_amax(amax)
    elif gran == "row":
        amax = amax_rows(x2) if rows else torch.zeros(0, dtype=torch.float32, device=dev)
        gs = global_encode_scale_from_amax(amax).reshape(lead)
        per_group = 1
    else:
        raise ValueError(f"unknown global-scale granularity {gran!r}; use one of ('tensor', 'expert', 'row')")
    if rows == 0:
        q = torch.empty(lead + (k // 2,), dtype=torch.uint8, device=dev)
        s = torch.empty(lead + (k // 16,), dtype=torch.float8_e4m3fn, device=dev)
        return NVFP4Parts(q, s, gs)
    q, s, _ = quantize_given_scale(x2, gs.reshape(-1), per_group)
    return NVFP4Parts(
        q.view(lead + (k // 2,)),
        s.view(torch.float8_e4m3fn).view(lead + (k // 16,)),
        gs,
    )


def rollout_experts_kernel(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up,
    down,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    act: ActivationQuant,
    static_masks=(None, None),
    backend: str = "hopper",
) -> torch.Tensor:
    """MoE experts with grouped W4A4 GEMMs; same routing/combine order as ``experts_loop``.

    ``gate_up`` (E, 2I, H) and ``down`` (E, H, I) are :class:`NVFP4Tensor` (3-D, per-expert
    global scales). No host synchronisation (CUDA-graph capturable).
    """
    if act.global_scale != "row":
        # A "tensor" activation scale is per expert call in the reference (over that expert's
        # rows), which the grouped kernel does not reproduce: run the per-expert loop.
        from quads.ops.moe_experts import experts_loop

        def mlp(rows: torch.Tensor, e: int) -> torch.Tensor:
            h = rollout_linear_kernel(rows, gate_up[e].parts, None, act, static_masks[0], backend)
            h = apply_gate(h)
            return rollout_linear_kernel(h, down[e].parts, None, act, static_masks[1], backend)

        return experts_loop(hidden, top_k_index, top_k_weights, gate_up.shape[0], mlp)

    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_index.shape[-1]
    num_experts = gate_up.shape[0]
    dev = hidden.device
    num_rows = top_k_index.numel()
    # the same row grouping as experts_loop (sentinel ids sorted last, counted nowhere)
    order, counts = route_by_expert(top_k_index, num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    token_of_row = (order // top_k).to(torch.int32)

    hx = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    x16, sx, r16, sr = _quantize_for_gemm(hx, act, static_masks[0])
    gu = gate_up.parts
    h = moe_w4a4_gemm(x16, sx, token_of_row, offsets, gu.qdata, gu.scale, gu.global_encode_scale.float(),
                      num_rows, r16=r16, sr=sr, out_dtype=hidden.dtype)
    h = apply_gate(h)
    h = h if h.stride(-1) == 1 else h.contiguous()
    x16, sx, r16, sr = _quantize_for_gemm(h, act, static_masks[1])
    dp = down.parts
    y = moe_w4a4_gemm(x16, sx, None, offsets, dp.qdata, dp.scale, dp.global_encode_scale.float(),
                      num_rows, r16=r16, sr=sr, out_dtype=h.dtype)
    out = torch.zeros(num_rows, hidden_dim, dtype=hidden.dtype, device=dev)
    out.index_copy_(0, order, y.to(hidden.dtype))
    weighted = out.view(num_tokens, top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)
