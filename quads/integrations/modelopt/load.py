"""Read a ``quads export`` checkpoint back into a transformers model (the inverse of the export).

    from quads.integrations.modelopt import load_exported
    trainer_forward = load_exported("out/", side="trainer")   # plain model, W4A16 forward weights
    rollout = load_exported("out/", side="rollout")            # quads rollout model, W4A4 + residual

* ``side="trainer"``: a plain transformers model whose quantized layers hold the dequantized
  NVFP4 weights in the checkpoint's dtype, i.e. the QUADS trainer's forward weights
  (``nvfp4_fake_quantize(master)``, with its sibling group's global scale) bit for bit; its forward is the trainer's W4A16 forward
  (BF16 activations). The masters themselves are not in the checkpoint: train on from them,
  not from this model.
* ``side="rollout"``: that model converted by ``quads.quantize_`` with
  ``QuadsPolicy(side="rollout")`` (or ``policy``), then every packed weight overwritten with the
  checkpoint's own codes, block scales and global scales: the rollout a ``sync_weights_`` from
  the trainer would have produced, bit for bit. With the default
  ``weight_global_scale="group"`` a checkpoint whose sibling shards carry different global
  scales (exported with ``fused_scales="separate"`` from a ``"tensor"``-mode model) is refused
  with an error that names the group; pass ``policy=QuadsPolicy(side="rollout",
  weight_global_scale="tensor")`` to load it.

How it loads (through a temporary standard checkpoint and transformers' own conversions):
docs/ecosystem.md.

Every file is first checked against the export's SHA-256 checksums (``verify=True``, default):
a flipped bit fails the load, naming the file (details: docs/ecosystem.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from quads.extras import require
from quads.integrations.modelopt.export import _row_sources
from quads.policies.policy import QuadsPolicy
from quads.policies.quantize import quantize_
from quads.policies.scale_groups import check_group_scales
from quads.tensor.files import atomic_path, write_atomically
from quads.tensor.modelopt_format import EXPORT_REPORT, read_modelopt_checkpoint, recorded_checksums, verify_checksums
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["load_exported"]

SIDES = ("trainer", "rollout")


def _read_config(config_file: Path) -> dict:
    """``config.json`` of an export (ValueError naming the file if it is not one)."""
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"load_exported: {config_file} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"load_exported: {config_file} is not a JSON object")
    if (config.get("quantization_config") or {}).get("quant_method") != "modelopt":
        raise ValueError(f"load_exported: {config_file} has no ModelOpt quantization_config (not a `quads export`)")
    return config


def _checkpoint_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"load_exported: config.json has dtype {name!r}, not a floating dtype")
    return dtype


def _dense_model(path: Path, tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype,
                 device: str) -> nn.Module:
    """transformers' own loading of ``tensors`` (NVFP4 ones dequantized) under ``config``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dense = {k: (v.dequantize(dtype) if isinstance(v, NVFP4Tensor) else v).contiguous() for k, v in tensors.items()}
    tmp = Path(tempfile.mkdtemp(prefix=".quads-load-"))
    try:
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        write_atomically(tmp / "config.json", json.dumps(plain), what="load_exported")
        with atomic_path(tmp / "model.safetensors", what="load_exported") as part:
            save_file(dense, str(part), metadata={"format": "pt"})
        if (path / "generation_config.json").is_file():
            shutil.copy(path / "generation_config.json", tmp / "generation_config.json")
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, local_files_only=True, device_map=device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.eval()


def _place_packed(rollout: nn.Module, tensors: dict[str, torch.Tensor], sources: dict) -> None:
    """Overwrite each packed rollout weight with the checkpoint's parts (all checked first by
    ``NVFP4Tensor``'s constructor and ``copy_``)."""
    by_param: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for ckpt, (param, rows) in sources.items():
        by_param.setdefault(param, []).append((ckpt, rows))
    params = dict(rollout.named_parameters())
    for param, pieces in by_param.items():
        dst = params.get(param)
        if not isinstance(dst, NVFP4Tensor):
            raise ValueError(f"load_exported: {param} is NVFP4 in the checkpoint but not a packed rollout weight")
        lead = dst.qdata.shape[:-1]
        qdata = torch.empty_like(dst.qdata).reshape(-1, dst.qdata.shape[-1])
        scale = torch.empty_like(dst.scale).reshape(-1, dst.scale.shape[-1])
        gs = torch.empty_like(dst.global_encode_scale)
        filled = torch.zeros(qdata.shape[0], dtype=torch.bool)
        for ckpt, rows in pieces:
            src = tensors[ckpt]
            if not isinstance(src, NVFP4Tensor):
                raise ValueError(f"load_exported: {ckpt} (rows of {param}) is not stored as NVFP4")
            qdata[rows] = src.qdata.to(qdata.device)
            scale[rows] = src.scale.to(scale.device)
            filled[rows] = True
            if gs.dim() == 0:
                if len(pieces) > 1:
                    raise NotImplementedError(f"load_exported: {param} has one global scale but {len(pieces)} "
                                              "checkpoint tensors")
                gs.copy_(src.global_encode_scale)
            else:
                gs[int(rows[0]) // lead[1]] = src.global_encode_scale.to(gs.device)
        if not bool(filled.all()):
            raise ValueError(f"load_exported: the checkpoint leaves rows of {param} unset")
        with torch.no_grad():
            dst.copy_(NVFP4Tensor(qdata.reshape(*lead, -1), scale.reshape(*lead, -1), gs, orig_dtype=dst.orig_dtype))


def load_exported(
    path: str | os.PathLike,
    side: str = "trainer",
    *,
    policy: QuadsPolicy | None = None,
    device: str = "cpu",
    verify: bool = True,
) -> nn.Module:
    """A transformers causal LM from a ``quads export`` directory (see the module doc).

    Args:
        path: the exported directory (``w4a16`` or ``nvfp4`` format; ``input_scale`` is ignored:
            the rollout quantizes activations online).
        side: ``"trainer"`` (plain model, the trainer's forward weights) or ``"rollout"``.
        policy: the rollout policy (default ``QuadsPolicy(side="rollout")``).
        device: where the model is built.
        verify: check every file against the export's checksums first (see the module doc).
    """
    if side not in SIDES:
        raise ValueError(f"load_exported: side must be one of {SIDES}, got {side!r}")
    require("quads.integrations.modelopt.load_exported", "transformers")
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"load_exported: {path} has no config.json (not an exported checkpoint)")
    if verify and recorded_checksums(path) is not None:
        verify_checksums(path)  # before anything is parsed: a flipped bit is named as such
    config = _read_config(config_file)
    if verify and recorded_checksums(path) is None:
        raise ValueError(f"load_exported: {path} records no checksums ({EXPORT_REPORT} with 'checksums', written "
                         "by quads export); pass verify=False to load it unchecked")
    dtype = _checkpoint_dtype(config)
    tensors = read_modelopt_checkpoint(path, dtype=dtype, verify=False)  # verified above
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".input_scale")}
    model = _dense_model(path, tensors, config, dtype, device)
    if side == "trainer":
        return model
    policy = policy or QuadsPolicy(side="rollout")
    if policy.side != "rollout":
        raise ValueError("load_exported: side='rollout' needs a rollout policy")
    packed = {k for k, v in tensors.items() if isinstance(v, NVFP4Tensor)}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() >= 2}
    sources = {c: s for c, s in _row_sources(model, shapes).items() if c in packed} if packed else {}
    missing = packed - set(sources)
    if missing:
        raise ValueError(f"load_exported: NVFP4 tensors {sorted(missing)[:3]} map to no parameter of the model")
    quantize_(model, policy, filter_fn=lambda m, name: any(
        src.rpartition(".")[0] == name for src, _ in sources.values()))
    scales = {param: tensors[ckpt].global_encode_scale for ckpt, (param, _) in sources.items()
              if tensors[ckpt].global_encode_scale.dim() == 0}
    groups = {id(g): [f"{n}.weight" for n in g.names] for m in model.modules()
              for g in [getattr(m, "quads_scale_group", None)] if g is not None}
    check_group_scales(groups.values(), scales, f"load_exported({str(path)!r})")
    _place_packed(model, tensors, sources)
    return model
