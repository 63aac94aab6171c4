"""``QuadsGRPOTrainer``: TRL's GRPOTrainer with a QUADS trainer policy and an NVFP4 rollout engine."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from quads.diagnostics.mismatch_alarm import DEFAULT_ALARM_FACTOR, MismatchAlarm
from quads.diagnostics.precision_probe import precision_probe, probe_warning
from quads.diagnostics.scoring import score_teacher_forced
from quads.integrations.trl.config import resolve_trainer_options
from quads.integrations.trl.engine import QuadsRolloutEngine
from quads.integrations.trl.metrics import MismatchLogging
from quads.policies import PolicyPreset, build_rollout_model, get_preset, prepare_trainer_, sync_weights_
from quads.policies.presets import PolicyPair, weight_only_rollout
from quads.policies.quantize import quantized_modules
from quads.policies.routing import RoutingCheck, routing_problem
from quads.policies.autocast_experts import experts_configs

__all__ = ["TESTED_TRL_VERSION", "QuadsGRPOTrainer"]

TESTED_TRL_VERSION = "1.16.0"


try:  # TRL is an optional dependency of quads (extra "trl")
    import trl as _trl
    from trl import GRPOTrainer as _GRPOTrainer
except ImportError as _err:  # pragma: no cover - exercised only without trl
    _trl = None
    _GRPOTrainer = object
    _TRL_IMPORT_ERROR = _err
else:
    _TRL_IMPORT_ERROR = None

ROLLOUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MISSING = object()
#: the trainer's options without a QuadsGRPOConfig (QuadsGRPOConfig's field defaults are the same)
OPTION_DEFAULTS = {"quads_policy": "quads", "rollout_dtype": torch.bfloat16, "decompose_mismatch": False,
                   "graphed_decode": None, "rollout_corr_metrics": False, "routing_replay": False,
                   "mismatch_alarm": DEFAULT_ALARM_FACTOR}


def _model_snapshot(model: nn.Module):
    """A function restoring ``model`` to its current state of classes and attributes.

    The trainer policy converts by swapping classes and adding attributes (no parameter is
    replaced) and hooks the parents of sibling groups (``ScaleGroup.attach``); TRL's ``__init__``
    adds attributes to the root (``model_tags``, accelerate's autocast ``forward``) and sets
    ``config.use_cache = False``; ``prepare_trainer_`` switches the experts implementation. So
    this undoes a ``prepare_trainer_(model, preset)`` followed by a failed ``GRPOTrainer.__init__``
    exactly.
    """
    saved = [(m, type(m), set(vars(m))) for m in model.modules()]
    experts = [(cfg, cfg._experts_implementation_internal) for _, cfg in experts_configs(model).values()]
    config = getattr(model, "config", None)
    use_cache = vars(config).get("use_cache", _MISSING) if config is not None else _MISSING

    def undo() -> None:
        for module, cls, attrs in saved:
            if type(module) is not cls or module is model:
                group = vars(module).get("quads_scale_group")
                if group is not None and "quads_scale_group" not in attrs:
                    group.detach()  # the hooks on the members' parent
                module.__class__ = cls
                for attr in set(vars(module)) - attrs:
                    delattr(module, attr)
        if use_cache is not _MISSING:
            config.use_cache = use_cache
        for cfg, impl in experts:
            cfg._experts_implementation_internal = impl

    return undo


def _check_options(args, rollout_dtype, flags: dict[str, object], graphed_decode, peft_config) -> None:
    """Refuse bad arguments in one line, before anything touches the caller's model."""
    if args is not None and getattr(args, "use_vllm", False):
        raise ValueError(
            "QuadsGRPOTrainer is its own rollout engine (transformers generate on the quads rollout model): set "
            "GRPOConfig(use_vllm=False), or roll out with vLLM through "
            "quads.integrations.vllm.trl_colocate.QuadsVLLMGRPOTrainer (use_vllm=True, vllm_mode='colocate')"
        )
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"QuadsGRPOTrainer(rollout_dtype=...) must be one of {', '.join(map(str, ROLLOUT_DTYPES))}, "
                         f"got {rollout_dtype!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"QuadsGRPOTrainer({name}=...) must be True or False, got {value!r}")
    if graphed_decode is not None and not isinstance(graphed_decode, bool):
        raise TypeError(f"QuadsGRPOTrainer(graphed_decode=...) must be None, True or False, got {graphed_decode!r}")
    if peft_config is not None:
        raise NotImplementedError("QuadsGRPOTrainer does not support PEFT models yet (peft_config=...)")


def _refuse_peft_model(model) -> None:
    if hasattr(model, "peft_config"):
        raise NotImplementedError("QuadsGRPOTrainer does not support PEFT models yet")


class QuadsGRPOTrainer(MismatchLogging, _GRPOTrainer):
    """``trl.GRPOTrainer`` with a QUADS trainer policy and an NVFP4 rollout engine.

    Args (besides ``GRPOTrainer``'s):
        quads_policy: what each side runs: a preset name from :data:`POLICY_PRESETS` (``"quads"``
            default), a :class:`PolicyPreset`, or a ``(trainer, rollout)`` pair of
            :class:`QuadsPolicy` (None: that side in BF16), e.g.
            ``(QuadsPolicy(side="trainer"), QuadsPolicy(side="rollout", residual_fraction=0.5))``.
        rollout_dtype: dtype of the rollout model (non-quantized parts and activations):
            ``torch.bfloat16`` (default), ``torch.float16`` or ``torch.float32``.
        decompose_mismatch: also log δ_num / δ_weight / δ_act each step (two extra scoring
            forwards over the completions).
        rollout_corr_metrics: also log verl's ``rollout_corr/*`` diagnostics under verl's names
            (:func:`quads.diagnostics.rollout_corr_metrics`); TRL's and quads' names are kept.
        routing_replay: rollout routing replay (R3): the trainer's scoring and loss forwards route
            each token by the experts the rollout recorded (also on with a preset whose
            ``routing_replay`` is set, e.g. ``"quads+r3"``). MoE models with supported routers only.

    On an MoE model with supported routers (:mod:`quads.policies.routing`) the rollout records
    each token's experts, the generation output carries them (``quads_routing``, sliced and
    shuffled with the batch) and the scoring forward that computes the old log-probs compares the
    trainer's own routing with them: ``sampling/quads/routing_flip_topk`` (share of recorded tokens
    whose top-k set differs, mean over MoE layers), ``routing_flip_topk_max`` and
    ``routing_flip_worst_layer``, ``routing_flip_top1``; with replay ``routing_replayed``.
    Dense models: no routing keys, no cost.
        mismatch_alarm: warn (one line, naming the worst decoder layer) when a step's mean gap
            exceeds this multiple of the median of the first 5 steps'; logs
            ``sampling/quads/alarm`` every step (:mod:`quads.diagnostics.mismatch_alarm`). None: off.

    ``args`` may be a :class:`~quads.integrations.trl.config.QuadsGRPOConfig`: its ``quads_*``
    fields give these options (a constructor argument that differs from one it sets: one-line error).
    ``args.use_vllm`` must be False (this class *is* the rollout engine; with vLLM use
    ``QuadsVLLMGRPOTrainer``). Every argument is checked before the model is touched. TRL's
    ``vllm_importance_sampling_*`` options keep their meaning and defaults
    (``sequence_mask``, clip max 3.0). Pass the trainer model as an instance (recommended:
    float32 masters with ``GRPOConfig(bf16=True)`` autocast) or a path; it is quantized in place
    with the preset's trainer policy unless it already carries quads layers, and converted back
    if TRL's ``__init__`` (or the rollout build) fails, so a retry works. A reference model
    (``beta > 0``) gets the same trainer policy. PEFT models are not supported.
    ``graphed_decode``: sample with the CUDA-graph decoder (None: on CUDA; see
    :class:`QuadsRolloutEngine`); False keeps ``generate``.
    """

    quads_routing: RoutingCheck | None = None
    _quads_routing_of_batch: torch.Tensor | None = None

    def __init__(
        self,
        model,
        reward_funcs,
        args=None,
        *pos,
        quads_policy: str | PolicyPreset | PolicyPair = _MISSING,
        rollout_dtype: torch.dtype = _MISSING,
        decompose_mismatch: bool = _MISSING,
        graphed_decode: bool | None = _MISSING,
        rollout_corr_metrics: bool = _MISSING,
        routing_replay: bool = _MISSING,
        mismatch_alarm: float | None = _MISSING,
        **kwargs,
    ):
        if _trl is None:
            raise ImportError("QuadsGRPOTrainer needs TRL: pip install 'quads-rl[trl]'") from _TRL_IMPORT_ERROR
        if _trl.__version__ != TESTED_TRL_VERSION:
            warnings.warn(
                f"quads.integrations.trl is tested with trl=={TESTED_TRL_VERSION}, found {_trl.__version__}; "
                "it hooks GRPOTrainer internals (vllm_generation, _generate_single_turn).",
                stacklevel=2,
            )
        options = resolve_trainer_options(args, {
            "quads_policy": quads_policy, "rollout_dtype": rollout_dtype, "decompose_mismatch": decompose_mismatch,
            "graphed_decode": graphed_decode, "rollout_corr_metrics": rollout_corr_metrics,
            "routing_replay": routing_replay, "mismatch_alarm": mismatch_alarm, "__missing__": _MISSING,
        }, OPTION_DEFAULTS)
        (quads_policy, rollout_dtype, decompose_mismatch, graphed_decode, rollout_corr_metrics, routing_replay,
         mismatch_alarm) = (options[k] for k in OPTION_DEFAULTS)
        flags = {"decompose_mismatch": decompose_mismatch, "rollout_corr_metrics": rollout_corr_metrics,
                 "routing_replay": routing_replay}
        _check_options(args, rollout_dtype, flags, graphed_decode, kwargs.get("peft_config"))
        self.quads_preset = get_preset(quads_policy)
        self.quads_alarm = MismatchAlarm(mismatch_alarm) if mismatch_alarm is not None else None
        self.quads_rollout_dtype = rollout_dtype
        self.quads_decompose = decompose_mismatch
        self.quads_rollout_corr = rollout_corr_metrics

        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
            model = AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
        _refuse_peft_model(model)
        multi_call = next((k for k in ("tools", "rollout_func") if kwargs.get(k)), None)
        self._quads_check_routing(model, routing_replay, multi_call)
        undo = _model_snapshot(model)
        self._quads_apply_trainer_policy(model)
        try:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)

            unwrapped = self.accelerator.unwrap_model(self.model)
            if self.ref_model is not None:
                self._quads_apply_trainer_policy(self.accelerator.unwrap_model(self.ref_model))

            rollout = build_rollout_model(unwrapped, self.quads_preset.rollout, dtype=rollout_dtype)
            tok = self._tokenizer
            self.quads_rollout = QuadsRolloutEngine(
                rollout,
                trainer_model=lambda: self.accelerator.unwrap_model(self.model),
                global_step=lambda: self.state.global_step,
                generation_config=self.generation_config,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                eos_token_ids=self.eos_token_ids,
                graphed=graphed_decode,
                record_routing=self.quads_routing_replay is not None,
            )
            self._quads_setup_routing(self.accelerator.unwrap_model(self.model))
            self._quads_precision_probe(args)
        except BaseException:
            routing = self.__dict__.get("quads_routing")
            if routing is not None:
                routing.remove()  # its hooks on the caller's model
            undo()  # TRL (or the rollout build) failed: the caller's model is as it was, a retry works
            raise
        # Hand the engine to TRL's external-engine code path (see use_vllm and the module doc).
        self.quads_engine = self.quads_rollout
        self.vllm_generation = self.quads_rollout
        self.vllm_mode = "quads"
        self._last_loaded_step = -1

        self._quads_probe_models: dict[str, nn.Module] | None = None

    def _quads_precision_probe(self, args) -> None:
        """Warn in one line when a module of the trainer computes in another dtype than its
        rollout twin under the trainer's autocast (:func:`quads.diagnostics.precision_probe`);
        one forward of a few tokens on each side, when autocast is the rollout's dtype."""
        autocast = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
        if autocast is None or autocast != self.quads_rollout_dtype:
            return
        line = probe_warning(precision_probe(self.accelerator.unwrap_model(self.model), self.rollout_model, autocast))
        if line:
            warnings.warn(line, stacklevel=3)

    # -- the engine TRL's vLLM code path runs ---------------------------------------------------

    #: what generates the completions: this trainer's engine (transformers on the quads rollout
    #: model, ``quads_engine``); no vLLM runs
    generation_engine = "quads"
    _quads_engine_calls = 0

    @property
    def use_vllm(self) -> bool:
        """False, as ``args.use_vllm``: no vLLM runs (``generation_engine`` is ``"quads"``).

        TRL reads this flag as "completions come from ``vllm_generation``, with their log-probs
        for the importance-sampling correction"; the quads engine is installed there, so while
        TRL's own generation and loss code runs (inside ``_prepare_inputs`` and ``compute_loss``)
        it reads True.
        """
        return self._quads_engine_calls > 0 or vars(self).get("_trl_use_vllm", False)

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:  # GRPOTrainer.__init__ copies args.use_vllm (False, checked)
        self._trl_use_vllm = bool(value)

    @contextlib.contextmanager
    def _quads_engine_path(self):
        ready = "quads_engine" in vars(self)
        self._quads_engine_calls += ready
        try:
            yield
        finally:
            self._quads_engine_calls -= ready

    def _prepare_inputs(self, generation_batch):
        with self._quads_engine_path():
            return super()._prepare_inputs(generation_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._quads_engine_path():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    # -- set-up helpers ------------------------------------------------------------------------

    def _quads_apply_trainer_policy(self, model: nn.Module) -> None:
        prepare_trainer_(model, self.quads_preset)  # quantized per the preset, experts in the autocast dtype

    @property
    def rollout_model(self) -> nn.Module:
        """The rollout model (quads rollout layers, or a plain BF16 copy for the ``bf16`` preset)."""
        return self.quads_rollout.model

    # -- checkpoints ---------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The masters of a checkpoint, read by transformers' own loader, strictly.

        ``Trainer`` resumes with ``load_state_dict(strict=False)`` of the saved file, and
        transformers 5 saves fused MoE experts under their per-expert checkpoint names, which
        that load skips without an error (the experts would resume from the initial weights).
        ``from_pretrained`` converts them back; the masters are then loaded strictly, in their
        own dtype, so a resumed run continues bit for bit. FSDP / DeepSpeed checkpoints keep
        ``Trainer``'s own loader.
        """
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        dtype = next(target.parameters()).dtype
        saved = type(target).from_pretrained(resume_from_checkpoint, dtype=dtype, local_files_only=True)
        target.load_state_dict(saved.state_dict(), strict=True)

    # -- metrics (MismatchLogging logs sampling/quads/* and rollout_corr/*) ----------------------

    def _generate_and_score_completions(self, inputs):
        self._quads_routing_of_batch = None
        if self.quads_routing is not None:
            self.quads_routing.release()  # the last step's rows: its backward is done
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if self.quads_routing is not None:
            self._quads_attach_routing(output, mode)
        seconds = self.quads_rollout.take_seconds()  # this generation's rollout phases
        self._quads_log(mode, {f"timing/quads/{phase}_s": s for phase, s in seconds.items()})
        return output

    def _quads_extra_metrics(self, output, rollout_lp, trainer_lp, mask) -> dict[str, float]:
        return self._decompose(output, rollout_lp, trainer_lp, mask) if self.quads_decompose else {}

    # -- routing agreement and replay (quads.policies.routing) ---------------------------------

    def _quads_check_routing(self, model: nn.Module, routing_replay: bool, multi_call: str | None = None) -> None:
        """Decide ``quads_routing_replay`` (None: not an MoE model with supported routers, no
        recording; else whether the trainer replays); refuse replay on such a model, in one line."""
        replay = routing_replay or self.quads_preset.routing_replay
        problem = routing_problem(model)
        if problem is None and multi_call:  # a batch's rollout is several engine calls: no one recording
            problem = f"{multi_call}= rolls a batch out in several engine calls, whose routing is not recorded as one"
        if problem is not None and replay:
            raise ValueError(f"QuadsGRPOTrainer(routing_replay=True): {problem}")
        self.quads_routing_replay = None if problem is not None else replay
        self.quads_routing: RoutingCheck | None = None

    def _quads_setup_routing(self, trainer_model: nn.Module) -> None:
        if self.quads_routing_replay is not None:
            self.quads_routing = RoutingCheck(trainer_model, replay=self.quads_routing_replay)

    def _quads_batch_routing(self, shape) -> torch.Tensor | None:
        """The rollout's routing of the latest generation, laid out as TRL lays out the trainer's
        input (prompts left-padded, completions right-padded, -1 at padding); taken once."""
        from trl.trainer.utils import pad

        rows, self.quads_rollout.last_routing = self.quads_rollout.last_routing, None
        if rows is None:
            return None
        prompt = pad(rows[0], padding_value=-1, padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        completion = pad(rows[1], padding_value=-1, padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of)
        routing = torch.cat([prompt, completion], dim=1).to(self.accelerator.device)
        if tuple(routing.shape[:2]) != tuple(shape):
            if self.quads_routing_replay:
                raise RuntimeError(f"QuadsGRPOTrainer: the recorded routing {tuple(routing.shape)} does not match the "
                                   f"trainer's input {tuple(shape)}: it cannot be replayed")
            return None  # not this batch's recording as a whole: no flips measured for it
        self._quads_routing_of_batch = routing
        return routing

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        check = self.quads_routing
        if (check is None or self.quads_rollout.last_routing is None
                or self.accelerator.unwrap_model(model) is not check.model):
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        with check.armed(self._quads_batch_routing(input_ids.shape), count=True):  # the scoring forward
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        routing = inputs.get("quads_routing")
        if self.quads_routing is None or not self.quads_routing.replay or routing is None:
            return super()._compute_loss(model, inputs)
        with self.quads_routing.armed(routing, count=False):  # stays current for the backward's recompute
            return super()._compute_loss(model, inputs)

    def _quads_attach_routing(self, output, mode: str) -> None:
        """Put the batch's routing into the generation output and log the scoring forward's flips."""
        routing = self._quads_routing_of_batch
        if routing is None and self.quads_rollout.last_routing is not None:  # no scoring forward ran
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            routing = self._quads_batch_routing(ids.shape)
        self._quads_routing_of_batch = None
        if routing is not None:
            output["quads_routing"] = routing
        stats = self.quads_routing.take()
        if stats is None:
            return
        names = {"flip_topk": "routing_flip_topk", "flip_topk_max": "routing_flip_topk_max",
                 "flip_topk_max_layer": "routing_flip_worst_layer", "flip_top1": "routing_flip_top1",
                 "replayed": "routing_replayed"}
        self._quads_log(mode, {f"sampling/quads/{names[k]}": v for k, v in stats.items() if k in names})

    # -- δ decomposition -----------------------------------------------------------------------

    def _probe_models(self) -> dict[str, nn.Module]:
        """Rollout-engine models with BF16 activations: the trainer's weights and the rollout's."""
        if self._quads_probe_models is None:
            preset = self.quads_preset
            trainer = self.accelerator.unwrap_model(self.model)
            def w16(policy):  # the same modules and weights as the preset's side, BF16 activations
                return weight_only_rollout(policy) if policy is not None else None

            probes = {"trainer_weights": build_rollout_model(trainer, w16(preset.trainer), self.quads_rollout_dtype)}
            if (preset.trainer is None) != (preset.rollout is None):
                probes["rollout_weights"] = build_rollout_model(trainer, w16(preset.rollout), self.quads_rollout_dtype)
            else:
                probes["rollout_weights"] = probes["trainer_weights"]
            self._quads_probe_models = probes
        trainer = self.accelerator.unwrap_model(self.model)
        synced = set()
        for m in self._quads_probe_models.values():
            if id(m) not in synced:
                sync_weights_(m, trainer, plain_trainer=True)
                synced.add(id(m))
        return self._quads_probe_models

    def _decompose(self, output, rollout_lp, trainer_lp, mask) -> dict[str, float]:
        """Split δ = log p_rollout - log p_trainer into δ_num + δ_weight + δ_act (telescoping).

        Re-scores the same completions (teacher forcing) with the rollout engine in BF16
        activations, first with the trainer's forward weights (``DQ(Q(W))`` under QAT, ``W``
        otherwise), then with the rollout's weights:

        * δ_num = log p(engine, trainer weights, BF16 act) - log p_trainer;
        * δ_weight = log p(engine, rollout weights, BF16 act) - log p(engine, trainer weights, BF16 act)
          (exactly 0 when both sides use the same weights: the QAT presets and ``bf16``);
        * δ_act = log p_rollout (sampling time) - log p(engine, rollout weights, BF16 act).

        For ``sym-qat`` the trainer's own activation fake-quant falls into δ_num.
        """
        probes = self._probe_models()
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        am = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        keep = output["completion_ids"].size(1)
        lp_tw = score_teacher_forced(probes["trainer_weights"], ids, am, keep, self.temperature)
        if probes["rollout_weights"] is probes["trainer_weights"]:
            lp_rw = lp_tw
        else:
            lp_rw = score_teacher_forced(probes["rollout_weights"], ids, am, keep, self.temperature)
        parts = {
            "delta_num": lp_tw.double() - trainer_lp.double(),
            "delta_weight": lp_rw.double() - lp_tw.double(),
            "delta_act": rollout_lp.double() - lp_rw.double(),
        }
        out = {}
        for name, d in parts.items():
            valid = mask & torch.isfinite(d)
            v = d[valid]
            out[f"sampling/quads/{name}_abs_mean"] = v.abs().mean().item() if v.numel() else 0.0
            out[f"sampling/quads/{name}_mean"] = v.mean().item() if v.numel() else 0.0
        return out
