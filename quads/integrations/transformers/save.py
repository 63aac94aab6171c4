"""``save_pretrained`` of a quads model (the handler behind
:class:`~quads.policies.quantize.QuadsSavePretrained`).

transformers' own ``save_pretrained`` runs with the model's policy as its
``quantization_config`` (:class:`QuadsConfig`), into a fresh
temporary directory beside ``save_directory``; it writes ``config.json`` (with the policy),
the generation config and, for a trainer, the BF16 masters as usual. A rollout's packed weights
are written by :func:`quads.tensor.save_safetensors` (one ``model.safetensors``: the parts under
the model's own names, header and per-tensor CRC32, ties stored once). Each file is then renamed
into ``save_directory`` (atomic per file; a symlink planted at a file's name is replaced, never
written through), and weight files of an earlier save that this one does not write are removed.
A rollout's ``config.json`` gets ``transformers_weights`` =
:data:`~quads.integrations.transformers.config.PLAIN_LOAD_REFUSAL`, so that a load without
quads fails in one line instead of initialising the packed weights randomly.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch.nn as nn

from quads.integrations.transformers.config import PLAIN_LOAD_REFUSAL, QuadsConfig
from quads.policies.modules import QuadsModule
from quads.policies.policy import QuadsPolicy
from quads.tensor.files import existing_parent, move_files_into, publish_modes, write_atomically
from quads.tensor.serialization import save_safetensors

__all__ = ["save_pretrained", "model_policy"]

_WEIGHTS = "model.safetensors"
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")
_MISSING = object()


def _refuse_plain_loads(config_file: Path) -> None:
    """``transformers_weights`` = :data:`PLAIN_LOAD_REFUSAL` in a rollout's ``config.json``
    (transformers' own writer drops that key, so it is added after it wrote the file)."""
    config = json.loads(config_file.read_text())
    config["transformers_weights"] = PLAIN_LOAD_REFUSAL
    write_atomically(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n", what="save_pretrained")


def model_policy(model: nn.Module) -> QuadsPolicy:
    """The one policy of ``model``'s quads modules (a checkpoint records one)."""
    policies = list(dict.fromkeys(m.quads_policy for m in model.modules() if isinstance(m, QuadsModule)))
    if not policies:
        raise ValueError(f"save_pretrained: {type(model).__name__} holds no quads module")
    if len(policies) > 1:
        raise ValueError(f"save_pretrained: {type(model).__name__} holds modules of {len(policies)} quads policies; "
                         "a checkpoint records one (convert the model with one policy)")
    return policies[0]


@contextlib.contextmanager
def _as_quads_checkpoint(model: nn.Module, policy: QuadsPolicy):
    """For the save: ``model.config.quantization_config`` is the policy's :class:`QuadsConfig`
    (written into ``config.json``) and ``model.hf_quantizer`` None (a quantizer's
    ``get_state_dict_and_metadata`` would replace a ``state_dict`` the caller passes); both put
    back afterwards (a ``TorchAoConfig`` model keeps its own)."""
    config = model.config
    held = config.__dict__.get("quantization_config", _MISSING), model.__dict__.get("hf_quantizer", _MISSING)
    config.quantization_config = QuadsConfig(policy)
    model.hf_quantizer = None
    try:
        yield
    finally:
        for owner, name, value in ((config, "quantization_config", held[0]), (model, "hf_quantizer", held[1])):
            if value is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, value)


def _remove_stale_weights(target: Path, written: list[str]) -> None:
    """Weight files (shards, indexes) of an earlier save into ``target`` that this one did not write."""
    for old in target.iterdir():
        if old.name not in written and _WEIGHT_FILE.fullmatch(old.name) and (old.is_file() or old.is_symlink()):
            old.unlink()


def save_pretrained(model: nn.Module, save, save_directory, *args, is_main_process: bool = True,
                    state_dict: dict | None = None, **kwargs) -> None:
    """Write ``model`` (a quads trainer or rollout) to ``save_directory`` (module doc); ``save``
    is the model's own (transformers') ``save_pretrained``."""
    policy = model_policy(model)
    if args:
        raise TypeError("save_pretrained of a quads model takes save_directory and keyword arguments only")
    if kwargs.get("push_to_hub"):
        raise ValueError("save_pretrained of a quads model does not push to the Hub: save, then upload the folder")
    if policy.side == "rollout":
        if state_dict is not None:
            raise ValueError("save_pretrained of a quads rollout writes the model's own packed state: "
                             "state_dict= is not supported")
        if kwargs:
            raise TypeError(f"save_pretrained of a quads rollout does not take {sorted(kwargs)[0]}= "
                            "(one model.safetensors is written)")
        if policy.residual_selection == "static":
            raise ValueError("save_pretrained: a rollout with residual_selection='static' keeps its calibrated channel "
                             "masks outside the state dict; save the trainer (or calibrate again after loading)")
    if not is_main_process:
        return
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"save_pretrained: {str(target)!r} exists and is not a directory")
    parent = existing_parent(target, "save_pretrained")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
    try:
        with _as_quads_checkpoint(model, policy):  # a rollout's tensors: none from transformers, quads' file below
            save(staging, state_dict={} if policy.side == "rollout" else state_dict, **kwargs)
        if policy.side == "rollout":
            save_safetensors(model.state_dict(), staging / _WEIGHTS)
            _refuse_plain_loads(staging / "config.json")
        publish_modes(staging)
        target.mkdir(exist_ok=True)
        _remove_stale_weights(target, move_files_into(staging, target))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
