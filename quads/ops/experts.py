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

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend, select_backend
from quads.ops.grouped_linear import grouped_linear
from quads.tensor.nvfp4_math import NVFP4Parts
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["Routing", "route_by_expert", "experts_loop", "rollout_experts"]

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
    (``NVFP4Tensor`` or their parts). ``backend``: the module's (stored at conversion); None picks
    one for ``hidden``'s device. ``prepared``: what ``backend.prepare_weight`` derived from each,
    if the caller has it. The forward: module -> this -> ``grouped_linear`` (custom op while
    compiling) -> ``backend.grouped_linear`` -> the grouped kernel launcher.

    ``apply_gate`` maps the gate_up output (rows, 2I) to (rows, I) (the module's
    ``_apply_gate``, e.g. ``silu(gate) * up``).
    """
    gate_up = gate_up.stored_parts() if isinstance(gate_up, NVFP4Tensor) else gate_up
    down = down.stored_parts() if isinstance(down, NVFP4Tensor) else down
    backend = backend or select_backend(hidden.device)
    num_tokens, hidden_dim = hidden.shape
    route = Routing(top_k_index, gate_up.qdata.shape[0])
    h = grouped_linear(backend, hidden, route.token_of_row, route.offsets, gate_up, gate_up_bias, act,
                               static_masks[0], route.num_rows, prepared=prepared[0])
    h = apply_gate(h)
    y = grouped_linear(backend, h, None, route.offsets, down, down_bias, act, static_masks[1],
                               route.num_rows, prepared=prepared[1])
    out = torch.zeros(route.num_rows, hidden_dim, dtype=hidden.dtype, device=hidden.device)
    out.index_copy_(0, route.order, y.to(hidden.dtype))
    weighted = out.view(num_tokens, route.top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)
