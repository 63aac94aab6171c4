"""safetensors for state dicts holding `NVFP4Tensor`s.

safetensors stores plain tensors only, so each NVFP4Tensor ``name`` is stored as three
tensors ``name.qdata``, ``name.scale`` (as uint8 bits) and ``name.global_encode_scale``, and
the metadata records its logical dtype and orientation (``quads.nvfp4``). ``torch.save``/
``torch.load(..., weights_only=True)`` need none of this: NVFP4Tensor is registered as a safe
global (and checks its parts when loaded).

safetensors has no checksum, so :func:`save_safetensors` records two:

* ``quads.crc32``: a CRC32 of every stored tensor's bytes; a flipped bit in the data fails the
  load, naming the tensor;
* ``quads.header_crc32``: a CRC32 of the whole header (every tensor's dtype, shape and data
  offsets, and all metadata, ``quads.nvfp4`` and ``quads.crc32`` included) without this entry,
  as canonical JSON (sorted keys, no spaces). Same-size header edits (a dtype BF16 -> F16, a
  swapped shape, ``"transposed": true``, a deleted NVFP4 entry, a flipped bit in a metadata
  key) fail the load instead of giving a different state dict.

:func:`load_safetensors` verifies both and refuses a file without the header checksum (written
by another tool or an older quads) unless called with ``verify=False``; such files then load
with the structural checks of :class:`NVFP4Tensor` only (a flipped ``qdata`` bit goes unseen).

Tied entries are stored once (``quads.ties``), and the file is written atomically
(:func:`quads.tensor.files.atomic_path`); both in detail: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import torch

from quads.tensor.files import atomic_path
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
_HEADER_CRC_KEY = "quads.header_crc32"
_TIES_KEY = "quads.ties"
_PENDING = "00000000"  # the header CRC's placeholder while the file is written (8 hex digits)
_PARTS = ("qdata", "scale", "global_encode_scale")
_DTYPES = {str(d).removeprefix("torch."): d for d in LOGICAL_DTYPES}


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (row-major, as safetensors stores them)."""
    flat = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return zlib.crc32(memoryview(flat.numpy()))


def _storage_key(t: torch.Tensor) -> tuple:
    """What makes two plain tensors the same tensor: storage, offset, shape, strides and dtype."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _tie_key(value: torch.Tensor) -> tuple:
    """Equal for the entries of one tensor under several names (``state_dict`` detaches each)."""
    if isinstance(value, NVFP4Tensor):
        return ("nvfp4", value.orig_dtype, value.transposed) + tuple(_storage_key(p) for p in value.parts)
    return ("dense",) + _storage_key(value)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every tensor that shares storage with an earlier one (a view of one
    buffer, not a tie) replaced by a copy: safetensors refuses shared storage."""
    seen: set[tuple] = set()
    out = {}
    for name, t in tensors.items():
        key = (t.device, t.untyped_storage().data_ptr())
        out[name] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    return out


def flatten_nvfp4_state_dict(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain tensors and safetensors metadata for a state dict (see the module doc)."""
    tensors: dict[str, torch.Tensor] = {}
    nvfp4: dict[str, dict] = {}
    ties: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is {type(value).__name__}, not a tensor; safetensors stores tensors")
        if not isinstance(name, str):
            raise TypeError(f"state dict key {name!r} is {type(name).__name__}, not a string")
        key = _tie_key(value)
        if key in first and value.numel():
            ties[name] = first[key]  # a tied weight: stored once
            continue
        first.setdefault(key, name)
        if isinstance(value, NVFP4Tensor):
            clash = [f"{name}.{p}" for p in _PARTS if f"{name}.{p}" in state_dict]
            if clash:
                raise ValueError(f"state dict entry {name!r} is an NVFP4Tensor stored as {name}.qdata/.scale/"
                                 f".global_encode_scale, but the state dict also has {', '.join(clash)}; rename one")
            tensors[f"{name}.qdata"] = value.qdata.contiguous()
            tensors[f"{name}.scale"] = value.scale.view(torch.uint8).contiguous()
            tensors[f"{name}.global_encode_scale"] = value.global_encode_scale.contiguous()
            nvfp4[name] = {"dtype": str(value.orig_dtype).removeprefix("torch."), "transposed": value.transposed}
        else:
            tensors[name] = value.contiguous()
    tensors = _unshared(tensors)
    crc = {k: tensor_crc32(v) for k, v in tensors.items()}
    metadata = {_META_KEY: json.dumps(nvfp4), _CRC_KEY: json.dumps(crc)}
    if ties:
        metadata[_TIES_KEY] = json.dumps(ties)
    return tensors, metadata


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
    for alias, name in _json_metadata(metadata, _TIES_KEY, what).items():
        if not isinstance(name, str) or name not in out:
            raise ValueError(f"{what}: tied entry {alias!r} refers to {name!r}, which the file does not hold; "
                             "the file is corrupt")
        if alias in out:
            raise ValueError(f"{what}: tied entry {alias!r} is also stored as a tensor; the file is corrupt")
        out[alias] = out[name]  # the tie, restored: one tensor under both names
    return out


def _read_header(path: str) -> tuple[bytes, dict]:
    """The raw JSON header of a safetensors file and its parsed form (ValueError if unreadable)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({len(head)} bytes)")
        (size,) = struct.unpack("<Q", head)
        if size > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{path}: not a safetensors file (header of {size} bytes in a shorter file)")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({err}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    return raw, header


def header_crc32(header: dict) -> int:
    """CRC32 of a parsed safetensors header without ``quads.header_crc32``, as canonical JSON."""
    header = dict(header)
    meta = dict(header.get("__metadata__") or {})
    meta.pop(_HEADER_CRC_KEY, None)
    header["__metadata__"] = meta
    return zlib.crc32(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())


def save_safetensors(state_dict: dict, path: str) -> None:
    """Write ``state_dict`` (NVFP4Tensors included) to a safetensors file with data and header
    checksums, atomically (see the module doc).

    The header CRC cannot be known before safetensors lays the header out, so the file is
    written with an 8-digit placeholder, its header read back, and the placeholder overwritten
    in place (same length: no offset moves) before the file is moved to ``path``.
    """
    from safetensors.torch import save_file

    tensors, metadata = flatten_nvfp4_state_dict(state_dict)
    metadata[_HEADER_CRC_KEY] = _PENDING
    with atomic_path(path, what="save_safetensors") as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        raw, header = _read_header(str(tmp))
        needle = json.dumps(_HEADER_CRC_KEY).encode() + b":" + json.dumps(_PENDING).encode()
        at = raw.find(needle)
        if at < 0 or raw.find(needle, at + 1) >= 0:
            raise RuntimeError(f"save_safetensors: cannot place the header checksum in {tmp} (unexpected header layout)")
        with open(tmp, "r+b") as f:
            f.seek(8 + at + len(needle) - 1 - len(_PENDING))
            f.write(f"{header_crc32(header):08x}".encode())


def _verify_header(path: str, metadata: dict, verify: bool) -> None:
    if not verify:
        return
    stored = (metadata or {}).get(_HEADER_CRC_KEY)
    if stored is None:
        raise ValueError(
            f"{path}: no header checksum ({_HEADER_CRC_KEY}): not written by quads' save_safetensors, or by an older "
            "version, or the key itself was damaged. load_safetensors(..., verify=False) loads it unchecked"
        )
    _, header = _read_header(path)
    if stored != f"{header_crc32(header):08x}":
        raise ValueError(
            f"{path}: header checksum mismatch: the tensor names, dtypes, shapes, offsets or metadata changed "
            "since the file was saved; the file is corrupt"
        )


def load_safetensors(path: str, device: str = "cpu", *, verify: bool = True) -> dict:
    """Read a file written by :func:`save_safetensors` onto ``device``.

    The header checksum (names, dtypes, shapes, offsets, metadata), the data checksums and the
    NVFP4 invariants are verified on the CPU copy before anything moves to ``device``; a corrupt
    file raises ValueError naming what changed. A file without a header checksum (another tool's)
    is refused unless ``verify=False``, which loads any safetensors file with the structural
    NVFP4 checks only (and the data checksums when present).
    """
    from safetensors import safe_open

    where = Path(path)
    if where.is_dir():
        raise IsADirectoryError(f"load_safetensors: {str(path)!r} is a directory; pass the .safetensors file in it")
    if not where.exists():
        raise FileNotFoundError(f"load_safetensors: {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' own errors for a damaged file
        raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None
    _verify_header(str(path), metadata, verify)
    state = unflatten_nvfp4_state_dict(tensors, metadata, what=str(path))
    if torch.device(device).type == "cpu":
        return state
    return {k: v.to(device) for k, v in state.items()}
