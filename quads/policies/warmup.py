"""Compile the rollout's just-in-time kernels before the first rollout, with a progress line.

humming (``QuadsPolicy(kernel="fast")``) compiles its GEMMs with NVRTC on a layer's first call:
tens of seconds for a model's worth of shapes in a fresh process, seconds once its disk cache
(:func:`quads.ops.backends.humming.library.humming_cache_dir`) holds them. :func:`warm_up_kernels` pays
that once, outside any graph capture, and says so; the graphed decoder calls it before its first
rollout. The exact Triton kernels need no warm-up (compiled at the decoder's warm-up step).

Weights whose kernels are the same (one ``warmup_key``: shape, dtype, experts, mode, tuning) form a
group: one weight of each group is warmed on a thread of its own, all groups at once (humming
compiles a layer's M intervals in parallel itself; its disk cache is file-locked), then the other
weights of each group, which find the group's kernels in humming's in-process cache.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch
import torch.nn as nn

from quads.policies.modules import RolloutModule

__all__ = ["warm_up_kernels"]


def _jit_weights(model: nn.Module) -> list[tuple[object, torch.dtype]]:
    """(prepared weight, activation dtype of its GEMM) of every weight a JIT backend holds, the
    stacked weights of fused sibling sets included."""
    out = []
    for module in model.modules():
        if not isinstance(module, RolloutModule):
            continue
        # W4A4 multiplies quads' fp16 operands; weight-only W4A16 the activations' own dtype
        dtype = torch.float16 if module.quads_act is not None else getattr(module, module.quads_packed_names[0]).dtype
        out += [(p, dtype) for p in module.quads_prepared if hasattr(p, "warmup")]
        stacked = getattr(getattr(getattr(module, "quads_group", None), "stacked", None), "weight", None)
        if hasattr(stacked, "warmup"):  # the set's GEMM: the same activation dtype as its members'
            out.append((stacked, dtype))
    return out


def _groups(weights) -> list[list[tuple[object, torch.dtype]]]:
    """``weights`` grouped by the kernels they compile, in first-seen order (a weight without a
    ``warmup_key`` is a group of its own; one weight held twice is warmed once)."""
    groups: dict[object, list] = {}
    seen: set[tuple[int, torch.dtype]] = set()
    for prepared, dtype in weights:
        if (id(prepared), dtype) in seen:
            continue
        seen.add((id(prepared), dtype))
        key = prepared.warmup_key(dtype) if hasattr(prepared, "warmup_key") else ("own", id(prepared), dtype)
        groups.setdefault(key, []).append((prepared, dtype))
    return list(groups.values())


def _build_workers() -> int:
    """humming's bound on parallel kernel builds (the CPUs available to it), else the CPU count."""
    try:
        from humming.utils.cpu import get_parallel_build_workers
    except ImportError:
        return os.cpu_count() or 1
    return get_parallel_build_workers()


def _warm(prepared, dtype: torch.dtype) -> None:
    """Warm one weight on the calling thread, on its own device (a thread starts on device 0)."""
    device = torch.device(getattr(prepared, "device", "cpu"))
    if device.type == "cuda":
        with torch.cuda.device(device):
            prepared.warmup(dtypes=(dtype,))
    else:
        prepared.warmup(dtypes=(dtype,))


def _warm_firsts(groups, workers: int) -> None:
    """The first weight of every group, ``workers`` threads at a time; the first error raised as it
    is (the groups not started are cancelled, the running ones finish)."""
    if workers <= 1 or len(groups) == 1:
        for group in groups:
            _warm(*group[0])
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quads-warmup")
    try:
        futures = [pool.submit(_warm, *group[0]) for group in groups]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def warm_up_kernels(model: nn.Module, log=None, workers: int | None = None) -> float:
    """Compile (or load from the disk cache) every JIT kernel ``model``'s rollout modules use;
    returns the seconds it took (0.0 when none). Distinct kernel groups compile concurrently on
    up to ``workers`` threads (default: humming's parallel-build bound, else the CPU count). One
    line before and one after, on stderr (``log``: another callable taking the line)."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    weights = _jit_weights(model)
    if not weights:
        return 0.0
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    from quads.ops.backends.humming.library import humming_cache_dir

    groups = _groups(weights)
    say(f"quads: compiling the fast kernels (humming) for {sum(map(len, groups))} weights before the first rollout "
        f"(cached in {humming_cache_dir()}; a fresh cache takes tens of seconds) ...")
    start = time.perf_counter()
    _warm_firsts(groups, min(len(groups), workers or _build_workers()))
    for group in groups:  # the rest: humming's in-process cache holds their kernels now
        for prepared, dtype in group[1:]:
            _warm(prepared, dtype)
    for device in {torch.device(getattr(p, "device", "cpu")) for p, _ in weights}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    say(f"quads: fast kernels ready in {took:.1f} s ({len(groups)} distinct kernel groups)")
    return took
