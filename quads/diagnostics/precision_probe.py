"""The precision probe: modules whose trainer computes in another dtype than its rollout twin.

A plan meant to be BF16 on both sides can multiply some GEMMs in FP32 in the trainer: an op
autocast does not cast (transformers' ``grouped_mm`` experts with FP32 masters). Such a module
drifts from its BF16 rollout twin as the masters move by less than a BF16 step, and the
rollout-vs-trainer gap grows. :func:`precision_probe` runs one tiny forward (a few tokens) of
the trainer under its autocast setting and one of the rollout, records per module the dtype of
the activation operand of every matmul-like op (attributed to the innermost module running,
through forward pre/post hooks), and returns the modules where the two differ. Modules quads
converts (on either side) are left out: their numerics are the plan's (an NVFP4 W4A4 rollout
GEMM has no BF16 operand to compare; the alignment of the two sides is tested on its own).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from quads.policies.quantize import quantized_modules

__all__ = ["MATMUL_OPS", "PrecisionMismatch", "compute_dtypes", "precision_probe", "probe_warning"]

#: aten ops (overload packet names) whose operand dtype is a module's compute dtype
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm", "grouped_mm", "matmul"})
_BIAS_FIRST = frozenset({"addmm", "baddbmm"})  # (bias/input, activation, weight)


def _activation(func, args) -> torch.Tensor | None:
    name = func.overloadpacket.__name__
    namespace = func.namespace
    if namespace == "aten" and name in MATMUL_OPS:
        x = args[1] if name in _BIAS_FIRST else args[0]
    elif namespace == "quads":
        x = args[0] if args else None
    else:
        return None
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


class _Recorder(TorchDispatchMode):
    """Adds the activation operand's dtype of every matmul-like op to the innermost module's set."""

    def __init__(self, stack: list[str], seen: dict[str, set[torch.dtype]]):
        super().__init__()
        self.stack, self.seen = stack, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = _activation(func, args)
        if x is not None and self.stack:
            self.seen.setdefault(self.stack[-1], set()).add(x.dtype)
        return func(*args, **(kwargs or {}))


def compute_dtypes(model: nn.Module, input_ids: torch.Tensor,
                   autocast_dtype: torch.dtype | None = None) -> dict[str, set[torch.dtype]]:
    """Module name -> dtypes its matmul-like ops computed in, over one no-grad forward of
    ``input_ids`` (under ``autocast_dtype`` autocast on the ids' device when given)."""
    stack: list[str] = []
    seen: dict[str, set[torch.dtype]] = {}
    handles = []

    def leave(module, args, output) -> None:  # returns None: the module's output is kept
        stack.pop()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name) and None))
        handles.append(module.register_forward_hook(leave, always_call=True))
    cast = (torch.autocast(input_ids.device.type, dtype=autocast_dtype) if autocast_dtype is not None
            else contextlib.nullcontext())
    try:
        with torch.no_grad(), _Recorder(stack, seen), cast:
            model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def _names(dtypes: set[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


@dataclass(frozen=True)
class PrecisionMismatch:
    """A module whose trainer and rollout matmuls compute in different dtypes."""

    module: str
    trainer: str
    rollout: str

    def line(self) -> str:
        return f"{self.module}: trainer {self.trainer}, rollout {self.rollout}"


def precision_probe(trainer: nn.Module, rollout: nn.Module, autocast_dtype: torch.dtype | None = torch.bfloat16,
                    tokens: int = 8) -> list[PrecisionMismatch]:
    """The modules (in the trainer's order) whose matmul dtypes differ between ``trainer`` (run
    under ``autocast_dtype`` autocast; None: none) and ``rollout`` (run as it is), on one forward of
    ``tokens`` token ids on the trainer's device. Modules one side does not run, or that quads
    converts, are left out."""
    if tokens < 1:
        raise ValueError(f"precision_probe: tokens must be >= 1, got {tokens}")
    device = next(trainer.parameters()).device
    vocab = getattr(getattr(trainer, "config", None), "vocab_size", None) or 2
    ids = (torch.arange(1, tokens + 1, device=device) % vocab)[None]
    t = compute_dtypes(trainer, ids, autocast_dtype)
    r = compute_dtypes(rollout, ids.to(next(rollout.parameters()).device))
    converted = set(quantized_modules(trainer)) | set(quantized_modules(rollout))
    return [PrecisionMismatch(name, _names(t[name]), _names(r[name]))
            for name in t if name in r and name not in converted and t[name] != r[name]]


def probe_warning(mismatches: list[PrecisionMismatch]) -> str | None:
    """One line naming the first mismatched module, the count and the fix (None: no mismatch)."""
    if not mismatches:
        return None
    return (f"quads precision probe: {len(mismatches)} module(s) compute in another dtype in the trainer than in "
            f"its rollout twin, first {mismatches[0].line()}; the rollout-vs-trainer gap grows as the masters "
            "move. Fix: quads_policy='bf16' (and every quads plan) computes unquantized experts in the autocast "
            "dtype (quads.prepare_trainer_), or cast the trainer model to the rollout dtype")
