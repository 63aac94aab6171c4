"""Tune humming's GEMM configurations for quads' decode shapes on one GPU, and write the table quads
ships (``quads/assets/humming_tuned/<device>.json``, read by :mod:`quads.ops.backends.humming.tuning`).

Run from the repository root (GPU: after ``source scripts/gpu_env.sh``)::

    python -m benchmarks.ops.tune_humming --out $OUT --write-table $OUT/nvidia-h200.json   # ~2-3 min
    python -m benchmarks.ops.tune_humming --dry-run     # CPU: the candidates per shape, nothing timed
    python -m benchmarks.ops.tune_humming --table-from tune_humming.json --write-table PATH   # CPU

For each (N, K) of ``--shapes``, activation dtype of ``--dtypes`` and M of ``--ms``: humming's
heuristic configuration (the entry of its M-interval table that serves M: what quads runs), up to
``--max-candidates`` configurations derived from it by changing one or two fields (Stream-K, block
M/N/K, CTAs per SM, stages, warp specialization, humming's small-M MMA kernel), kept only where
humming's own legality checks pass (``humming.testing.tuning``; and ``num_ctas_per_sm`` CTAs' shared
memory fits one SM: Stream-K's persistent grid), compiled in parallel (a candidate
that fails to compile or run is printed and skipped), checked against the heuristic's output
(max|d| / max|ref| <= ``--max-rel``, else rejected) and timed as ``benchmarks/timing.py`` does (one
CUDA graph over weight sets of more than 2x L2), beside cuBLAS BF16 ``x @ w.T`` of the same shape.

Writes ``tune_humming.json`` to ``--out`` after every (N, K, dtype) and prints a table. The tuned
table: per (N, K, dtype, mode) the best configuration at each M that beats the baseline by
``--min-gain``, on the M interval of humming's entry that served M (split at the measured Ms when
several share one entry). Mode ``default``: any configuration vs the heuristic; ``no_stream_k``:
Stream-K-off configurations vs the heuristic without Stream-K (what that mode runs).
The CPU dry run needs humming importable (``pip install --no-deps --target DIR <humming wheel>``,
``PYTHONPATH=DIR``); it runs humming's heuristics under a stand-in H200 profile (132 SMs, 227 KiB)
(without humming: the candidates of a stored M = 64 entry, unchecked).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

DENSE_SHAPES = ((5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (1024, 3072), (8192, 3072))  # (N, K)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEADROOM = 2.2  # the weight bytes cycled through per graph replay, in units of the L2 size
#: the stand-in device of the dry run (an H200's figures; humming's heuristics read these)
STAND_IN_H200 = dict(
    name="NVIDIA H200", is_ppu=False, sm_count=132, max_threads_per_block=1024, max_threads_per_sm=2048,
    max_registers_per_sm=65536, sm_major=9, sm_minor=0, sm_version=90, l2_cache_size=50 * 2**20,
    l2_cache_size_mb=50.0, l1_cache_size=256 * 1024, l1_cache_size_kb=256.0, default_smem_size=48 * 1024,
    max_smem_size=227 * 1024, max_smem_size_kb=227.0, memory_clock_khz=2619000, memory_bus_width=6144,
    sm_clock_khz=1980000, memory_bandwidth_gbps=4800.0, index=0,
    tensorcore_tops={"float16": 989.0, "bfloat16": 989.0, "float8e4m3": 1979.0, "float8e5m2": 1979.0,
                     "int8": 1979.0, "int4": 0.0})


# -- candidates ------------------------------------------------------------------------------------

def _shape(cfg, name):
    return tuple(int(x) for x in cfg[name])


def _with(cfg, **changes):
    out = copy.deepcopy(cfg)
    out.update(changes)
    return out


def derive_candidates(heur: dict) -> list[tuple[str, dict]]:
    """(name, config) variants of humming's heuristic config ``heur``, most promising for small M
    first: one or two fields changed. Not checked for legality here (see :func:`legality`)."""
    bm, bn, bk = _shape(heur, "block_shape")
    wm, wn, wk = _shape(heur, "warp_shape")
    sk = bool(heur.get("use_stream_k", True))
    ctas = int(heur.get("num_ctas_per_sm", 1))
    stages = int(heur.get("num_stages", 2))
    half_m = {"block_shape": (bm // 2, bn, bk), "warp_shape": (min(wm, bm // 2), wn, wk)} if bm >= 16 else None
    quarter_m = {"block_shape": (bm // 4, bn, bk), "warp_shape": (min(wm, bm // 4), wn, wk)} if bm >= 32 else None
    k2 = {"block_shape": (bm, bn, 2 * bk)} if bk == wk else None
    n256 = {"block_shape": (bm, 256, bk), "warp_shape": (wm, 64, wk)} if bn != 256 else None
    n64 = {"block_shape": (bm, 64, bk), "warp_shape": (wm, 32, wk)} if bn != 64 else None
    other_ctas = 1 if ctas != 1 else 2
    small_m_mma = {"mma_type": "mma", "block_shape": (16, 128, 64), "warp_shape": (16, 32, 32), "num_stages": 4,
                   "num_ctas_per_sm": 1, "use_tma": False, "use_warp_spec": False, "multi_cast_size_a": 1}
    out = [
        (f"stream_k={not sk}", {"use_stream_k": not sk}),
        ("block_m/2", half_m),
        (f"ctas_per_sm={other_ctas}", {"num_ctas_per_sm": other_ctas}),
        ("k_warps*2", k2),
        ("block_n=256", n256),
        (f"block_m/2 stream_k={not sk}", half_m and {**half_m, "use_stream_k": not sk}),
        (f"k_warps*2 stream_k={not sk}", k2 and {**k2, "use_stream_k": not sk}),
        ("block_m/4", quarter_m),
        (f"stages={stages + 2}", {"num_stages": min(stages + 2, 8)} if stages < 8 else None),
        (f"stages={stages - 1}", {"num_stages": stages - 1} if stages > 3 else None),
        (f"block_m/2 ctas_per_sm={other_ctas}", half_m and {**half_m, "num_ctas_per_sm": other_ctas}),
        ("small-M mma 16x128x64 stream_k=True", {**small_m_mma, "use_stream_k": True}),
        ("small-M mma 16x128x64 stream_k=False", {**small_m_mma, "use_stream_k": False}),
        (f"warp_spec={not heur.get('use_warp_spec', False)}", {"use_warp_spec": not heur.get("use_warp_spec", False)}),
        ("block_n=64", n64),
        (f"block_n=256 stream_k={not sk}", n256 and {**n256, "use_stream_k": not sk}),
    ]
    seen, result = {json.dumps(_plain_cfg(heur), sort_keys=True)}, []
    for name, change in out:
        if change is None:
            continue
        cfg = _with(heur, **change)
        key = json.dumps(_plain_cfg(cfg), sort_keys=True)
        if key not in seen:
            seen.add(key)
            result.append((name, cfg))
    return result


def _plain_cfg(cfg: dict) -> dict:
    """A config as JSON values (tuples as lists, enums as their values)."""
    return json.loads(json.dumps(cfg, default=lambda v: v.value if hasattr(v, "value") else v.item()))


def legality(layer_config, compute_config, cfg: dict) -> str | None:
    """None when humming's own candidate checks (``humming.testing.tuning``: MMA kind, geometry,
    threads, registers, shared memory) accept ``cfg`` for this layer; else why not."""
    from humming.config import MmaType, TuningConfig
    from humming.device import current_device
    from humming.testing import tuning as ht
    from humming.utils.smem import estimate_smem_size_config

    filled = {"num_stages": 2, "num_ctas_per_sm": 1, "use_warp_spec": False, "use_tma": False,
              "multi_cast_size_a": 1, "multi_cast_size_b": 1, "use_stream_k": True, "use_tma_bzp": False,
              "umma_num_dequant_warpgroups": 1, "umma_cta_group_size": 1, **_plain_cfg(cfg)}
    try:
        mma = MmaType(filled.get("mma_type") or "wgmma")
        block, warp = _shape(filled, "block_shape"), _shape(filled, "warp_shape")
        if not ht._is_legal_mma_type(layer_config, compute_config, mma):
            return f"mma type {mma.value} not legal here"
        if not ht._is_legal_geometry(layer_config, block, warp, mma):
            return f"geometry block {block} warp {warp} not legal"
        filled["block_shape"], filled["warp_shape"] = block, warp
        tuning = TuningConfig(**{k: v for k, v in filled.items() if k in ht.TUNING_FIELDS})
        if ht._try_combine_candidate(layer_config, compute_config, ((filled, {}),)) is None:
            return "threads/registers/shared memory/pipeline checks fail"
        # the persistent grid is num_ctas_per_sm CTAs per SM; Stream-K's fix-ups wait on each other,
        # so all of them must fit at once (humming's check counts one CTA's shared memory)
        smem = estimate_smem_size_config(layer_config, compute_config, tuning) * tuning.num_ctas_per_sm
        if smem > current_device.max_smem_size:
            return f"{tuning.num_ctas_per_sm} CTAs need {smem // 1024} KiB of shared memory per SM"
    except Exception as e:  # noqa: BLE001  (humming's asserts and ValueErrors: not legal)
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def interval_for(table: list, m: int) -> tuple[int, int, dict]:
    """humming's table entry serving ``m`` rows (``lo < m <= hi``)."""
    for lo, hi, cfg in table:
        if lo < m <= hi:
            return int(lo), int(hi), cfg
    raise ValueError(f"humming's table has no entry for M={m}")


# -- the tuned table -------------------------------------------------------------------------------

def table_from_results(results: dict, min_gain: float) -> dict:
    """The table file (:mod:`quads.ops.backends.humming.tuning` format) from this script's JSON: per (N, K,
    dtype, mode) the winners' intervals (module doc)."""
    from quads.ops.backends.humming.tuning import HUMMING_REQUIREMENT, TABLE_FORMAT

    groups: dict[tuple, list] = {}
    for r in results["rows"]:
        for mode, best_key, base_key in (("default", "best", "default"),
                                         ("no_stream_k", "best_no_stream_k", "default_no_stream_k")):
            best, base = r.get(best_key), r.get(base_key)
            if not best or not base or best["us"] > base["us"] * (1 - min_gain):
                winner = None
            else:
                winner = best
            dtype = str(DTYPES[r["dtype"]]).removeprefix("torch.")  # the table's name: "bfloat16", "float16"
            groups.setdefault((r["n"], r["k"], dtype, mode), []).append((r["m"], tuple(r["interval"]), winner,
                                                                             base))
    entries = []
    for (n, k, dtype, mode), rows in sorted(groups.items()):
        intervals, measured = [], []
        by_entry: dict[tuple, list] = {}
        for m, iv, winner, base in sorted(rows, key=lambda t: t[0]):
            by_entry.setdefault(iv, []).append((m, winner, base))
        for (lo, hi), ms in sorted(by_entry.items()):
            for i, (m, winner, base) in enumerate(ms):
                piece_lo = lo if i == 0 else ms[i - 1][0]
                piece_hi = hi if i == len(ms) - 1 else m
                if winner is not None:
                    intervals.append([piece_lo, piece_hi, winner["cfg"]])
                    measured.append({"m": m, "us": winner["us"], "baseline_us": base["us"], "name": winner["name"]})
        if intervals:
            entries.append({"n": n, "k": k, "dtype": dtype, "mode": mode, "experts": None, "intervals": intervals,
                            "measured": {"runs": measured, "commit": results.get("commit")}})
    return {"format": TABLE_FORMAT, "device": results["device"], "humming": HUMMING_REQUIREMENT, "entries": entries}


def write_table(results: dict, path: str, min_gain: float) -> dict:
    from quads.ops.backends.humming.tuning import validate_table
    from quads.tensor.files import write_atomically

    table = table_from_results(results, min_gain)
    validate_table(json.loads(json.dumps(table)), results["device"])
    write_atomically(Path(path), json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}: {len(table['entries'])} entries "
          f"({sum(len(e['intervals']) for e in table['entries'])} intervals)", flush=True)
    return table


# -- the CPU dry run: humming's heuristics under a stand-in device ---------------------------------

def install_stand_in_device():
    """Let humming's Python run on a machine without CUDA: stand-in ``cuda.bindings`` modules (only
    if absent), the H200 profile for humming's device queries, CPU for torch.cuda's device calls."""
    import contextlib
    import types

    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        def _getattr(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

        for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.bindings.nvrtc", "cuda.bindings.runtime"):
            mod = types.ModuleType(name)
            mod.__getattr__ = _getattr
            sys.modules[name] = mod
        sys.modules["cuda"].bindings = sys.modules["cuda.bindings"]
        for sub in ("driver", "nvrtc", "runtime"):
            setattr(sys.modules["cuda.bindings"], sub, sys.modules[f"cuda.bindings.{sub}"])
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    import humming.device as hd

    profile = type("StandInH200", (), STAND_IN_H200)()
    hd.current_device._value = profile
    for key in (0, "cpu"):
        inst = object.__new__(hd.DeviceInfo)
        inst._index, inst._value = 0, profile
        hd.DeviceInfo._instances[key] = inst


def stand_in_layer_config(n: int, k: int, dtype: torch.dtype):
    """humming's layer config of an (N, K) NVFP4 weight, built on CPU (zero parts)."""
    from humming.layer import HummingLayer

    from quads.ops.backends.humming.library import modelopt_tensors

    layer = HummingLayer(shape_n=n, shape_k=k, torch_dtype=dtype, num_experts=None,
                         weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"})
    layer.load_from_tensors(modelopt_tensors(torch.zeros(n, k // 2, dtype=torch.uint8),
                                             torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn),
                                             torch.ones(1)))
    try:
        layer.transform()  # sets humming_config, then fails at the repack (a CUDA kernel): config enough
    except AssertionError:
        pass
    if layer.humming_config is None:
        raise RuntimeError("humming's transform did not reach its layer config on CPU")
    return layer.humming_config


def plan(layer_config, m: int, max_candidates: int, device=None):
    """(humming's table, its entry for M, [(name, cfg)] legal candidates, [(name, why)] skipped)."""
    from humming.config import ComputeConfig
    from humming.tune import get_heuristics_config

    table = get_heuristics_config(layer_config, shape_m=None, device=device)
    lo, hi, heur = interval_for(table, m)
    compute = ComputeConfig(gemm_type="dense")
    kept, skipped = [], []
    for name, cfg in derive_candidates(heur):
        why = legality(layer_config, compute, cfg)
        if why is not None:
            skipped.append((name, why))
        elif len(kept) < max_candidates:
            kept.append((name, cfg))
        else:
            skipped.append((name, f"over --max-candidates {max_candidates}"))
    return table, (lo, hi, heur), kept, skipped


#: humming 0.1.19's heuristic entry for M = 64 on every default shape (bf16 and fp16), under the
#: stand-in H200: what the dry run derives candidates from when humming is not importable
STORED_HEURISTIC_M64 = {"block_shape": (64, 128, 64), "warp_shape": (64, 32, 64), "use_stream_k": True,
                        "use_f16_accum": False, "num_stages": 4, "use_warp_spec": True, "use_tma": True,
                        "num_ctas_per_sm": 2, "mma_type": "wgmma", "raster_group_m": 1}


def dry_run(args):
    try:
        install_stand_in_device()
        import humming.layer  # noqa: F401
    except ImportError as e:
        print(f"humming is not importable ({e}): candidates from a stored heuristic entry (humming 0.1.19, "
              "M = 64), legality NOT checked")
        for name, cfg in derive_candidates(STORED_HEURISTIC_M64)[:args.max_candidates]:
            print(f"  try  {name:38s} {json.dumps(_diff(STORED_HEURISTIC_M64, cfg))}")
        return
    total = 0
    for n, k in args.shapes:
        for dname in args.dtypes:
            t = time.time()
            layer_config = stand_in_layer_config(n, k, DTYPES[dname])
            for m in args.ms:
                _, (lo, hi, heur), kept, skipped = plan(layer_config, m, args.max_candidates)
                total += len(kept) + 1
                print(f"\nN={n} K={k} {dname} M={m}: humming's entry ({lo}, {hi}] {json.dumps(_plain_cfg(heur))}"
                      f"  [{time.time() - t:.1f} s]")
                for name, cfg in kept:
                    print(f"  try  {name:38s} {json.dumps(_diff(heur, cfg))}")
                for name, why in skipped:
                    print(f"  skip {name:38s} {why}")
    print(f"\n{total} configurations to compile (heuristic + candidates; ~1.5 s each, compiled in parallel)")


def _diff(base: dict, cfg: dict) -> dict:
    b, c = _plain_cfg(base), _plain_cfg(cfg)
    return {key: c[key] for key in c if b.get(key) != c[key]}


# -- the GPU run -----------------------------------------------------------------------------------

def _sets(per_set_bytes: int, l2: int, cap: int = 96) -> int:
    return max(2, min(cap, math.ceil(HEADROOM * l2 / per_set_bytes)))


def _view(layer, cfg_json: str | None):
    v = copy.copy(layer)
    v.tuning_config = cfg_json
    return v


def _precompile(layer, cfgs: list[dict], dev) -> str | None:
    """Compile ``cfgs`` at once (humming's parallel build: one table of dummy intervals); None, or
    the error (then each is compiled alone at its first call)."""
    from humming.kernel.humming import HummingKernel

    table = [[i, i + 1, _plain_cfg(c)] for i, c in enumerate(cfgs)]
    try:
        HummingKernel.prepare_kernels(layer.layer.humming_config.to_str(), layer.compute_config,
                                      json.dumps(table), dev)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]}"


def run_group(n, k, dname, ms, args, dev, l2, cublas_cache, out_rows, t0):
    from benchmarks.timing import graph_time
    from quads.ops.backends.humming.library import HummingNVFP4
    from quads.tensor.nvfp4_math import nvfp4_quantize

    dtype = DTYPES[dname]
    per = n * k // 2 + n * k // 16
    s = _sets(per, l2)
    g = torch.Generator(device=dev).manual_seed(n * 7 + k)
    parts = [nvfp4_quantize((torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()) for _ in range(s)]
    # the baseline is humming's heuristic, whatever table ships
    layers = [HummingNVFP4(*p, dtype=dtype, mode="default", rows_hint=tuple(ms), tuned=False) for p in parts]
    del parts
    for m in ms:
        if time.time() - t0 > args.budget_s:
            print(f"CUT N={n} K={k} {dname} M={m}: over the {args.budget_s} s budget", flush=True)
            continue
        t = time.time()
        table, (lo, hi, heur), kept, skipped = plan(layers[0].layer.humming_config, m, args.max_candidates, dev)
        named = [("heuristic", heur), *kept]
        nsk = heur if heur.get("use_stream_k") is False else _with(heur, use_stream_k=False)
        if not any(_plain_cfg(c) == _plain_cfg(nsk) for _, c in named):  # the no_stream_k baseline
            named.insert(1, ("heuristic stream_k=False", nsk))
        err = _precompile(layers[0], [c for _, c in named], dev)
        jit_s = time.time() - t
        xs = [torch.randn(m, k, device=dev, generator=g).to(dtype) for _ in range(s)]
        x_check = torch.randn(m, k, device=dev, generator=g).to(dtype)
        ref = None
        rows = []
        for name, cfg in named:
            cj = json.dumps(_plain_cfg(cfg))
            views = [_view(layer, cj) for layer in layers]
            row = {"name": name, "cfg": _plain_cfg(cfg)}
            try:
                y = views[0](x_check).float()
                torch.cuda.synchronize(dev)
                if ref is None:
                    ref = y
                rel = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                row["rel"] = rel
                if not math.isfinite(rel) or rel > args.max_rel:
                    row["status"] = f"rejected: rel {rel:.3g} > {args.max_rel}"
                else:
                    row["us"] = graph_time([lambda v=v, x=x: v(x) for v, x in zip(views, xs)])
                    row["status"] = "ok"
            except Exception as e:  # noqa: BLE001  (compile or launch failure of this candidate)
                row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                if "illegal" in str(e).lower() or "CUDA error" in str(e):
                    raise  # a poisoned context: nothing after it can be trusted
            rows.append(row)
        if (n, k, m) not in cublas_cache:
            sb = _sets(n * k * 2, l2, cap=16)
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(sb)]
            xb = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(sb)]
            cublas_cache[(n, k, m)] = graph_time([lambda x=x, w=w: x @ w.T for x, w in zip(xb, ws)])
            del ws, xb
        ok = [r for r in rows if r.get("status") == "ok"]
        default = next((r for r in rows if r["name"] == "heuristic" and "us" in r), None)
        default_nsk = next((r for r in rows if _plain_cfg(r["cfg"]) == _plain_cfg(nsk) and "us" in r), None)
        best = min(ok, key=lambda r: r["us"], default=None)
        best_nsk = min((r for r in ok if r["cfg"].get("use_stream_k") is False), key=lambda r: r["us"], default=None)
        out_rows.append({"n": n, "k": k, "dtype": dname, "m": m, "interval": [lo, hi], "sets": s,
                         "jit_s": round(jit_s, 2), "precompile_error": err, "cublas_bf16_us": cublas_cache[(n, k, m)],
                         "default": default, "default_no_stream_k": default_nsk, "best": best,
                         "best_no_stream_k": best_nsk, "candidates": rows,
                         "skipped": [{"name": a, "why": b} for a, b in skipped]})
        _print_group(out_rows[-1])
    del layers
    torch.cuda.empty_cache()


def _print_group(r):
    cub = r["cublas_bf16_us"]
    print(f"\nN={r['n']} K={r['k']} {r['dtype']} M={r['m']} (humming's entry ({r['interval'][0]}, {r['interval'][1]}], "
          f"{r['sets']} weight sets, JIT {r['jit_s']} s{', precompile: ' + r['precompile_error'] if r['precompile_error'] else ''})"
          f"  cuBLAS BF16 {cub:.2f} us", flush=True)
    base = r["default"]["us"] if r["default"] else None
    for c in r["candidates"]:
        us = c.get("us")
        extra = f"{us:8.2f} us  x{base / us:5.2f} vs heur  x{cub / us:5.2f} vs cuBLAS" if us and base else " " * 44
        print(f"  {c['name']:38s} {extra}  rel {c.get('rel', float('nan')):.2e}  {c['status']}", flush=True)
    for key in ("best", "best_no_stream_k"):
        if r[key]:
            print(f"  {key}: {r[key]['name']} {r[key]['us']:.2f} us", flush=True)


def gpu_run(args):
    from benchmarks.timing import _commit, _device_name
    from quads.ops.backends.humming.library import HUMMING_REQUIREMENT, check_humming_device, import_humming
    from quads.tensor.files import write_atomically

    dev = check_humming_device(torch.device("cuda", torch.cuda.current_device()))
    import_humming()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    t0 = time.time()
    results = {"device": _device_name(), "humming": HUMMING_REQUIREMENT, "commit": _commit(),
               "date": time.strftime("%Y-%m-%d"), "args": {k: v for k, v in vars(args).items()}, "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cublas_cache: dict = {}
    poisoned = False
    for n, k in args.shapes:
        for dname in args.dtypes:
            if poisoned or time.time() - t0 > args.budget_s:
                print(f"CUT N={n} K={k} {dname}: {'a CUDA error before' if poisoned else 'over the budget'}",
                      flush=True)
                continue
            try:
                run_group(n, k, dname, args.ms, args, dev, l2, cublas_cache, results["rows"], t0)
            except Exception:  # noqa: BLE001
                tb = traceback.format_exc()
                print(tb + f"FAILED N={n} K={k} {dname}", flush=True)
                poisoned = "illegal" in tb.lower() or "CUDA error" in tb  # the context cannot be trusted
            results["seconds"] = round(time.time() - t0, 1)
            write_atomically(out / "tune_humming.json", json.dumps(results, indent=1) + "\n")
    summary(results)
    print(f"total {time.time() - t0:.1f} s", flush=True)
    if args.write_table:
        write_table(results, args.write_table, args.min_gain)


def summary(results):
    print("\n| N | K | dtype | M | heuristic us | best us | best | no_stream_k best us | cuBLAS BF16 us | "
          "heur/cuBLAS | best/cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        d, b, bn, c = r["default"], r["best"], r["best_no_stream_k"], r["cublas_bf16_us"]
        f = lambda x: f"{x['us']:.2f}" if x else "-"  # noqa: E731
        print(f"| {r['n']} | {r['k']} | {r['dtype']} | {r['m']} | {f(d)} | {f(b)} | {b['name'] if b else '-'} | "
              f"{f(bn)} | {c:.2f} | {d['us'] / c if d else float('nan'):.2f} | {b['us'] / c if b else float('nan'):.2f} |")


def _shapes(text: str):
    out = []
    for item in text.split(","):
        n, k = item.lower().split("x")
        out.append((int(n), int(k)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_shapes, default=list(DENSE_SHAPES),
                    help="NxK,NxK,... (default: the dense benchmark's GEMMs plus 1024x3072 and 8192x3072)")
    ap.add_argument("--dtypes", default="bf16,fp16", type=lambda s: [d for d in s.split(",") if d])
    ap.add_argument("--ms", default="64", type=lambda s: [int(x) for x in s.split(",")],
                    help="row counts, e.g. 1,16,64,128,256")
    ap.add_argument("--max-candidates", type=int, default=12, help="per (N, K, dtype, M), besides the heuristic")
    ap.add_argument("--max-rel", type=float, default=1e-2, help="reject a candidate whose output differs more")
    ap.add_argument("--min-gain", type=float, default=0.03, help="a tuned entry must be this much faster")
    ap.add_argument("--budget-s", type=float, default=190.0, help="stop starting new shapes after this")
    ap.add_argument("--out", default="results/tune_humming")
    ap.add_argument("--write-table", default="", help="write the tuned table file here")
    ap.add_argument("--table-from", default="", help="(CPU) a tune_humming.json to turn into --write-table")
    ap.add_argument("--dry-run", action="store_true", help="CPU: print the candidates per shape")
    args = ap.parse_args(argv)
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: {bad} not in {sorted(DTYPES)}")
    if args.table_from:
        if not args.write_table:
            ap.error("--table-from needs --write-table")
        write_table(json.loads(Path(args.table_from).read_text()), args.write_table, args.min_gain)
    elif args.dry_run:
        dry_run(args)
    else:
        gpu_run(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
