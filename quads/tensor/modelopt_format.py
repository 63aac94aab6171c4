"""The ModelOpt NVFP4 checkpoint format (what vLLM's ``modelopt_fp4`` loads), in quads' parts.

A quantized linear with checkpoint name ``X`` (MoE experts: one ``X`` per expert and
projection, ``...experts.{e}.gate_proj``) is stored as four tensors:

====================  ===========================  =========================================
``X.weight``          uint8 ``(N, K/2)``           E2M1 codes, even element in the low nibble:
                                                   quads' ``qdata``
``X.weight_scale``    float8_e4m3fn ``(N, K/16)``  block scales, plain row-major (not
                                                   swizzled; vLLM swizzles at load): ``scale``
``X.weight_scale_2``  float32 ``()``               per-tensor *decode* scale ``1/S_enc``
                                                   (ModelOpt: ``amax/(6*448)``)
``X.input_scale``     float32 ``()``               W4A4 only: static activation decode scale
                                                   ``amax_x/(6*448)`` (calibrated)
====================  ===========================  =========================================

``weight_scale_2`` is written as the float32 reciprocal of quads' encode scale ``S_enc``; the
exact ``S_enc`` also goes into the header metadata (:data:`ENCODE_SCALE_KEY`; why:
docs/ecosystem.md) for a bit-exact quads read-back (without it: ``S_enc = 1/weight_scale_2``).

:func:`read_modelopt_checkpoint` verifies the SHA-256 of every file ``quads export`` recorded
(:data:`EXPORT_REPORT`) and confines shard names and symlinks to the checkpoint (docs/ecosystem.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from quads.tensor.nvfp4_math import BLOCK_SIZE, NVFP4Parts
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = [
    "ENCODE_SCALE_KEY",
    "INDEX_FILE",
    "QUANT_CONFIG_FILE",
    "decode_scale",
    "modelopt_weight_tensors",
    "exact_encode_scales",
    "read_modelopt_checkpoint",
    "EXPORT_REPORT",
    "file_sha256",
    "recorded_checksums",
    "verify_checksums",
]

#: safetensors metadata key holding the exact quads encode scales (see the module doc)
ENCODE_SCALE_KEY = "quads.global_encode_scale"
INDEX_FILE = "model.safetensors.index.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"
#: the export's report, which also holds the files' checksums (``"checksums"``: name -> ``sha256:<hex>``)
EXPORT_REPORT = "quads_export.json"

_PARTS = ("weight", "weight_scale", "weight_scale_2")


def decode_scale(global_encode_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2``: the float32 reciprocal of quads' encode scale."""
    gs = global_encode_scale.to(torch.float32)
    return torch.ones_like(gs) / gs


def modelopt_weight_tensors(name: str, parts: NVFP4Parts) -> dict[str, torch.Tensor]:
    """The three checkpoint tensors of one 2-D weight with one global scale (``name`` without
    the ``.weight`` suffix)."""
    if parts.qdata.dim() != 2 or parts.global_encode_scale.dim() != 0:
        raise ValueError(
            f"{name}: ModelOpt stores 2-D weights with one global scale, got qdata "
            f"{tuple(parts.qdata.shape)} and global scale {tuple(parts.global_encode_scale.shape)}"
        )
    return {
        f"{name}.weight": parts.qdata.contiguous(),
        f"{name}.weight_scale": parts.scale.contiguous(),
        f"{name}.weight_scale_2": decode_scale(parts.global_encode_scale).contiguous(),
    }


def exact_encode_scales(tensors: dict[str, torch.Tensor], encode_scales: dict[str, torch.Tensor]) -> dict[str, str]:
    """The ``X.weight_scale_2 -> S_enc.hex()`` entries whose ``S_enc`` is not ``1/weight_scale_2``.

    ``encode_scales`` maps ``X.weight_scale_2`` names to the exact quads ``S_enc`` (0-d)."""
    out = {}
    for key, s_enc in encode_scales.items():
        recovered = torch.ones((), dtype=torch.float32) / tensors[key].to(torch.float32).cpu()
        if not torch.equal(recovered, s_enc.to(torch.float32).cpu()):
            out[key] = float(s_enc).hex()
    return out


def _allowed_roots(path: Path) -> list[Path]:
    """Where the files of checkpoint directory ``path`` may resolve to: the directory itself, and
    in the Hugging Face cache layout (``<repo>/snapshots/<revision>``) the repository's ``blobs``."""
    root = path.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _confined(path: Path, name, where) -> Path:
    """``path / name`` if it names a file inside the checkpoint directory (see the module doc),
    else ValueError: an index or report must not make the reader open ``../`` or absolute paths,
    nor follow a symlink out (other than into the Hugging Face cache's ``blobs``)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"{where}: file {name!r} is not a file name inside the checkpoint directory")
    target = (path / name).resolve()
    roots = _allowed_roots(path)
    if not any(target.is_relative_to(r) for r in roots):
        raise ValueError(f"{where}: {name!r} resolves to {target}, outside the checkpoint directory {roots[0]}"
                         + (f" and the cache's {roots[1]}" if len(roots) > 1 else ""))
    return path / name


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def recorded_checksums(path: str | Path) -> dict[str, str] | None:
    """The ``file -> sha256:<hex>`` map of an export's report, or None (no report, or a report
    without checksums); ValueError for an unreadable report."""
    report = Path(path) / EXPORT_REPORT
    if not report.is_file():
        return None
    try:
        checksums = json.loads(report.read_text()).get("checksums")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        raise ValueError(f"{report}: not a readable export report ({type(err).__name__}: {err})") from None
    if checksums is None:
        return None
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise ValueError(f"{report}: 'checksums' must be an object of file name -> 'sha256:<hex>'")
    return checksums


def verify_checksums(path: str | Path, files: list[str] | None = None) -> int:
    """Check ``files`` (default: every file the report lists) against the export's report;
    ValueError naming the first file that is missing or whose bytes changed. Returns how many
    files were checked (0 when the checkpoint records no checksums)."""
    path = Path(path)
    checksums = recorded_checksums(path)
    if checksums is None:
        return 0
    where = path / EXPORT_REPORT
    names = sorted(checksums) if files is None else files
    for name in names:
        if name not in checksums:
            raise ValueError(f"{where}: no checksum for {name!r}, which the checkpoint holds; it was changed "
                             "after the export (pass verify=False to read it unchecked)")
        file = _confined(path, name, where)
        if not file.is_file():
            raise ValueError(f"{path}: {name} is missing (the export wrote it, {where} lists it)")
        if file_sha256(file) != checksums[name]:
            raise ValueError(f"{file}: checksum mismatch: its bytes changed since the export wrote it; the "
                             "checkpoint is corrupt (pass verify=False to read it unchecked)")
    return len(names)


def _shard_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {err}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> shard file")
        return [_confined(path, f, index) for f in sorted(set(map(str, weight_map.values())))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return [_confined(path, f.name, path) for f in files]


def _encode_scale(path: Path, name: str, raw: dict[str, torch.Tensor], exact: dict) -> torch.Tensor:
    """``S_enc`` of checkpoint weight ``name`` from its ``weight_scale_2`` (or the exact value in
    the metadata); ValueError naming the tensor unless it is one finite positive number."""
    key = f"{name}.weight_scale_2"
    stored = raw[key]
    if stored.numel() != 1 or not stored.is_floating_point():
        raise ValueError(f"{path}: {key} must be one floating-point number, got {stored.dtype} of shape "
                         f"{tuple(stored.shape)}")
    if key in exact:
        try:
            s_enc = torch.tensor(float.fromhex(exact[key]), dtype=torch.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: the exact encode scale of {key} is {exact[key]!r}, not a hex float") from None
    else:
        s_enc = torch.ones(()) / stored.to(torch.float32).reshape(()).cpu()
    value = float(s_enc)
    if not (0 < value < float("inf")) or not 0 < float(stored.reshape(())) < float("inf"):
        raise ValueError(f"{path}: {key} is {float(stored.reshape(())):g} (encode scale {value:g}); a weight "
                         "scale must be finite and > 0; the checkpoint is corrupt")
    return s_enc


def read_modelopt_checkpoint(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", *,
                             verify: bool = True) -> dict[str, torch.Tensor]:
    """Read a ModelOpt NVFP4 checkpoint directory into checkpoint-named tensors.

    Every ``X.weight`` stored as NVFP4 (uint8 with ``X.weight_scale`` and ``X.weight_scale_2``
    beside it) becomes one 2-D :class:`~quads.NVFP4Tensor` of logical dtype ``dtype`` under
    ``X.weight``; ``X.input_scale`` and all unquantized tensors are returned as stored.
    ``verify``: check the files read against the checksums a ``quads export`` recorded, when the
    checkpoint has them (see the module doc).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    raw: dict[str, torch.Tensor] = {}
    exact: dict[str, str] = {}
    shards = _shard_files(path)
    if verify:
        verify_checksums(path, [f.name for f in shards] + ([INDEX_FILE] if (path / INDEX_FILE).exists() else []))
    for file in shards:
        try:
            with safe_open(str(file), framework="pt", device=device) as f:
                exact.update(json.loads((f.metadata() or {}).get(ENCODE_SCALE_KEY, "{}")))
                for key in f.keys():
                    raw[key] = f.get_tensor(key)
        except OSError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors' and json's own errors for a damaged shard
            raise ValueError(f"{file}: not a readable safetensors shard ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})") from None
    out: dict[str, torch.Tensor] = {}
    packed = {k[: -len(".weight_scale_2")] for k in raw if k.endswith(".weight_scale_2")}
    for name in packed:
        missing = [p for p in _PARTS if f"{name}.{p}" not in raw]
        if missing:
            raise ValueError(f"{path}: {name} has weight_scale_2 but no {missing}")
        qdata, scale = raw[f"{name}.weight"], raw[f"{name}.weight_scale"]
        if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{path}: {name}.weight must be uint8 and .weight_scale float8_e4m3fn, got {qdata.dtype}, {scale.dtype}")
        if scale.shape[-1] * BLOCK_SIZE != qdata.shape[-1] * 2:
            raise ValueError(f"{path}: {name}.weight_scale {tuple(scale.shape)} does not fit weight {tuple(qdata.shape)} (group size 16)")
        s_enc = _encode_scale(path, name, raw, exact)
        try:
            out[f"{name}.weight"] = NVFP4Tensor(qdata, scale, s_enc.to(qdata.device), orig_dtype=dtype)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {name}: {err}") from None
    for key, value in raw.items():
        name, _, part = key.rpartition(".")
        if name in packed and part in _PARTS:
            continue
        out[key] = value
    return out
