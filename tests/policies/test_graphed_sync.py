"""GraphedSync: the sync's transaction around its captured phases (capture itself: GPU check ``graphed_sync``).

On CPU there are no CUDA graphs: the default capture makes every call the eager sync (and says
why); ``RerunCapture`` runs the captured phases again at each replay, which exercises everything
around the graphs: the plan key, the checks read after the stage, the write's snapshot and
restore, the modules' bookkeeping.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import quads
from quads.policies import graphed_sync as gs
from quads.policies.graphed_sync import GraphedSync, RerunCapture
from quads.tensor import NVFP4Tensor
from tests.model_state import assert_unchanged, snapshot
from tests.ops.test_humming_backend import fake_humming  # noqa: F401  (fixture)
from tests.ops.test_humming_memory import _fast_rollout, _llama
from tests.tiny_models import build


def _pair(kind="qwen3_moe", fuse=False):
    trainer = build(kind, seed=1)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    rollout, twin = build(kind, seed=2), build(kind, seed=2)
    for m in (rollout, twin):
        quads.quantize_(m, quads.QuadsPolicy(side="rollout"))
        if fuse:
            quads.fuse_projections_(m)
    return trainer, rollout, twin


def _step(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)


def _sync_like_eager(sync, trainer, twin, steps):
    """``steps`` optimizer-like steps, each synced by ``sync`` and by the eager sync into ``twin``:
    the same count and the same bits after every one."""
    for step in range(steps):
        _step(trainer, step)
        assert sync() == quads.sync_weights_(twin, trainer)
        assert _same(sync.rollout_model, twin), step


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


def _state(model):
    out = []
    for p in model.parameters():
        out += [t.reshape(-1).view(torch.uint8) for t in p.parts] if isinstance(p, NVFP4Tensor) else [p.detach()]
    return out


@pytest.fixture
def rerun(monkeypatch):
    monkeypatch.setattr(GraphedSync, "capture", RerunCapture)


class _Record(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        assert all(t in (torch.Tensor, torch.nn.Parameter) for t in types), (func, types)  # no subclass Python
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


_FACTORIES = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}


class RecordedCapture(RerunCapture):
    """A CPU stand-in for a CUDA graph, closer than :class:`RerunCapture`: ``fn``'s aten ops are
    recorded when it runs once at capture; a replay runs only them again on the same tensors (each
    output copied into the tensor made at capture), no Python of ``fn`` and no version counter
    moved. Host state the sync's code changes is then changed only at capture, as by a real replay.
    Triton launches are not aten ops: the torch backend's paths only."""

    def __init__(self, fn):
        self.ops = []
        with _Record(self.ops):
            self.out = fn()

    def replay(self):
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for func, args, kwargs, out in self.ops:
                if func in _FACTORIES:
                    continue
                new = func(*args, **kwargs)
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)}
                for held, value in zip(tree_leaves(out), tree_leaves(new)):
                    if isinstance(held, torch.Tensor) and held.untyped_storage().data_ptr() not in inputs:
                        held.copy_(value)  # not a view or an in-place write: the graph's own output
        return self.out


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(GraphedSync, "capture", RecordedCapture)


def test_cpu_default_is_the_eager_sync_and_says_why():
    trainer, rollout, twin = _pair()
    sync = GraphedSync(rollout, trainer)
    _sync_like_eager(sync, trainer, twin, 2)
    assert sync.replays == 0 and sync.captures == 0
    assert "CUDA" in sync.blocker


@pytest.mark.parametrize("capture", ["rerun", "recorded"])
@pytest.mark.parametrize("fuse", [False, True])
def test_replays_equal_the_eager_sync(capture, fuse, request):
    request.getfixturevalue(capture)
    trainer, rollout, twin = _pair(fuse=fuse)
    sync = GraphedSync(rollout, trainer)
    _sync_like_eager(sync, trainer, twin, 4)
    assert (sync.captures, sync.replays, sync.blocker, sync.last_replayed) == (1, 3, None, True)
    ids = torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        assert torch.equal(rollout(ids).logits, twin(ids).logits)


def test_replay_records_versions_so_nothing_is_rebuilt(rerun, monkeypatch):
    trainer, rollout, _ = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    _step(trainer, 1)
    versions = {id(p): p.parts_version() for p in rollout.parameters() if isinstance(p, NVFP4Tensor)}
    sync()
    assert all(p.parts_version() != versions[id(p)] for p in rollout.parameters() if isinstance(p, NVFP4Tensor))
    rebuilt = []
    for m in rollout.modules():
        if hasattr(m, "quads_weights_changed"):
            monkeypatch.setattr(m, "quads_weights_changed", lambda m=m: rebuilt.append(m))
    with torch.no_grad():
        rollout(torch.zeros(1, 3, dtype=torch.long))
    assert rebuilt == []


def test_a_replay_moves_the_version_counters(recorded):
    """What a replay wrote is seen by version-keyed caches (``quads.ops.weight_cache``), as an
    eager sync's write is."""
    from quads.ops.weight_cache import dequantized_weight, weight_cache_enabled
    from quads.tensor.nvfp4_math import nvfp4_dequantize

    trainer, rollout, _ = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    packed = [p for p in rollout.parameters() if isinstance(p, NVFP4Tensor)]
    dense = [p for p in rollout.parameters() if not isinstance(p, NVFP4Tensor)]
    with weight_cache_enabled():
        for p in packed:
            dequantized_weight(p.parts, torch.float32)
        versions = [p._version for p in dense]
        _step(trainer, 5)
        sync()
        assert sync.replays == 1
        assert all(p._version != v for p, v in zip(dense, versions))
        for p in packed:
            assert torch.equal(dequantized_weight(p.parts, torch.float32), nvfp4_dequantize(*p.parts, torch.float32))


def test_a_replaced_master_recaptures(rerun):
    trainer, rollout, twin = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    sync()
    master = trainer.model.layers[0].self_attn.q_proj.weight
    master.data = master.data.clone() * 1.5  # new storage: the captured plan read the old one
    sync()
    quads.sync_weights_(twin, trainer)
    assert _same(rollout, twin)
    assert sync.captures == 2


def test_a_rollout_dtype_changed_in_place_recaptures(recorded):
    """The graphs cast and range-check for the dtypes they were captured with: a parameter that
    changed dtype at the same address (a packed linear's ``half()``, a dense view as another dtype)
    is a new plan."""
    trainer, rollout, twin = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    for model in (rollout, twin):
        model.model.layers[0].self_attn.q_proj.half()
        norm = model.model.norm.weight
        norm.data = norm.data.view(torch.float16)
    _step(trainer, 4)
    sync()
    quads.sync_weights_(twin, trainer)
    assert sync.captures == 2
    assert _same(rollout, twin)


def test_what_the_graphs_write_stays_alive_while_they_are_held(rerun):
    """The plan key names objects by identity: one replaced between two calls (a sibling set made
    again) must not be freed while the graphs that write into it are held, or a new object could
    take its id and the key match."""
    import gc
    import weakref

    from quads.policies.fused_projections import unfuse_projections_

    trainer = quads.quantize_(_llama(1), quads.QuadsPolicy(side="trainer"))
    rollout = _llama(2)
    with quads.use_backend("hopper"):  # (its sets stack their layouts: the sync writes into them)
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    quads.fuse_projections_(rollout)
    sync = GraphedSync(rollout, trainer)
    sync()
    group = rollout.model.layers[0].self_attn.q_proj.quads_group
    assert group is not None and group.stacked is not None  # the sync writes into it
    old = weakref.ref(group)
    del group
    unfuse_projections_(rollout)
    gc.collect()
    assert old() is not None
    sync()  # a new plan: the old graphs, and what kept the set alive, are dropped
    gc.collect()
    assert sync.captures == 2 and old() is None


def test_a_call_that_turns_eager_drops_the_graphs(rerun):
    import gc
    import weakref

    trainer, rollout, twin = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    writes = sync._captured[4]
    staged = weakref.ref(next(w for w in writes if w.packed).staged.qdata)  # a graph-owned value
    del writes
    sync.capture = gs.CudaGraphCapture  # (on CPU: every call eager from now on)
    _step(trainer, 2)
    sync()
    gc.collect()
    assert sync._captured is None and staged() is None and "CUDA" in sync.blocker
    quads.sync_weights_(twin, trainer)
    assert _same(rollout, twin)


@pytest.mark.parametrize("capture", ["rerun", "recorded"])
def test_nan_master_is_refused_and_nothing_written(capture, request):
    request.getfixturevalue(capture)
    trainer, rollout, _ = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    sync()
    before = snapshot(rollout)
    with torch.no_grad():
        trainer.model.layers[1].mlp.experts.down_proj[-1, -1, -1] = float("nan")
    with pytest.raises(ValueError, match=r"nothing was written.*model\.layers\.1\.mlp\.experts\.down_proj"):
        sync()
    assert_unchanged(before, rollout)


@pytest.mark.parametrize("capture", ["rerun", "recorded"])
def test_interrupt_after_the_write_restores_everything(capture, monkeypatch, request):
    request.getfixturevalue(capture)
    trainer, rollout, _ = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    sync()
    before = snapshot(rollout)
    _step(trainer, 7)
    module = next(m for m in rollout.modules() if hasattr(m, "quads_weights_rewritten"))

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "quads_weights_rewritten", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sync()
    monkeypatch.undo()  # the patched method is an attribute of the module: gone before comparing
    assert_unchanged(before, rollout)


@pytest.mark.parametrize("capture", ["rerun", "recorded"])
def test_interrupt_before_the_write_is_launched_writes_nothing(capture, request):
    """An interrupt that lands before the write graph's launch: nothing was written, and nothing is
    "restored" from the snapshot, which then holds the values before the previous sync."""
    request.getfixturevalue(capture)
    trainer, rollout, _ = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    _step(trainer, 6)
    sync()
    before = snapshot(rollout)
    _step(trainer, 7)
    write = sync._captured[3]

    def interrupted():
        raise KeyboardInterrupt

    write.replay = interrupted
    with pytest.raises(KeyboardInterrupt):
        sync()
    assert_unchanged(before, rollout)


def test_interrupt_inside_the_write_restores_what_was_written(rerun, monkeypatch):
    trainer, rollout, _ = _pair()
    sync = GraphedSync(rollout, trainer)
    sync()
    sync()
    before = snapshot(rollout)
    _step(trainer, 8)
    real_put, calls = gs._put, []

    def put(w, value):
        calls.append(w.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_put(w, value)

    monkeypatch.setattr(gs, "_put", put)
    with pytest.raises(KeyboardInterrupt):
        sync()
    assert_unchanged(before, rollout)


def test_mark_written_moves_the_parts_version():
    w = NVFP4Tensor.from_float(torch.randn(32, 64))
    v = w.parts_version()
    w.mark_written_()
    assert w.parts_version() != v
    assert [t.data_ptr() for t in w.written_storage()] == [t.data_ptr() for t in w.parts]


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="rollout_model must be an nn.Module"):
        GraphedSync({}, torch.nn.Linear(2, 2))


#: ops a CUDA-graph capture refuses or cannot record: a tensor made from host data (``torch.tensor``,
#: indexing by a Python list: a copy from pageable host memory), a read of a device value, an output
#: whose size depends on device values (``nonzero``, ``masked_select``, indexing by a boolean mask)
_HOST_OPS = {torch.ops.aten.lift_fresh.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}


def _reads_the_device(func, args) -> bool:
    if func in _INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return func in _HOST_OPS


class _HostOps(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _reads_the_device(func, args):
            import traceback

            self.seen.append(f"{func}: {traceback.format_stack(limit=6)[0].strip()}")
        return func(*args, **(kwargs or {}))


def _fast_moe(seed):
    """A Qwen3-MoE (widths humming tiles without padding), its routed experts NVFP4 on the fast path."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=128, intermediate_size=128, moe_intermediate_size=128,
                         num_experts=2, num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def test_the_host_op_watch_sees_what_it_must():
    seen: list[str] = []
    x = torch.randn(4)
    for op in (lambda: x[[0, 2]], lambda: x[x > 0], lambda: x.sum().item(), lambda: torch.tensor([1.0]),
               lambda: x.tolist()):
        with _HostOps(seen), _tolist_watched(seen):
            op()
    assert len(seen) == 5, seen
    index = torch.tensor([0, 2])
    with _HostOps(seen), _tolist_watched(seen):
        x[index] * 2 + x.sum()  # device-only work: not flagged
    assert len(seen) == 5, seen


class _tolist_watched:
    """``Tensor.tolist`` (a device read no dispatch mode sees) recorded while active."""

    def __init__(self, seen):
        self.seen, self.real = seen, torch.Tensor.tolist

    def __enter__(self):
        seen, real = self.seen, self.real

        def tolist(t):
            seen.append("tolist")
            return real(t)

        torch.Tensor.tolist = tolist

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.real


@pytest.mark.parametrize("kind", ["exact", "fast", "fast-experts"])
def test_the_captured_phases_take_nothing_from_the_host(kind, monkeypatch, request):
    """What the graphs capture (stage, write: the quantizer, the checks' reductions, the layouts'
    writes, a sibling set's stacked copy) makes no tensor from host data and reads no device value:
    the CPU restatement of what CUDA-graph capture refuses. The replay's weights and forward are the
    eager sync's (the fast path: humming layouts and a stacked copy)."""
    seen: list[str] = []

    class Watched(RerunCapture):
        def replay(self):
            with _HostOps(seen), _tolist_watched(seen):
                return self.fn()

    monkeypatch.setattr(GraphedSync, "capture", Watched)
    if kind == "fast":
        request.getfixturevalue("fake_humming")
        trainer, rollout, twin = _llama(1), _fast_rollout(2), _fast_rollout(2)
    elif kind == "fast-experts":
        request.getfixturevalue("fake_humming")
        trainer, rollout, twin = _fast_moe(1), _fast_moe(2), _fast_moe(2)
        for model in (rollout, twin):
            with quads.use_backend("humming"):
                quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel="fast", scope="routed_experts"))
        assert any(type(getattr(m, "quads_prepared", (None,))[0]).__name__ == "HummingWeight"
                   for m in rollout.modules() if hasattr(m, "quads_prepared"))
    else:
        trainer, rollout, twin = build("qwen3_moe", seed=1), build("qwen3_moe", seed=2), build("qwen3_moe", seed=2)
        for model in (rollout, twin):
            quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", scope="routed_experts" if kind == "fast-experts" else "all"))
    for model in (rollout, twin):
        quads.fuse_projections_(model)
    sync = GraphedSync(rollout, trainer)
    sync()
    _step(trainer, 1)
    sync()
    assert sync.replays == 1 and not seen, seen[:3]
    quads.sync_weights_(twin, trainer)
    ids = torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        assert _same(rollout, twin) and torch.equal(rollout(ids).logits, twin(ids).logits)


def test_the_trl_engine_syncs_through_the_graphs_when_asked(rerun):
    from quads.integrations.trl.engine import QuadsRolloutEngine

    trainer, rollout, twin = _pair()
    engines = [QuadsRolloutEngine(model, trainer_model=lambda: trainer, global_step=lambda: 0,
                                  generation_config=None, pad_token_id=0, eos_token_ids=[1], graphed_sync=graphed)
               for model, graphed in ((rollout, True), (twin, False))]
    for step in range(3):
        _step(trainer, step)
        assert engines[0].sync_weights() == engines[1].sync_weights()
        assert _same(rollout, twin)
    assert engines[0].sync_report() == {"sync": "graphed", "captures": 1, "replays": 2, "sync_blocker": None}
    assert engines[1].sync_report()["sync"] == "eager"


def test_a_capture_that_loses_a_write_is_caught_at_the_first_replay(monkeypatch):
    """The first replay is checked against the eager sync's bytes: a write phase that ran nothing
    (a launch the capture did not record) makes every call eager, and says why; the rollout holds
    the eager sync's values."""
    made = []

    class LosesTheWrite(RerunCapture):
        def __init__(self, fn):
            super().__init__(fn)
            made.append(self)

        def replay(self):
            return None if self is made[1] else self.fn()

    monkeypatch.setattr(GraphedSync, "capture", LosesTheWrite)
    trainer, rollout, twin = _pair()
    sync = GraphedSync(rollout, trainer)
    _sync_like_eager(sync, trainer, twin, 3)
    assert sync.replays == 0 and sync.captures == 1 and "other bytes" in sync.blocker


def test_dormant_sibling_sets_made_after_a_capture_keep_its_graphs(rerun):
    """The decoder makes its dormant sibling sets (quantization sharing, no stacked layout: nothing
    on the device for a sync to write) at its first forward, after the sync's first capture: the
    next sync replays rather than capturing again."""
    from quads.policies.fused_projections import sibling_groups_

    trainer, rollout, twin = _pair("llama")
    sync = GraphedSync(rollout, trainer)
    _sync_like_eager(sync, trainer, twin, 1)
    assert sync.captures == 1
    sets = sibling_groups_(rollout)
    assert sets and all(s.stacked is None for s in sets)
    _sync_like_eager(sync, trainer, twin, 2)
    assert sync.captures == 1 and sync.replays == 2
