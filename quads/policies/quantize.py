"""`quantize_(model, policy)`: convert a model in place to a QUADS trainer or rollout model.

All or nothing. ``quantize_`` first checks every module it will convert (K a multiple of 16, a
float dtype, a supported experts layout, values present (not meta) for the rollout, tied
weights, finiteness of every weight in one fused pass), then quantizes every rollout weight
into new NVFP4Tensors, and only then swaps classes and parameters. An error at any point
names the module and leaves the model exactly as it was (the same parameter objects, bit for
bit); a failure during the final swap is rolled back, and so is any exception after it, Ctrl-C
included, up to the last step (hooks, attributes, the model's ``save_pretrained``):
:class:`~quads.policies.transaction.ModuleTreeSnapshot`.

Tied weights: on the trainer side a tied weight stays one parameter (the class swap does not
touch parameters). On the rollout side a weight shared by several converted modules of the same
kind is packed once and stays shared; a weight shared with a module that is not converted
(``tie_word_embeddings``: ``lm_head`` and the input embedding) is refused, because packing it
would either untie the two (the embedding keeps a dense copy that no longer follows the head)
or quantize the embedding lookup, which the trainer does not do (breaking exact alignment).
The default skip patterns keep ``lm_head`` in high precision, which avoids the case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import warnings

import torch
import torch.nn as nn

from quads.ops.backend_registry import Backend, gemm_shape, select_backend
from quads.policies.load_check import RolloutLoadCheck
from quads.policies.modules import (
    QuadsModule,
    RolloutExperts,
    RolloutLinear,
    refresh_after_load,
    TrainerExperts,
    TrainerLinear,
)
from quads.policies.policy import QuadsPolicy
from quads.policies.scale_groups import GroupScaleLoadCheck, ScaleGroup, sibling_groups
from quads.policies.transaction import ModuleTreeSnapshot
from quads.policies.walk import ConversionTarget, FilterFn, policy_targets
from quads.tensor.finite import check_all_finite, check_dequantized_range, check_finite
from quads.tensor.nvfp4_math import BLOCK_SIZE
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["quantize_", "quantized_modules", "pack_weight", "check_target", "check_convertible", "convert_targets",
           "install_save_pretrained", "QuadsSavePretrained", "set_save_pretrained_handler"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}
_QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIXINS = {("trainer", "linear"): TrainerLinear, ("trainer", "experts"): TrainerExperts,
           ("rollout", "linear"): RolloutLinear, ("rollout", "experts"): RolloutExperts}
_WEIGHT_NAMES = {"linear": ("weight",), "experts": ("gate_up_proj", "down_proj")}


def _swap_class(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"{mixin.__name__}_{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
    module.__class__ = _CLASS_CACHE[key]


def _pack(weight: torch.Tensor, backend: Backend, global_encode_scale: torch.Tensor | None = None,
          block_scaling: str = "6") -> NVFP4Tensor:
    """Quantize a weight already checked finite (no host sync), with its own global scale or
    ``global_encode_scale`` (its sibling group's), and ``block_scaling`` (the policy's)."""
    granularity = None
    if global_encode_scale is not None:  # each member its own tensor: parts are written in place
        granularity, global_encode_scale = "tensor", global_encode_scale.clone()
    return NVFP4Tensor(*backend.quantize_weight(weight.detach(), granularity, global_encode_scale, block_scaling),
                       orig_dtype=weight.dtype, check_values=False, block_scaling=block_scaling)


def pack_weight(weight: torch.Tensor, backend: Backend, what: str = "weight",
                global_encode_scale: torch.Tensor | None = None, block_scaling: str = "6") -> NVFP4Tensor:
    """A dense 2-D/3-D weight as an NVFP4Tensor, quantized by ``backend`` (same bits on any
    backend); ``global_encode_scale`` (shape ``()``): a sibling group's shared ``S_enc``;
    ``block_scaling``: ``QuadsPolicy.weight_block_scaling``."""
    check_finite(weight, what)
    return _pack(weight, backend, global_encode_scale, block_scaling)


@dataclass
class _Target:
    """One module to convert and what converting it needs."""

    name: str
    module: nn.Module
    kind: str  # "linear" or "experts"
    backend: Backend | None = None  # rollout only
    packed: dict[str, NVFP4Tensor] = field(default_factory=dict)  # rollout only: staged weights
    scale_group: ScaleGroup | None = None  # group mode: the siblings sharing its global scale

    @property
    def weight_names(self) -> tuple[str, ...]:
        return _WEIGHT_NAMES[self.kind]

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{self.name}.{p}" if self.name else p, getattr(self.module, p)) for p in self.weight_names]


def _check_target(target: _Target, side: str) -> None:
    """The per-module checks that need no tensor values."""
    module, name = target.module, target.name
    if target.kind == "experts":
        if getattr(module, "is_transposed", False):
            raise NotImplementedError(f"{name}: transposed expert layouts (E, K, N) are not supported yet")
        if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
            raise NotImplementedError(f"{name}: only concatenated gate/up experts are supported")
    for qualified, weight in target.weights():
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{qualified} is {type(weight).__name__}, not a tensor; quads converts modules with weights")
        if weight.numel() == 0:
            raise ValueError(f"{qualified} has shape {tuple(weight.shape)}: an empty weight has nothing to quantize")
        if isinstance(weight, NVFP4Tensor):
            raise ValueError(f"{qualified} is already a packed NVFP4Tensor; quantize_ takes a high-precision model")
        if weight.dtype not in _QUANTIZABLE_DTYPES:
            raise TypeError(f"{qualified}: cannot quantize a {weight.dtype} weight (float32/bfloat16/float16 only)")
        if weight.shape[-1] % BLOCK_SIZE:
            raise ValueError(
                f"{qualified}: input dim K={weight.shape[-1]} is not a multiple of {BLOCK_SIZE}; "
                "NVFP4 cannot quantize it. Exclude it with QuadsPolicy(extra_skip_patterns=...) or filter_fn."
            )
        if side == "rollout" and weight.device.type == "meta":
            raise ValueError(
                f"{qualified} is on the meta device: a rollout model packs real weight values. Load or "
                "materialize the weights first (from_pretrained, or to_empty() + load_state_dict)"
            )


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every qualified name it is reachable under (ties share one id)."""
    out: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(param), []).append(name)
    return out


def _check_ties(model: nn.Module, targets: list[_Target]) -> None:
    """Rollout side: a packed weight may be shared only by converted modules of one kind."""
    aliases = _aliases(model)
    converted = {q: t.kind for t in targets for q, _ in t.weights()}
    # a module registered under several names (s.b = s.a) is converted once, under its first
    # name; its weight under the other names is the same module's, not a tie to another one
    module_names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(module), []).append(name)
    for t in targets:
        for other in module_names.get(id(t.module), [])[1:]:
            for pname in t.weight_names:
                converted[f"{other}.{pname}" if other else pname] = t.kind
    for t in targets:
        for qualified, weight in t.weights():
            others = [a for a in aliases.get(id(weight), []) if a != qualified]
            foreign = [a for a in others if converted.get(a) != t.kind]
            if foreign:
                raise ValueError(
                    f"quantize_: {qualified} is tied to {', '.join(foreign)}, which the policy does not convert "
                    "(e.g. tie_word_embeddings). Packing it would untie them or quantize the embedding "
                    f"lookup. Keep {t.name} in high precision (the default skip_patterns skip lm_head) "
                    "or untie the weights before quantize_"
                )


def _stage_packed(targets: list[_Target], policy: QuadsPolicy) -> None:
    """Rollout side: quantize every weight into a new NVFP4Tensor; shared weights are packed once."""
    done: dict[int, NVFP4Tensor] = {}
    group_scales: dict[int, torch.Tensor] = {}
    block_scaling = policy.weight_block_scaling
    for t in targets:
        t.backend = select_backend(getattr(t.module, t.weight_names[0]).device, policy.kernel)
        scale = None
        if t.scale_group is not None:  # the dense masters of every member, before any is packed
            key = id(t.scale_group)
            if key not in group_scales:
                group_scales[key] = t.scale_group.encode_scale()
            scale = group_scales[key]
        for pname in t.weight_names:
            weight = getattr(t.module, pname)
            if id(weight) not in done:
                done[id(weight)] = nn.Parameter(_pack(weight, t.backend, scale, block_scaling), requires_grad=False)
            t.packed[pname] = done[id(weight)]


def _form_scale_groups(targets: list[_Target], policy: QuadsPolicy) -> list[ScaleGroup]:
    """Group mode: one :class:`ScaleGroup` per sibling set among the linear targets."""
    if policy.weight_global_scale != "group":
        return []
    linears = {t.name: t for t in targets if t.kind == "linear"}
    groups = []
    for names in sibling_groups(linears):
        group = ScaleGroup([linears[n].module for n in names], names, policy.weight_block_scaling)
        for n in names:
            linears[n].scale_group = group
        groups.append(group)
    return groups


def _group_parent(group: ScaleGroup, model: nn.Module | None) -> nn.Module | None:
    """The module of ``model`` holding every member of ``group`` as a direct child, or None."""
    if model is None:
        return None
    parent_name = group.names[0].rpartition(".")[0]
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return None
    children = [n.rpartition(".")[2] for n in group.names]
    if all(getattr(parent, c, None) is m for c, m in zip(children, group.members)):
        return parent
    return None


def _attach_trainer_groups(groups: list[ScaleGroup], model: nn.Module | None) -> None:
    """Trainer side: each group's scale is computed once per forward of the members' parent
    (:meth:`ScaleGroup.attach`); without a parent found in ``model``, each member computes it."""
    for group in groups:
        parent = _group_parent(group, model)
        if parent is not None:
            group.attach(parent)


def _commit(t: _Target, policy: QuadsPolicy) -> None:
    for pname, packed in t.packed.items():
        setattr(t.module, pname, packed)
    _swap_class(t.module, _MIXINS[(policy.side, t.kind)])
    t.module.quads_policy = policy
    if t.scale_group is not None:
        t.module.quads_scale_group = t.scale_group
    policy.activation_quant  # built now, not inside a (compiled) forward
    if policy.side == "rollout":
        t.module.quads_select_backend()  # the kernels for the packed weights' device and shapes
        t.module.register_load_state_dict_post_hook(refresh_after_load)  # a load writes the parts in place
    else:
        t.module.quads_select_backend()  # the fake quantizer for the masters' device


def _commit_all(targets: list[_Target], policy: QuadsPolicy) -> None:
    """Swap every module; if anything raises, restore the ones already swapped."""
    saved = []
    try:
        for t in targets:
            saved.append((t, type(t.module), set(vars(t.module)), {p: getattr(t.module, p) for p in t.weight_names}))
            _commit(t, policy)
    except BaseException:
        for t, cls, attrs, params in reversed(saved):
            t.module.__class__ = cls
            for pname, param in params.items():
                setattr(t.module, pname, param)
            for attr in set(vars(t.module)) - attrs:
                delattr(t.module, attr)
        raise


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module for every module converted by `quantize_`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuadsModule)}


def quantize_(model: nn.Module, policy: QuadsPolicy, filter_fn: FilterFn | None = None) -> nn.Module:
    """Convert ``model`` in place per ``policy`` and return it; all or nothing (see module doc).

    Converted: every ``nn.Linear`` and every fused MoE experts module whose name is not
    matched by the policy's skip patterns, that its ``scope`` and boundary layers include
    (:mod:`quads.policies.scope`) and for which ``filter_fn(module, name)`` (if given) is true. Trainer side: weights stay BF16 parameters, fake-quantized in each forward with a
    straight-through gradient. Rollout side: weights become frozen ``NVFP4Tensor`` parameters
    and activations are quantized online (W4A4 + residual compensation); each rollout module
    stores the backend (:func:`quads.ops.select_backend`) for its weights' device.

    Raises (naming the module, the model unchanged) if the model is already quantized, the
    scope or boundary layers cannot apply to it (routed experts only on a dense model, boundary
    layers without a decoder-layer list), nothing matches, a weight cannot be quantized (K % 16, dtype, NaN/Inf, meta device for a rollout,
    an unsupported experts layout) or a rollout weight is tied to a module left unconverted.
    Meta-device trainer models are accepted (the class swap needs no values; nothing can be
    checked for finiteness there).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ takes an nn.Module as its model, got {type(model).__name__}"
                        + (" (a state dict? load it into a model first)" if isinstance(model, dict) else ""))
    if not isinstance(policy, QuadsPolicy):
        raise TypeError(f"quantize_ takes a QuadsPolicy, got {type(policy).__name__}")
    already = quantized_modules(model)
    if already:
        first = next(iter(already))
        raise ValueError(f"model is already quantized by quads (e.g. {first!r}); build a fresh model to re-quantize")

    targets = policy_targets(model, policy, filter_fn)
    if not targets:
        raise ValueError(
            "quantize_: the policy matched no module (no nn.Linear or fused MoE experts outside "
            f"the skip patterns {policy.all_skip_patterns}"
            + (" and accepted by filter_fn" if filter_fn else "")
            + ")"
        )
    snapshot = ModuleTreeSnapshot(model)
    try:
        convert_targets(targets, policy, model)
        if policy.side == "rollout":  # (a trainer refuses packed values through quads.tensor.load_guard)
            model.register_load_state_dict_pre_hook(RolloutLoadCheck())  # every value checked before any loads
        install_save_pretrained(model)
    except BaseException:  # Ctrl-C included: every class, attribute and hook back as it was
        snapshot.restore()
        raise
    if policy.side == "rollout" and policy.kernel == "fast":
        warn_exact_kernel_layers(targets)
    return model


def exact_kernel_layers(targets: list[ConversionTarget]) -> list[tuple[str, tuple[int, int]]]:
    """``(name, (N, K))`` of every target that ``kernel="fast"`` runs on the exact kernels
    because the fast backend cannot serve that weight's shape (on any device: the rule is the
    fast backend's own, :func:`~quads.ops.backends.humming.backend.humming_shape_problem`)."""
    from quads.ops.backends.humming.backend import humming_shape_problem

    out = []
    for t in targets:
        shapes = [gemm_shape(getattr(t.module, pname)) for pname in t.module.quads_packed_names]
        out += [(t.name, shape) for shape in shapes if humming_shape_problem(*shape)][:1]
    return out


def warn_exact_kernel_layers(targets: list[ConversionTarget]) -> None:
    """One warning line for the whole model: how many layers keep the exact kernels, and why; or,
    where no layer runs humming (a CPU, a GPU without it), that the preference has no effect."""
    from quads.ops.backends.humming.backend import HUMMING_K_BLOCK

    kept = exact_kernel_layers(targets)
    backends = sorted({getattr(getattr(t.module, "quads_backend", None), "name", "?") for t in targets})
    if targets and "humming" not in backends:  # this device runs no humming at all: say so, not what a GPU would do
        would = f"; on a Hopper GPU {len(kept)} of them would keep the exact kernels" if kept else ""
        warnings.warn(f"quads: kernel='fast' has no effect here: all {len(targets)} layers run the "
                      f"{'/'.join(backends)} backend (humming runs on Hopper GPUs){would}", stacklevel=3)
        return
    if kept:
        shapes = [f"{n}x{k}" for n, k in dict.fromkeys(shape for _, shape in kept)]
        warnings.warn(f"quads: kernel='fast': {len(kept)} of {len(targets)} layers keep the exact kernels: humming "
                      f"needs K % {HUMMING_K_BLOCK} == 0 (N x K here: "
                      f"{', '.join(shapes[:4])}{', ...' if len(shapes) > 4 else ''}; e.g. {kept[0][0]})", stacklevel=3)


#: ``handler(model, save, *args, **kwargs)``: how a quads model's ``save_pretrained`` writes it
#: (``save``: the model's own, transformers', bound method); set by the transformers integration
_SAVE_PRETRAINED_HANDLER: list[Callable] = []


def set_save_pretrained_handler(handler: Callable) -> None:
    """Install the writer behind every quads model's ``save_pretrained`` (one, the latest wins):
    :mod:`quads.integrations.transformers` sets it when imported (policies cannot import it)."""
    _SAVE_PRETRAINED_HANDLER[:] = [handler]


def install_save_pretrained(model: nn.Module) -> None:
    """Route ``model.save_pretrained`` (a transformers model quads converted) through the quads
    writer (:class:`QuadsSavePretrained`); no-op for a model without one."""
    if callable(getattr(model, "save_pretrained", None)) and not isinstance(model.save_pretrained, QuadsSavePretrained):
        model.save_pretrained = QuadsSavePretrained(model)


class QuadsSavePretrained:
    """``save_pretrained`` of a quads model: the registered handler (the transformers
    integration: packed parts or masters, with the policy in ``config.json``) around the
    model's own ``save_pretrained``. Without one, it raises before writing anything, naming the
    ways that save such a model (:data:`quads.tensor.nvfp4_tensor.SAVE_HINT`)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        save = type(self.model).save_pretrained.__get__(self.model)  # the class's (transformers') method
        if not _SAVE_PRETRAINED_HANDLER:
            from quads.tensor.nvfp4_tensor import SAVE_HINT

            raise TypeError(f"save_pretrained cannot write this quads {type(self.model).__name__} without quads' "
                            f"transformers integration (import quads.integrations.transformers, then save again): {SAVE_HINT}")
        return _SAVE_PRETRAINED_HANDLER[0](self.model, save, *args, **kwargs)


def check_target(target: ConversionTarget, policy: QuadsPolicy) -> None:
    """Raise (naming the module) if ``target`` cannot be converted per ``policy``; changes nothing."""
    if isinstance(target.module, QuadsModule):
        raise ValueError(f"{target.name!r} is already quantized by quads; build a fresh model to re-quantize")
    t = _Target(*target)
    _check_target(t, policy.side)
    check_all_finite({id(w): (q, w) for q, w in t.weights()}.values(), "quantize_")


def check_convertible(model: nn.Module, policy: QuadsPolicy, filter_fn: FilterFn | None = None) -> int:
    """Raise what ``quantize_(model, policy, filter_fn)`` would raise for the modules' kinds,
    shapes (K % 16), dtypes, layouts and ties, naming the module, without converting anything or
    reading a value (finiteness is not checked); returns the number of modules it would convert.
    For command-line tools, which must refuse a model before any work."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ takes an nn.Module as its model, got {type(model).__name__}")
    staged = [_Target(*t) for t in policy_targets(model, policy, filter_fn)]
    for t in staged:
        _check_target(t, policy.side)
    if policy.side == "rollout":
        _check_ties(model, staged)
    return len(staged)


def convert_targets(targets: list[ConversionTarget], policy: QuadsPolicy, model: nn.Module | None = None) -> None:
    """Convert ``targets`` in place, all or nothing: every check first (ties against ``model``
    when given), every rollout weight staged, then the swap (rolled back on failure)."""
    staged = [_Target(*t) for t in targets]
    for t in staged:
        if isinstance(t.module, QuadsModule):
            raise ValueError(f"{t.name!r} is already quantized by quads; build a fresh model to re-quantize")
        _check_target(t, policy.side)
    groups = _form_scale_groups(staged, policy)
    if policy.side == "rollout" and model is not None:
        _check_ties(model, staged)
    weights = {id(w): (q, w) for t in staged for q, w in t.weights()}  # a tied weight is checked once
    check_all_finite(weights.values(), "quantize_")
    with torch.no_grad():
        if policy.side == "rollout":
            _stage_packed(staged, policy)
            check_dequantized_range(
                {id(p): (f"{t.name}.{n}" if t.name else n, p.parts, p.orig_dtype)
                 for t in staged for n, p in t.packed.items()}.values(), "quantize_")
        _commit_all(staged, policy)
    if groups and policy.side == "rollout" and model is not None:
        model.register_load_state_dict_pre_hook(GroupScaleLoadCheck([g.names for g in groups],
                                                                    policy.weight_block_scaling))
    if policy.side == "trainer":
        _attach_trainer_groups(groups, model)
