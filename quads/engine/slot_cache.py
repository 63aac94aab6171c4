"""A fixed-length key/value cache written at the slots the decoder sets.

:func:`SlotCache` builds a transformers ``Cache`` whose layers write ``index_copy_`` at
``state.slots`` (prefill: ``arange(P)``; decode: the session's one-slot tensor), so the decode
step has static shapes and does not depend on a transformers version's cache bookkeeping. The
transformers parts relied on: ``Cache.update`` and a prepared 4-D mask.
"""

from __future__ import annotations

import torch

__all__ = ["SlotCache", "Slots"]


class _SlotLayer:
    """One layer's fixed-size key/value cache, written at the decoder's current slots."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, state: "Slots"):
        self.state = state
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        length = self.state.cache_len
        self.keys = key_states.new_zeros((b, h, length, dk))
        self.values = value_states.new_zeros((b, h, length, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.state.slots
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.cache_len, 0

    def get_seq_length(self) -> int:
        return self.state.seen

    def get_max_length(self) -> int:
        return self.state.cache_len

    def get_max_cache_shape(self) -> int:
        return self.state.cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()

    def offload(self):  # never offloaded
        pass

    def prefetch(self):
        pass


def _slot_cache_class():
    from transformers.cache_utils import Cache

    class SlotCache(Cache):
        """A transformers ``Cache`` of :class:`_SlotLayer` s (one per decoder layer)."""

        def __init__(self, state: "Slots", num_layers: int):
            super().__init__(layers=[_SlotLayer(state) for _ in range(num_layers)])

    return SlotCache


def SlotCache(state: "Slots", num_layers: int):  # noqa: N802 - a class built on first use
    """Build a fixed-length cache written at ``state.slots`` (transformers imported lazily)."""
    return _slot_cache_class()(state, num_layers)


class Slots:
    """Where the cache layers write (shared by the session and its layers; holds no graph, so
    session -> cache -> layers -> slots has no reference cycle: a dropped session, CUDA graph
    included, is freed at once, never by a garbage collection in the middle of a capture)."""

    def __init__(self, cache_len: int, slots: torch.Tensor):
        self.cache_len = cache_len
        self.slots = slots  # prefill: arange(P); decode: the session's one-slot tensor
        self.seen = 0  # host-side count, only for get_seq_length (models we pass positions to ignore it)
