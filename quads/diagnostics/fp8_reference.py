"""FP8 W8A8 fake quantization, for reference rows in ``quads diagnose`` (not a quads policy).

The FP8 recipe verl / NeMo-RL rollouts use: E4M3 weights with one scale per output channel
(per expert and channel for fused MoE weights), E4M3 activations with one scale per token,
scale = amax / 448, round to nearest even (torch's cast). Applied by class swap to the modules
``quantize_`` would convert (the same walk and skip rules), so the same routing loop runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from quads.ops.experts import experts_loop
from quads.ops.weight_cache import cached_derived
from quads.policies.modules import apply_gate
from quads.policies.policy import QuadsPolicy
from quads.policies.walk import conversion_targets

__all__ = ["fp8_fake_quantize", "fp8_w8a8_"]

E4M3_MAX = 448.0


def fp8_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """E4M3 round trip with one scale per row of the last dim (amax/448; all-zero rows stay 0)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _fp8_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight's W8 round trip, computed once per weight version."""
    return cached_derived("fp8_e4m3", (w,), lambda: fp8_fake_quantize(w))


class _FP8Linear:
    def forward(self, x):
        return F.linear(fp8_fake_quantize(x), _fp8_weight(self.weight), self.bias)


class _FP8Experts:
    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate_up, down = _fp8_weight(self.gate_up_proj), _fp8_weight(self.down_proj)

        def mlp(rows, e):
            h = apply_gate(self, F.linear(fp8_fake_quantize(rows), gate_up[e]))
            return F.linear(fp8_fake_quantize(h), down[e])

        return experts_loop(hidden_states, top_k_index, top_k_weights, gate_up.shape[0], mlp)


def fp8_w8a8_(model: nn.Module) -> nn.Module:
    """Swap every Linear / fused experts module quads would quantize to W8A8 fake quant."""
    for target in conversion_targets(model, QuadsPolicy(side="trainer").skips):
        mixin = _FP8Linear if target.kind == "linear" else _FP8Experts
        module = target.module
        module.__class__ = type(f"FP8{type(module).__name__}", (mixin, type(module)), {})
    return model
