"""FP8 W8A8 fake quantization, for reference rows in ``quads diagnose`` (not a quads policy).

The FP8 recipe verl / NeMo-RL rollouts use: E4M3 weights with one scale per output channel
(per expert and channel for fused MoE weights), E4M3 activations with one scale per token,
scale = amax / 448, round to nearest even (torch's cast). Applied by class swap to the modules
``quantize_`` would convert (the same walk and skip rules), so the same routing loop runs.

Weights are rounded either in every forward (``weights="per_forward"``, the default: the model's
weights stay the masters, as ``quads diagnose`` needs) or once, in place (``weights="stored"``:
the weight tensors then hold their E4M3 round trip, as an FP8 inference engine holds its FP8
weights). The stored form is what a captured decode graph needs: rounding every weight in every
decoded token costs more than the decode itself (7.5 s against 2 s per GRPO step on SmolLM2), and
the weight cache cannot serve a captured graph (a refreshed entry is a new tensor the graph never
reads). After copying new weights into a stored model, call :func:`round_fp8_weights_` (in
place, so captured graphs stay valid).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from quads.ops.experts_op import experts_loop
from quads.ops.weight_cache import cached_derived
from quads.policies.modules import apply_gate
from quads.policies.policy import QuadsPolicy
from quads.policies.walk import conversion_targets

__all__ = ["fp8_fake_quantize", "fp8_w8a8_", "round_fp8_weights_"]

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


WEIGHT_MODES = ("per_forward", "stored")


def _forward_weight(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    return w if module._fp8_weights_stored else _fp8_weight(w)


class _FP8Linear:
    _fp8_weight_names = ("weight",)

    def forward(self, x):
        return F.linear(fp8_fake_quantize(x), _forward_weight(self, self.weight), self.bias)


class _FP8Experts:
    _fp8_weight_names = ("gate_up_proj", "down_proj")

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate_up, down = _forward_weight(self, self.gate_up_proj), _forward_weight(self, self.down_proj)

        def mlp(rows, e):
            h = apply_gate(self, F.linear(fp8_fake_quantize(rows), gate_up[e]))
            return F.linear(fp8_fake_quantize(h), down[e])

        return experts_loop(hidden_states, top_k_index, top_k_weights, gate_up.shape[0], mlp)


def fp8_w8a8_(model: nn.Module, *, weights: str = "per_forward") -> nn.Module:
    """Swap every Linear / fused experts module quads would quantize to W8A8 fake quant.

    ``weights``: ``"per_forward"`` rounds the weights in each forward (the masters stay as they
    are); ``"stored"`` rounds them once, in place, now (see the module doc).
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"fp8_w8a8_: weights must be one of {WEIGHT_MODES}, got {weights!r}")
    stored = weights == "stored"
    for target in conversion_targets(model, QuadsPolicy(side="trainer").skips):
        mixin = _FP8Linear if target.kind == "linear" else _FP8Experts
        module = target.module
        module.__class__ = type(f"FP8{type(module).__name__}", (mixin, type(module)),
                                {"_fp8_weights_stored": stored})
    if stored:
        round_fp8_weights_(model)
    return model


@torch.no_grad()
def round_fp8_weights_(model: nn.Module) -> int:
    """Round the weights of every ``weights="stored"`` FP8 module to E4M3 in place; returns the count.

    Call after copying new weights into such a model (``quads.sync_weights_``). Rounding is
    idempotent only up to the BF16 rounding of ``q * scale``, so call it once per copy.
    """
    count = 0
    for module in model.modules():
        if getattr(module, "_fp8_weights_stored", False):
            for name in module._fp8_weight_names:
                w = getattr(module, name)
                w.copy_(fp8_fake_quantize(w))
                count += 1
    return count
