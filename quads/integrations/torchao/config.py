"""``QuadsPolicy`` as a torchao config: the module handler behind ``torchao.quantization.quantize_``.

The handler applies the policy to the module torchao hands it (docs/ecosystem.md) exactly as
:func:`quads.quantize_` would: it converts the quads targets inside that module (itself, or all
of them in a container torchao's filter selected) under the policy's skip patterns. Hence

* ``torchao.quantization.quantize_(model, policy)`` (``nn.Linear`` only) equals ``quads.quantize_``
  with that filter; for a dense model that is ``quads.quantize_(model, policy)``, same bits;
* with ``filter_fn=linear_or_experts`` (or any filter) it equals ``quads.quantize_`` with that
  filter, fused MoE experts included.

**Names.** The skip patterns are module names, which torchao does not pass: the handler finds
the root module of the ``quantize_`` call it runs under (details: docs/ecosystem.md).

**All or nothing.** On the first conversion of a model (no quads module in it yet) the
handler replays torchao's selection with the same filter and checks every target it will be
handed, so a module that cannot be converted raises, naming it, before anything changes
(``FqnToConfig``: per module). A module already converted with an equal policy is left as it
is; a model holding modules converted with another policy is refused.

**Sibling groups.** With ``weight_global_scale="group"`` (the default) the handler converts a
linear together with its selected siblings (q/k/v, gate/up), so their shared global scale sees
every member's weight (siblings handed over later are left as they are); ``TorchAoConfig(policy)``
loading gives :func:`quads.quantize_`'s model too (how: docs/ecosystem.md).
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple

import torch.nn as nn

from quads.policies.fused_projections import SIBLING_PROJECTIONS
from quads.policies.modules import QuadsModule
from quads.policies.policy import QuadsPolicy
from quads.policies.quantize import check_target, convert_targets, install_save_pretrained
from quads.policies.walk import ConversionTarget, policy_targets, target_kind

__all__ = ["linear_or_experts", "register"]


def linear_or_experts(module: nn.Module, fqn: str = "") -> bool:
    """A torchao ``filter_fn`` selecting what :func:`quads.quantize_` converts: ``nn.Linear`` and
    transformers-5 fused MoE experts (torchao's default selects ``nn.Linear`` only). The
    policy's skip patterns still apply (the handler checks names)."""
    return target_kind(module) is not None


class _QuantizeCall(NamedTuple):
    model: nn.Module
    filter_fn: Callable[[nn.Module, str], bool] | None  # None: an FqnToConfig call


def _current_quantize_call() -> _QuantizeCall | None:
    """The innermost ``torchao.quantization.quantize_`` call on this thread's stack, if any.

    Its locals ``model`` (the root) and ``filter_fn`` (torchao has replaced a None filter by its
    default before walking; it stays None for ``FqnToConfig``) are its public arguments.
    """
    from torchao.quantization import quant_api

    code = quant_api.quantize_.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            local = frame.f_locals
            return _QuantizeCall(local["model"], local["filter_fn"])
        frame = frame.f_back
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _targets_in(module: nn.Module, name: str, policy: QuadsPolicy, root: nn.Module) -> list[ConversionTarget]:
    """The policy's targets inside ``module`` (named ``name`` in ``root``, which numbers the
    decoder layers of a policy with boundary layers)."""
    return policy_targets(module, policy, root=root, prefix=name)


def _selected_by(root: nn.Module, filter_fn) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs torchao's walk hands to the handler (see the module doc)."""
    selected: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        if filter_fn(module, name):
            selected.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(child, _join(name, child_name))

    visit(root, "")
    return selected


def _check_whole_walk(root: nn.Module, filter_fn, policy: QuadsPolicy) -> None:
    planned = [t for name, module in _selected_by(root, filter_fn) for t in _targets_in(module, name, policy, root)]
    if not planned:
        raise ValueError(
            "torchao.quantization.quantize_ with a QuadsPolicy matched no module (the filter's selection "
            f"holds no nn.Linear or fused MoE experts outside the skip patterns {policy.all_skip_patterns})"
        )
    for target in planned:
        check_target(target, policy)


def _transformers_load() -> tuple[nn.Module, str, object] | None:
    """``(model, module name, hf_quantizer)`` when this runs inside transformers' loading of a
    ``TorchAoConfig`` model (``TorchAoQuantize.convert``, which calls ``quantize_`` on each linear
    right after its weight is loaded), found on this thread's stack like the quantize_ call."""
    try:
        from transformers.integrations.torchao import TorchAoQuantize
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    code = TorchAoQuantize.convert.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            local = frame.f_locals
            return local["model"], local["full_layer_name"].rpartition(".")[0], local["self"].hf_quantizer
        frame = frame.f_back
    return None


def _load_siblings_together(module: nn.Module, load: tuple[nn.Module, str, object],
                            policy: QuadsPolicy) -> list[ConversionTarget] | None:
    """Group mode inside transformers' loading: the linears of ``module``'s sibling set, to be
    converted together once the last of them has its weight, or ``[]`` while one is still
    waiting for its weight (``module`` then stays dense until then); None for a linear without
    siblings. The set is the siblings the policy converts and transformers will quantize
    (``hf_quantizer.param_needs_quantization``)."""
    model, name, quantizer = load
    if policy.weight_global_scale != "group" or target_kind(module) != "linear" or policy.skips(name):
        return None
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    for siblings in SIBLING_PROJECTIONS:
        if child not in siblings:
            continue
        members = [(_join(parent_name, s), getattr(parent, s, None)) for s in siblings]
        members = [(n, m) for n, m in members if m is not None and target_kind(m) == "linear"
                   and not policy.skips(n) and quantizer.param_needs_quantization(model, f"{n}.weight")]
        if len(members) < 2:
            return None
        module._quads_awaits_siblings = True
        if not all(getattr(m, "_quads_awaits_siblings", False) for _, m in members):
            return []
        for _, m in members:
            del m._quads_awaits_siblings
        return [ConversionTarget(n, m, "linear") for n, m in members]
    return None


def _apply_during_load(module: nn.Module, load: tuple[nn.Module, str, object], policy: QuadsPolicy) -> None:
    """The handler inside transformers' ``TorchAoConfig`` loading: ``module`` is the linear
    whose weight was just loaded, ``load`` names it in the whole model, so the policy's skip
    patterns apply by full name as in :func:`quads.quantize_`."""
    model, name, quantizer = load
    install_save_pretrained(model)  # quads' writer: a plain from_pretrained gives this model back
    _convert_experts_after_load(quantizer)
    together = _load_siblings_together(module, load, policy)
    if together is None:
        targets = [t for t in _targets_in(module, name, policy, model) if not isinstance(t.module, QuadsModule)]
        convert_targets(targets, policy, model)
        return
    convert_targets(together, policy, model)
    for _, m, _ in together:  # transformers marks only the module it handed over
        for p in m.parameters(recurse=False):
            p._is_hf_initialized = True


def _convert_experts_after_load(quantizer) -> None:
    """Inside a ``TorchAoConfig(QuadsPolicy(...))`` load: convert the fused MoE experts once
    transformers has loaded every weight (installed on the load's quantizer, run once).

    transformers hands torchao only ``nn.Linear`` weights (``param_needs_quantization``), so the
    experts, most of an MoE's parameters, would stay BF16. The quantizer's after-loading step
    is wrapped for this one load: it converts every experts module outside the policy's skip
    patterns and the config's ``modules_to_not_convert`` with quads' converter (checks first,
    naming the module), then runs transformers' own step; the model is then what
    ``quads.quantize_`` builds from the same checkpoint."""
    if "_process_model_after_weight_loading" in vars(quantizer):
        return  # installed for this load already
    policy = quantizer.quantization_config.quant_type
    if not isinstance(policy, QuadsPolicy):  # FqnToConfig: it selects what it converts by name
        return
    original = quantizer._process_model_after_weight_loading

    def after_weight_loading(model: nn.Module, **kwargs):
        del quantizer._process_model_after_weight_loading  # the class's method again
        from transformers.quantizers.quantizers_utils import should_convert_module

        experts = [t for t in policy_targets(model, policy)
                   if t.kind == "experts" and not isinstance(t.module, QuadsModule)
                   and all(should_convert_module(f"{t.name}.{p}", quantizer.modules_to_not_convert)
                           for p, _ in t.module.named_parameters(recurse=False))]
        convert_targets(experts, policy, model)
        return original(model, **kwargs)

    quantizer._process_model_after_weight_loading = after_weight_loading


def apply_policy(module: nn.Module, policy: QuadsPolicy) -> nn.Module:
    """The torchao module handler of ``QuadsPolicy``: convert ``module`` in place, return it."""
    load = _transformers_load()
    if load is not None and policy.is_scoped:
        raise NotImplementedError(
            "TorchAoConfig loading with a scoped QuadsPolicy (scope / skip_first_layers / skip_last_layers) is not "
            "supported: load the model plainly, then quads.quantize_(model, policy)")
    if load is not None:
        _apply_during_load(module, load, policy)
        return module
    call = _current_quantize_call()
    root = module if call is None else call.model
    if call is not None:
        install_save_pretrained(call.model)
    name, converted = None, False
    for n, m in root.named_modules():
        if m is module and name is None:
            name = n
        if isinstance(m, QuadsModule):
            if m.quads_policy != policy:
                raise ValueError(
                    f"model is already quantized by quads with another policy (e.g. {n!r}: "
                    f"{m.quads_policy}); build a fresh model to re-quantize"
                )
            converted = True
    if name is None:  # pragma: no cover - torchao only hands over modules of the model it walks
        raise RuntimeError(f"{type(module).__name__} is not a submodule of the model torchao is quantizing")
    if not converted and call is not None and call.filter_fn is not None:
        _check_whole_walk(root, call.filter_fn, policy)
    pending = [t for t in _targets_in(module, name, policy, root) if not isinstance(t.module, QuadsModule)]
    if policy.weight_global_scale == "group":
        pending += _unconverted_siblings(root, pending, policy, None if call is None else call.filter_fn)
    convert_targets(pending, policy, root)
    return module


def _unconverted_siblings(root: nn.Module, pending: list[ConversionTarget], policy: QuadsPolicy,
                          filter_fn) -> list[ConversionTarget]:
    """Group mode: the sibling linears (:data:`SIBLING_PROJECTIONS`) of the pending linears that
    the policy converts and torchao's filter selects (any, under ``FqnToConfig``) but that torchao
    has not handed over yet. They are converted in the same call: the group's global scale comes
    from every member's dense weight, which a member converted alone could not see."""
    have = {t.name for t in pending}
    extra = []
    for t in pending:
        if t.kind != "linear":
            continue
        parent_name, _, child = t.name.rpartition(".")
        parent = root.get_submodule(parent_name)
        for siblings in SIBLING_PROJECTIONS:
            if child not in siblings:
                continue
            for s in siblings:
                qualified = _join(parent_name, s)
                m = getattr(parent, s, None)
                if (qualified in have or m is None or isinstance(m, QuadsModule) or target_kind(m) != "linear"
                        or policy.skips(qualified) or (filter_fn is not None and not filter_fn(m, qualified))):
                    continue
                have.add(qualified)
                extra.append(ConversionTarget(qualified, m, "linear"))
    return extra


def register() -> None:
    """Make ``QuadsPolicy`` a torchao ``AOBaseConfig`` and register its handler (idempotent)."""
    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import register_quantize_module_handler

    AOBaseConfig.register(QuadsPolicy)
    register_quantize_module_handler(QuadsPolicy)(apply_policy)
