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
from quads.policies.walk import FilterFn, conversion_targets
from quads.tensor.nvfp4_math import BLOCK_SIZE
from quads.tensor.nvfp4_tensor import NVFP4Tensor, check_finite

__all__ = ["quantize_", "quantized_modules", "pack_weight"]

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


def _convert_linear(module: nn.Linear, name: str, policy: QuadsPolicy) -> None:
    _check_k(module.weight, f"{name}.weight")
    if policy.side == "trainer":
        _swap_class(module, TrainerLinear)
    else:
        backend = select_backend(module.weight.device)
        _pack_parameter(module, "weight", f"{name}.weight", backend)
        _swap_class(module, RolloutLinear)
        module.quads_backend = backend
        module.quads_policy = policy
        module.quads_weights_changed()
    module.quads_policy = policy


def _convert_experts(module: nn.Module, name: str, policy: QuadsPolicy) -> None:
    if getattr(module, "is_transposed", False):
        raise NotImplementedError(f"{name}: transposed expert layouts (E, K, N) are not supported yet")
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        raise NotImplementedError(f"{name}: only concatenated gate/up experts are supported")
    for pname in ("gate_up_proj", "down_proj"):
        _check_k(getattr(module, pname), f"{name}.{pname}")
    if policy.side == "trainer":
        _swap_class(module, TrainerExperts)
    else:
        backend = select_backend(module.gate_up_proj.device)
        for pname in ("gate_up_proj", "down_proj"):
            _pack_parameter(module, pname, f"{name}.{pname}", backend)
        _swap_class(module, RolloutExperts)
        module.quads_backend = backend
        module.quads_policy = policy
        module.quads_weights_changed()
    module.quads_policy = policy


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

    Raises ValueError if the model is already quantized or nothing matches.
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
    with torch.no_grad():
        for name, module, kind in targets:
            if kind == "linear":
                _convert_linear(module, name, policy)
            else:
                _convert_experts(module, name, policy)
    return model
