"""`quantize_(model, policy)`: convert a model in place to a QUADS trainer or rollout model."""

from __future__ import annotations

import torch
import torch.nn as nn

from quads.ops.backend import Backend, select_backend
from quads.policies.modules import (
    QuadsModule,
    RolloutExperts,
    RolloutLinear,
    TrainerExperts,
    TrainerLinear,
)
from quads.policies.policy import QuadsPolicy
from quads.policies.walk import ConversionTarget, FilterFn, conversion_targets
from quads.tensor.nvfp4_math import BLOCK_SIZE
from quads.tensor.nvfp4_tensor import NVFP4Tensor, check_finite

__all__ = ["quantize_", "quantized_modules", "pack_weight", "check_target", "convert_targets"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"{mixin.__name__}_{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
    module.__class__ = _CLASS_CACHE[key]


def pack_weight(weight: torch.Tensor, backend: Backend, what: str = "weight") -> NVFP4Tensor:
    """A dense 2-D/3-D weight as an NVFP4Tensor, quantized by ``backend`` (same bits on any backend)."""
    check_finite(weight, what)
    return NVFP4Tensor(*backend.quantize_weight(weight.detach()), orig_dtype=weight.dtype)


def _pack_parameter(module: nn.Module, name: str, qualified: str, backend: Backend) -> None:
    """Replace a BF16 parameter by its packed NVFP4Tensor (frozen) under the same name."""
    packed = pack_weight(getattr(module, name).detach(), backend, qualified)
    setattr(module, name, nn.Parameter(packed, requires_grad=False))


def _check_k(weight: torch.Tensor, qualified: str) -> None:
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"{qualified}: input dim K={weight.shape[-1]} is not a multiple of {BLOCK_SIZE}; "
            "NVFP4 cannot quantize it. Exclude it with QuadsPolicy(extra_skip_patterns=...) or filter_fn."
        )
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{qualified}: cannot quantize a {weight.dtype} weight")


def _weight_names(kind: str) -> tuple[str, ...]:
    """The weight parameters a conversion target of ``kind`` quantizes."""
    return ("weight",) if kind == "linear" else ("gate_up_proj", "down_proj")


def check_target(target: ConversionTarget, policy: QuadsPolicy) -> None:
    """Raise (naming the module) if ``target`` cannot be converted per ``policy``; changes nothing."""
    name, module, kind = target
    if isinstance(module, QuadsModule):
        raise ValueError(f"{name!r} is already quantized by quads; build a fresh model to re-quantize")
    if kind == "experts":
        if getattr(module, "is_transposed", False):
            raise NotImplementedError(f"{name}: transposed expert layouts (E, K, N) are not supported yet")
        if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
            raise NotImplementedError(f"{name}: only concatenated gate/up experts are supported")
    for pname in _weight_names(kind):
        weight = getattr(module, pname)
        _check_k(weight, f"{name}.{pname}")
        if policy.side == "rollout":
            check_finite(weight, f"{name}.{pname}")


def _convert(target: ConversionTarget, policy: QuadsPolicy) -> None:
    name, module, kind = target
    trainer_mixin, rollout_mixin = (TrainerLinear, RolloutLinear) if kind == "linear" else (TrainerExperts, RolloutExperts)
    if policy.side == "trainer":
        _swap_class(module, trainer_mixin)
    else:
        backend = select_backend(getattr(module, _weight_names(kind)[0]).device)
        for pname in _weight_names(kind):
            _pack_parameter(module, pname, f"{name}.{pname}", backend)
        _swap_class(module, rollout_mixin)
        module.quads_backend = backend
        module.quads_policy = policy
        module.quads_weights_changed()
    module.quads_policy = policy


def convert_targets(targets: list[ConversionTarget], policy: QuadsPolicy) -> None:
    """Convert ``targets`` in place per ``policy``: all are checked first, so a bad one raises
    before any module is changed (never a half-converted model)."""
    for target in targets:
        check_target(target, policy)
    with torch.no_grad():
        for target in targets:
            _convert(target, policy)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module for every module converted by `quantize_`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuadsModule)}


def quantize_(model: nn.Module, policy: QuadsPolicy, filter_fn: FilterFn | None = None) -> nn.Module:
    """Convert ``model`` in place per ``policy`` and return it.

    Converted: every ``nn.Linear`` and every fused MoE experts module whose name is not
    matched by the policy's skip patterns and for which ``filter_fn(module, name)`` (if given)
    is true. Trainer side: weights stay BF16 parameters, fake-quantized in each forward with a
    straight-through gradient. Rollout side: weights become frozen ``NVFP4Tensor`` parameters
    and activations are quantized online (W4A4 + residual compensation); each rollout module
    stores the backend (:func:`quads.ops.select_backend`) for its weights' device.

    Raises ValueError if the model is already quantized or nothing matches, and (naming the
    module) if a target cannot be converted; every target is checked before any is changed.
    """
    if not isinstance(policy, QuadsPolicy):
        raise TypeError(f"quantize_ takes a QuadsPolicy, got {type(policy).__name__}")
    already = quantized_modules(model)
    if already:
        first = next(iter(already))
        raise ValueError(f"model is already quantized by quads (e.g. {first!r}); build a fresh model to re-quantize")

    targets = conversion_targets(model, policy.skips, filter_fn)
    if not targets:
        raise ValueError(
            "quantize_: the policy matched no module (no nn.Linear or fused MoE experts outside "
            f"the skip patterns {policy.all_skip_patterns}"
            + (" and accepted by filter_fn" if filter_fn else "")
            + ")"
        )
    convert_targets(targets, policy)
    return model
