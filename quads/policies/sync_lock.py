"""One weight writer at a time per rollout model: the lock ``sync_weights_`` holds.

Two trainer threads syncing into one rollout at once would interleave their in-place writes
and leave weights with the packed codes of one trainer and the scales of the other (a torn
rollout that still computes plausible numbers). Every sync therefore holds its rollout's lock
for the whole transaction (plan, stage, check, write): a second sync of the same rollout waits
and then writes whole; syncs of different rollouts run in parallel. The lock is reentrant (a
sync inside a sync of the same thread does not deadlock) and lives beside the model, in a
weak-keyed table, so it never travels with ``copy.deepcopy``, pickling or ``torch.save``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch.nn as nn

__all__ = ["rollout_write_lock"]

_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_TABLE_LOCK = threading.Lock()


def _lock_of(model: nn.Module) -> threading.RLock:
    with _TABLE_LOCK:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


@contextlib.contextmanager
def rollout_write_lock(model: nn.Module) -> Iterator[None]:
    """Hold ``model``'s weight-write lock for the block (waiting for another writer to finish)."""
    lock = _lock_of(model)
    with lock:
        yield
