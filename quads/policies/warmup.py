"""Compile the rollout's just-in-time kernels before the first rollout, with a progress line.

humming (``QuadsPolicy(kernel="fast")``) compiles its GEMMs with NVRTC on a layer's first call:
about 20 s for a model's worth of shapes in a fresh process, seconds once its disk cache
(:func:`quads.ops.backends.humming.library.humming_cache_root`) holds them. :func:`warm_up_kernels` pays
that once, outside any graph capture, and says so; the graphed decoder calls it before its first
rollout. The exact Triton kernels need no warm-up (compiled at the decoder's warm-up step).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn as nn

from quads.policies.modules import RolloutModule

__all__ = ["warm_up_kernels"]


def _jit_weights(model: nn.Module) -> list[tuple[object, torch.dtype]]:
    """(prepared weight, activation dtype of its GEMM) of every weight a JIT backend holds."""
    out = []
    for module in model.modules():
        if not isinstance(module, RolloutModule):
            continue
        # W4A4 multiplies quads' fp16 operands; weight-only W4A16 the activations' own dtype
        dtype = torch.float16 if module.quads_act is not None else getattr(module, module.quads_packed_names[0]).dtype
        out += [(p, dtype) for p in module.quads_prepared if hasattr(p, "warmup")]
    return out


def warm_up_kernels(model: nn.Module, log=None) -> float:
    """Compile (or load from the disk cache) every JIT kernel ``model``'s rollout modules use;
    returns the seconds it took (0.0 when none). One line before and one after, on stderr
    (``log``: another callable taking the line)."""
    weights = _jit_weights(model)
    if not weights:
        return 0.0
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    from quads.ops.backends.humming.library import humming_cache_root

    cache = os.environ.get("HUMMING_CACHE_DIR") or humming_cache_root()
    say(f"quads: compiling the fast kernels (humming) for {len(weights)} weights before the first rollout "
        f"(cached in {cache}; a fresh cache takes ~20 s) ...")
    start = time.perf_counter()
    for prepared, dtype in weights:
        prepared.warmup(dtypes=(dtype,))
    took = time.perf_counter() - start
    say(f"quads: fast kernels ready in {took:.1f} s")
    return took
