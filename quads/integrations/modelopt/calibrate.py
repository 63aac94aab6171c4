"""Static activation amax per quantized input, for the ``input_scale`` of a W4A4 export.

ModelOpt's NVFP4 (W4A4) checkpoints carry one static activation decode scale per linear
(``input_scale = amax_x/(6*448)``); engines quantize activations online with it. The amax is a
property of the data, so it is measured: calibration batches go through the model and
forward hooks record ``max|x|`` of every quantized linear's input and, for fused MoE experts,
of each expert's ``gate_up`` input (its routed tokens) and ``down`` input (the gated
intermediate, recomputed with the experts' forward weights).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from quads.policies.modules import apply_gate
from quads.policies.walk import ConversionTarget
from quads.tensor.nvfp4_math import nvfp4_fake_quantize
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["ExpertsAmax", "activation_amax"]


class ExpertsAmax:
    """Per-expert input amax of one fused experts module: ``gate_up (E,)`` and ``down (E,)``."""

    def __init__(self, num_experts: int):
        self.gate_up = torch.zeros(num_experts)
        self.down = torch.zeros(num_experts)
        self.seen = torch.zeros(num_experts, dtype=torch.bool)


def _forward_weight(param: torch.Tensor, block_scaling: str = "6") -> torch.Tensor:
    """The weight a quads forward multiplies by: DQ of a packed weight, fake-quant of a master."""
    if isinstance(param, NVFP4Tensor):
        return param.dequantize(param.orig_dtype)
    return nvfp4_fake_quantize(param.detach(), block_scaling=block_scaling)


def _observe_experts(module: nn.Module, stats: ExpertsAmax, hidden, top_k_index) -> None:
    policy = getattr(module, "quads_policy", None)
    gate_up = _forward_weight(module.gate_up_proj, "6" if policy is None else policy.weight_block_scaling)
    bias = module.gate_up_proj_bias if getattr(module, "has_bias", False) else None
    flat = top_k_index.reshape(-1)
    for e in torch.unique(flat).tolist():
        if not 0 <= e < stats.seen.numel():
            continue
        rows = hidden[(top_k_index == e).any(dim=-1)]
        h = apply_gate(module, F.linear(rows, gate_up[e].to(rows.dtype), None if bias is None else bias[e]))
        stats.gate_up[e] = torch.maximum(stats.gate_up[e], rows.detach().abs().amax().float().cpu())
        stats.down[e] = torch.maximum(stats.down[e], h.detach().abs().amax().float().cpu())
        stats.seen[e] = True


@torch.no_grad()
def activation_amax(
    model: nn.Module, targets: list[ConversionTarget], batches: Iterable[dict | torch.Tensor]
) -> dict[str, torch.Tensor | ExpertsAmax]:
    """``name -> amax`` (0-d) of each linear target's input, ``name -> ExpertsAmax`` for experts.

    ``batches`` yields model inputs (a dict of kwargs or an ``input_ids`` tensor). Raises if no
    batch is given or a linear target never ran; experts that no calibration token was routed
    to get the largest amax of their layer (as ModelOpt does), a layer no token reached raises.
    """
    stats: dict[str, torch.Tensor | ExpertsAmax] = {}
    hooks = []

    def linear_hook(name):
        def hook(module, args):
            amax = args[0].detach().abs().amax().float().cpu()
            stats[name] = torch.maximum(stats[name], amax) if name in stats else amax

        return hook

    def experts_hook(name):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            _observe_experts(module, stats[name], hidden, top_k_index)

        return hook

    for name, module, kind in targets:
        if kind == "linear":
            hooks.append(module.register_forward_pre_hook(linear_hook(name)))
        else:
            stats[name] = ExpertsAmax(module.gate_up_proj.shape[0])
            hooks.append(module.register_forward_pre_hook(experts_hook(name), with_kwargs=True))
    count = 0
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
            count += 1
    finally:
        for h in hooks:
            h.remove()
    if count == 0:
        raise ValueError("activation calibration got no batch")
    for name, _, kind in targets:
        if kind == "linear" and name not in stats:
            raise ValueError(f"activation calibration: {name!r} saw no calibration input")
        if kind == "experts":
            s = stats[name]
            if not bool(s.seen.any()):
                raise ValueError(f"activation calibration: no calibration token reached the experts {name!r}")
            s.gate_up[~s.seen] = s.gate_up[s.seen].max()
            s.down[~s.seen] = s.down[s.seen].max()
    return stats
