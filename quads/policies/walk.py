"""Which modules of a model a precision policy converts: the one module walk.

Used by :func:`quads.quantize_` and by the FP8 reference rows of ``quads diagnose``, so every
conversion sees the same modules: each ``nn.Linear`` and each transformers-5 fused experts
module whose name the skip rule does not match and ``filter_fn(module, name)`` (if given) accepts.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch.nn as nn

from quads.policies.modules import is_fused_experts

__all__ = ["ConversionTarget", "FilterFn", "conversion_targets"]

FilterFn = Callable[[nn.Module, str], bool]


class ConversionTarget(NamedTuple):
    name: str
    module: nn.Module
    kind: str  # "linear" or "experts"


def conversion_targets(
    model: nn.Module, skips: Callable[[str], bool], filter_fn: FilterFn | None = None
) -> list[ConversionTarget]:
    """The modules to convert, in ``named_modules`` order."""
    targets = []
    for name, module in model.named_modules():
        if skips(name):
            continue
        if isinstance(module, nn.Linear):
            kind = "linear"
        elif is_fused_experts(module):
            kind = "experts"
        else:
            continue
        if filter_fn is not None and not filter_fn(module, name):
            continue
        targets.append(ConversionTarget(name, module, kind))
    return targets
