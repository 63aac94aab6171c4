"""`QuadsPolicy`: what `quantize_` does to a model, for the trainer or the rollout side."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import KERNEL_PREFERENCES
from quads.tensor.nvfp4_math import BLOCK_SCALINGS

__all__ = ["QuadsPolicy", "DEFAULT_SKIP_PATTERNS", "SIDES", "ACTIVATION_MODES", "WEIGHT_GLOBAL_SCALES", "SCOPES",
           "WEIGHT_BLOCK_SCALINGS"]

SIDES = ("trainer", "rollout")
_UNSET = object()
ACTIVATION_MODES = ("bf16", "nvfp4")
#: ``QuadsPolicy.weight_global_scale``: one NVFP4 global scale per sibling group, or per weight
WEIGHT_GLOBAL_SCALES = ("group", "tensor")
#: ``QuadsPolicy.scope``: which modules a policy quantizes (see :mod:`quads.policies.scope`)
SCOPES = ("all", "routed_experts")
#: ``QuadsPolicy.weight_block_scaling``: NVIDIA's (every block's max to 6) or Four Over Six
WEIGHT_BLOCK_SCALINGS = BLOCK_SCALINGS

# The activation defaults live in one place: ActivationQuant's fields.
_ACT_DEFAULTS = {f.name: f.default for f in fields(ActivationQuant)}

# fields only the rollout reads (the trainer's activations carry no residual; kernels serve rollouts),
# with their defaults: a trainer policy must leave them there
_ROLLOUT_ONLY = {"residual_fraction": float(_ACT_DEFAULTS["residual_fraction"]),
                 "residual_selection": _ACT_DEFAULTS["selection"], "kernel": "exact"}

# QuadsPolicy field -> the ActivationQuant field that validates it
_ACT_FIELDS = {"residual_fraction": "residual_fraction", "residual_selection": "selection",
               "activation_granularity": "granularity", "activation_block_scaling": "block_scaling"}

# Module-name regexes never quantized by default: embeddings, the LM head, MoE routers /
# gates (the routing decision is discrete, a flipped expert is a large log-prob error) and
# norms. `gate_proj` (an MLP projection) is *not* a router and stays quantized.
DEFAULT_SKIP_PATTERNS = (
    r"(^|\.)lm_head$",
    r"(^|\.)embed[^.]*$",
    r"(^|\.)(gate|router|shared_expert_gate)$",
    r"(^|\.)[^.]*norm[^.]*$",
)


class Patterns(tuple):
    """A policy's regex patterns: a plain tuple (equal to, and hashed like, the tuple of its
    items) that torchao's config serializer can also write. ``TorchAoConfig(QuadsPolicy(...))``
    serializes the policy field by field with torchao's encoder, which refuses tuples but
    writes named tuples through ``_asdict``; so ``repr(model.config)``, ``config.to_dict()`` and
    ``save_pretrained``'s config of such a model work."""

    __slots__ = ()
    _fields = ("patterns",)

    def _asdict(self) -> dict:
        return {"patterns": list(self)}


@dataclass(frozen=True)
class QuadsPolicy:
    """The precision policy of one side of QUADS.

    side: ``"trainer"`` (BF16 masters, NVFP4 fake-quant weights with straight-through
        gradient) or ``"rollout"`` (packed NVFP4 weights, online activation quantization).
    activations: ``"bf16"`` or ``"nvfp4"``. Default: ``"bf16"`` for the trainer (asymmetric
        W4A16 QAT, the QUADS default), ``"nvfp4"`` for the rollout (W4A4). ``"nvfp4"`` on the
        trainer is the symmetric-QAT ablation.
    residual_fraction: rollout only: fraction of channels whose activation-quantization
        residual is re-quantized and added back (0 = naive W4A4).
    residual_selection: ``"per_token"`` (top-k |residual| channels of each token)
        or ``"static"`` (a per-layer channel set from ``calibrate_residual_channels``).
    activation_granularity: global-scale groups of the activations: ``"row"`` (per-token
        NVFP4 global scale, batch invariant) or ``"tensor"``.
    skip_patterns: regexes of module names left in high precision (see DEFAULT_SKIP_PATTERNS).
    extra_skip_patterns: regexes added to ``skip_patterns`` (the usual override).
    kernel: rollout kernel preference (in the spirit of torchao's KernelPreference):
        ``"exact"`` (default: the Triton kernels, bit-exact with the torch reference,
        deterministic, batch invariant) or ``"fast"`` (vLLM's humming GEMMs on Hopper, the
        ``humming`` backend: not bit-exact). ``QUADS_BACKEND`` still overrides both.
    weight_global_scale: ``"group"`` (default) or ``"tensor"``: how many NVFP4 global weight
        scales. ``"group"``: one per sibling group (q/k/v of an attention block, gate/up of an
        MLP: :data:`~quads.policies.fused_projections.SIBLING_PROJECTIONS`), from the largest
        amax of its members, on the trainer's forward weights, the rollout's packed weights and
        every sync alike; that is the layout of the fused layers serving engines run (vLLM's
        ``qkv_proj``/``gate_up_proj`` hold one ``weight_scale_2``), so ``quads export`` writes
        the trained weights unchanged. ``"tensor"``: one per weight. Fused MoE experts keep one
        per expert either way (their fused ``gate_up_proj`` already shares it between gate and
        up). Trainer and rollout must use the same value (``sync_weights_`` checks).
    scope: ``"all"`` (default: every ``nn.Linear`` and fused MoE experts module outside the skip
        patterns) or ``"routed_experts"`` (only the routed experts: attention, shared experts,
        routers and ``lm_head`` stay in high precision; a model without routed experts is refused).
    skip_first_layers, skip_last_layers: how many decoder layers at each end of the model's
        decoder-layer list (``model.layers.N``) stay wholly in high precision (default 0). A
        whole layer, attention included; with ``scope="routed_experts"`` that is the layer's
        experts (verl's Qwen3 recipe keeps the first 2 and last 4 MLP layers in BF16).
        :mod:`quads.policies.scope` numbers the layers; a model without a decoder-layer list is
        refused. Trainer and rollout must convert the same modules (``sync_weights_`` checks).
    weight_block_scaling: ``"6"`` (default: NVIDIA's recipe, every 16-element block's max
        mapped to E2M1's 6) or ``"4over6"`` (Four Over Six, arXiv 2512.02010: each block maps its
        max to 4 or 6, whichever quantizes it with less squared error; the global scale maps the
        amax to 256 instead of 448). The weights stay standard NVFP4 (packing, scales and
        dequantization unchanged), so GEMMs and ``quads export`` are unchanged. Weights only
        (activations: ``activation_block_scaling``). Applies to the trainer's forward weights, the rollout's packed weights, every sync and the export alike; trainer and
        rollout must use the same value (``sync_weights_`` checks).
    activation_block_scaling: ``"6"`` (default) or ``"4over6"``: the block scaling of the
        quantized activations and of the residual (which shares the row's global scale). A
        rollout-side choice (and the symmetric-QAT trainer's): it changes no weight, so the sides
        need not agree. Measured: docs/results.md section 4.

    Defaults of the four activation fields are :class:`~quads.ops.ActivationQuant`'s.
    """

    side: str
    activations: str | None = None
    residual_fraction: float = _ACT_DEFAULTS["residual_fraction"]
    residual_selection: str = _ACT_DEFAULTS["selection"]
    activation_granularity: str = _ACT_DEFAULTS["granularity"]
    skip_patterns: tuple[str, ...] = DEFAULT_SKIP_PATTERNS
    extra_skip_patterns: tuple[str, ...] = field(default_factory=tuple)
    kernel: str = "exact"
    weight_global_scale: str = "group"
    scope: str = "all"
    skip_first_layers: int = 0
    skip_last_layers: int = 0
    weight_block_scaling: str = "6"
    activation_block_scaling: str = _ACT_DEFAULTS["block_scaling"]

    def __post_init__(self):
        if not isinstance(self.scope, str) or self.scope not in SCOPES:
            raise ValueError(f"QuadsPolicy.scope must be one of {SCOPES}, got {self.scope!r}")
        for name in ("skip_first_layers", "skip_last_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"QuadsPolicy.{name} must be a non-negative int (a count of decoder layers), "
                                 f"got {value!r}")
        if self.weight_global_scale not in WEIGHT_GLOBAL_SCALES:
            raise ValueError(f"QuadsPolicy.weight_global_scale must be one of {WEIGHT_GLOBAL_SCALES}, "
                             f"got {self.weight_global_scale!r}")
        if not isinstance(self.weight_block_scaling, str) or self.weight_block_scaling not in WEIGHT_BLOCK_SCALINGS:
            raise ValueError(f"QuadsPolicy.weight_block_scaling must be one of {WEIGHT_BLOCK_SCALINGS}, "
                             f"got {self.weight_block_scaling!r}")
        if self.kernel not in KERNEL_PREFERENCES:
            raise ValueError(f"QuadsPolicy.kernel must be one of {KERNEL_PREFERENCES}, got {self.kernel!r}")
        if not isinstance(self.side, str) or self.side not in SIDES:
            raise ValueError(f"QuadsPolicy.side must be one of {SIDES}, got {self.side!r}")
        if self.activations is None:
            object.__setattr__(self, "activations", "bf16" if self.side == "trainer" else "nvfp4")
        if not isinstance(self.activations, str) or self.activations not in ACTIVATION_MODES:
            raise ValueError(f"QuadsPolicy.activations must be one of {ACTIVATION_MODES}, got {self.activations!r}")
        for name in ("skip_patterns", "extra_skip_patterns"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) for p in value):
                raise TypeError(
                    f"QuadsPolicy.{name} must be a tuple of regex strings, got {value!r}"
                    + (f" (write ({value!r},) for one pattern)" if isinstance(value, str) else "")
                )
            object.__setattr__(self, name, Patterns(value))
        for pattern in self.all_skip_patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"QuadsPolicy: bad skip pattern {pattern!r}: {err}") from None
        # the residual fields are validated on every side (ActivationQuant checks them), so a
        # typo in a trainer policy fails here rather than when the policy is reused for a rollout
        for policy_field, act_field in _ACT_FIELDS.items():
            try:
                ActivationQuant(**{act_field: getattr(self, policy_field)})
            except ValueError as err:
                raise ValueError(f"QuadsPolicy.{policy_field} (side={self.side!r}): {err}") from None
        object.__setattr__(self, "residual_fraction", float(self.residual_fraction))  # e.g. numpy.float32
        if self.side == "trainer":
            self._refuse_rollout_fields()

    def _refuse_rollout_fields(self) -> None:
        """A rollout-only field set on a trainer policy would be ignored silently: refuse it."""
        for name, default in _ROLLOUT_ONLY.items():
            value = getattr(self, name)
            if value != default:
                raise ValueError(f"QuadsPolicy.{name}={value!r} is a rollout-side field; side='trainer' ignores it "
                                 f"(set it on the QuadsPolicy(side='rollout', ...) of the pair)")

    @property
    def all_skip_patterns(self) -> tuple[str, ...]:
        return tuple(self.skip_patterns) + tuple(self.extra_skip_patterns)

    @property
    def activation_quant(self) -> ActivationQuant | None:
        """The activation quantizer this side applies, or None for BF16 activations.

        The trainer's symmetric-QAT ablation quantizes activations without residual
        compensation (it models a naive W4A4 rollout).
        """
        cached = self.__dict__.get("_activation_quant", _UNSET)
        if cached is _UNSET:  # built once (forwards read it, compiled graphs too)
            cached = None
            if self.activations != "bf16":
                fraction = self.residual_fraction if self.side == "rollout" else 0.0
                cached = ActivationQuant(fraction, self.residual_selection, self.activation_granularity,
                                         self.activation_block_scaling)
            object.__setattr__(self, "_activation_quant", cached)
        return cached

    @property
    def skips_boundary_layers(self) -> bool:
        """Whether decoder layers at either end stay in high precision."""
        return self.skip_first_layers > 0 or self.skip_last_layers > 0

    @property
    def is_scoped(self) -> bool:
        """Whether the policy converts less than every linear outside the skip patterns (a
        ``scope`` or boundary layers, which need the model to decide: :mod:`quads.policies.scope`)."""
        return self.scope != "all" or self.skips_boundary_layers
    def weight_mismatch(self, trainer: "QuadsPolicy") -> str | None:
        """Why this (rollout) policy's packed weights would not be ``trainer``'s forward weights
        (a weight field differs: ``weight_global_scale``, ``weight_block_scaling``), or None."""
        for name in ("weight_global_scale", "weight_block_scaling"):
            mine, theirs = getattr(self, name), getattr(trainer, name)
            if mine != theirs:
                return (f"the rollout quantizes with {name}={mine!r}, the trainer with {theirs!r}; the rollout's "
                        "weights would not be the trainer's forward weights (use one value on both sides)")
        return None

    def skips(self, module_name: str) -> bool:
        """Whether the skip patterns keep ``module_name`` in high precision (by name alone; the
        scope and boundary layers are the model walk's, :func:`quads.policies.scope.policy_skips`)."""
        return any(re.search(p, module_name) for p in self.all_skip_patterns)
