"""Which modules of a model a precision policy converts: the one module walk.

Used by :func:`quads.quantize_`, ``quads export``, the torchao handler and the FP8 reference rows
of ``quads diagnose``, so every conversion sees the same modules: each ``nn.Linear`` and each
transformers-5 fused experts module whose name the skip rule does not match and
``filter_fn(module, name)`` (if given) accepts. A policy's skip rule
(:func:`policy_targets`) is its skip patterns, its ``scope`` and its boundary decoder layers
(:mod:`quads.policies.scope`).

A subclass of ``nn.Linear`` that overrides ``forward`` (``super().forward(x) * 2 + 1``,
transformers' ``DeepseekV4GroupedLinear``, which reshapes) is refused, naming it: converting
it would replace its forward with a plain linear one on both sides, a different model with no
error. Skip it (``QuadsPolicy(extra_skip_patterns=...)`` or ``filter_fn``) to keep it dense.
An instance-level override (``m.forward = f``, or an accelerate hook's wrapper) is refused the
same way, for any module the walk would convert: the instance's ``forward`` shadows the class
quads swaps in, so the layer would silently stay unquantized on one side while a rollout built
from the config (which has no ``f``) is quantized on the other.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch.nn as nn

from quads.policies.modules import QuadsModule, is_fused_experts
from quads.policies.policy import QuadsPolicy
from quads.policies.scope import policy_skips

__all__ = ["ConversionTarget", "FilterFn", "conversion_targets", "policy_targets", "target_kind", "overridden_forward",
           "instance_forward"]

FilterFn = Callable[[nn.Module, str], bool]


class ConversionTarget(NamedTuple):
    name: str
    module: nn.Module
    kind: str  # "linear" or "experts"


def target_kind(module: nn.Module) -> str | None:
    """``"linear"`` (an ``nn.Linear``), ``"experts"`` (transformers-5 fused experts) or None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if is_fused_experts(module):
        return "experts"
    return None


def overridden_forward(module: nn.Module) -> bool:
    """True for an ``nn.Linear`` subclass with its own ``forward`` (quads' modules excepted)."""
    return (isinstance(module, nn.Linear) and not isinstance(module, QuadsModule)
            and type(module).forward is not nn.Linear.forward)


def instance_forward(module: nn.Module) -> bool:
    """True if ``module`` has its own ``forward`` attribute (``m.forward = f``), shadowing its class's."""
    return "forward" in vars(module)


def _refuse_instance_forward(name: str, module: nn.Module) -> None:
    hooked = " (an accelerate hook: load the model on one device, without offloading)" \
        if hasattr(module, "_hf_hook") else ""
    raise TypeError(
        f"{name or '<root>'} has an instance-level forward ({name or 'module'}.forward = ...){hooked}; quads converts "
        "a module by its class, which that forward would shadow: the layer would stay unquantized. Remove the "
        f"override, or keep the module dense: QuadsPolicy(extra_skip_patterns=[{name!r}]) or a filter_fn"
    )


def conversion_targets(
    model: nn.Module, skips: Callable[[str], bool], filter_fn: FilterFn | None = None, prefix: str = ""
) -> list[ConversionTarget]:
    """The modules to convert, in ``named_modules`` order.

    ``prefix`` is ``model``'s own name when it is a submodule of a larger model (the torchao
    bridge converts submodules): names, skip patterns and ``filter_fn`` then see full names.
    """
    targets = []
    for rel_name, module in model.named_modules():
        name = f"{prefix}.{rel_name}" if prefix and rel_name else (prefix or rel_name)
        if skips(name):
            continue
        kind = target_kind(module)
        if kind is None:
            continue
        if filter_fn is not None and not filter_fn(module, name):
            continue
        if kind == "linear" and overridden_forward(module):
            cls = type(module)
            raise TypeError(
                f"{name or '<root>'} is a {cls.__module__}.{cls.__qualname__}, an nn.Linear subclass with its own "
                "forward; quads would replace that forward with a plain linear one (a different model). "
                f"Keep it dense: QuadsPolicy(extra_skip_patterns=[{name!r}]) or a filter_fn"
            )
        if instance_forward(module):
            _refuse_instance_forward(name, module)
        targets.append(ConversionTarget(name, module, kind))
    return targets


def policy_targets(model: nn.Module, policy: QuadsPolicy, filter_fn: FilterFn | None = None, *,
                   root: nn.Module | None = None, prefix: str = "") -> list[ConversionTarget]:
    """The modules ``policy`` converts in ``model``: :func:`conversion_targets` under the policy's
    skip patterns, scope and boundary layers, numbered in ``root`` (default ``model``; a
    submodule's walk passes the whole model and the submodule's name as ``prefix``).

    Raises ValueError, naming the model, when the scope or boundary cannot apply to it."""
    return conversion_targets(model, policy_skips(root if root is not None else model, policy), filter_fn, prefix)
