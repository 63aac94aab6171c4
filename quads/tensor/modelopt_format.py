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

``weight_scale_2`` is written as the float32 reciprocal of quads' encode scale ``S_enc``.
About 11% of float32 ``S_enc`` values are no float32 reciprocal's reciprocal, so for those
the exact ``S_enc`` also goes into the safetensors header metadata (:data:`ENCODE_SCALE_KEY`,
a JSON map from ``X.weight_scale_2`` to ``S_enc.hex()``): loaders ignore it, and
:func:`read_modelopt_checkpoint` uses it, so a quads read-back dequantizes bit for bit like the
trainer's fake quantizer. Checkpoints without it read back with ``S_enc = 1/weight_scale_2``.
"""

from __future__ import annotations

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
]

#: safetensors metadata key holding the exact quads encode scales (see the module doc)
ENCODE_SCALE_KEY = "quads.global_encode_scale"
INDEX_FILE = "model.safetensors.index.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"

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


def _confined(path: Path, name, index: Path) -> Path:
    """``path / name`` if it names a file inside the checkpoint directory, else ValueError: an
    index file must not make the reader open ``../`` or absolute paths (or follow a symlink out)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"{index}: shard {name!r} is not a file name inside the checkpoint directory")
    root = path.resolve()
    target = (path / name).resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"{index}: shard {name!r} resolves to {target}, outside the checkpoint directory {root}")
    return path / name


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
    return files


def read_modelopt_checkpoint(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a ModelOpt NVFP4 checkpoint directory into checkpoint-named tensors.

    Every ``X.weight`` stored as NVFP4 (uint8 with ``X.weight_scale`` and ``X.weight_scale_2``
    beside it) becomes one 2-D :class:`~quads.NVFP4Tensor` of logical dtype ``dtype`` under
    ``X.weight``; ``X.input_scale`` and all unquantized tensors are returned as stored.
    """
    from safetensors import safe_open

    path = Path(path)
    raw: dict[str, torch.Tensor] = {}
    exact: dict[str, str] = {}
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt", device=device) as f:
            exact.update(json.loads((f.metadata() or {}).get(ENCODE_SCALE_KEY, "{}")))
            for key in f.keys():
                raw[key] = f.get_tensor(key)
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
        key = f"{name}.weight_scale_2"
        p = raw[key].to(torch.float32).reshape(())
        s_enc = torch.tensor(float.fromhex(exact[key]), dtype=torch.float32) if key in exact else torch.ones(()) / p
        out[f"{name}.weight"] = NVFP4Tensor(qdata, scale, s_enc.to(qdata.device), orig_dtype=dtype)
    for key, value in raw.items():
        name, _, part = key.rpartition(".")
        if name in packed and part in _PARTS:
            continue
        out[key] = value
    return out
