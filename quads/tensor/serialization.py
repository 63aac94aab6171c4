"""safetensors for state dicts holding `NVFP4Tensor`s.

safetensors stores plain tensors only, so each NVFP4Tensor ``name`` is stored as three
tensors ``name.qdata``, ``name.scale`` (as uint8 bits) and ``name.global_encode_scale``, and
the metadata records its logical dtype and orientation (``quads.nvfp4``). ``torch.save``/
``torch.load(..., weights_only=True)`` need none of this: NVFP4Tensor is registered as a safe
global (and checks its parts when loaded).

safetensors has no checksum, so :func:`save_safetensors` also records a CRC32 of every stored
tensor's bytes (``quads.crc32``) and :func:`load_safetensors` verifies it: a flipped bit
anywhere in a file written by quads fails the load, naming the tensor. Files without
checksums (written by other tools) load with the structural checks only: every NVFP4 entry's
metadata, part shapes and dtypes, and finite, non-negative block scales and finite, positive
global scales (:class:`NVFP4Tensor`); there a flipped bit in ``qdata`` changes one element
silently, as it would in any unchecked weight file.
"""

from __future__ import annotations

import json
import zlib

import torch

from quads.tensor.nvfp4_tensor import LOGICAL_DTYPES, NVFP4Tensor

__all__ = [
    "flatten_nvfp4_state_dict",
    "unflatten_nvfp4_state_dict",
    "save_safetensors",
    "load_safetensors",
    "tensor_crc32",
]

_META_KEY = "quads.nvfp4"
_CRC_KEY = "quads.crc32"
_PARTS = ("qdata", "scale", "global_encode_scale")
_DTYPES = {str(d).removeprefix("torch."): d for d in LOGICAL_DTYPES}


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (row-major, as safetensors stores them)."""
    flat = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return zlib.crc32(memoryview(flat.numpy()))


def flatten_nvfp4_state_dict(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain tensors and safetensors metadata for a state dict (see the module doc)."""
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
    crc = {k: tensor_crc32(v) for k, v in tensors.items()}
    return tensors, {_META_KEY: json.dumps(nvfp4), _CRC_KEY: json.dumps(crc)}


def _json_metadata(metadata: dict[str, str], key: str, what: str) -> dict:
    raw = metadata.get(key)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what}: metadata {key!r} is not valid JSON ({err}); the file is corrupt") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: metadata {key!r} must be a JSON object, got {type(value).__name__}")
    return value


def _verify_checksums(tensors: dict[str, torch.Tensor], crc: dict, what: str) -> None:
    for name, want in crc.items():
        if name not in tensors:
            raise ValueError(f"{what}: tensor {name!r} listed in the checksums is missing; the file is corrupt")
        if tensor_crc32(tensors[name]) != want:
            raise ValueError(f"{what}: checksum mismatch for {name!r}: its bytes changed since it was saved")


def _nvfp4_entry(name: str, info, tensors: dict[str, torch.Tensor], what: str) -> NVFP4Tensor:
    where = f"{what}: NVFP4 weight {name!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: metadata must be an object with 'dtype' and 'transposed', got {info!r}")
    dtype = info.get("dtype")
    if dtype not in _DTYPES:
        raise ValueError(f"{where}: metadata dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    transposed = info.get("transposed", False)
    if type(transposed) is not bool:
        raise ValueError(f"{where}: metadata 'transposed' must be true or false, got {transposed!r}")
    missing = [p for p in _PARTS if f"{name}.{p}" not in tensors]
    if missing:
        raise ValueError(f"{where}: the file has no {', '.join(f'{name}.{p}' for p in missing)}")
    scale = tensors[f"{name}.scale"]
    if scale.dtype != torch.uint8:
        raise ValueError(f"{where}: {name}.scale must be stored as uint8 bits, got {scale.dtype}")
    try:
        return NVFP4Tensor(
            tensors[f"{name}.qdata"],
            scale.view(torch.float8_e4m3fn),
            tensors[f"{name}.global_encode_scale"],
            _DTYPES[dtype],
            transposed,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def unflatten_nvfp4_state_dict(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, what: str = "safetensors file"
) -> dict:
    """The state dict of :func:`flatten_nvfp4_state_dict`'s output, every NVFP4 entry checked.

    Raises ValueError naming the entry for bad metadata, missing parts, parts that do not fit
    together, NaN/negative scales or non-positive global scales, and checksum mismatches.
    """
    metadata = metadata or {}
    nvfp4 = _json_metadata(metadata, _META_KEY, what)
    _verify_checksums(tensors, _json_metadata(metadata, _CRC_KEY, what), what)
    parts = {f"{n}.{p}" for n in nvfp4 for p in _PARTS}
    out = {k: v for k, v in tensors.items() if k not in parts}
    for name, info in nvfp4.items():
        out[name] = _nvfp4_entry(name, info, tensors, what)
    return out


def save_safetensors(state_dict: dict, path: str) -> None:
    """Write ``state_dict`` (NVFP4Tensors included) to a safetensors file with checksums."""
    from safetensors.torch import save_file

    tensors, metadata = flatten_nvfp4_state_dict(state_dict)
    save_file(tensors, path, metadata=metadata)


def load_safetensors(path: str, device: str = "cpu") -> dict:
    """Read a file written by :func:`save_safetensors` (or plain safetensors) onto ``device``.

    Checksums (when present) and NVFP4 invariants are verified on the CPU copy before anything
    moves to ``device``; a corrupt file raises ValueError naming the tensor.
    """
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    state = unflatten_nvfp4_state_dict(tensors, metadata, what=str(path))
    if torch.device(device).type == "cpu":
        return state
    return {k: v.to(device) for k, v in state.items()}
