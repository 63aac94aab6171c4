"""Repeated weight syncs replayed from CUDA graphs: :func:`quads.sync_weights_` at a fraction of its host cost.

The eager sync launches tens of small kernels per weight (quantizer, checks, the layout's repack
and scales): 1-2.5 ms of Python per weight on the fast path, well under 1 ms of device time.
:class:`GraphedSync` runs it once eagerly, then captures two CUDA graphs over the same plan:

* **stage**: every master re-quantized into graph-owned tensors, the checks' reductions
  (:class:`quads.tensor.finite.FiniteProbe`) launched; then the checks are read (one host sync):
  a failure raises the eager sync's ValueError, nothing written;
* **write**: a snapshot of what is overwritten, the staged values written in place, the modules'
  derived copies (a sibling set's stacked layout) rewritten; then host bookkeeping only
  (:meth:`~quads.policies.modules.QuadsModule.quads_weights_rewritten`). Any exception once the
  write was launched (KeyboardInterrupt included) restores the snapshot: all or nothing.

Same bits as the eager sync (the same kernels), checked once per capture: the written tensors are
cleared and the first replay must write the eager sync's bytes again (else every call is eager).
The plan is made again per call and compared with every object and address the graphs use; any
difference (a parameter replaced or cast, a layout rebuilt, a set fused) runs the eager sync and
recaptures. Memory: the staged values and the snapshot stay allocated (about twice the packed
bytes plus the dense parameters). Where capture is impossible every call is the eager sync and
:attr:`GraphedSync.blocker` says why.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from quads.policies.scope import conversion_mismatch
from quads.policies.shards import has_sharded_parameters
from quads.policies.sync import (
    NOTHING_WRITTEN,
    _plan,
    _probe,
    _put,
    _restore,
    _snapshot,
    _stage,
    _sync,
    _written_modules,
)
from quads.policies.sync_lock import rollout_write_lock
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["GraphedSync"]


def _written_storage(param: torch.Tensor) -> tuple:
    """The addresses a write into ``param`` lands on."""
    if hasattr(param, "written_storage"):
        return tuple(t.data_ptr() for t in param.written_storage())
    return (param.data_ptr(),)


def _written(writes) -> list[torch.Tensor]:
    return [t.detach() for w in writes for t in (w.param.written_storage() if w.packed else (w.param,))]


def _fingerprint(writes) -> torch.Tensor:
    """One int64 byte sum per tensor the writes land on: what the first replay is checked against."""
    return torch.stack([t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64) for t in _written(writes)])


class _Same:
    """An object of the plan key: equal only to itself, and held by the key, so no new object can
    take its id while captured graphs that read or write it are kept."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _plan_key(writes, modules) -> tuple:
    """Everything the captured graphs depend on: the plan (which tensors, of which dtypes, how
    quantized, which global-scale groups) and every object and address they read or write."""
    key = []
    for w in writes:
        s = w.source
        key.append((_Same(w.param), w.param.dtype, w.param.device, s.data_ptr(), s.dtype, tuple(s.shape),
                    s.stride(), _Same(w.backend), w.block_scaling,
                    tuple(_Same(g.param) for g in w.group) if w.group else None, _written_storage(w.param)))
    for m in modules:
        stacked = getattr(getattr(m, "quads_group", None), "stacked", None)
        # a set with a stacked layout is written by the sync (its rows' scales, its copy); one
        # without (a decoder's dormant set, made after a capture) is not, so it is not part of the key
        key.append((_Same(m), _Same(m.quads_backend), _Same(m.quads_group if stacked is not None else None),
                    _Same(stacked), tuple(_Same(p) for p in m.quads_prepared)))
    return tuple(key)


class CudaGraphCapture:
    """``fn`` captured as one CUDA graph (not run); ``replay()`` runs it and returns what ``fn``
    returned at capture (its tensors hold the replay's values: same addresses)."""

    needs_cuda = True

    def __init__(self, fn):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = fn()

    def replay(self):
        self.graph.replay()
        return self.out


class RerunCapture:
    """The same contract by running ``fn`` again at each replay (no graph): the transaction around
    the graphs on a machine without CUDA (tests)."""

    needs_cuda = False

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        return self.fn()


class GraphedSync:
    """``sync()`` == ``quads.sync_weights_(rollout_model, trainer_model)`` (same bits, errors and
    transaction), replayed from CUDA graphs once captured (module doc). One per (rollout,
    trainer) pair; calls take the rollout's write lock like the eager sync. ``capture``: how the
    two phases are recorded (:class:`CudaGraphCapture`; :class:`RerunCapture` runs them again)."""

    capture = CudaGraphCapture

    def __init__(self, rollout_model: nn.Module, trainer_model: nn.Module):
        for what, model in (("rollout_model", rollout_model), ("trainer_model", trainer_model)):
            if not isinstance(model, nn.Module):
                raise TypeError(f"GraphedSync: {what} must be an nn.Module, got {type(model).__name__}")
        self.rollout_model, self.trainer_model = rollout_model, trainer_model
        self.blocker: str | None = None  # why calls run eagerly (None: captured, or not tried yet)
        self.replays = 0  # calls served by the graphs
        self.last_replayed = False  # whether the latest call was served by the graphs
        self.captures = 0
        self._failed = False  # a capture failed on these models: every call eager (until release())
        self._captured = None  # (key, count, stage, write, writes, modules, snapshots, launches)

    @torch.no_grad()
    def __call__(self) -> int:
        with rollout_write_lock(self.rollout_model):
            return self._sync()

    def release(self) -> None:
        """Drop the graphs and what they hold (staged values, snapshot); the next call recaptures."""
        self._captured, self._failed = None, False

    # -- one call ----------------------------------------------------------------------------------
    def _sync(self) -> int:
        rollout, trainer = self.rollout_model, self.trainer_model
        self.last_replayed = False
        mismatch = conversion_mismatch(rollout, trainer)
        if mismatch:
            raise ValueError(f"sync_weights_: nothing was written; {mismatch}")
        if has_sharded_parameters(trainer) or not self._capturable():
            self._captured = None  # graphs of a plan that cannot come back without a new capture
            return _sync(rollout, trainer, True)
        writes = _plan(rollout, trainer, True)
        modules = _written_modules(writes, rollout)
        key = _plan_key(writes, modules)
        if self._captured is None or self._captured[0] != key:
            self._captured = None
            n = _sync(rollout, trainer, True)  # errors, kernels compiled, layouts made: as always
            self._capture()
            return n
        return self._replay()

    def _capturable(self) -> bool:
        if self._failed:
            return False
        if not any(isinstance(p, NVFP4Tensor) for p in self.rollout_model.parameters()):
            self.blocker = "no packed weights: the eager sync is one copy per parameter"
            return False
        devices = {p.device for p in self.rollout_model.parameters()} | {p.device for p in self.trainer_model.parameters()}
        if self.capture.needs_cuda and (len(devices) != 1 or next(iter(devices)).type != "cuda"):
            self.blocker = f"needs one CUDA device for both models, got {sorted(str(d) for d in devices)}"
            return False
        return True

    def _replay(self) -> int:
        _, count, stage, write, writes, modules, snapshots, launches = self._captured
        stage.replay().check(NOTHING_WRITTEN)
        launched = int(launches)  # (the stream is idle after the check: one small read)
        try:
            write.replay()
            for w in writes:  # the host's record of the writes (the graph moved no version counter)
                if w.packed:
                    w.param.mark_written_()
                else:
                    torch.autograd.graph.increment_version(w.param)
            for module in modules:
                module.quads_weights_rewritten()
        except BaseException:
            if int(launches) != launched:  # the write ran: undo it (before its launch the snapshot is stale)
                for w, old in reversed(list(zip(writes, snapshots))):
                    _restore(w, old)
                for module in modules:
                    module.quads_weights_changed()
            raise
        self.replays += 1
        self.last_replayed = True
        return count

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self) -> None:
        """Capture stage and write over a fresh plan, then replay them once (the host state the
        capture recorded, e.g. the layouts' staged parts, then holds real values). A failure leaves
        the eager sync's result in place and every later call eager."""
        rollout, trainer = self.rollout_model, self.trainer_model
        writes = _plan(rollout, trainer, True)
        modules = _written_modules(writes, rollout)

        def stage():
            _stage(writes)
            return _probe(writes)

        snapshots: list = []  # filled at capture (CUDA: the graph rewrites their values) or at each rerun
        device = writes[0].param.device
        launches = torch.zeros((), dtype=torch.int64, device=device)  # the write's runs, counted by itself

        def write():
            snapshots.clear()
            launches.add_(1)
            for w in writes:
                snapshots.append(_snapshot(w))  # before its first byte is overwritten
                _put(w, w.staged)
            for module in modules:
                module.quads_weights_changed()

        expected = _fingerprint(writes)  # the eager sync just wrote these masters' values
        try:
            if self.capture.needs_cuda:
                torch.cuda.synchronize(device)
            captured = self.capture(stage), self.capture(write)
        except Exception as e:  # noqa: BLE001 - any capture failure: stay eager, say why
            self._give_up(f"capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return
        self._captured = (_plan_key(writes, modules), len(writes), *captured, writes, modules, snapshots, launches)
        self.captures += 1
        self.blocker = None
        # the first replay is checked: every written tensor cleared, then it must write the eager
        # sync's bytes again (same masters); a write the capture lost leaves zeros
        try:
            for t in _written(writes):
                t.zero_()
            self._replay()
        except BaseException:
            self._give_up("the first replay raised")
            raise
        self.replays -= 1  # the capture's own replay is not a served call
        self.last_replayed = False
        if not torch.equal(_fingerprint(writes), expected):
            self._give_up("the first replay wrote other bytes than the eager sync (a launch the capture lost)")

    def _give_up(self, why: str) -> None:
        """Every later call eager, the graphs dropped, the eager sync's result written again."""
        self.blocker, self._captured, self._failed = why, None, True
        device = next(self.rollout_model.parameters()).device
        if self.capture.needs_cuda:
            torch.cuda.synchronize(device)
        _sync(self.rollout_model, self.trainer_model, True)
