"""MoE experts for transformers-5 fused expert modules: routing loop and rollout op.

transformers 5 MoE blocks (Qwen3-MoE, Mixtral, OLMoE, ...) call their experts module as
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` with 3-D parameters
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``. :func:`experts_loop` is the one
routing skeleton both quads sides use: tokens are grouped by expert (stable sort), each
expert's MLP runs on its rows, outputs are weighted and summed over the k choices in the
same order transformers uses. The trainer plugs in a fake-quantized BF16 MLP; the rollout
plugs in W4A4 linears (:func:`rollout_experts`), or a grouped Triton kernel on GPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from quads.ops.activation_quant import ActivationQuant
from quads.ops.dispatch import select_backend
from quads.ops.rollout_linear import rollout_linear
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["route_by_expert", "experts_loop", "rollout_experts"]

ExpertMLP = Callable[[torch.Tensor, int], torch.Tensor]


def route_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, choice) rows by expert: ``(order, counts)``.

    ``order`` sorts the flattened rows by expert id (stable, so rows of one expert keep token
    order); ``counts[e]`` is the number of rows of expert ``e``. Ids outside ``[0, E)``
    (expert-parallel sentinels) are sorted last and counted nowhere. Shared by the reference
    loop and the grouped kernel so both see the same row order.
    """
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    return order, counts


def experts_loop(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    expert_mlp: ExpertMLP,
) -> torch.Tensor:
    """Run ``expert_mlp(rows, e)`` for every expert that received tokens; combine top-k.

    Expert ids outside ``[0, num_experts)`` (expert-parallel sentinels) contribute nothing.
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
    gate_up: NVFP4Tensor,
    down: NVFP4Tensor,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    act: ActivationQuant | None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    static_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.Tensor:
    """Experts forward with packed NVFP4 weights ``gate_up (E, 2I, H)`` and ``down (E, H, I)``.

    ``apply_gate`` maps the gate_up output (rows, 2I) to (rows, I) (the module's
    ``_apply_gate``, e.g. ``silu(gate) * up``). On CUDA the grouped Triton kernel runs; the
    reference loops over experts with :func:`rollout_linear`.
    """
    backend = select_backend(hidden.device)
    if backend != "torch" and act is not None and gate_up_bias is None and down_bias is None:
        from quads.kernels import rollout_experts_kernel

        return rollout_experts_kernel(
            hidden, top_k_index, top_k_weights, gate_up, down, apply_gate, act, static_masks, backend=backend
        )

    def mlp(rows: torch.Tensor, e: int) -> torch.Tensor:
        h = rollout_linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_bias[e], act, static_masks[0])
        h = apply_gate(h)
        return rollout_linear(h, down[e], None if down_bias is None else down_bias[e], act, static_masks[1])

    return experts_loop(hidden, top_k_index, top_k_weights, gate_up.shape[0], mlp)
