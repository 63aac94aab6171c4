"""Export a QUADS-trained model as a ModelOpt NVFP4 checkpoint (vLLM ``modelopt_fp4``, SGLang,
TensorRT-LLM), the tensors laid out as :mod:`quads.tensor.modelopt_format` describes.

    from quads.integrations.modelopt import export_modelopt
    report = export_modelopt(trainer_model, "out/", format="w4a16", tokenizer=tok)

What is exported:

* **Which weights**: exactly those a QUADS trainer fake-quantizes (the model's quads modules, else
  the targets of ``policy``); everything else is written as stored and listed in
  ``exclude_modules``;
* **Their values**: the trainer's forward weight ``nvfp4_fake_quantize(master)`` as codes and
  block scales (a rollout model's packed weights are the same bits), fused experts per expert
  under transformers' checkpoint names;
* **Fused layers** (``fused_scales``): q/k/v and gate/up shards with one global scale, as vLLM
  serves them (``"shared"``, default) or each its own (``"separate"``);
* **Formats**: ``"w4a16"`` (``quant_algo: W4A16_NVFP4``: NVFP4 weights, BF16 activations, the
  numerics of the QUADS trainer) and ``"nvfp4"`` (W4A4 with a static per-tensor activation
  scale ``input_scale`` from calibration batches, no residual compensation: not the QUADS rollout).
* **Files**: the config with ``quantization_config``, safetensors shards, tokenizer and
  ``quads_export.json`` (the report, with a SHA-256 of every other file), written all or nothing;
* **Dtype** of the tensors that are not quantized: the 16-bit dtype the trained forward ran in
  (``dtype="auto"``); a value that would be Inf in it is refused before anything is written.

Each point in detail (what vLLM does with fused shards, file modes, dtype rules): docs/ecosystem.md.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from quads.integrations.modelopt.calibrate import ExpertsAmax, activation_amax
from quads.policies.policy import QuadsPolicy
from quads.policies.quantize import quantized_modules
from quads.policies.walk import ConversionTarget, policy_targets, target_kind
from quads.tensor.files import atomic_path, publish_modes, write_atomically
from quads.tensor.finite import check_dequantized_range, check_fits_dtype
from quads.tensor.modelopt_format import (
    ENCODE_SCALE_KEY,
    EXPORT_REPORT,
    INDEX_FILE,
    QUANT_CONFIG_FILE,
    decode_scale,
    exact_encode_scales,
    file_sha256,
    modelopt_weight_tensors,
)
from quads.tensor.nvfp4_math import (
    NVFP4Parts,
    check_quantizable,
    global_encode_scale_from_amax,
    nvfp4_dequantize,
    nvfp4_quantize,
    shared_global_encode_scale,
)
from quads.tensor.nvfp4_tensor import NVFP4Tensor, check_finite
from quads.policies.fused_projections import SIBLING_PROJECTIONS
from quads.policies.scale_groups import sibling_groups

__all__ = ["DTYPES", "FORMATS", "FUSED_SIBLINGS", "ExportReport", "check_out_dir", "export_modelopt"]

#: ``--format`` -> ModelOpt ``quant_algo``
FORMATS = {"nvfp4": "NVFP4", "w4a16": "W4A16_NVFP4"}
#: sibling linears vLLM merges into one layer with one global weight scale (the one list of them)
FUSED_SIBLINGS = SIBLING_PROJECTIONS
FUSED_SCALES = ("shared", "separate")
#: ``dtype`` choices for the tensors that are not quantized ("auto": the masters' 16-bit dtype, BF16 for float32)
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@dataclasses.dataclass
class ExportReport:
    """What :func:`export_modelopt` wrote (also saved as ``quads_export.json``)."""

    format: str
    quant_algo: str
    quantized_weights: int  # checkpoint tensors written as NVFP4
    exact_weights: int  # ... of which carry the trainer's forward weight bit for bit
    requantized: dict[str, dict[str, float]]  # shard -> weight error vs the trainer forward weight
    mismatched_fused_groups: list[list[str]]  # "separate": groups vLLM would mis-scale
    exclude_modules: list[str]
    files: list[str]
    checksums: dict[str, str] = dataclasses.field(default_factory=dict)  # file -> sha256:<hex> (not the report's)

    def summary(self) -> str:
        lines = [
            f"{self.quant_algo}: {self.quantized_weights} NVFP4 weights, {self.exact_weights} equal to the "
            f"trainer's forward weights bit for bit, {len(self.exclude_modules)} modules excluded"
        ]
        if not self.requantized and not self.mismatched_fused_groups:
            lines.append("0 fused-layer shards re-quantized (each fused group's shards share one global scale)")
        if self.requantized:
            worst = max(v["max_abs_error"] for v in self.requantized.values())
            lines.append(
                f"{len(self.requantized)} fused-layer shards re-quantized to their group's global scale "
                f"(vLLM needs one per fused layer); max |error| {worst:.3g} (per shard: quads_export.json)"
            )
        if self.mismatched_fused_groups:
            lines.append(
                f"WARNING: {len(self.mismatched_fused_groups)} fused groups keep different global scales "
                "(fused_scales='separate'): vLLM would use the largest for all shards"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Weights: targets and their NVFP4 parts
# ---------------------------------------------------------------------------------------------

_WEIGHTS = {"linear": ("weight",), "experts": ("gate_up_proj", "down_proj")}


def _targets(model: nn.Module, policy: QuadsPolicy) -> list[ConversionTarget]:
    converted = quantized_modules(model)
    if converted:
        return [ConversionTarget(n, m, target_kind(m)) for n, m in converted.items()]
    targets = policy_targets(model, policy)
    if not targets:
        raise ValueError(f"export: the model has no nn.Linear or fused MoE experts outside {policy.all_skip_patterns}")
    return targets


def _parts(param: torch.Tensor, qualified: str, global_encode_scale: torch.Tensor | None = None,
           block_scaling: str = "6") -> NVFP4Parts:
    """NVFP4 parts of a weight: a packed one as it is, a master through the recipe (with its
    sibling group's global scale when it has one, and its policy's block scaling)."""
    if isinstance(param, NVFP4Tensor):
        if param.transposed:
            raise NotImplementedError(f"{qualified}: transposed packed weights are not exported")
        return param.parts
    check_quantizable(param, qualified)
    check_finite(param, qualified)
    return nvfp4_quantize(param.detach(), None, global_encode_scale, block_scaling, check_values=False)  # from checked masters


def _block_scaling(module: nn.Module, policy: QuadsPolicy) -> str:
    """The block scaling a target's weights are quantized with: its own policy's (a quads
    module), else ``policy``'s (a plain model)."""
    own = getattr(module, "quads_policy", None)
    return (own or policy).weight_block_scaling


def _group_scales(targets: list[ConversionTarget], policy: QuadsPolicy, converted: bool) -> dict[str, torch.Tensor]:
    """``weight name -> S_enc`` of the master weights quantized with a sibling group's global
    scale: a trainer's groups (``quads_scale_group``), or, for a plain model, the groups of
    ``policy`` (:mod:`quads.policies.scale_groups`). Packed rollout weights carry theirs."""
    groups = []
    if converted:
        seen = set()
        for _, module, _ in targets:
            group = getattr(module, "quads_scale_group", None)
            if group is not None and id(group) not in seen and not isinstance(module.weight, NVFP4Tensor):
                seen.add(id(group))
                groups.append(group)
        names = {id(m): n for n, m, _ in targets}
        return {f"{names[id(m)]}.weight": scale for g in groups for scale in [g.encode_scale()] for m in g.members}
    if policy.weight_global_scale != "group":
        return {}
    modules = {n: m for n, m, kind in targets if kind == "linear"}
    out = {}
    for names in sibling_groups(modules):
        for n in names:
            check_quantizable(modules[n].weight, f"{n}.weight")
            check_finite(modules[n].weight, f"{n}.weight")
        scale = shared_global_encode_scale((modules[n].weight.detach() for n in names), policy.weight_block_scaling)
        out.update({f"{n}.weight": scale for n in names})
    return out


def _quantize_targets(targets: list[ConversionTarget], scales: dict[str, torch.Tensor], policy: QuadsPolicy
                      ) -> tuple[dict[str, NVFP4Parts], dict[str, torch.dtype]]:
    """``param name -> parts`` and ``-> dtype`` (of the forward weight) for every target weight."""
    out, dtypes = {}, {}
    for name, module, kind in targets:
        if kind == "experts" and (getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True)):
            raise NotImplementedError(f"{name}: only concatenated, untransposed fused experts are exported")
        for pname in _WEIGHTS[kind]:
            qualified = f"{name}.{pname}" if name else pname
            param = getattr(module, pname)
            out[qualified] = _parts(param, qualified, scales.get(qualified), _block_scaling(module, policy))
            dtypes[qualified] = param.orig_dtype if isinstance(param, NVFP4Tensor) else param.dtype
    return out, dtypes


def _fused_groups(targets: list[ConversionTarget]) -> list[list[str]]:
    """Weight names of the linear targets vLLM fuses (q/k/v, gate/up under one parent)."""
    linears = {name for name, _, kind in targets if kind == "linear"}
    groups = []
    parents = {n.rpartition(".")[0] for n in linears}
    for parent in sorted(parents):
        for siblings in FUSED_SIBLINGS:
            names = [f"{parent}.{s}" if parent else s for s in siblings]
            present = [n for n in names if n in linears]
            if present and len(present) != len(names):
                raise ValueError(
                    f"export: {present} are quantized but {sorted(set(names) - set(present))} are not; vLLM fuses "
                    "them into one layer, which must be quantized or excluded as a whole"
                )
            if present:
                groups.append([f"{n}.weight" for n in names])
    return groups


def _share_group_scales(
    parts: dict[str, NVFP4Parts], dtypes: dict[str, torch.dtype], groups: list[list[str]],
    block_scalings: dict[str, str],
) -> dict[str, dict[str, float]]:
    """Re-quantize group members to the group's smallest ``S_enc`` (with their block scaling);
    returns their weight errors against the trainer's forward weight (the dequantized weight in
    the master's dtype)."""
    errors = {}
    for group in groups:
        shared = min(parts[n].global_encode_scale for n in group)
        for name in group:
            old = parts[name]
            if torch.equal(old.global_encode_scale, shared):
                continue
            forward = nvfp4_dequantize(*old, dtype=dtypes[name])
            new = nvfp4_quantize(forward, global_encode_scale=shared, block_scaling=block_scalings[name],
                                 check_values=False)
            diff = (nvfp4_dequantize(*new, dtype=dtypes[name]).float() - forward.float()).abs()
            errors[name] = {
                "max_abs_error": diff.max().item(),
                "rel_error": (diff.norm() / forward.float().norm().clamp_min(1e-30)).item(),
                "changed_fraction": (diff > 0).float().mean().item(),
            }
            parts[name] = new
    return errors


# ---------------------------------------------------------------------------------------------
# Checkpoint names (transformers' save_pretrained names, via its own weight conversion)
# ---------------------------------------------------------------------------------------------


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without tied duplicates (the first name of a storage wins)."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape)) if not isinstance(t, NVFP4Tensor) else id(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _revert(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state) if state else {}


def _row_sources(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, torch.Tensor]]:
    """``checkpoint name -> (param name, row ids)`` for the target weights.

    Each weight goes through transformers' save-time conversion as a column of its row ids
    (rows = all dims but K), so whatever renaming, splitting or per-expert unbinding that
    conversion does, every checkpoint tensor says which rows of which weight it holds.
    """
    tags, offsets, start = {}, {}, 0
    for name, shape in shapes.items():
        rows = int(torch.Size(shape[:-1]).numel())
        tags[name] = torch.arange(start, start + rows, dtype=torch.float64).reshape(*shape[:-1], 1)
        offsets[name] = (start, start + rows)
        start += rows
    out = {}
    for ckpt, tag in _revert(model, tags).items():
        ids = tag.reshape(-1).to(torch.int64)
        owner = [n for n, (a, b) in offsets.items() if a <= int(ids[0]) < b]
        if len(owner) != 1 or not bool(((ids >= offsets[owner[0]][0]) & (ids < offsets[owner[0]][1])).all()):
            raise NotImplementedError(f"export: checkpoint tensor {ckpt} mixes rows of several weights")
        out[ckpt] = (owner[0], ids - offsets[owner[0]][0])
    return out


def _slice_rows(parts: NVFP4Parts, rows: torch.Tensor, ckpt: str) -> NVFP4Parts:
    """The 2-D parts of ``rows`` (flat row ids over all dims but K), one global scale."""
    q = parts.qdata.reshape(-1, parts.qdata.shape[-1])[rows]
    s = parts.scale.reshape(-1, parts.scale.shape[-1])[rows]
    gs = parts.global_encode_scale
    if gs.dim() == 0:
        return NVFP4Parts(q, s, gs)
    per_expert = parts.qdata.shape[1]
    experts = torch.unique(rows // per_expert)
    if experts.numel() != 1:
        raise NotImplementedError(f"export: checkpoint tensor {ckpt} spans several experts")
    return NVFP4Parts(q, s, gs[int(experts[0])].reshape(()))


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _quant_configs(quant_algo: str, exclude: list[str]) -> tuple[dict, dict]:
    """(``config.json``'s ``quantization_config``, ``hf_quant_config.json``)."""
    import quads  # the package is initialised whenever this module is imported

    producer = {"name": "quads", "version": quads.__version__}
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    acts = dict(weights) if quant_algo == "NVFP4" else None
    in_config = {
        "quant_method": "modelopt",
        "quant_algo": quant_algo,
        "group_size": 16,
        "ignore": exclude,
        "config_groups": {"group_0": {"weights": weights, "input_activations": acts, "targets": ["Linear"]}},
        "producer": producer,
    }
    legacy = {
        "producer": producer,
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude},
    }
    return in_config, legacy


def _write_shards(tmp: Path, tensors: dict[str, torch.Tensor], exact: dict[str, str], max_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for file, shard in zip(files, shards):
        meta = {"format": "pt"}
        mine = {k: v for k, v in exact.items() if k in shard}
        if mine:
            meta[ENCODE_SCALE_KEY] = json.dumps(mine)
        with atomic_path(tmp / file, what="export") as part:
            save_file(shard, str(part), metadata=meta)
        weight_map.update({k: file for k in shard})
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_atomically(tmp / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                      indent=2), what="export")
        files.append(INDEX_FILE)
    return files


def check_out_dir(out_dir: Path) -> None:
    """Refuse an existing non-empty ``out_dir`` (an export never overwrites files) and a symlink."""
    if out_dir.is_symlink():
        raise FileExistsError(f"export: {out_dir} is a symbolic link; give a real new directory")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"export: {out_dir} exists and is not an empty directory; choose a new --out")


_TEMP_TAG = "quads-export"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process (or not ours to judge): leave its directory alone
    return True


def stale_temp_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories that killed exports to ``out_dir`` left beside it.

    An export writes into ``.<out>.quads-export-<pid>.<random>`` and renames it into place; a
    SIGTERM or SIGKILL during the write leaves it behind. Those whose process is gone are
    removed here (each removal is warned about); the directories of exports still running
    are returned (and left alone).
    """
    out_dir = Path(out_dir)
    parent, live = out_dir.absolute().parent, []
    if not parent.is_dir():
        return live
    for path in parent.glob(f".{glob.escape(out_dir.name)}.{_TEMP_TAG}-*.*"):
        pid = path.name[len(f".{out_dir.name}.{_TEMP_TAG}-"):].split(".", 1)[0]
        if not path.is_dir() or path.is_symlink() or not pid.isdigit():
            continue
        if _pid_alive(int(pid)):
            live.append(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
            warnings.warn(f"export: removed {path}, left by an export (pid {pid}) that did not finish", stacklevel=2)
    return live


def _temp_dir_beside(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stale_temp_dirs(out_dir)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{_TEMP_TAG}-{os.getpid()}.", dir=out_dir.parent))


def _check_fits(parts: dict[str, NVFP4Parts], rest: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Refuse (naming the tensors) weights that would be Inf in the checkpoint's dtype: dense ones
    cast to it, quantized ones dequantized in it (bounded from their scales)."""
    check_fits_dtype([(k, v, dtype) for k, v in rest.items() if v.is_floating_point()],
                     f"export (dtype {str(dtype).removeprefix('torch.')}; nothing was written)")
    check_dequantized_range([(k, p, dtype) for k, p in parts.items()],
                            f"export (dtype {str(dtype).removeprefix('torch.')}; nothing was written)")


def _checksums(tmp: Path) -> dict[str, str]:
    """``sha256`` of every file written into ``tmp`` (relative names), the report excepted."""
    return {str(f.relative_to(tmp)): file_sha256(f) for f in sorted(tmp.rglob("*"))
            if f.is_file() and f.name != EXPORT_REPORT}


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` to ``out_dir`` (absent or empty); FileExistsError if another
    process filled ``out_dir`` meanwhile (its checkpoint is left as it is)."""
    taken = FileExistsError(f"export: {out_dir} was created by another process (another export to the same --out?) "
                            "while this export ran; it is left as it is and this export is discarded")
    try:
        out_dir.rmdir()  # empty (checked before the work), or gone
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise taken from None
        raise
    try:
        os.replace(tmp, out_dir)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise taken from None
        raise


def _rest_dtype(dtype: str, dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The dtype of the tensors that are not quantized (see the module doc)."""
    if dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if DTYPES[dtype] is not None:
        return DTYPES[dtype]
    found = sorted(set(dtypes.values()), key=str)
    if len(found) != 1:
        raise ValueError(
            f"export: dtype='auto' needs one master dtype, the quantized weights have {[str(d) for d in found]}; "
            "pass dtype='bfloat16', 'float16' or 'float32'"
        )
    return torch.bfloat16 if found[0] == torch.float32 else found[0]  # float32 masters train under BF16 autocast


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------


def _input_scales(amax: dict, ckpt_sources: dict[str, tuple[str, torch.Tensor]], shapes) -> dict[str, torch.Tensor]:
    """``X.input_scale`` (decode scale of the calibrated amax) for every NVFP4 checkpoint weight."""
    out = {}
    for ckpt, (param, rows) in ckpt_sources.items():
        module = param.rpartition(".")[0]
        stat = amax[module]
        if isinstance(stat, ExpertsAmax):
            per_expert = shapes[param][1]
            e = int(rows[0]) // per_expert
            value = (stat.gate_up if param.endswith("gate_up_proj") else stat.down)[e]
        else:
            value = stat
        out[f"{ckpt.removesuffix('.weight')}.input_scale"] = decode_scale(global_encode_scale_from_amax(value.reshape(())))
    return out


def _excluded(model: nn.Module, targets: list[ConversionTarget]) -> list[str]:
    """Checkpoint names of the linear-like modules left in high precision (``lm_head``, routers,
    skipped linears; not embeddings), found like the weights' names (:func:`_row_sources`), and
    of the fused experts modules left in high precision: the prefix their per-expert checkpoint
    tensors share (``...experts.{e}.gate_proj`` -> ``...experts``)."""
    target_modules = {id(m) for _, m, _ in targets}
    kept, experts = {}, {}
    for name, module in model.named_modules():
        if id(module) in target_modules or not name:
            continue
        if target_kind(module) == "experts":
            experts.update({f"{name}.{p}": tuple(getattr(module, p).shape) for p in _WEIGHTS["experts"]})
            continue
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() == 2:
            kept[f"{name}.weight"] = tuple(weight.shape)
    names = {ckpt.removesuffix(".weight") for ckpt in _row_sources(model, kept)}
    for ckpt in _row_sources(model, experts) if experts else ():
        module = re.match(r"^(.*)\.\d+\.[^.]+$", ckpt.removesuffix(".weight"))
        if module is None:
            raise NotImplementedError(f"export: the fused experts tensor {ckpt} has no per-expert checkpoint name")
        names.add(module.group(1))
    return sorted(names)


def export_modelopt(
    model: nn.Module,
    out_dir: str | os.PathLike,
    format: str = "w4a16",
    *,
    calibration: Iterable[dict | torch.Tensor] | None = None,
    fused_scales: str = "shared",
    tokenizer=None,
    policy: QuadsPolicy | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str = "auto",
) -> ExportReport:
    """Write ``model`` to ``out_dir`` as a ModelOpt NVFP4 checkpoint (see the module doc).

    Args:
        model: a transformers causal LM: BF16 masters, or the QUADS trainer (or rollout) model.
        out_dir: a new (or empty) directory.
        format: ``"w4a16"`` or ``"nvfp4"`` (W4A4; needs ``calibration``).
        calibration: model inputs (dicts of kwargs or ``input_ids`` tensors) whose activations
            set the static ``input_scale`` of the ``"nvfp4"`` format.
        fused_scales: ``"shared"`` (one global scale per vLLM fused layer) or ``"separate"``.
        tokenizer: saved beside the weights when given.
        policy: which modules a plain model's export quantizes, its ``weight_global_scale``
            (default ``QuadsPolicy("trainer")``: one global scale per sibling group) and its
            ``weight_block_scaling`` (a quads model's modules use their own policy's).
        max_shard_bytes: safetensors shard size limit.
        dtype: of the tensors that are not quantized: ``"auto"`` (the masters' dtype; BF16 for float32 masters) or
            ``"bfloat16"`` / ``"float16"`` / ``"float32"``.
    """
    if format not in FORMATS:
        raise ValueError(f"export: format must be one of {tuple(FORMATS)}, got {format!r}")
    if fused_scales not in FUSED_SCALES:
        raise ValueError(f"export: fused_scales must be one of {FUSED_SCALES}, got {fused_scales!r}")
    if format == "nvfp4" and calibration is None:
        raise ValueError("export: format 'nvfp4' (W4A4) needs calibration batches for its static input_scale")
    if format == "w4a16" and calibration is not None:
        raise ValueError("export: format 'w4a16' has no activation scales; drop the calibration batches")
    if dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    quant_algo = FORMATS[format]
    policy = policy or QuadsPolicy(side="trainer")
    out_dir = Path(out_dir)
    check_out_dir(out_dir)

    targets = _targets(model, policy)
    parts, dtypes = _quantize_targets(targets, _group_scales(targets, policy, bool(quantized_modules(model))), policy)
    rest_dtype = _rest_dtype(dtype, dtypes)
    groups = _fused_groups(targets)
    requantized, mismatched = {}, []
    if fused_scales == "shared":
        block_scalings = {f"{n}.{p}" if n else p: _block_scaling(m, policy) for n, m, kind in targets for p in _WEIGHTS[kind]}
        requantized = _share_group_scales(parts, dtypes, groups, block_scalings)
    else:
        mismatched = [g for g in groups if len({float(parts[n].global_encode_scale) for n in g}) > 1]
        if mismatched:
            warnings.warn(
                f"export: {len(mismatched)} fused groups (e.g. {mismatched[0]}) keep different global scales; "
                "vLLM's modelopt_fp4 uses the largest weight_scale_2 for every shard of a fused layer"
            )
    amax = activation_amax(model, targets, calibration) if calibration is not None else None

    shapes = {name: tuple(p.qdata.shape[:-1]) + (p.qdata.shape[-1] * 2,) for name, p in parts.items()}
    sources = _row_sources(model, shapes)
    tensors: dict[str, torch.Tensor] = {}
    encode_scales: dict[str, torch.Tensor] = {}
    exact = 0
    for ckpt, (param, rows) in sources.items():
        if not ckpt.endswith(".weight"):
            raise NotImplementedError(f"export: checkpoint tensor {ckpt} of {param} is not a '.weight'")
        piece = _slice_rows(parts[param], rows, ckpt)
        name = ckpt.removesuffix(".weight")
        tensors.update(modelopt_weight_tensors(name, piece))
        encode_scales[f"{name}.weight_scale_2"] = piece.global_encode_scale
        exact += param not in requantized
    if amax is not None:
        tensors.update(_input_scales(amax, sources, shapes))
    target_params = {f"{n}.{p}" if n else p for n, _, kind in targets for p in _WEIGHTS[kind]}
    rest = _revert(model, {k: v for k, v in _state(model).items() if k not in target_params})
    clash = set(rest) & set(tensors)
    if clash:
        raise ValueError(f"export: checkpoint names {sorted(clash)[:3]} are produced twice")
    exclude = _excluded(model, targets)
    _check_fits(parts, rest, rest_dtype)
    tensors.update({k: (v.to(rest_dtype) if v.is_floating_point() else v).detach().cpu() for k, v in rest.items()})
    tensors = {k: v.detach().cpu() for k, v in tensors.items()}

    check_out_dir(out_dir)
    tmp = _temp_dir_beside(out_dir)
    try:
        files = _write_shards(tmp, tensors, exact_encode_scales(tensors, encode_scales), max_shard_bytes)
        in_config, legacy = _quant_configs(quant_algo, exclude)
        config = model.config.to_dict()
        config["quantization_config"] = in_config
        config["dtype"] = str(rest_dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
        write_atomically(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n", what="export")
        write_atomically(tmp / QUANT_CONFIG_FILE, json.dumps(legacy, indent=2) + "\n", what="export")
        files += ["config.json", QUANT_CONFIG_FILE]
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
            files.append("generation_config.json")
        if tokenizer is not None:
            files += [Path(f).name for f in tokenizer.save_pretrained(tmp)]
        report = ExportReport(format, quant_algo, len(sources), exact, requantized, mismatched, exclude,
                              sorted(set(files)), _checksums(tmp))
        write_atomically(tmp / EXPORT_REPORT, json.dumps(dataclasses.asdict(report), indent=2) + "\n", what="export")
        publish_modes(tmp)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
