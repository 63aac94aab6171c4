"""safetensors for state dicts holding `NVFP4Tensor`s.

safetensors stores plain tensors only, so each NVFP4Tensor ``name`` is stored as three
tensors ``name.qdata``, ``name.scale`` (as uint8 bits) and ``name.global_encode_scale``, and
the metadata records its logical dtype and orientation. ``torch.save``/``torch.load(...,
weights_only=True)`` need none of this: NVFP4Tensor is registered as a safe global.
"""

from __future__ import annotations

import json

import torch

from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["flatten_nvfp4_state_dict", "unflatten_nvfp4_state_dict", "save_safetensors", "load_safetensors"]

_META_KEY = "quads.nvfp4"
_PARTS = ("qdata", "scale", "global_encode_scale")


def flatten_nvfp4_state_dict(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    nvfp4: dict[str, dict] = {}
    for name, value in state_dict.items():
        if isinstance(value, NVFP4Tensor):
            tensors[f"{name}.qdata"] = value.qdata.contiguous()
            tensors[f"{name}.scale"] = value.scale.view(torch.uint8).contiguous()
            tensors[f"{name}.global_encode_scale"] = value.global_encode_scale.contiguous()
            nvfp4[name] = {"dtype": str(value.orig_dtype).removeprefix("torch."), "transposed": value.transposed}
        else:
            tensors[name] = value.contiguous()
    return tensors, {_META_KEY: json.dumps(nvfp4)}


def unflatten_nvfp4_state_dict(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict:
    nvfp4 = json.loads((metadata or {}).get(_META_KEY, "{}"))
    out = {k: v for k, v in tensors.items() if not any(k == f"{n}.{p}" for n in nvfp4 for p in _PARTS)}
    for name, info in nvfp4.items():
        out[name] = NVFP4Tensor(
            tensors[f"{name}.qdata"],
            tensors[f"{name}.scale"].view(torch.float8_e4m3fn),
            tensors[f"{name}.global_encode_scale"],
            getattr(torch, info["dtype"]),
            info["transposed"],
        )
    return out


def save_safetensors(state_dict: dict, path: str) -> None:
    from safetensors.torch import save_file

    tensors, metadata = flatten_nvfp4_state_dict(state_dict)
    save_file(tensors, path, metadata=metadata)


def load_safetensors(path: str, device: str = "cpu") -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=device) as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return unflatten_nvfp4_state_dict(tensors, metadata)
