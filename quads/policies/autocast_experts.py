"""Unquantized trainer experts that multiply in the autocast dtype, as ``F.linear`` does.

transformers 5's ``grouped_mm`` experts implementation (the default for fused MoE experts)
calls torch's grouped GEMM, which autocast does not cast: a trainer with FP32 masters under
``GRPOConfig(bf16=True)`` autocast multiplies its experts in FP32 while its BF16 rollout copy
multiplies them in BF16, and the rollout-vs-trainer gap grows as the masters move by less
than a BF16 step. (``eager`` and ``batched_mm`` run ``F.linear`` / ``bmm``, which autocast
casts.)

:func:`autocast_experts_` selects :data:`AUTOCAST_GROUPED_MM` on every transformers experts
module of a trainer that quads has not converted and that runs ``grouped_mm``: the same
function, run on the module's floating weights cast to the autocast dtype (a differentiable
cast: the gradient reaches the FP32 master, as under ``F.linear``). Without autocast, or with
weights already in the autocast dtype, it is ``grouped_mm`` itself. quads' own trainer
experts (:mod:`quads.policies.trainer_experts`) compute in the autocast dtype already.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["AUTOCAST_GROUPED_MM", "autocast_experts_", "base_experts_implementation", "experts_configs"]

#: the experts implementation name registered with transformers' ``ExpertsInterface``
AUTOCAST_GROUPED_MM = "quads_autocast_grouped_mm"

# the experts' floating tensors a transformers experts forward multiplies or adds
_CAST = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class _CastView:
    """``module`` as the experts forward reads it, its weights (``_CAST``) cast to ``dtype``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        self._module = module
        self._dtype = dtype

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name in _CAST and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self._dtype)
        return value


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def autocast_grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' ``grouped_mm`` experts forward with the weights in the autocast dtype."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    dtype = _autocast_dtype(hidden_states.device)
    target = module if dtype is None else _CastView(module, dtype)
    return grouped_mm_experts_forward(target, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    if AUTOCAST_GROUPED_MM not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(AUTOCAST_GROUPED_MM, autocast_grouped_mm_experts_forward)


def base_experts_implementation(impl: str | None) -> str | None:
    """The transformers implementation ``impl`` runs without autocast (for a rollout copy)."""
    return "grouped_mm" if impl == AUTOCAST_GROUPED_MM else impl


def experts_configs(model: nn.Module) -> dict[int, tuple[str, object]]:
    """id(config) -> (first module name, config) of the transformers experts modules
    (``@use_experts_implementation``) of ``model`` that quads has not converted."""
    from quads.policies.modules import QuadsModule

    found: dict[int, tuple[str, object]] = {}
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if (not isinstance(m, QuadsModule) and hasattr(m, "is_concatenated") and hasattr(m, "has_gate")
                and hasattr(cfg, "_experts_implementation_internal")):
            found.setdefault(id(cfg), (name, cfg))
    return found


def autocast_experts_(model: nn.Module) -> list[str]:
    """Select :data:`AUTOCAST_GROUPED_MM` for ``model``'s unconverted experts that run
    ``grouped_mm``; returns the names of the first module of each config switched. Idempotent;
    a model without such experts is left as it is."""
    targets = [(name, cfg) for name, cfg in experts_configs(model).values()
               if cfg._experts_implementation_internal == "grouped_mm"]
    if targets:
        _register()
    for _, cfg in targets:
        cfg._experts_implementation_internal = AUTOCAST_GROUPED_MM  # the internal one: no recursion
    return [name for name, _ in targets]
