"""Calibrate static residual-channel sets (``residual_selection="static"``).

For every rollout layer, run calibration batches through the model, accumulate the mean
|x - DQ(Q(x))| per input channel, and keep the top ``round_half_up(k*K)`` channels as the
layer's static compensation set. The per-token selection needs no calibration.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
import torch.nn as nn

from quads.ops.activation_quant import num_residual_channels
from quads.policies.modules import RolloutExperts, RolloutLinear
from quads.policies.quantize import quantized_modules
from quads.tensor.finite import check_all_finite
from quads.tensor.nvfp4_math import nvfp4_dequantize, nvfp4_quantize

__all__ = ["calibrate_residual_channels"]


class _ResidualStats:
    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def observe(self, key: str, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return
        x_hat = nvfp4_dequantize(*nvfp4_quantize(x2, "row"), dtype=torch.float32)
        contrib = (x2.float() - x_hat).abs().sum(dim=0)
        self.sums[key] = self.sums.get(key, 0) + contrib

    def mask(self, key: str, fraction: float) -> torch.Tensor | None:
        if key not in self.sums:
            return None
        stats = self.sums[key]
        k = num_residual_channels(stats.numel(), fraction)
        mask = torch.zeros_like(stats, dtype=torch.bool)
        mask[torch.topk(stats, k).indices] = True
        return mask


@torch.no_grad()
def calibrate_residual_channels(model: nn.Module, batches: Iterable[dict | torch.Tensor]) -> int:
    """Set the static residual channel masks of every rollout layer of ``model``.

    ``batches`` yields model inputs (a dict of kwargs or an ``input_ids`` tensor). Layers use
    the masks only if their policy has ``residual_selection="static"``. Returns the number of
    layers calibrated. Layers that saw no token (unrouted experts' inputs) raise, and so do
    NaN/Inf activations (naming the layers; checked once, at the end, before any mask is set).
    """
    layers = {n: m for n, m in quantized_modules(model).items() if isinstance(m, (RolloutLinear, RolloutExperts))}
    if not layers:
        raise ValueError("calibrate_residual_channels: the model has no quads rollout layers")
    stats = _ResidualStats()
    hooks = []
    policies = {name: module.quads_policy for name, module in layers.items()}
    for name, module in layers.items():
        # No mask exists yet: calibrate while running the per-token selection.
        module.quads_policy = dataclasses.replace(policies[name], residual_selection="per_token")
        if isinstance(module, RolloutLinear):
            hooks.append(module.register_forward_pre_hook(lambda m, args, n=name: stats.observe(n, args[0])))
        else:
            module.quads_observer = lambda key, x, n=name: stats.observe(f"{n}.{key}", x)
        module.quads_weights_changed()  # the kernel of the calibration's policy (and observing gate)
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
    finally:
        for h in hooks:
            h.remove()
        for name, module in layers.items():
            module.quads_policy = policies[name]
            if isinstance(module, RolloutExperts):
                module.quads_observer = None
            module.quads_weights_changed()
    # a NaN/Inf activation makes its layer's sums non-finite: one check for all, before any mask is set
    check_all_finite(stats.sums.items(), "calibrate_residual_channels: non-finite calibration activations (no mask "
                     "was set); the inputs of these layers held NaN/Inf")
    for name, module in layers.items():
        fraction = module.quads_policy.residual_fraction
        if isinstance(module, RolloutLinear):
            masks = [stats.mask(name, fraction)]
            module.quads_static_mask = masks[0]
        else:
            masks = [stats.mask(f"{name}.gate_up_proj", fraction), stats.mask(f"{name}.down_proj", fraction)]
            module.quads_static_masks = tuple(masks)
        if any(m is None for m in masks):
            raise ValueError(f"calibrate_residual_channels: layer {name!r} saw no calibration tokens")
        module.quads_weights_changed()  # the kernel remade now with the mask
    return len(layers)
