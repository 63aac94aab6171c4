"""Straight-through fake quantization for the trainer side.

Forward: the NVFP4 round trip ``DQ(Q(w))`` in the weight's dtype, computed by the one recipe
in :mod:`quads.tensor.nvfp4_math` (so the rollout's dequantized weight is the same bits).
Backward: the gradient passes to the BF16 master unchanged (straight-through estimator).
The forward weight is computed once per weight version (:mod:`quads.ops.weight_cache`): a
forward between two optimizer steps reuses it.
A custom autograd.Function, not ``w + (fq - w).detach()``: the latter re-rounds in BF16 and
would break bit-exact alignment.
"""

from __future__ import annotations

import torch

from quads.ops.activation_quant import ActivationQuant, dequantize_activation
from quads.ops.activation_quant import quantize_activation
from quads.ops.weight_cache import cached_derived
from quads.policies.shards import is_dtensor
from quads.tensor.nvfp4_math import nvfp4_fake_quantize

__all__ = ["fake_quantize_weight", "fake_quantize_activation"]


class _FakeQuantWeightSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        # Cached until the master changes (optimizer step, sync); a copy, so the graph never
        # shares the cached tensor.
        return cached_derived("fake_quantize", (weight,), lambda: nvfp4_fake_quantize(weight)).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _FakeQuantActivationSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, config: ActivationQuant) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        return dequantize_activation(quantize_activation(x2, config)).to(x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake-quant of a 2-D weight (one global scale) or 3-D experts (one per expert).

    ``weight`` must be the whole weight: under FSDP2 it is (``fully_shard`` unshards parameters
    into plain tensors before a module's forward). A DTensor here means a module was called
    outside its FSDP root's forward, or a tensor-parallel weight: its global scale would need a
    collective the forward must not issue, so this refuses.
    """
    if is_dtensor(weight):
        raise RuntimeError(
            f"quads trainer layer got a distributed (DTensor) weight of shape {tuple(weight.shape)} with "
            f"placements {tuple(weight.placements)}: NVFP4 fake quantization needs the whole weight for its "
            "global scale. Under FSDP2, call the model through its fully_shard root (which unshards "
            "parameters before each forward); tensor-parallel quads trainer layers are not supported."
        )
    return _FakeQuantWeightSTE.apply(weight)


def fake_quantize_activation(x: torch.Tensor, config: ActivationQuant) -> torch.Tensor:
    """NVFP4 fake-quant of activations (symmetric-QAT ablation), straight-through."""
    return _FakeQuantActivationSTE.apply(x, config)
