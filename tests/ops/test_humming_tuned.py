"""The tuned humming table (quads.ops.backends.humming.tuning): its merge into humming's M-interval table,
the lookup by (device, N, K, dtype, mode, experts), file validation, and the layer configuration
it gives (unchanged where no entry matches)."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import quads
from quads.ops.backends.humming import backend as hb
from quads.ops.backends.humming import library as hg
from quads.ops.backends.humming import tuning as ht
from tests.ops.test_humming_backend import _ORIG_CONFIGS, _weight, fake_humming  # noqa: F401  (fixture)

DEVICE = "NVIDIA H200"
BIG = 1 << 30


def _pick(table, m):
    return next((cfg for lo, hi, cfg in table if lo < m <= hi), None)


def _cfg(tag, sk=True):
    return {"block_shape": [64, 128, 64], "warp_shape": [64, 32, 64], "use_stream_k": sk, "num_stages": tag}


def _table_file(tmp_path, entries, **over):
    data = {"format": ht.TABLE_FORMAT, "device": DEVICE, "humming": ht.HUMMING_REQUIREMENT, "entries": entries}
    data.update(over)
    path = tmp_path / "nvidia-h200.json"
    path.write_text(json.dumps(data))
    return path


def _entry(n=64, k=128, dtype="float16", mode="default", experts=None, intervals=None):
    return {"n": n, "k": k, "dtype": dtype, "mode": mode, "experts": experts,
            "intervals": intervals or [[48, 64, _cfg(7, sk=mode != "no_stream_k")]]}


# -- the merge -------------------------------------------------------------------------------------

def test_merge_gives_tuned_configs_on_their_intervals_and_humming_s_elsewhere():
    table = [[0, 8, "a"], [8, 64, "b"], [64, 512, "c"], [512, BIG, "d"]]
    tuned = [[16, 32, "T1"], [48, 100, "T2"], [600, 700, "T3"]]
    before = json.dumps([table, tuned])
    merged = ht.merge_tuned(table, tuned)
    for m in range(1, 1100):
        want = _pick(tuned, m) or _pick(table, m)
        assert _pick(merged, m) == want, m
    assert _pick(merged, BIG) == "d" and merged[0][0] == 0 and merged[-1][1] == BIG
    assert all(a[1] == b[0] for a, b in zip(merged, merged[1:]))  # contiguous, no empty piece
    assert all(lo < hi for lo, hi, _ in merged)
    assert json.dumps([table, tuned]) == before  # inputs not modified
    # humming's entries split by a tuned interval stay one entry on each side, not rejoined across it
    assert [e[2] for e in merged] == ["a", "b", "T1", "b", "T2", "c", "d", "T3", "d"]


def test_merge_copies_configs_and_keeps_a_table_without_tuned_entries():
    table = [[0, 8, {"block_shape": (16, 128, 64)}], [8, BIG, {"block_shape": (64, 128, 64)}]]
    assert ht.merge_tuned(table, []) == table
    merged = ht.merge_tuned(table, [[0, 8, {"block_shape": [32, 128, 64]}]])
    merged[1][2]["block_shape"] = None
    assert table[1][2]["block_shape"] == (64, 128, 64)


# -- the file: lookup and validation --------------------------------------------------------------

def test_lookup_by_device_shape_dtype_mode_and_experts(tmp_path):
    nsk = [[0, 64, _cfg(3, sk=False)]]
    path = _table_file(tmp_path, [_entry(), _entry(mode="no_stream_k", intervals=nsk), _entry(experts=8)])
    tuned = hb.HummingBackend(tuned=path).tuned  # the backend's choice, handed to the lookup
    assert ht.tuned_intervals(DEVICE, 64, 128, "float16", "default", None, tuned) == [[48, 64, _cfg(7)]]
    assert ht.tuned_intervals(DEVICE, 64, 128, "float16", "no_stream_k", None, tuned) == nsk
    assert ht.tuned_intervals(DEVICE, 64, 128, "float16", "default", 8, tuned) == [[48, 64, _cfg(7)]]
    for key in [(128, 64, "float16", "default", None), (64, 128, "bfloat16", "default", None),
                (64, 128, "float16", "default", 4), (64, 128, "float16", "batch_invariant", None)]:
        assert ht.tuned_intervals(DEVICE, *key, tuned) is None, key
    with pytest.raises(ValueError, match="this device is 'NVIDIA H100'"):
        ht.tuned_intervals("NVIDIA H100", 64, 128, "float16", "default", None, tuned)
    off = hb.HummingBackend(tuned=False).tuned
    assert ht.tuned_intervals(DEVICE, 64, 128, "float16", "default", None, off) is None


def test_shipped_table_path_is_named_after_the_device(tmp_path):
    assert ht.device_slug("NVIDIA H200") == "nvidia-h200" and ht.device_slug(" NVIDIA H100 80GB HBM3") == \
        "nvidia-h100-80gb-hbm3"
    assert ht.table_path(DEVICE) == ht.TUNED_DIR / "nvidia-h200.json"
    assert ht.table_path(DEVICE, hb.HummingBackend(tuned=True).tuned) == ht.TUNED_DIR / "nvidia-h200.json"
    # shipped with the package (pyproject's package-data: quads/assets/**)
    assert ht.TUNED_DIR.parent == Path(quads.__file__).resolve().parent / "assets"
    assert ht.load_table("No Such GPU") == {}  # no file: no entries
    with pytest.raises(ValueError, match="missing.json: no such file"):
        ht.load_table(DEVICE, hb.HummingBackend(tuned=tmp_path / "missing.json").tuned)


def test_the_table_choice_is_read_from_the_environment_when_the_backend_is_made(tmp_path, monkeypatch):
    """``QUADS_HUMMING_TUNED`` (unset or 1: shipped, 0: off, else a file) is the default of
    ``HummingBackend(tuned=)``, read when the backend is made; the argument wins; a bad one is refused."""
    path = tmp_path / "t.json"
    for env, want in ((None, ht.SHIPPED), ("1", ht.SHIPPED), ("0", ht.OFF), (str(path), str(path))):
        if env is None:
            monkeypatch.delenv("QUADS_HUMMING_TUNED", raising=False)
        else:
            monkeypatch.setenv("QUADS_HUMMING_TUNED", env)
        backend = hb.HummingBackend()
        monkeypatch.setenv("QUADS_HUMMING_TUNED", "0")  # later changes do not reach it
        assert backend.tuned == want and hb.HummingBackend(tuned=path).tuned == str(path)
    assert hb.HummingBackend(tuned="off").tuned == ht.OFF and hb.HummingBackend(tuned="shipped").tuned == ht.SHIPPED
    monkeypatch.chdir(tmp_path)
    assert hb.HummingBackend(tuned="rel.json").tuned == os.path.join(os.getcwd(), "rel.json")  # fixed when made
    with pytest.raises(ValueError, match="tuned must be"):
        hb.HummingBackend(tuned=1)


def test_every_shipped_table_validates():
    paths = sorted(ht.TUNED_DIR.glob("*.json"))
    if not paths:
        pytest.skip(f"no tuned table shipped in {ht.TUNED_DIR}")
    for path in paths:
        data = json.loads(path.read_text())
        ht.validate_table(data, data.get("device"))
        assert path.stem == ht.device_slug(data["device"]), path


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format="x"), "format must be"),
    (lambda d: d.update(humming="humming-kernels==0.2.0"), "measured with"),
    (lambda d: d["entries"][0].update(mode="batch_invariant"), "mode one of"),
    (lambda d: d["entries"][0].update(dtype="float32"), "dtype must be"),
    (lambda d: d["entries"][0].update(n=0), "positive integers"),
    (lambda d: d["entries"][0].update(extra=1), "exactly n, k"),
    (lambda d: d["entries"].append(d["entries"][0]), "a second entry"),
    (lambda d: d["entries"][0].update(intervals=[[0, 64, _cfg(1)], [32, 128, _cfg(2)]]), "without overlap"),
    (lambda d: d["entries"][0].update(intervals=[[64, 64, _cfg(1)]]), "must rise"),
    (lambda d: d["entries"][0].update(intervals=[[0, 64]]), r"\[lo, hi, cfg\]"),
    (lambda d: d["entries"][0]["intervals"][0][2].update(bogus=1), "unknown configuration fields"),
    (lambda d: d["entries"][0]["intervals"][0][2].update(block_shape=[64, 128]), "block_shape must be"),
    (lambda d: d["entries"][0]["intervals"][0][2].update(num_stages=[4]), "num_stages must be a JSON scalar"),
    (lambda d: d["entries"][0].update(mode="no_stream_k"), "must have use_stream_k false"),
])
def test_a_tampered_table_is_one_line_naming_the_file(tmp_path, edit, message):
    data = {"format": ht.TABLE_FORMAT, "device": DEVICE, "humming": ht.HUMMING_REQUIREMENT, "entries": [_entry()]}
    ht.validate_table(json.loads(json.dumps(data)), DEVICE)  # the unedited table is valid
    edit(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        ht.tuned_intervals(DEVICE, 64, 128, "float16", "default", None, hb.HummingBackend(tuned=path).tuned)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_file_is_an_error_and_0_turns_the_table_off(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text('{"format": ')
    with pytest.raises(ValueError, match="humming tuned table .*t.json: .*QUADS_HUMMING_TUNED=0"):
        ht.load_table(DEVICE, hb.HummingBackend(tuned=path).tuned)
    monkeypatch.setenv("QUADS_HUMMING_TUNED", "0")
    assert ht.load_table(DEVICE, hb.HummingBackend().tuned) == {}


# -- the layer's configuration -------------------------------------------------------------------

@pytest.fixture
def heuristics(monkeypatch):
    """humming's heuristic table, as humming.tune would give it (tuples, an enum)."""
    import enum

    class Mma(enum.Enum):
        WGMMA = "wgmma"

    table = [[0, 8, {"block_shape": (16, 128, 64), "use_stream_k": True, "mma_type": Mma.WGMMA}],
             [8, 64, {"block_shape": (64, 128, 64), "use_stream_k": True, "mma_type": Mma.WGMMA}],
             [64, BIG, {"block_shape": (128, 256, 64), "use_stream_k": True, "mma_type": Mma.WGMMA}]]
    fake_tune = types.ModuleType("humming.tune")
    fake_tune.get_heuristics_config = lambda config, shape_m=None, device=None, **kw: table
    monkeypatch.setitem(sys.modules, "humming.tune", fake_tune)
    monkeypatch.setattr(hg, "device_name", lambda device: DEVICE)
    return table


def _layer(mode, tuned, rows_hint=None):
    """The fp16 layer a backend of this ``tuned`` choice prepares (a (64, 128) weight, held padded: its
    GEMM, the tables' key, is 128 x 128); a row hint (benchmarks) through the weight's own argument."""
    backend = hb.HummingBackend(mode=mode, tuned=tuned)
    if rows_hint is not None:
        return hb.HummingWeight(_weight(), mode, rows_hint=rows_hint, tuned=backend.tuned).layer(torch.float16)
    return backend.prepare_weight(_weight()).layer(torch.float16)


def _plain(table):
    return json.loads(json.dumps(table, default=hg._json_value))


def test_layer_configs_unchanged_when_no_entry_matches(fake_humming, heuristics, tmp_path):
    path = _table_file(tmp_path, [_entry(n=128, dtype="bfloat16"), _entry(n=64)])  # other dtype, the unpadded N
    for tuned in (False, path, True):  # off, a table without this layer's key, the shipped one
        assert _ORIG_CONFIGS(_layer("default", tuned)) == (None, None)
        compute, tuning = _ORIG_CONFIGS(_layer("no_stream_k", tuned))
        assert compute is None and json.loads(tuning) == [[lo, hi, {**c, "use_stream_k": False}]
                                                          for lo, hi, c in _plain(heuristics)]
        assert _ORIG_CONFIGS(_layer("batch_invariant", tuned)) == (json.dumps({"use_batch_invariant": True}), None)
        compute, tuning = _ORIG_CONFIGS(_layer("default", tuned, rows_hint=(4,)))
        assert json.loads(tuning) == [[0, BIG, _plain(heuristics)[0][2]]]


def test_layer_configs_take_tuned_entries_by_mode(fake_humming, heuristics, tmp_path):
    nsk = [[32, 64, _cfg(5, sk=False)]]
    path = _table_file(tmp_path, [_entry(n=128), _entry(n=128, mode="no_stream_k", intervals=nsk)])
    h = _plain(heuristics)
    compute, tuning = _ORIG_CONFIGS(_layer("default", path))
    assert compute is None
    assert json.loads(tuning) == [[0, 8, h[0][2]], [8, 48, h[1][2]], [48, 64, _cfg(7)], [64, BIG, h[2][2]]]
    compute, tuning = _ORIG_CONFIGS(_layer("no_stream_k", path))
    off = [[lo, hi, {**c, "use_stream_k": False}] for lo, hi, c in h]
    assert json.loads(tuning) == [off[0], [8, 32, off[1][2]], [32, 64, _cfg(5, sk=False)], off[2]]
    # the mode's view of a layer keeps its table; off: humming's own
    assert json.loads(_ORIG_CONFIGS(_layer("default", path).with_mode("no_stream_k"))[1]) == json.loads(tuning)
    assert _ORIG_CONFIGS(_layer("default", False)) == (None, None)
    # batch_invariant: humming's own (no tuned entries)
    assert _ORIG_CONFIGS(_layer("batch_invariant", path)) == (json.dumps({"use_batch_invariant": True}), None)
    # a row hint prunes the merged table: M = 50 runs the tuned kernel
    compute, tuning = _ORIG_CONFIGS(_layer("default", path, rows_hint=(50,)))
    assert json.loads(tuning) == [[0, BIG, _cfg(7)]]
    assert heuristics[1][2]["block_shape"] == (64, 128, 64)  # humming's cached table not modified


# -- the tuning script's table (benchmarks/ops/tune_humming.py) ----------------------------------

def _run(name, us, sk=True, tag=1):
    return {"name": name, "us": us, "cfg": _cfg(tag, sk)}


def test_tuning_results_become_a_valid_table_of_the_winners_intervals():
    from benchmarks.ops.tune_humming import table_from_results

    def row(m, interval, default_us, best, best_nsk, dtype="bf16"):
        return {"n": 3072, "k": 3072, "dtype": dtype, "m": m, "interval": interval,
                "default": _run("heuristic", default_us), "default_no_stream_k": _run("sk off", default_us + 1, False),
                "best": best, "best_no_stream_k": best_nsk}

    rows = [row(64, [56, 64], 10.0, _run("block_m/2", 8.0, tag=2), _run("k2", 10.5, False, tag=3)),  # nsk: +4.5%
            row(16, [8, 32], 6.0, _run("ctas", 5.9, tag=4), None),  # 1.7% faster: not worth an entry
            row(24, [8, 32], 6.0, _run("ctas", 5.0, tag=5), _run("k2", 6.98, False, tag=6)),  # nsk: 0.3%
            row(64, [56, 64], 9.0, _run("heuristic", 9.0), None, dtype="fp16")]  # the heuristic wins
    table = table_from_results({"device": DEVICE, "rows": rows, "commit": "abc"}, min_gain=0.03)
    ht.validate_table(json.loads(json.dumps(table)), DEVICE)
    got = {(e["dtype"], e["mode"]): e["intervals"] for e in table["entries"]}
    # M=16 and M=24 share humming's (8, 32]: split at 16; only M=24's piece (16, 32] won
    assert got == {("bfloat16", "default"): [[16, 32, _cfg(5)], [56, 64, _cfg(2)]],
                   ("bfloat16", "no_stream_k"): [[56, 64, _cfg(3, False)]]}
    assert table["humming"] == ht.HUMMING_REQUIREMENT and table["device"] == DEVICE


def test_candidates_differ_from_the_heuristic_and_from_each_other():
    from benchmarks.ops.tune_humming import STORED_HEURISTIC_M64, _plain_cfg, derive_candidates

    cands = derive_candidates(STORED_HEURISTIC_M64)
    keys = [json.dumps(_plain_cfg(c), sort_keys=True) for _, c in cands]
    assert json.dumps(_plain_cfg(STORED_HEURISTIC_M64), sort_keys=True) not in keys
    assert len(set(keys)) == len(keys) and len(cands) > 12  # more than --max-candidates: the order matters
    assert cands[0] == ("stream_k=False", {**STORED_HEURISTIC_M64, "use_stream_k": False})  # no_stream_k's baseline
    assert STORED_HEURISTIC_M64["block_shape"] == (64, 128, 64)  # not modified


def test_the_gpu_run_s_bookkeeping_with_stand_ins(monkeypatch, tmp_path):
    """run_group with humming's layer, plan, compile and timing stood in for: the heuristic is the
    reference, a candidate whose output differs is rejected, one that raises is recorded and
    skipped, the fastest ok one wins (and the fastest Stream-K-off one for no_stream_k), and the
    rows make a valid table."""
    import benchmarks.timing
    from benchmarks.ops import tune_humming as th
    from quads.ops.backends.humming import library as humming_library

    heur = th.STORED_HEURISTIC_M64
    cands = th.derive_candidates(heur)[:4]  # stream_k off, block_m/2, ctas 1, k_warps*2
    times = {(64, 128, 64): 10.0, (32, 128, 64): 8.0}  # by block shape; Stream-K off costs 0.5 us more

    class Layer:
        def __init__(self, qdata, scale, gs, dtype, mode, rows_hint, tuned):
            assert tuned is False  # the baseline is humming's heuristic, whatever table ships
            self.w = torch.randn(qdata.shape[0], qdata.shape[1] * 2, generator=torch.Generator().manual_seed(0))
            self.dtype, self.tuning_config, self.layer = dtype, None, types.SimpleNamespace(humming_config="cfg")

        def __call__(self, x):
            cfg = json.loads(self.tuning_config)
            calls.append(cfg)
            if cfg.get("num_ctas_per_sm") == 1:
                raise RuntimeError("nvrtc: compile failed\nmore")
            y = x.float() @ self.w.T
            return (y * 1.1 if cfg["block_shape"][2] == 128 else y).to(self.dtype)  # k_warps*2: wrong output

    def graph_time(fns):
        fns[0]()
        cfg = calls[-1]
        return times[tuple(cfg["block_shape"])] + (0.5 if cfg["use_stream_k"] is False else 0.0)

    calls = []
    monkeypatch.setattr(humming_library, "HummingNVFP4",
                        lambda q, s, g, dtype, mode, rows_hint, tuned: Layer(q, s, g, dtype, mode, rows_hint, tuned))
    monkeypatch.setattr(th, "plan", lambda lc, m, mx, dev=None: ([[0, BIG, heur]], (56, 64, heur), cands, []))
    monkeypatch.setattr(th, "_precompile", lambda layer, cfgs, dev: None)
    monkeypatch.setattr(benchmarks.timing, "graph_time", graph_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = types.SimpleNamespace(budget_s=1e9, max_candidates=12, max_rel=1e-2)
    rows = []
    th.run_group(64, 128, "bf16", [64], args, torch.device("cpu"), 1 << 12, {(64, 128, 64): 3.0}, rows, time.time())
    (r,) = rows
    status = {c["name"]: c["status"] for c in r["candidates"]}
    assert list(status) == ["heuristic", "stream_k=False", "block_m/2", "ctas_per_sm=1", "k_warps*2"]
    assert status["heuristic"] == "ok" and r["candidates"][0]["rel"] == 0.0
    assert status["ctas_per_sm=1"].startswith("failed: RuntimeError: nvrtc: compile failed")
    assert status["k_warps*2"].startswith("rejected: rel 0.1")
    assert (r["default"]["us"], r["default_no_stream_k"]["us"]) == (10.0, 10.5)
    assert (r["best"]["name"], r["best"]["us"]) == ("block_m/2", 8.0)
    assert (r["best_no_stream_k"]["name"], r["best_no_stream_k"]["us"]) == ("stream_k=False", 10.5)
    assert r["cublas_bf16_us"] == 3.0 and r["interval"] == [56, 64] and r["sets"] == 2
    table = th.table_from_results({"device": DEVICE, "rows": rows}, min_gain=0.03)
    ht.validate_table(json.loads(json.dumps(table)), DEVICE)
    assert [(e["dtype"], e["mode"], e["intervals"]) for e in table["entries"]] == [
        ("bfloat16", "default", [[56, 64, r["best"]["cfg"]]])]  # no_stream_k: the heuristic without Stream-K is best
    assert r["best"]["cfg"]["block_shape"] == [32, 128, 64]
