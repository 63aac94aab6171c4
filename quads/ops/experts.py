"""MoE experts for transformers-5 fused expert modules: routing, the trainer-side loop, the rollout op.

transformers 5 MoE blocks (Qwen3-MoE, Mixtral, OLMoE, ...) call their experts module as
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` with 3-D parameters
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``.

* :func:`route_by_expert` groups the (token, choice) rows by expert (stable sort; static shapes,
  no host synchronisation), shared by every path so all see the same row order;
* :func:`experts_loop` is the trainer's skeleton (each expert's MLP on its rows, outputs weighted
  and summed over the k choices in transformers' order), also used by the FP8 reference;
* :func:`rollout_experts` is the rollout op: route, grouped ``gate_up`` GEMM, the module's gate,
  grouped ``down`` GEMM, combine, with the grouped GEMMs of a :class:`~quads.ops.backend_registry.Backend`.
  Per row it computes what :func:`experts_loop` computes with rollout linears (tested).
"""

from __future__ import annotations

from typing import Callable

import torch

from quads.ops.activation_quant import ActivationQuant, as_operands, operand_row_args
from quads.ops.backend_registry import Backend, LinearArgs, gemm_shape, select_backend
from quads.ops.grouped_linear import grouped_linear
from quads.ops.linear import prepare_weight_hopper
from quads.tensor.nvfp4_math import NVFP4Parts
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["ExpertsKernel", "HopperExpertsKernel", "Routing", "combine_top_k", "route_by_expert", "experts_loop", "rollout_experts"]

ExpertMLP = Callable[[torch.Tensor, int], torch.Tensor]


class Routing:
    """(token, choice) rows grouped by expert: ``order`` (sorted position -> flat row),
    ``offsets`` (E+1,) int32 bounds of each expert's rows, ``token_of_row`` (sorted position ->
    token). Ids outside ``[0, E)`` (expert-parallel sentinels) sort last and belong to no expert."""

    __slots__ = ("order", "counts", "offsets", "token_of_row", "num_rows", "top_k")

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        flat = top_k_index.reshape(-1)
        valid = (flat >= 0) & (flat < num_experts)
        key = torch.where(valid, flat, num_experts)
        self.order = torch.argsort(key, stable=True)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        self.counts = counts[:num_experts]
        # exclusive prefix sum over the E+1 counts (the sentinels' last): 0, c0, c0+c1, ... (exact
        # int64); two kernels, no zero-filled buffer and slice assignment (host time per call)
        self.offsets = torch.cumsum(counts, 0) - counts
        self.top_k = top_k_index.shape[-1]
        self.token_of_row = self.order // self.top_k
        self.num_rows = flat.numel()


def route_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)`` of :class:`Routing` (stable sort by expert id; counts per expert)."""
    r = Routing(top_k_index, num_experts)
    return r.order, r.counts


def experts_loop(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    expert_mlp: ExpertMLP,
) -> torch.Tensor:
    """Run ``expert_mlp(rows, e)`` for every expert that received tokens; combine top-k.

    Expert ids outside ``[0, num_experts)`` (expert-parallel sentinels) contribute nothing.
    A host loop over experts (``counts.tolist()``): the trainer side, not CUDA-graph capturable.
    """
    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_index.shape[-1]
    order, counts = route_by_expert(top_k_index, num_experts)
    out = hidden.new_zeros(num_tokens * top_k, hidden_dim)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        out = out.index_put((rows,), expert_mlp(hidden[rows // top_k], expert).to(out.dtype))
    weighted = out.view(num_tokens, top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


class ExpertsKernel:
    """One experts module's kernel: routing, the grouped ``gate_up`` GEMM, the gate, the grouped
    ``down`` GEMM, the top-k combine, over two weights (:class:`~quads.ops.backend_registry.LinearArgs`,
    3-D). Made once when the weights are set (``Backend.experts_kernel``). This base runs each
    grouped GEMM through :func:`~quads.ops.grouped_linear.grouped_linear` (the backend's entry; the
    custom op inside ``torch.compile``); kernel backends override :meth:`apply` with their launchers."""

    def __init__(self, backend: Backend, gate_up: LinearArgs, down: LinearArgs):
        self.backend, self.gate_up, self.down = backend, gate_up, down
        w = gate_up.weight
        self.h = None if w is None else (w.qdata.shape[-1] * 2 if isinstance(w, NVFP4Parts) else gemm_shape(w)[1])

    def check_input(self, hidden: torch.Tensor) -> None:
        """Raise unless ``hidden``'s last dim is the experts' H (grouped GEMMs may read only the first H columns)."""
        if self.h is not None and hidden.shape[-1] != self.h:
            raise ValueError(f"quads experts: hidden of shape {tuple(hidden.shape)} has H={hidden.shape[-1]}, "
                             f"the experts' weights have H={self.h}")

    def apply(self, hidden, top_k_index, top_k_weights, apply_gate, biases=(None, None)) -> torch.Tensor:
        """``hidden (T, H)`` routed by ``top_k_index``/``top_k_weights`` (T, k) -> (T, H);
        ``apply_gate`` maps the gate_up output (rows, 2I) to (rows, I)."""
        if not torch.compiler.is_compiling():
            self.check_input(hidden)
        gu, dn = self.gate_up.parts(), self.down.parts()
        route = Routing(top_k_index, gu.qdata.shape[0])
        h = grouped_linear(self.backend, hidden, route.token_of_row, route.offsets, gu, biases[0], self.gate_up.act,
                           self.gate_up.static_mask, route.num_rows, prepared=self.gate_up.prepared)
        h = apply_gate(h)
        y = grouped_linear(self.backend, h, None, route.offsets, dn, biases[1], self.down.act, self.down.static_mask,
                           route.num_rows, prepared=self.down.prepared)
        return combine_top_k(y, route, top_k_weights, hidden)


class HopperExpertsKernel(ExpertsKernel):
    """The Hopper backend's experts: each projection one grouped W4A4 launch over all experts
    (weights in the layout ``args.prepared``, built per call if absent), no host synchronisation;
    ``act=None`` (W4A16) feeds the same kernel fp16 rows times a per-row power of two. Expert
    biases, ``"tensor"`` activation scales and compiled code take the base path (the per-expert
    loop where the grouped kernel does not reproduce the reference)."""

    def apply(self, hidden, top_k_index, top_k_weights, apply_gate, biases=(None, None)) -> torch.Tensor:
        act = self.gate_up.act
        if (torch.compiler.is_compiling() or biases[0] is not None or biases[1] is not None
                or (act is not None and act.granularity != "row")):
            return super().apply(hidden, top_k_index, top_k_weights, apply_gate, biases)
        self.check_input(hidden)
        from quads.kernels.fp16_operand import scaled_fp16_rows
        from quads.kernels.moe_grouped_gemm import moe_w4a4_gemm
        from quads.kernels.quantize_activations import quantize_rows

        route = Routing(top_k_index, self.gate_up.parts().qdata.shape[0])
        offsets = route.offsets.to(torch.int32)
        x, rows = hidden, route.token_of_row.to(torch.int32)
        for i, a in enumerate((self.gate_up, self.down)):
            if i:
                x, rows = apply_gate(x), None
            x = x if x.stride(-1) == 1 else x.contiguous()
            if a.act is None:
                stacked, row_scale = scaled_fp16_rows(x)
                has_residual = False
            else:
                ops = as_operands(quantize_rows(x, **operand_row_args(x, a.act, a.static_mask)), x.shape[0])
                stacked, row_scale, has_residual = ops.stacked, ops.main_scale, ops.residual is not None
            w = a.parts()
            prepared = a.prepared if a.prepared is not None else prepare_weight_hopper(w)
            x = moe_w4a4_gemm(stacked, row_scale, rows, offsets, prepared, w.global_encode_scale.float(),
                              route.num_rows, x.shape[0], has_residual, out_dtype=x.dtype)
        return combine_top_k(x, route, top_k_weights, hidden)


def combine_top_k(y: torch.Tensor, route: Routing, top_k_weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The rows' outputs (sorted by expert) back in token order, weighted and summed over the k choices."""
    num_tokens, hidden_dim = hidden.shape
    out = torch.zeros(route.num_rows, hidden_dim, dtype=hidden.dtype, device=hidden.device)
    out.index_copy_(0, route.order, y.to(hidden.dtype))
    weighted = out.view(num_tokens, route.top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


def rollout_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: NVFP4Tensor | NVFP4Parts,
    down: NVFP4Tensor | NVFP4Parts,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    act: ActivationQuant | None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    static_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    backend: Backend | None = None,
    prepared: tuple = (None, None),
) -> torch.Tensor:
    """Experts forward with packed NVFP4 ``gate_up (E, 2I, H)`` and ``down (E, H, I)`` weights
    (``NVFP4Tensor`` or their parts), for callers that keep no kernel (a rollout module applies its
    :class:`ExpertsKernel`). ``backend``: None picks one for ``hidden``'s device. ``prepared``: what
    ``backend.prepare_weight`` derived from each, if the caller has it. ``apply_gate`` maps the
    gate_up output (rows, 2I) to (rows, I) (the module's ``_apply_gate``, e.g. ``silu(gate) * up``)."""
    backend = backend or select_backend(hidden.device)
    kernel = backend.experts_kernel(LinearArgs(gate_up, act, static_masks[0], prepared[0]),
                                    LinearArgs(down, act, static_masks[1], prepared[1]))
    return kernel.apply(hidden, top_k_index, top_k_weights, apply_gate, (gate_up_bias, down_bias))
