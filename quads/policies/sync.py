"""Trainer -> rollout weight sync: re-quantize the BF16 masters into the rollout in place."""

from __future__ import annotations

import torch
import torch.nn as nn

from quads.policies.modules import RolloutModule
from quads.policies.shards import has_sharded_parameters
from quads.tensor.nvfp4_tensor import NVFP4Tensor, check_finite

__all__ = ["sync_weights_"]


def _owners(model: nn.Module) -> dict[str, RolloutModule]:
    """Qualified name of every packed parameter -> the rollout module holding it."""
    out = {}
    for mname, module in model.named_modules():
        if isinstance(module, RolloutModule):
            for pname in module.quads_packed_names:
                out[f"{mname}.{pname}" if mname else pname] = module
    return out


@torch.no_grad()
def sync_weights_(rollout_model: nn.Module, trainer_model: nn.Module) -> int:
    """Copy every parameter of ``trainer_model`` into ``rollout_model`` (same architecture).

    Packed NVFP4 rollout parameters are re-quantized from the trainer's BF16 masters with the
    recipe the trainer's fake quantizer uses (through the rollout module's backend: kernels on
    the GPU, same bits), into their existing storage, so afterwards
    ``rollout_param.dequantize(w.dtype)`` equals the trainer's forward weight bit for bit.
    Other parameters (embeddings, norms, routers, lm_head) are copied as they are.
    Returns the number of parameters synced.

    A sharded trainer (FSDP2 / DTensor parameters) makes this a collective: every rank calls it
    with its own full rollout replica (:func:`quads.policies.sharded_sync.sync_sharded_weights_`).
    """
    if has_sharded_parameters(trainer_model):
        from quads.policies.sharded_sync import sync_sharded_weights_  # imports this module

        return sync_sharded_weights_(rollout_model, trainer_model)
    masters = dict(trainer_model.named_parameters())
    owners = _owners(rollout_model)
    synced = 0
    for name, param in rollout_model.named_parameters():
        master = masters.get(name)
        if master is None:
            raise KeyError(f"sync_weights_: trainer model has no parameter {name!r} (architectures differ?)")
        if tuple(master.shape) != tuple(param.shape):
            raise ValueError(f"sync_weights_: {name} has shape {tuple(master.shape)} in the trainer, {tuple(param.shape)} in the rollout")
        source = master.detach()
        if isinstance(param, NVFP4Tensor):
            check_finite(source, f"sync_weights_: {name}")
            backend = owners[name].quads_backend if name in owners else None
            dense = source.to(param.device)
            if backend is None:
                param.copy_(dense)
            else:
                parts = backend.quantize_weight(dense.transpose(-2, -1) if param.transposed else dense)
                param.copy_(NVFP4Tensor(*parts, orig_dtype=param.orig_dtype, transposed=param.transposed))
        else:
            param.copy_(source)
        synced += 1
    for module in set(owners.values()):
        module.quads_weights_changed()
    return synced
