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


def _lock_of(model: nn.Module) -> threading.RLock:
    """The model's lock, made on first use. No lock guards the table: ``dict.setdefault`` is atomic
    under the GIL, and a table lock would be held forever by a ``with`` whose exit an interrupt
    skips (an interrupt can land after the block's last line, before its ``__exit__``)."""
    lock = _LOCKS.get(model)
    return lock if lock is not None else _LOCKS.setdefault(model, threading.RLock())


@contextlib.contextmanager
def rollout_write_lock(model: nn.Module) -> Iterator[None]:
    """Hold ``model``'s weight-write lock for the block (waiting for another writer to finish)."""
    lock = _lock_of(model)
    with lock:
        yield
