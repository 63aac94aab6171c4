"""``QuadsHfQuantizer``: what transformers' ``from_pretrained`` does with a :class:`QuadsConfig`.

transformers loads the checkpoint as for a plain model; then, before the model is returned
(``_process_model_after_weight_loading``):

* a plain checkpoint with ``quantization_config=QuadsConfig(policy)``, or a quads *trainer*
  checkpoint (its BF16 masters): ``quads.quantize_(model, policy)``, the same model as a plain
  load followed by ``quantize_``, bit for bit;
* a quads *rollout* checkpoint (packed NVFP4 parts in one ``model.safetensors`` written by
  :func:`quads.tensor.save_safetensors`): the file is read with that function's checks (header
  and per-tensor CRC32, NVFP4 invariants), its names, shapes and dtypes matched against the
  model ``quantize_(model, policy)`` builds, then ``load_state_dict`` (the rollout's value
  checks: finite, no 16-bit overflow) writes the parts into it and every rollout module's
  :meth:`~quads.policies.modules.RolloutModule.quads_weights_changed` refreshes what its kernels
  read. transformers never holds the packed weights: the modules it would have filled are
  initialised and then overwritten, and their names are kept out of its missing/unexpected report.

Refused with one line naming the culprit, before the model is returned: another architecture
than the checkpoint's, a ``quantization_config`` asking for another policy (side, or any field)
than the checkpoint holds, a ``device_map`` over several devices or offloaded, a dtype quads does
not quantize, a rollout loaded in another dtype than it was packed from.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.nn as nn
from transformers.quantizers.base import HfQuantizer

from quads.integrations.transformers.config import PLAIN_LOAD_REFUSAL, QuadsConfig, policy_to_json
from quads.policies.modules import RolloutModule
from quads.policies.policy import QuadsPolicy
from quads.policies.quantize import quantize_
from quads.policies.walk import policy_targets
from quads.tensor.nvfp4_tensor import NVFP4Tensor
from quads.tensor.serialization import load_safetensors

__all__ = ["QuadsHfQuantizer", "load_rollout_checkpoint"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PART_SUFFIX = r"\.(qdata|scale|global_encode_scale)$"
_IGNORE_MISSING = "_keys_to_ignore_on_load_missing"
_IGNORE_UNEXPECTED = "_keys_to_ignore_on_load_unexpected"


def _requested_config():
    """The ``quantization_config`` argument of the ``from_pretrained`` call running on this
    thread (transformers keeps only the checkpoint's when both are given), or None."""
    from transformers.modeling_utils import PreTrainedModel

    code = PreTrainedModel.from_pretrained.__func__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals.get("quantization_config")
        frame = frame.f_back
    return None


def _check_request(stored: QuadsPolicy, where: str) -> None:
    """A ``QuadsConfig`` passed to ``from_pretrained`` of a quads checkpoint must ask for its policy."""
    asked = _requested_config()
    if not isinstance(asked, QuadsConfig) or asked.policy == stored:
        return
    mine, theirs = policy_to_json(stored), policy_to_json(asked.policy)
    field = next((k for k in mine if mine[k] != theirs[k]), "side")
    raise ValueError(f"{where}: the checkpoint holds a quads {stored.side} with {field}={mine[field]!r}, but "
                     f"quantization_config asks for {field}={theirs[field]!r}; load it without quantization_config "
                     "(or with its own policy)")


def _check_device_map(device_map) -> None:
    """One device (None, a device, or a map to one device); quads converts whole modules in place."""
    if device_map is None or isinstance(device_map, (int, torch.device)):
        return
    if isinstance(device_map, str):
        if device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"QuadsConfig: device_map={device_map!r} is not supported: quads loads the model onto one "
                             "device (device_map=None, or a device such as 'cuda:0')")
        return
    if isinstance(device_map, dict):
        devices = {str(d) for d in device_map.values()}
        if len(devices) > 1 or devices & {"disk", "meta"}:
            raise ValueError(f"QuadsConfig: device_map over {sorted(devices)} is not supported: quads loads the model "
                             "onto one device, without offloading")
        return
    raise TypeError(f"QuadsConfig: device_map must be None, a device or a dict, got {type(device_map).__name__}")


def _where(model: nn.Module) -> str:
    return str(getattr(model.config, "name_or_path", "") or type(model).__name__)


def _check_architecture(model: nn.Module) -> None:
    recorded = list(getattr(model.config, "architectures", None) or [])
    if recorded and type(model).__name__ not in recorded:
        raise ValueError(f"{_where(model)}: a quads checkpoint of {recorded[0]} cannot load into {type(model).__name__}; "
                         f"load it with {recorded[0]} (or AutoModelForCausalLM)")


def _check_state(path: str, state: dict, model: nn.Module) -> None:
    """Names, kinds (packed or dense), shapes and dtypes of ``state`` against ``model``'s."""
    mine = model.state_dict()
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    if missing or unexpected:
        what = (f"has no {missing[0]!r}" if missing else f"holds {unexpected[0]!r}, which the model has not")
        more = len(missing) + len(unexpected) - 1
        raise ValueError(f"{path}: the checkpoint {what}{f' ({more} more names differ)' if more else ''}: it was saved "
                         f"from another architecture or policy than {type(model).__name__} with its policy")
    for key, want in mine.items():
        have = state[key]
        if isinstance(have, NVFP4Tensor) != isinstance(want, NVFP4Tensor):
            kind = "packed" if isinstance(have, NVFP4Tensor) else "dense"
            raise ValueError(f"{path}: {key} is {kind} in the checkpoint but not in the model: another policy")
        if tuple(have.shape) != tuple(want.shape):
            raise ValueError(f"{path}: {key} has shape {tuple(have.shape)}, the model's {tuple(want.shape)}")
        if have.dtype != want.dtype:
            raise ValueError(f"{path}: {key} is {have.dtype} in the checkpoint, {want.dtype} in the model; load it "
                             f"with dtype={have.dtype} (or dtype='auto')")


def load_rollout_checkpoint(model: nn.Module, policy: QuadsPolicy, files: list[str]) -> nn.Module:
    """``model`` (loaded by transformers, still plain) as the quads rollout the checkpoint holds:
    the file checked, ``quantize_``, the names matched, ``load_state_dict``, the kernels refreshed."""
    if len(files) != 1 or Path(files[0]).suffix != ".safetensors":
        raise ValueError(f"{_where(model)}: a quads rollout checkpoint is one model.safetensors written by "
                         f"save_pretrained, found {[Path(f).name for f in files]}")
    path = str(files[0])
    device = next(model.parameters()).device
    state = load_safetensors(path, device)  # header and per-tensor CRC32, NVFP4 invariants (on the CPU), before any work
    quantize_(model, policy)
    _check_state(path, state, model)
    model.load_state_dict(state, strict=True)  # RolloutLoadCheck: every value checked before any is written
    for module in model.modules():
        if isinstance(module, RolloutModule):
            module.quads_weights_changed()  # the refresh every write of packed weights goes through
    return model


class QuadsHfQuantizer(HfQuantizer):
    """transformers' quantizer for ``quant_method="quads"`` (module doc)."""

    requires_calibration = False

    def __init__(self, quantization_config: QuadsConfig, **kwargs):
        if not isinstance(quantization_config, QuadsConfig):
            raise TypeError(f"QuadsHfQuantizer takes a QuadsConfig, got {type(quantization_config).__name__}")
        super().__init__(quantization_config, **kwargs)
        self.checkpoint_files: list[str] | None = None

    @property
    def policy(self) -> QuadsPolicy:
        return self.quantization_config.policy

    def validate_environment(self, device_map=None, **kwargs):
        _check_device_map(device_map)
        if self.pre_quantized:
            _check_request(self.policy, "from_pretrained")

    def update_tp_plan(self, config):
        """A hook transformers runs on the config after it made the quantizer and before it
        resolves the weight files: a rollout checkpoint's ``transformers_weights``
        (:data:`PLAIN_LOAD_REFUSAL`, what makes a load without quads fail) is removed there, so
        transformers reads ``model.safetensors`` as usual."""
        config = super().update_tp_plan(config)
        if getattr(config, "transformers_weights", None) == PLAIN_LOAD_REFUSAL:
            del config.transformers_weights
        return config

    def update_dtype(self, dtype):
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"QuadsConfig: dtype={dtype} is not supported: quads quantizes bfloat16, float16 and "
                             "float32 models")
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not self.pre_quantized:
            return model
        _check_architecture(model)
        self.checkpoint_files = list(checkpoint_files or [])
        if self.policy.side == "rollout":  # the packed weights are read by quads, not by transformers
            names = [f"{t.name}.{p}" for t in policy_targets(model, self.policy)
                     for p in (("weight",) if t.kind == "linear" else ("gate_up_proj", "down_proj"))]
            missing = set(getattr(model, _IGNORE_MISSING, None) or ())
            unexpected = set(getattr(model, _IGNORE_UNEXPECTED, None) or ())
            setattr(model, _IGNORE_MISSING, missing | {f"^{re.escape(n)}$" for n in names})
            setattr(model, _IGNORE_UNEXPECTED, unexpected | {_PART_SUFFIX})
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for attr in (_IGNORE_MISSING, _IGNORE_UNEXPECTED):
            model.__dict__.pop(attr, None)
        if self.pre_quantized and self.policy.side == "rollout":
            return load_rollout_checkpoint(model, self.policy, self.checkpoint_files or [])
        quantize_(model, self.policy)
        return model

    def get_state_dict_and_metadata(self, model):
        """transformers' writer gets no tensors of a rollout (quads' ``save_pretrained`` writes its
        file); a trainer's masters are plain parameters, written by transformers as usual."""
        if self.policy.side == "rollout":
            return {}, {}
        return None, {}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return self.policy.side == "trainer"

    @property
    def is_qat_trainable(self) -> bool:
        return self.policy.side == "trainer"
