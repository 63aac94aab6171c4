"""A cache of tensors derived from weights, kept until the weight changes (off by default).

Between two weight syncs every forward recomputes the same things from the same weights: the
rollout reference dequantizes each packed weight, the W4A16 path dequantizes it to the
activation dtype, the FP8 reference rounds each weight to E4M3. :func:`cached_derived` computes
such a tensor once and returns it while the weight is unchanged (the QAT trainer never uses it).

**Stale entries.** An entry records each source's data pointer and version counter and keeps a
detached alias of it (its storage cannot be freed and reused). Replacing ``param.data`` or an
in-place write (``copy_``, an optimizer step) makes the next lookup recompute. **Not seen**:
writes through a tensor that shares the storage without being a view (``p.data.copy_``, ``set_``,
FSDP's all-gather into a flat parameter): such code calls :func:`clear_weight_cache`. Entries of
a collected source are dropped with it.

**Off by default; on only where weights cannot change behind its back.** Fused optimizers
(``AdamW(fused=True)``) and vLLM's weight loaders update parameters without bumping version
counters; a cache on by default served the trainer stale weights after fused optimizer steps.
So the budget is 0 and only code that owns its weights turns it on (``quads diagnose`` runs
inside :func:`weight_cache_enabled`); ``QUADS_WEIGHT_CACHE_MB`` sets it process-wide.

**Memory.** At most the budget in megabytes over all devices, least recently used first out.
Dequantized float32 values take 7x the packed weight. Traced, meta and inference-mode tensors are
never cached. Not thread-safe (like the modules that call it).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Hashable

import torch

from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize

__all__ = ["cached_derived", "dequantized_weight", "clear_weight_cache", "set_weight_cache_budget", "weight_cache_info",
           "weight_cache_enabled"]

_DEFAULT_BUDGET_MB = 0  # off: see the module doc
#: the budget ``weight_cache_enabled()`` uses (``quads diagnose``)
SCOPED_BUDGET_MB = 4096


class _Entry:
    __slots__ = ("stamp", "aliases", "value", "nbytes")

    def __init__(self, stamp, aliases, value: torch.Tensor):
        self.stamp = stamp
        self.aliases = aliases
        self.value = value
        self.nbytes = value.numel() * value.element_size()


class _DerivedCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.owner_keys: dict[int, set[tuple]] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def _drop_owner(self, owner_id: int) -> None:
        for key in self.owner_keys.pop(owner_id, ()):
            self._remove(key)

    def _remove(self, key: tuple) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _track(self, owner: torch.Tensor, key: tuple) -> None:
        keys = self.owner_keys.get(id(owner))
        if keys is None:
            keys = self.owner_keys[id(owner)] = set()
            weakref.finalize(owner, self._drop_owner, id(owner))
        keys.add(key)

    def get(self, kind: Hashable, sources: tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]):
        if self.budget <= 0 or not _cacheable(sources):
            return compute()
        first = sources[0]
        owner = first._base if first._base is not None else first
        key = (kind, id(owner), first.storage_offset(), tuple(first.shape), tuple(first.stride()))
        stamp = tuple((s.data_ptr(), s._version, s.dtype, s.device) for s in sources)
        entry = self.entries.get(key)
        if entry is not None and entry.stamp == stamp:
            self.entries.move_to_end(key)
            self.hits += 1
            return entry.value
        self.misses += 1
        with torch.no_grad(), torch.inference_mode(False):  # a normal tensor, usable outside inference mode
            value = compute()
        self._remove(key)
        new = _Entry(stamp, tuple(s.detach() for s in sources), value)
        if new.nbytes > self.budget:
            return value
        self.evict_to(self.budget - new.nbytes)
        self.entries[key] = new
        self.nbytes += new.nbytes
        self._track(owner, key)
        return value

    def evict_to(self, limit: int) -> None:
        """Drop least recently used entries until at most ``limit`` bytes remain."""
        while self.entries and self.nbytes > limit:
            _, entry = self.entries.popitem(last=False)
            self.nbytes -= entry.nbytes


def _cacheable(sources: tuple[torch.Tensor, ...]) -> bool:
    if torch.compiler.is_compiling():
        return False
    for s in sources:
        if type(s) not in (torch.Tensor, torch.nn.Parameter) or s.device.type == "meta" or s.is_inference():
            return False
    return True


def _budget_from_env() -> int:
    raw = os.environ.get("QUADS_WEIGHT_CACHE_MB", str(_DEFAULT_BUDGET_MB))
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"QUADS_WEIGHT_CACHE_MB must be a number of megabytes, got {raw!r}") from None
    return int(mb * 2**20)


_CACHE = _DerivedCache(_budget_from_env())


def cached_derived(kind: Hashable, sources: tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()`` (a tensor derived from ``sources``), cached until a source changes.

    ``kind`` names the derivation and everything besides the sources it depends on (e.g.
    ``("dequantize", torch.bfloat16)``). The first source identifies the weight (its base
    tensor and its view geometry). The returned tensor is shared: callers must not modify it.
    """
    return _CACHE.get(kind, sources, compute)


def dequantized_weight(parts: NVFP4Parts, dtype: torch.dtype, *, unscaled: bool = False) -> torch.Tensor:
    """:func:`~quads.tensor.nvfp4_math.nvfp4_dequantize` of packed weight parts, cached.

    ``unscaled=True``: ``e2m1 * f32(block scale)`` without the global scale (exact; the W4A4
    reference multiplies these and applies the global scales in the epilogue).
    """
    if unscaled:
        def unscaled_values():
            one = torch.ones((), dtype=torch.float32, device=parts.qdata.device)
            return nvfp4_dequantize(parts.qdata, parts.scale, one, dtype)

        return cached_derived(("unscaled", dtype), (parts.qdata, parts.scale), unscaled_values)
    return cached_derived(("dequantize", dtype), (parts.qdata, parts.scale, parts.global_encode_scale),
                          lambda: nvfp4_dequantize(parts.qdata, parts.scale, parts.global_encode_scale, dtype))


def clear_weight_cache() -> None:
    """Drop every cached tensor."""
    _CACHE.entries.clear()
    _CACHE.nbytes = 0


def set_weight_cache_budget(megabytes: float) -> None:
    """Set the cache's size limit (0 turns caching off); evicts down to it now."""
    _CACHE.budget = int(megabytes * 2**20)
    _CACHE.evict_to(max(_CACHE.budget, 0))


def weight_cache_info() -> dict:
    """``{"entries", "bytes", "budget_bytes", "hits", "misses"}`` (for tests and benchmarks)."""
    return {"entries": len(_CACHE.entries), "bytes": _CACHE.nbytes, "budget_bytes": _CACHE.budget,
            "hits": _CACHE.hits, "misses": _CACHE.misses}


@contextmanager
def weight_cache_enabled(megabytes: float = SCOPED_BUDGET_MB):
    """Cache derived weights inside the block (for code whose weights change only through
    in-place writes that bump version counters: ``quads diagnose``); the previous budget is
    restored and every entry dropped on exit. A process-wide budget already larger is kept."""
    previous = _CACHE.budget
    _CACHE.budget = max(previous, int(megabytes * 2**20))
    try:
        yield
    finally:
        _CACHE.budget = previous
        clear_weight_cache()
