"""``load_state_dict`` of packed NVFP4 weights into dense tensors: refused, before anything loads.

torch loads a state dict tensor by tensor (``param.copy_(value)``), and ``copy_`` from an
:class:`~quads.tensor.nvfp4_tensor.NVFP4Tensor` into a dense tensor writes its dequantized
weight; so a rollout checkpoint (``rollout.state_dict()``, ``quads.tensor.load_safetensors``)
loaded into a plain model, a quads trainer or a rollout of another scope would give a model that
holds dequantized weights without saying so. A plain module has no quads hook, and torch runs no
hook before its first ``copy_``; so :func:`install` wraps ``torch.nn.Module.load_state_dict``
(``import quads`` runs it) with :func:`check_no_dequantizing_load`, which costs one type and one
name test per entry when the state dict holds no packed weight, and refuses in one line naming
the first culprit key (in the model's order):

* a packed value (an ``NVFP4Tensor``) whose destination is a dense tensor;
* a packed weight's serialized parts (``K.qdata``, ``K.scale``, ``K.global_encode_scale``: a
  quads file read with another reader than ``load_safetensors``) where the model holds a dense
  ``K`` and the state dict has no ``K``: ``strict=False`` would drop them, silently.

``assign=True`` (the packed tensor becomes the parameter; nothing is dequantized) and
destinations that are ``NVFP4Tensor`` (a rollout quantized the same way) pass.
``dense.copy_(packed)`` and ``NVFP4Tensor.dequantize()`` stay what they are: explicit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn as nn

from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["check_no_dequantizing_load", "install"]

_PARTS = ("qdata", "scale", "global_encode_scale")
_FIX = ("quantize_ the model with the checkpoint's rollout policy first (quads.quantize_(model, "
        "QuadsPolicy(side='rollout', ...))), or load a saved checkpoint with from_pretrained (import quads first) or "
        "quads.integrations.modelopt.load_exported; for dense weights, dequantize explicitly "
        "({k: v.dequantize(v.dtype) for k, v in state.items()})")


def _destinations(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in module.named_buffers(remove_duplicate=False) if b is not None})
    return out


def check_no_dequantizing_load(module: nn.Module, state_dict: Mapping) -> None:
    """Raise ``ValueError`` if loading ``state_dict`` into ``module`` would dequantize a packed
    NVFP4 weight into a dense tensor (module doc); otherwise do nothing."""
    packed = [k for k, v in state_dict.items() if isinstance(v, NVFP4Tensor)]
    parts = {k for k in state_dict if isinstance(k, str) and k.endswith(".qdata")}
    if not packed and not parts:
        return
    for key, dst in _destinations(module).items():  # the first culprit in the model's order
        if isinstance(dst, NVFP4Tensor):
            continue
        if isinstance(state_dict.get(key), NVFP4Tensor):
            raise ValueError(f"load_state_dict (nothing was loaded): {key} is a packed NVFP4 weight ({len(packed)} in "
                             f"the state dict: a quads rollout checkpoint) and {type(module).__name__} holds a dense "
                             f"{dst.dtype} tensor there, which would receive its dequantized values (no longer the "
                             f"rollout's packed bits); {_FIX}")
        if f"{key}.qdata" in parts and key not in state_dict and all(f"{key}.{p}" in state_dict for p in _PARTS):
            raise ValueError(f"load_state_dict (nothing was loaded): {key}.qdata is a part of the packed NVFP4 weight "
                             f"{key} (a quads rollout file read without quads.tensor.load_safetensors); "
                             f"{type(module).__name__} holds a dense {key}, which this load would leave as it is; "
                             f"read the file with quads.tensor.load_safetensors, then {_FIX}")


def install() -> None:
    """Wrap ``torch.nn.Module.load_state_dict`` with :func:`check_no_dequantizing_load` (once)."""
    load = nn.Module.load_state_dict
    if getattr(load, "_quads_load_guard", False):
        return

    @functools.wraps(load)
    def load_state_dict(self, state_dict, strict=True, assign=False):
        if not assign and isinstance(state_dict, Mapping):
            check_no_dequantizing_load(self, state_dict)
        return load(self, state_dict, strict=strict, assign=assign)

    load_state_dict._quads_load_guard = True
    nn.Module.load_state_dict = load_state_dict
