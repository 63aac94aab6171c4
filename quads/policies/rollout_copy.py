"""Rollout copies of a trainer model: same class and config, weights copied, then quantized."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from quads.policies.autocast_experts import base_experts_implementation
from quads.policies.policy import QuadsPolicy
from quads.policies.fused_projections import fuse_projections_
from quads.policies.quantize import quantize_
from quads.policies.shards import is_dtensor
from quads.policies.sync import sync_weights_
from quads.policies.walk import conversion_targets
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["copy_model", "build_rollout_model"]


def copy_model(model: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> nn.Module:
    """A fresh, unquantized copy of a transformers model: same class and config, parameters copied.

    Built with ``type(model)._from_config`` and a parameter copy, never ``copy.deepcopy`` (TRL
    patches the trainer model's ``forward``; a deep copy would keep calling the trainer's weights).
    ``model`` may carry quads *trainer* layers (their parameters are the BF16/FP32 masters);
    the copy does not. The copy is in eval mode with gradients off, in ``dtype`` (default: the
    dtype of ``model``'s first parameter) on ``device`` (default: ``model``'s). A sharded
    ``model`` (FSDP2) is gathered parameter by parameter: every rank calls this together and
    gets a full copy.
    """
    first = next(model.parameters())
    dtype = dtype or first.dtype
    device = device or first.device
    config = copy.deepcopy(model.config)
    from_config = getattr(type(model), "_from_config", None)
    if from_config is None:
        raise TypeError(f"{type(model).__name__} has no _from_config; pass a transformers PreTrainedModel")
    target = torch.device(device)
    if target.type == "cuda" and (not torch.cuda.is_available()
                                  or (target.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"copy_model: device {str(target)!r} requested, but this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no usable'} CUDA device(s)")
    rng_devices = [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    # built on the target device (a GPU initializes billions of parameters in milliseconds, a
    # CPU takes tens of seconds); the random init must not shift the caller's RNG streams
    with torch.random.fork_rng(devices=rng_devices), torch.device(target):
        clone = from_config(config, dtype=dtype)
    impl = base_experts_implementation(getattr(model.config, "_experts_implementation", None))
    if impl is not None:  # the trainer's autocast experts are grouped_mm without autocast
        clone.config._experts_implementation = impl
    masters = {n: p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in clone.named_parameters():
            if name not in masters:
                raise KeyError(f"copy_model: source model has no parameter {name!r} (architectures differ?)")
            src = masters[name]
            if is_dtensor(src):
                src = src.full_tensor()
            if isinstance(src, NVFP4Tensor):
                raise TypeError(f"copy_model: {name} is a {type(src).__name__}; copy from the trainer (masters), not a rollout model")
            param.copy_(src)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        clone.generation_config = copy.deepcopy(generation_config)
    clone.to(device)
    clone.eval()
    clone.requires_grad_(False)
    return clone


def build_rollout_model(
    trainer_model: nn.Module,
    policy: QuadsPolicy | None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    fuse_projections: bool = True,
) -> nn.Module:
    """A rollout model: :func:`copy_model` of ``trainer_model`` quantized per ``policy``, synced.

    ``policy=None`` leaves the copy unquantized (a BF16 rollout engine). Otherwise
    ``quads.quantize_(copy, policy)`` then ``quads.sync_weights_(copy, trainer_model)``, so the
    rollout's dequantized weights equal the trainer's fake-quant weights bit for bit; with
    ``fuse_projections`` then :func:`quads.fuse_projections_` (on every backend: one activation
    quantization per sibling input; the exact kernels' stacked GEMM keeps the bits, humming's stacked
    copy is within its stated bound).
    """
    if policy is not None and policy.side != "rollout":
        raise ValueError(f"build_rollout_model needs a rollout-side policy, got side={policy.side!r}")
    if policy is not None:  # what the copy (built from the config) would drop: an instance-level forward
        conversion_targets(trainer_model, policy.skips)
    rollout = copy_model(trainer_model, dtype, device)
    if policy is not None:
        quantize_(rollout, policy)
        sync_weights_(rollout, trainer_model, plain_trainer=True)  # a plain trainer is a BF16-trainer plan's
        if fuse_projections:
            fuse_projections_(rollout)
    return rollout
