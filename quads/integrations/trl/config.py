"""``QuadsGRPOConfig``: TRL's ``GRPOConfig`` with the ``QuadsGRPOTrainer`` options as fields.

Every option of the trainer that is data is a plain-typed dataclass field with help metadata,
so a YAML file or a ``trl.TrlParser`` command line sets it like any TRL option::

    parser = TrlParser((QuadsGRPOConfig,))
    (config,) = parser.parse_args_and_config()   # --quads_policy w4a16 --quads_kernel fast ...
    QuadsGRPOTrainer(model, reward, config, ...)

The trainer reads them when ``args`` is a ``QuadsGRPOConfig``; its constructor arguments still
work, and one given there that differs from a field set here is a one-line error
(:func:`resolve_trainer_options`). The ``quads_importance_sampling_*`` fields are
engine-neutral names of TRL's ``vllm_importance_sampling_*`` options (TRL keeps its names; the
correction runs on the quads engine's log-probs, no vLLM involved): a value set here is copied
into TRL's field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from quads.diagnostics.mismatch_alarm import DEFAULT_ALARM_FACTOR
from quads.policies import POLICY_PRESETS, get_preset
from quads.policies.policy import KERNEL_PREFERENCES
from quads.policies.presets import PolicyPreset, with_kernel, with_residual_fraction

__all__ = ["QuadsGRPOConfig", "ROLLOUT_DTYPE_NAMES", "TRAINER_OPTIONS", "resolve_trainer_options"]

#: ``quads_rollout_dtype`` names -> torch dtypes (the trainer's ``rollout_dtype``)
ROLLOUT_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: QuadsGRPOTrainer constructor argument -> the QuadsGRPOConfig field that holds it
TRAINER_OPTIONS = {
    "quads_policy": "quads_policy",
    "rollout_dtype": "quads_rollout_dtype",
    "decompose_mismatch": "quads_decompose_mismatch",
    "graphed_decode": "quads_graphed_decode",
    "rollout_corr_metrics": "quads_rollout_corr_metrics",
    "routing_replay": "quads_routing_replay",
    "mismatch_alarm": "quads_mismatch_alarm",
}

#: engine-neutral field -> TRL's vLLM-named field it sets
_IS_ALIASES = {
    "quads_importance_sampling_correction": "vllm_importance_sampling_correction",
    "quads_importance_sampling_mode": "vllm_importance_sampling_mode",
    "quads_importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
    "quads_importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
}


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class QuadsGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the QUADS options (see the module doc); every field is checked in
    ``__post_init__`` with a one-line error naming it."""

    quads_policy: str = field(default="quads", metadata=_help(
        "QUADS plan: a preset name of quads.POLICY_PRESETS (" + ", ".join(POLICY_PRESETS) + ")"))
    quads_kernel: str | None = field(default=None, metadata=_help(
        "rollout kernels: 'exact' (bit-exact Triton/torch reference) or 'fast' (humming, Hopper); "
        "default: the preset's own"))
    quads_residual_fraction: float | None = field(default=None, metadata=_help(
        "rollout residual fraction k in [0, 1] (QuadsPolicy.residual_fraction); default: the preset's own"))
    quads_rollout_dtype: str = field(default="bfloat16", metadata=_help(
        "dtype of the rollout model's non-quantized parts and activations: bfloat16, float16 or float32"))
    quads_decompose_mismatch: bool = field(default=False, metadata=_help(
        "also log delta_num / delta_weight / delta_act each step (two extra scoring forwards)"))
    quads_graphed_decode: bool | None = field(default=None, metadata=_help(
        "sample with the CUDA-graph decoder (default: on CUDA); false keeps transformers generate"))
    quads_rollout_corr_metrics: bool = field(default=False, metadata=_help(
        "also log verl's rollout_corr/* diagnostics under verl's names"))
    quads_routing_replay: bool = field(default=False, metadata=_help(
        "rollout routing replay (R3): the trainer's forwards route each MoE token by the experts the rollout used"))
    quads_mismatch_alarm: float | None = field(default=DEFAULT_ALARM_FACTOR, metadata=_help(
        "warn when a step's mean log-prob gap exceeds this multiple of the first steps' median (null: off)"))
    quads_importance_sampling_correction: bool | None = field(default=None, metadata=_help(
        "TRL's vllm_importance_sampling_correction under an engine-neutral name (default: TRL's)"))
    quads_importance_sampling_mode: str | None = field(default=None, metadata=_help(
        "TRL's vllm_importance_sampling_mode under an engine-neutral name (default: TRL's)"))
    quads_importance_sampling_clip_min: float | None = field(default=None, metadata=_help(
        "TRL's vllm_importance_sampling_clip_min under an engine-neutral name (default: TRL's)"))
    quads_importance_sampling_clip_max: float | None = field(default=None, metadata=_help(
        "TRL's vllm_importance_sampling_clip_max under an engine-neutral name (default: TRL's)"))

    def __post_init__(self):
        self._check_quads_fields()
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        for alias, trl_name in _IS_ALIASES.items():
            value = getattr(self, alias)
            if value is None:
                continue
            current = getattr(self, trl_name)
            if current != defaults[trl_name] and current != value:
                raise ValueError(f"QuadsGRPOConfig: {alias}={value!r} and {trl_name}={current!r} set the same option "
                                 "differently; set one of them")
            setattr(self, trl_name, value)
        super().__post_init__()

    def _check_quads_fields(self) -> None:
        try:
            get_preset(self.quads_policy)  # a preset name, or one with the routing-replay suffix
        except (TypeError, ValueError):
            raise ValueError(f"QuadsGRPOConfig.quads_policy: unknown preset {self.quads_policy!r}; "
                             f"choose one of {', '.join(POLICY_PRESETS)}") from None
        if self.quads_kernel is not None and self.quads_kernel not in KERNEL_PREFERENCES:
            raise ValueError(f"QuadsGRPOConfig.quads_kernel must be one of {KERNEL_PREFERENCES}, "
                             f"got {self.quads_kernel!r}")
        if self.quads_rollout_dtype not in ROLLOUT_DTYPE_NAMES:
            raise ValueError(f"QuadsGRPOConfig.quads_rollout_dtype must be one of {', '.join(ROLLOUT_DTYPE_NAMES)}, "
                             f"got {self.quads_rollout_dtype!r}")
        fraction = self.quads_residual_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0.0 <= fraction <= 1.0):
            raise ValueError(f"QuadsGRPOConfig.quads_residual_fraction must be a number in [0, 1], got {fraction!r}")
        alarm = self.quads_mismatch_alarm
        if alarm is not None and (isinstance(alarm, bool) or not isinstance(alarm, (int, float)) or not alarm > 1):
            raise ValueError(f"QuadsGRPOConfig.quads_mismatch_alarm must be null or a number > 1, got {alarm!r}")
        for name in ("quads_decompose_mismatch", "quads_rollout_corr_metrics", "quads_routing_replay"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QuadsGRPOConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.quads_graphed_decode is not None and not isinstance(self.quads_graphed_decode, bool):
            raise TypeError(f"QuadsGRPOConfig.quads_graphed_decode must be null, true or false, "
                            f"got {self.quads_graphed_decode!r}")
        self.quads_preset()  # a kernel or fraction the preset cannot take (a BF16 rollout), named now

    def quads_preset(self) -> PolicyPreset:
        """The :class:`PolicyPreset` these fields name (the preset, its kernel and residual fraction)."""
        preset = get_preset(self.quads_policy)
        if self.quads_kernel is not None:
            try:
                preset = with_kernel(preset, self.quads_kernel)
            except ValueError as err:
                raise ValueError(f"QuadsGRPOConfig.quads_kernel: {err}") from None
        if self.quads_residual_fraction is not None:
            if preset.rollout is None or preset.rollout.activations != "nvfp4":
                raise ValueError(f"QuadsGRPOConfig.quads_residual_fraction: preset {preset.name!r} has no W4A4 rollout "
                                 "to compensate")
            preset = with_residual_fraction(preset, float(self.quads_residual_fraction))
        return preset

    def quads_trainer_options(self) -> dict:
        """The trainer's constructor arguments these fields stand for (:data:`TRAINER_OPTIONS`)."""
        return {
            "quads_policy": self.quads_preset(),
            "rollout_dtype": ROLLOUT_DTYPE_NAMES[self.quads_rollout_dtype],
            "decompose_mismatch": self.quads_decompose_mismatch,
            "graphed_decode": self.quads_graphed_decode,
            "rollout_corr_metrics": self.quads_rollout_corr_metrics,
            "routing_replay": self.quads_routing_replay,
            "mismatch_alarm": None if self.quads_mismatch_alarm is None else float(self.quads_mismatch_alarm),
        }


def _field_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(QuadsGRPOConfig)}


def resolve_trainer_options(args, given: dict, defaults: dict) -> dict:
    """The trainer's options: ``given`` (constructor arguments; ``missing`` marks one not passed),
    else the config's field when ``args`` is a :class:`QuadsGRPOConfig`, else ``defaults``.
    A constructor argument that differs from a field the config sets (not at its default) is a
    one-line ValueError naming both."""
    missing = given.pop("__missing__")
    from_config = args.quads_trainer_options() if isinstance(args, QuadsGRPOConfig) else {}
    field_defaults = _field_defaults()
    out = {}
    for name, value in given.items():
        field_name = TRAINER_OPTIONS[name]
        config_set = bool(from_config) and getattr(args, field_name) != field_defaults[field_name]
        if name == "quads_policy" and from_config:  # a kernel or fraction field sets the plan too
            config_set = config_set or args.quads_kernel is not None or args.quads_residual_fraction is not None
        if value is missing:
            out[name] = from_config[name] if from_config else defaults[name]
            continue
        if config_set and not _same(name, value, from_config[name]):
            raise ValueError(f"QuadsGRPOTrainer({name}={_show(value)}) differs from "
                             f"QuadsGRPOConfig.{field_name}={getattr(args, field_name)!r}; set it in one place")
        out[name] = value
    return out


def _same(name: str, value, configured) -> bool:
    if name == "quads_policy":
        try:
            return get_preset(value) == configured
        except (TypeError, ValueError):
            return False
    return value == configured


def _show(value) -> str:
    return value.name if isinstance(value, PolicyPreset) else repr(value)
