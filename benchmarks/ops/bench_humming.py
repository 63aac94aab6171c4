"""The humming fast path on one H200: correctness, determinism, speed, sync time, memory.

One script, one process, every number same-run (run from the repository root)::

    pip install --no-index --no-deps --target /tmp/pylib .whl/*.whl      # humming-kernels, tabulate
    export PYTHONPATH=/tmp/pylib HUMMING_CACHE_DIR=/tmp/humming/cache HUMMING_TMP_DIR=/tmp/humming/tmp
    python -m benchmarks.ops.bench_humming --out $OUT                        # ~5 min, --budget-s 330
    python -m benchmarks.ops.bench_humming --dry-run --out /tmp/x            # CPU: the code, no numbers

Sections (``--sections``, default ``linear,moe``):

* **linear**: for each shape (K, N) of the fast path's targets (4096², 2048x4096, 4096x2048, 4096x14336,
  14336x4096) and M = 1, 8, 16, 32, 64, 128, 256, 512, 2048:

  1. *Correctness* (weight set 0, M = 1, 64, 512 rows of one input with an outlier channel): each
     variant against the fp32 exact reference (``w4a4_linear_reference`` on fp32 inputs: exact
     products, fp32 sums; W4A16: ``x @ DQ(W)ᵀ`` in fp32): ``rel`` = max|Δ| / max|ref|, and
     ``bound`` = max over outputs of |Δ| / (its stated bound), PASS when <= 1. Bounds per output
     (``|a|@|W|ᵀ``: sums of absolute products of operand and dequantized weight): every variant
     ``2^-8 |y|`` (bf16 output rounding and slack) ``+ K 2^-24 (|a|@|W|ᵀ)`` (fp32 sums in another
     order); W4A4 ``+ 2^-11 (|x̂|@|W|ᵀ [+ |r̂|@|W|ᵀ])`` (fp16 GEMM output rows) ``+ 2^-20 |W|_1/S_w``
     (fp16 subnormals after the output shift); ``summed`` ``+ 2^-11 (|x̂+r̂|@|W|ᵀ)`` (its one fp16
     rounding per operand element). The dense (cuBLAS) variants are held to the same bounds.
  2. *Determinism* (the same input 3 more times: max |Δ|) and *batch invariance* (row 0 alone vs
     inside M = 64 and 512: max |Δ|) per variant; on the first shape also under the humming modes
     of ``--check-modes`` (default ``no_stream_k,batch_invariant``).
  3. *Speed*: median µs per call of one CUDA graph over ``S`` weight sets (more than the 60 MB L2
     between two uses of a set; ``benchmarks/timing.py``), activation quantization included in
     every W4A4 row. Peers: cuBLAS BF16 and the fused FP8 W8A8 peer (``benchmarks/ops/fp8_peer.py``).
     Rows: quads' exact path (k = 100% residual; W4A16); humming (``--modes``, default
     ``default`` = Stream-K heuristics) W4A16, W4A4 + residual ``stacked`` (2M rows), ``summed``
     (M rows; the operand now written by the quantization kernel itself: 3 launches), the unfused
     ``summed`` path (quantize, sum kernel, GEMM, unscale: 4 launches, for the gain), plain W4A4,
     and the GEMMs alone (operands pre-built); from ``--dense-from`` rows (default 128) the prefill
     candidates ``dense``: the weight dequantized exactly to fp16 (one Triton kernel) per call, or
     held (per sync: 3.6x the NVFP4 bytes, over the memory target: an upper bound), times the
     summed or stacked fp16 operand in cuBLAS with fp32 output, then the per-row unscale.
  4. *Sync*: one in-place refresh of the humming layers (fp16 + bf16, one shared layout: humming's
     repack launched straight into the held tensor) vs the Hopper layout kernel vs the dense fp16
     weight (ms); then ``check refresh``: the refreshed tensors vs a layer built from scratch from
     the same parts (bit for bit), humming's layout vs quads' restatement of its repack kernel
     (``quads/kernels/humming/layout.py``) and the packed parts derived back from it.
  5. *Memory*: packed NVFP4 bytes (qdata + block scales) and, per backend, the bytes a rollout holds
     per weight: exact = packed + Hopper layout; humming = packed + its layout (the fp16 and bf16
     layers share one when the bits agree: ``shared``); target <= 1.1x packed.

* **moe**: the two blocks of ``bench_kernels.py`` ((E, top-k, H, I) = (128, 8, 2048, 768) and
  (8, 2, 4096, 14336)), T = ``--moe-ts`` (default 1, 4, 16, 64) tokens, captured: BF16
  ``grouped_mm`` (transformers' experts), quads exact (k = 100%; W4A16), humming W4A16, W4A4 +
  residual (summed operand, rows gathered inside the quantization kernel) and plain; each humming
  output's rel error vs quads' exact output; sync and memory rows of the experts.

``--budget-s`` (default 330) cuts the remaining timing rows (printed CUT) when the run is slower
than planned; the linear section stops at ``--linear-budget-s`` (default 210) so MoE gets its
turn. ``--full-jit`` times humming's full M table once (17.2 s at 4096² on the H200);
``--probe-fp8`` tries humming's own FP8-activation mode (failed to schedule on sm_90 then).
Writes ``bench_humming.json`` and ``bench_humming.csv`` to ``--out`` after every shape.

Each run's predictions and outcomes: its ``NOTES`` under ``results/`` (docs/humming.md links them).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import statistics
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
if DRY:  # before any Triton kernel is decorated: the interpreter runs them on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from benchmarks.timing import RESULTS_CSV, add_csv_argument, append_results
from quads.ops.backends.humming import library as hg
from quads.kernels.hopper.weight_layout import to_hopper_layout
from quads.ops import ActivationQuant, get_backend
from quads.ops.activation_quant import activation_operands_triton, quantize_activation_reference, summed_operand_triton
from benchmarks.ops.humming_dense_prefill import dense_w4a4, dense_weight_fp16
from quads.ops.backends.humming.backend import HummingBackend, HummingWeight
from quads.ops.linear_op import unscaled_values, w4a4_linear_reference
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize, nvfp4_quantize
from quads.tensor.files import write_atomically

HOPPER = get_backend("hopper")
QUADS_DEFAULT = ActivationQuant(residual_fraction=1.0)
PLAIN = ActivationQuant(residual_fraction=0.0)
SHAPES = [(4096, 4096), (2048, 4096), (4096, 2048), (4096, 14336), (14336, 4096)]  # (K, N)
MS = (1, 8, 16, 32, 64, 128, 256, 512, 2048)
CHECK_MS = (1, 64, 512)
BUCKETS = {"M<=16": (1, 8, 16), "M=32-128": (32, 64, 128), "M=256-512": (256, 512), "M=2048": (2048,)}
TARGETS = {"M<=16": 1.25, "M=32-128": 1.0, "M=256-512": 0.8, "M=2048": 0.8}
BACKENDS = {lay: HummingBackend(mode="default", residual_layout=lay) for lay in ("stacked", "summed")}
ROWS: list[dict] = []
T0 = time.time()


# -- timing ------------------------------------------------------------------------------------------

def timed(calls, budget) -> float | None:
    """µs per call (CUDA graph over the calls; CPU dry run: wall clock), None once over budget."""
    if time.time() - T0 > budget:
        return None
    if DRY:
        ts = []
        for _ in range(2):
            t = time.perf_counter()
            for c in calls:
                c()
            ts.append((time.perf_counter() - t) * 1e6 / len(calls))
        return statistics.median(ts)
    from benchmarks.timing import graph_time

    return graph_time(calls)


def sync():
    if not DRY:
        torch.cuda.synchronize()


def record(section, **kw):
    ROWS.append({"section": section, **kw})
    return kw


def wall_ms(fn, reps=3) -> float:
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(ts), 3)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# -- the CPU stand-in for humming's GEMM (dry run only) --------------------------------------------

def install_cpu_emulation():
    """Dry run: humming's GEMM replaced by its documented arithmetic on CPU (exact weight decode,
    fp32 sums, * weight_scale_2, one rounding), so everything around it runs as on the GPU."""

    class Config:
        def __init__(self, key):
            self.key = key

        def to_str(self):
            return self.key

    class Layer(torch.nn.Module):
        def __init__(self, qdata, scale, dtype):
            super().__init__()
            self.weight = torch.nn.Parameter(qdata.clone(), requires_grad=False)
            self.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
            self.humming_config = Config(f"{tuple(qdata.shape)}{dtype}")

    def call(self, a, scaling="unit", out=None, expert_layout=None):
        a = self.padded_input(a)
        w = unscaled_values(NVFP4Parts(self.layer.weight, self.layer.weight_scale, torch.ones(())))
        if expert_layout is None:
            return self.logical_output(((a.float() @ w.T) * self.ws2[scaling]).to(self.dtype))
        y = torch.zeros(a.shape[0], w.shape[-2], dtype=self.dtype)
        b = expert_layout.tolist()
        for e in range(len(b) - 1):
            y[b[e]:b[e + 1]] = ((a[b[e]:b[e + 1]].float() @ w[e].T) * self.ws2[scaling][e]).to(self.dtype)
        return self.logical_output(y)

    hg.check_humming_device = lambda d: torch.device(d)
    hg.import_humming = lambda: None
    hg.HummingNVFP4._build = lambda self, q, s, g: Layer(q, s, self.dtype)
    hg.HummingNVFP4._configs = lambda self: (None, None)
    hg.HummingNVFP4.__call__ = call

    def transform_into(layer, qdata, scale, gs):
        layer.weight.data.copy_(qdata)
        layer.weight_scale.data.copy_(scale)

    hg.transform_into_ = transform_into
    hg.direct_repack = lambda cfg: False  # the emulation holds the parts as they are: HummingWeight keeps them


# -- variants ----------------------------------------------------------------------------------------

def humming_variants(mode_weights: dict, modes, full=True) -> dict:
    """name -> (check kind, fn(x, i)): humming variants under each mode, on weight set i."""
    out = {}
    for mode in modes:
        hw = mode_weights[mode]
        out[f"humming W4A16 [{mode}]"] = ("w4a16-sk" if mode == "default" else "w4a16",
                                          lambda x, i, hw=hw: hw[i].layer(torch.bfloat16)(x))
        for lay in ("stacked", "summed"):
            out[f"humming W4A4+res {lay} [{mode}]"] = (
                lay,
                lambda x, i, hw=hw, lay=lay: BACKENDS[lay].linear(x, hw[i].shape_parts, None, QUADS_DEFAULT, None, hw[i]))
        if not full:
            continue
        # the unfused summed path: stacked operands, a sum kernel, the GEMM, the unscale (4 launches)
        out[f"humming W4A4+res summed 4-kernel (stage 1) [{mode}]"] = (
            "summed", lambda x, i, hw=hw: BACKENDS["summed"].linear(
                x, hw[i].shape_parts, None, QUADS_DEFAULT, None, hw[i], activation_operands_triton(x, QUADS_DEFAULT)))
        out[f"humming W4A4 plain [{mode}]"] = (
            "plain", lambda x, i, hw=hw: BACKENDS["stacked"].linear(x, hw[i].shape_parts, None, PLAIN, None, hw[i]))
    return out


def dense_variants(parts, w16s) -> dict:
    """The prefill candidates (benchmarks.ops.humming_dense_prefill.dense_w4a4): weight dequantized per call or held."""
    out = {}
    for lay in ("summed", "stacked"):
        out[f"dense {lay}, W dequantized per call"] = (
            lay, lambda x, i, lay=lay: dense_w4a4(x, parts[i], None, QUADS_DEFAULT, layout=lay))
        out[f"dense {lay}, W held fp16 (3.6x mem)"] = (
            lay, lambda x, i, lay=lay: dense_w4a4(x, parts[i], None, QUADS_DEFAULT, w16=w16s[i], layout=lay))
    return out


#: humming's W4A16 in its Stream-K configurations (``default`` mode) with bf16 output: the
#: slices of a tile add their partial sums into the output with bf16 atomics, so each partial and
#: each running sum is rounded to bf16 (humming's ``epilogue/gmem_writer.cuh``); how many slices is
#: humming's choice per shape. The bound that holds there is stated against the call's largest
#: output, not per element: ``|err| <= 2^-6 max|y|`` (measured on the H200: 4.3e-3 to 8.0e-3).
STREAM_K_BF16_REL = 2**-6


def bounds(x: torch.Tensor, parts: NVFP4Parts, kind: str):
    """(fp32 reference, per-element error bound) of a variant kind (module doc; ``w4a16-sk``: W4A16
    through humming's Stream-K configurations, :data:`STREAM_K_BF16_REL`)."""
    k = x.shape[1]
    w = nvfp4_dequantize(*parts, dtype=torch.float32)
    aw = w.abs().T
    if kind == "w4a16-sk":
        ref = x.float() @ w.T
        return ref, torch.full_like(ref, STREAM_K_BF16_REL) * ref.abs().max()
    if kind in ("w4a16", "fp8"):
        ref = x.float() @ w.T
        return ref, 2**-8 * ref.abs() + k * 2**-24 * (x.float().abs() @ aw)
    act = PLAIN if kind == "plain" else QUADS_DEFAULT
    ref = w4a4_linear_reference(x.float(), parts, None, act)
    qa = quantize_activation_reference(x.float(), act)
    xh = nvfp4_dequantize(*qa.main, dtype=torch.float32)
    mags = xh.abs() @ aw
    b = 2**-8 * ref.abs() + 2**-11 * mags + 2**-20 * w.abs().sum(-1)
    if qa.residual is not None:
        rh = nvfp4_dequantize(*qa.residual, dtype=torch.float32)
        mags = mags + rh.abs() @ aw
        b = b + 2**-11 * (rh.abs() @ aw)
        if kind == "summed":
            b = b + 2**-11 * ((xh + rh).abs() @ aw)
    return ref, b + k * 2**-24 * mags


def check(name, kind, fn, x_big, parts, tag):
    """Correctness, determinism and batch invariance of one variant (module doc, items 1-2)."""
    res = {}
    try:
        worst_rel, worst_bound, det = 0.0, 0.0, 0.0
        outs = {}
        for m in CHECK_MS:
            x = x_big[:m]
            y = fn(x, 0)
            sync()
            ref, b = bounds(x, parts, kind)
            err = (y.float() - ref).abs()
            worst_rel = max(worst_rel, float(err.max() / ref.abs().max().clamp(min=1e-30)))
            worst_bound = max(worst_bound, float((err / b.clamp(min=1e-30)).max()))
            for _ in range(3):
                det = max(det, float((fn(x, 0).float() - y.float()).abs().max()))
            outs[m] = y[:1].float()
        inv = max(float((outs[m] - outs[CHECK_MS[0]]).abs().max()) for m in CHECK_MS)
        res = dict(rel=worst_rel, bound=None if kind == "fp8" else worst_bound, det_maxdiff=det, inv_maxdiff=inv)
        ok = "" if kind == "fp8" else ("PASS" if worst_bound <= 1 else "FAIL")
        shown = None if res["bound"] is None else round(worst_bound, 3)
        print(f"check {tag} {name:48s} rel {worst_rel:.2e} bound {shown}"
              f" {ok} | rerun maxdiff {det:.2e} | batch-inv maxdiff {inv:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
        res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"check {tag} {name} FAILED TO RUN: {res['error']}", flush=True)
    record("check", shape=tag, name=name, **res)


# -- one shape ---------------------------------------------------------------------------------------

def nvfp4_bytes(k, n):
    return n * k // 2 + n * k // 16


def fp8_humming_layer(parts: NVFP4Parts):
    """humming's own dynamic per-token FP8 activation quantization over the NVFP4 weight (W4A8)."""
    from humming.layer import HummingLayer

    layer = HummingLayer(shape_n=parts.qdata.shape[0], shape_k=parts.qdata.shape[1] * 2, torch_dtype=torch.bfloat16,
                         weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"},
                         input_config={"quant_method": "humming", "a_dtype": "float8e4m3",
                                       "input_quant_mode": "dynamic_token"}).to(parts.qdata.device)
    layer.load_from_tensors(hg.modelopt_tensors(*parts))
    layer.transform()
    return layer


def memory_row(tag, parts: NVFP4Parts, hopper, hw: HummingWeight, w16=None, **extra):
    """Bytes a rollout holds for one weight, per backend (module doc, item 5)."""
    packed = nbytes(parts.qdata, parts.scale, parts.global_encode_scale)
    hop = nbytes(hopper.values, hopper.scales) if hopper is not None else None
    h16 = hw.layers[torch.float16].nbytes if torch.float16 in hw.layers else None
    hbf = hw.layers[torch.bfloat16].nbytes if torch.bfloat16 in hw.layers else None
    both = hw.nbytes  # fp16 + bf16 layers, a shared layout counted once
    row = dict(packed_nvfp4=packed, hopper_layout=hop, humming_fp16=h16, humming_bf16=hbf, humming_both=both,
               humming_layout_shared=all(lay.shared for dt, lay in hw.layers.items() if dt != torch.float16),
               dense_fp16=nbytes(w16) if w16 is not None else None,
               exact_total_x=(packed + hop) / packed if hop else None,
               humming_w4a4_total_x=(packed + h16) / packed if h16 else None,
               humming_both_total_x=(packed + both) / packed if both else None,
               humming_layout_alone_x=both / packed if both else None, **extra)
    record("memory", shape=tag, **row)
    print(f"memory {tag}: packed {packed / 2**20:.2f} MiB | exact packed+Hopper {row['exact_total_x']} x | "
          f"humming packed+fp16 {row['humming_w4a4_total_x']} x, +bf16 {row['humming_both_total_x']} x | "
          f"humming layouts alone {row['humming_layout_alone_x']} x (shared {row['humming_layout_shared']})",
          flush=True)


def refresh_check(tag, hws, new_parts):
    """The in-place refresh (humming's repack launched into the held tensors) against a layer built
    from scratch from the same parts, bit for bit; humming's real layout against quads' restatement
    (``quads.kernels.humming.layout``) and the packed parts derived back from it. Run after
    ``refresh_`` to ``new_parts``; True when every comparison holds."""
    from quads.kernels.humming.layout import repack_reference

    res = {"refresh_vs_rebuild": True, "layout_reference": None, "derived_parts": None}
    try:
        for hw, parts in zip(hws, new_parts):
            for dtype, layer in hw.layers.items():
                fresh = layer._build(parts.qdata, parts.scale, parts.global_encode_scale)
                held = dict(layer.layer.named_parameters())
                for name, p in fresh.named_parameters():
                    same = held[name].shape == p.shape and torch.equal(
                        held[name].data.contiguous().view(torch.uint8), p.data.contiguous().view(torch.uint8))
                    res["refresh_vs_rebuild"] &= bool(same)
                del fresh
                if not DRY:  # the CPU emulation holds the parts as they are, not humming's layout
                    ok = torch.equal(layer.layer.weight.data, repack_reference(parts.qdata))
                    res["layout_reference"] = ok if res["layout_reference"] is None else res["layout_reference"] and ok
                    q, sc = layer.packed_parts()
                    ok = torch.equal(q, parts.qdata) and torch.equal(sc.view(torch.uint8), parts.scale.view(torch.uint8))
                    res["derived_parts"] = ok if res["derived_parts"] is None else res["derived_parts"] and ok
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    record("refresh_check", shape=tag, **res)
    print(f"check refresh {tag}: in place vs rebuilt {res['refresh_vs_rebuild']} | humming layout = quads' "
          f"restatement {res['layout_reference']} | packed parts derived back {res['derived_parts']}"
          + (f" | ERROR {res['error']}" if "error" in res else ""), flush=True)
    return res


def bench_shape(k, n, ms, modes, check_modes, budget, dev, dense_from, first, probe_fp8, full_jit):
    tag = f"K={k} N={n}"
    if time.time() - T0 > budget:
        print(f"CUT {tag}: over the {budget} s budget", flush=True)
        return
    per = nvfp4_bytes(k, n)
    s_sets = 2 if DRY else max(4, min(32, int(200e6 // per) + 1))
    g = torch.Generator(device=dev).manual_seed(k + n)
    ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16() for _ in range(s_sets)]
    parts = [nvfp4_quantize(w) for w in ws]
    prep = [to_hopper_layout(p.qdata, p.scale) for p in parts]
    dense_ms = [m for m in ms if m >= dense_from]
    w16s = [dense_weight_fp16(p) for p in parts] if dense_ms else None
    fp8w = None
    if not DRY:
        from benchmarks.ops.fp8_peer import fp8_weight

        fp8w = [fp8_weight(w) for w in ws]
    t = time.time()
    # compile only the kernels humming picks for the row counts run here (stacked: 2M rows): the
    # same kernel per M as its full table (quads.ops.backends.humming.library.prune_table)
    hint = sorted({1, 2, *ms, *(2 * m for m in ms), *CHECK_MS, *(2 * m for m in CHECK_MS)})
    base = [HummingWeight(p, "default", rows_hint=hint, tuned=BACKENDS["stacked"].tuned) for p in parts]
    for hw in base:
        hw.layer(torch.float16), hw.layer(torch.bfloat16)
    sync()
    record("build", shape=tag, seconds=round(time.time() - t, 3), sets=s_sets)
    memory_row(tag, parts[0], prep[0], base[0], w16s[0] if w16s else None)
    all_modes = tuple(dict.fromkeys((*modes, *(check_modes if first else ()))))
    mode_weights = {m: [hw.with_mode(m) for hw in base] for m in all_modes}
    x1 = torch.randn(1, k, device=dev, generator=g)
    if full_jit and not DRY and first:  # the production cost: humming's full table, one layer
        try:
            t = time.time()
            full = hg.HummingNVFP4(*parts[0], dtype=torch.float16, mode="default", tuned=BACKENDS["stacked"].tuned)
            full(x1.half())
            sync()
            record("jit", shape=tag, mode="default", dtype="float16", full_table=True,
                   seconds=round(time.time() - t, 2))
            print(f"jit {tag} default fp16, humming's full M table: {time.time() - t:.2f} s", flush=True)
            del full
        except Exception as e:  # noqa: BLE001
            print(f"jit full table FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    # JIT: the first call of each (layout dtype, mode) compiles its (pruned) M-interval table
    for mode in all_modes:
        for dtype in (torch.float16, torch.bfloat16):
            t = time.time()
            try:
                mode_weights[mode][0].layer(dtype)(x1.to(dtype))
                sync()
                record("jit", shape=tag, mode=mode, dtype=str(dtype), seconds=round(time.time() - t, 2))
                print(f"jit {tag} {mode} {dtype}: {time.time() - t:.2f} s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"jit {tag} {mode} {dtype} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    fp8_layers = None
    if probe_fp8 and not DRY:  # fails on sm_90: FP8 MMA K=32 > NVFP4's 16-wide scale groups
        try:
            t = time.time()
            probe = fp8_humming_layer(parts[0])
            probe(x1.bfloat16())
            fp8_layers = [probe] + [fp8_humming_layer(p) for p in parts[1:]]
            sync()
            print(f"jit {tag} humming FP8-activation layer: {time.time() - t:.2f} s", flush=True)
        except Exception as e:  # noqa: BLE001
            record("fp8_mode", shape=tag, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"humming FP8-activation mode unavailable: {type(e).__name__}: {str(e)[:300]}", flush=True)

    var = humming_variants(mode_weights, modes)
    exact = {"quads exact k=100% (default)": ("stacked", lambda x, i: HOPPER.linear(x, parts[i], None, QUADS_DEFAULT,
                                                                                      None, prep[i])),
             "quads exact W4A16": ("w4a16", lambda x, i: HOPPER.linear(x, parts[i], None, None, None, prep[i]))}
    dense = dense_variants(parts, w16s) if dense_ms else {}
    if fp8_layers:
        var["humming W4A8 FP8-act (own quant)"] = ("fp8", lambda x, i: fp8_layers[i](x))
    # 1-2: correctness, determinism, batch invariance (and per humming mode on the first shape)
    x_big = torch.randn(max(CHECK_MS), k, device=dev, generator=g).bfloat16()
    x_big[:, 7] *= 20  # an outlier channel
    checked = {**exact, **var, **dense}
    if first:
        extra = [m for m in check_modes if m not in modes]
        checked.update(humming_variants(mode_weights, extra, full=False))
    for name, (kind, fn) in checked.items():
        check(name, kind, fn, x_big, parts[0], tag)
    # 3: speed
    for m in ms:
        S = s_sets if m <= 256 else min(4, s_sets)
        xs = [torch.randn(m, k, device=dev, generator=g).bfloat16() for _ in range(S)]
        mt = f"{tag} M={m}"
        bf16 = timed([lambda i=i: torch.matmul(xs[i], ws[i].t()) for i in range(S)], budget)
        if bf16 is None:
            print(f"CUT {mt}: over the {budget} s budget", flush=True)
            continue
        line = {"bf16": bf16}
        if fp8w is not None:
            from benchmarks.ops.fp8_peer import fp8_linear

            line["fp8"] = timed([lambda i=i: fp8_linear(xs[i], *fp8w[i]) for i in range(S)], budget)
        ops = [activation_operands_triton(x, QUADS_DEFAULT) for x in xs]
        sums = [summed_operand_triton(x, QUADS_DEFAULT)[0] for x in xs]
        gemm_only = {}
        if "default" in modes:
            hwd = mode_weights["default"]
            gemm_only = {"humming stacked GEMM only [default]":
                         lambda i: hwd[i].layer(torch.float16)(ops[i].stacked, "w4a4"),
                         "humming summed GEMM only [default]":
                         lambda i: hwd[i].layer(torch.float16)(sums[i], "summed")}
        timed_vars = {**exact, **var, **(dense if m >= dense_from else {})}
        for name, (_, fn) in timed_vars.items():
            try:
                line[name] = timed([lambda i=i, fn=fn: fn(xs[i], i) for i in range(S)], budget)
            except Exception as e:  # noqa: BLE001
                print(f"time {mt} {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for name, fn in gemm_only.items():
            try:
                line[name] = timed([lambda i=i, fn=fn: fn(i) for i in range(S)], budget)
            except Exception as e:  # noqa: BLE001
                print(f"time {mt} {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for name, us in line.items():
            if us is not None:
                record("time", shape=tag, k=k, n=n, m=m, name=name, us=us,
                       x_vs_bf16=bf16 / us, x_vs_fp8=line["fp8"] / us if line.get("fp8") else None)
        print(f"time {mt}: bf16 {bf16:.1f} us | " + " | ".join(
            f"{nm} {bf16 / us:.2f}x" for nm, us in line.items() if nm != "bf16" and us), flush=True)

    # 4: sync: in-place refresh of the humming layouts vs the Hopper layout kernel vs the dense weight
    if time.time() - T0 < budget:
        hw = base[0]
        row = dict(humming_refresh_ms=wall_ms(lambda: hw.write_parts_(parts[1])),
                   hopper_layout_ms=wall_ms(lambda: to_hopper_layout(parts[1].qdata, parts[1].scale, out=prep[0])),
                   dense_fp16_ms=wall_ms(lambda: dense_weight_fp16(parts[1])), humming_layouts=len(hw.layers))
        record("sync", shape=tag, **row)
        print(f"sync {tag}: humming refresh ({len(hw.layers)} layers) {row['humming_refresh_ms']} ms | "
              f"Hopper layout {row['hopper_layout_ms']} ms | dense fp16 weight {row['dense_fp16_ms']} ms", flush=True)
        refresh_check(tag, [hw], [parts[1]])
    # the shape's tensors are freed when this returns; main() then empties the CUDA cache


# -- MoE blocks ------------------------------------------------------------------------------------

MOE_CONFIGS = ((128, 8, 2048, 768), (8, 2, 4096, 14336))  # (E, top-k, H, I): bench_kernels.py's two blocks
MOE_TS = (1, 4, 16, 64)


def bf16_experts(hid, idx, wts, gate_up_t, down_t, inter):
    """transformers-5 grouped_mm experts (BF16), as bench_kernels.py's peer: sort, two torch._grouped_mm."""
    import torch.nn.functional as F

    num_tokens, top_k = idx.shape
    e = gate_up_t.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=hid.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(hid[order // top_k], gate_up_t, offs=offs)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(h, down_t, offs=offs)
    out = torch.zeros_like(y).index_copy_(0, order, y)
    return (out.view(num_tokens, top_k, -1) * wts.unsqueeze(-1)).sum(1)


def moe_gemm_checks(mt, humming, prep_m, gu, dn, hid, idx, num_experts, gate):
    """Each of the block's two grouped GEMMs through humming against the fp32 exact reference, per
    expert, with the linear checks' stated bounds (:func:`bounds`), on the same input: gate_up on
    the tokens, down on ``gate(h)`` of humming's own gate_up output (W4A16, W4A4 + residual summed,
    plain W4A4). The block-level rel above compares outputs after the gate and the re-quantization
    of ``h``: a difference of ``2^-11`` in ``h`` can flip an e2m1 code (one step: up to 1/3 of its
    block's max) or a block scale, which no GEMM bound covers; this check is the bound that holds."""
    from quads.ops.experts_op import Routing

    route = Routing(idx, num_experts)
    offs = route.offsets.tolist()
    for name, act, kind in (("humming W4A16", None, "w4a16-sk"), ("humming W4A4+res summed", QUADS_DEFAULT, "summed"),
                            ("humming W4A4 plain", PLAIN, "plain")):
        try:
            h = humming.grouped_linear(hid, route.token_of_row, route.offsets, gu, None, act, None, route.num_rows,
                                       prep_m[0])
            x2 = gate(h)
            y = humming.grouped_linear(x2, None, route.offsets, dn, None, act, None, route.num_rows, prep_m[1])
            rows_in = hid.index_select(0, route.token_of_row)
            for gemm, out, xin, w in (("gate_up", h, rows_in, gu), ("down", y, x2, dn)):
                worst_rel, worst_bound = 0.0, 0.0
                for e in range(num_experts):
                    lo, hi = offs[e], offs[e + 1]
                    if hi <= lo:
                        continue
                    pe = NVFP4Parts(w.qdata[e], w.scale[e], w.global_encode_scale.reshape(-1)[e])
                    ref, b = bounds(xin[lo:hi], pe, kind)
                    err = (out[lo:hi].float() - ref).abs()
                    worst_rel = max(worst_rel, float(err.max() / ref.abs().max().clamp(min=1e-30)))
                    worst_bound = max(worst_bound, float((err / b.clamp(min=1e-30)).max()))
                record("check", shape=f"{mt} {gemm}", name=name, rel=worst_rel, bound=worst_bound)
                print(f"check moe-gemm {mt} {gemm} {name}: rel vs fp32 {worst_rel:.2e} bound {worst_bound:.3f} "
                      f"{'PASS' if worst_bound <= 1 else 'FAIL'}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"check moe-gemm {mt} {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


def bench_moe(budget, dev, configs=MOE_CONFIGS, ts=MOE_TS, modes=("default",)):
    """MoE blocks, captured: BF16 grouped_mm, quads exact (k = 100%, W4A16), humming (default mode:
    W4A16, W4A4 + residual summed, plain W4A4; W4A16 and W4A4 + residual summed under each other
    mode of ``modes`` too); rel error of each vs quads' exact output."""
    import torch.nn.functional as F

    from quads.ops import rollout_experts
    from quads.tensor import NVFP4Tensor

    humming = HummingBackend(mode="default")
    for E, TOPK, H, I in configs:
        tag = f"E={E} top{TOPK} H={H} I={I}"
        if time.time() - T0 > budget:
            print(f"CUT moe {tag}: over the {budget} s budget", flush=True)
            continue
        g = torch.Generator(device=dev).manual_seed(9)
        gu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).bfloat16()
        dn = (torch.randn(E, H, I, device=dev, generator=g) * 0.02).bfloat16()
        gu_t, dn_t = gu.transpose(1, 2), dn.transpose(1, 2)
        qgu, qdn = NVFP4Tensor.from_float(gu), NVFP4Tensor.from_float(dn)
        del gu, dn
        prep_h = (HOPPER.prepare_weight(qgu.parts), HOPPER.prepare_weight(qdn.parts))
        prep_m = (HummingWeight(qgu.parts, "default", rows_hint=[T * TOPK for T in ts], tuned=humming.tuned),
                  HummingWeight(qdn.parts, "default", rows_hint=[T * TOPK for T in ts], tuned=humming.tuned))
        t = time.time()
        for p in prep_m:
            p.layer(torch.float16), p.layer(torch.bfloat16)
        sync()
        record("build", shape=tag, seconds=round(time.time() - t, 3))
        for name, q, ph, pm in (("gate_up", qgu, prep_h[0], prep_m[0]), ("down", qdn, prep_h[1], prep_m[1])):
            memory_row(f"{tag} {name}", q.parts, ph if hasattr(ph, "values") else None, pm)

        def gate(h, inter=I):
            return F.silu(h[:, :inter]) * h[:, inter:]

        paths = {
            "quads exact k=100% (default)": lambda h, i, w: rollout_experts(h, i, w, qgu, qdn, gate, QUADS_DEFAULT,
                                                                            backend=HOPPER, prepared=prep_h),
            "quads exact W4A16": lambda h, i, w: rollout_experts(h, i, w, qgu, qdn, gate, None, backend=HOPPER,
                                                                 prepared=prep_h),
            "humming W4A16 [default]": lambda h, i, w: rollout_experts(h, i, w, qgu, qdn, gate, None,
                                                                       backend=humming, prepared=prep_m),
            "humming W4A4+res summed [default]": lambda h, i, w: rollout_experts(
                h, i, w, qgu, qdn, gate, QUADS_DEFAULT, backend=humming, prepared=prep_m),
            "humming W4A4 plain [default]": lambda h, i, w: rollout_experts(h, i, w, qgu, qdn, gate, PLAIN,
                                                                            backend=humming, prepared=prep_m),
        }
        for mode in modes:
            if mode == "default":
                continue
            prep_x = tuple(p.with_mode(mode) for p in prep_m)  # the same layouts under another configuration
            paths[f"humming W4A16 [{mode}]"] = lambda h, i, w, p=prep_x: rollout_experts(
                h, i, w, qgu, qdn, gate, None, backend=humming, prepared=p)
            paths[f"humming W4A4+res summed [{mode}]"] = lambda h, i, w, p=prep_x: rollout_experts(
                h, i, w, qgu, qdn, gate, QUADS_DEFAULT, backend=humming, prepared=p)
        for T in ts:
            S = 2 if DRY else 8
            hid = [torch.randn(T, H, device=dev, generator=g).bfloat16() for _ in range(S)]
            idx = [torch.stack([torch.randperm(E, device=dev, generator=g)[:TOPK] for _ in range(T)]) for _ in range(S)]
            wts = [torch.softmax(torch.randn(T, TOPK, device=dev, generator=g), -1).bfloat16() for _ in range(S)]
            mt = f"{tag} T={T}"
            t = time.time()
            refs = {"w4a16": paths["quads exact W4A16"](hid[0], idx[0], wts[0]).float(),
                    "w4a4": paths["quads exact k=100% (default)"](hid[0], idx[0], wts[0]).float(),
                    "plain": rollout_experts(hid[0], idx[0], wts[0], qgu, qdn, gate, PLAIN, backend=HOPPER,
                                             prepared=prep_h).float()}
            for name, fn in paths.items():
                if not name.startswith("humming"):
                    continue
                try:
                    y = fn(hid[0], idx[0], wts[0]).float()
                    ref = refs["w4a16" if "W4A16" in name else "plain" if "plain" in name else "w4a4"]
                    rel = float((y - ref).abs().max() / ref.abs().max())
                    record("check", shape=mt, name=name, rel_vs_exact=rel)
                    print(f"check moe {mt} {name}: block output rel vs the exact path's block output {rel:.2e} "
                          "(through the gate and h's re-quantization: no GEMM bound applies)", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"check moe {mt} {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if T in (ts[0], ts[-1]):  # per expert: a few seconds per T on E=128
                moe_gemm_checks(mt, humming, prep_m, qgu.parts, qdn.parts, hid[0], idx[0], E, gate)
            record("jit" if T == ts[0] else "moe_check", shape=mt, seconds=round(time.time() - t, 2))
            base = None
            if not DRY:
                try:
                    base = timed([lambda i=i: bf16_experts(hid[i], idx[i], wts[i], gu_t, dn_t, I) for i in range(S)],
                                 budget)
                except Exception as e:  # noqa: BLE001
                    print(f"moe bf16 failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            line = {}
            for name, fn in paths.items():
                try:
                    line[name] = timed([lambda i=i, fn=fn: fn(hid[i], idx[i], wts[i]) for i in range(S)], budget)
                except Exception as e:  # noqa: BLE001
                    print(f"time moe {mt} {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            for name, us in line.items():
                if us is not None:
                    record("moe", shape=tag, t=T, name=name, us=us, x_vs_bf16=base / us if base else None)
            print(f"moe {mt}: bf16 grouped_mm {base} us | " + " | ".join(
                f"{nm} {us:.1f} us" + (f" {base / us:.2f}x" if base else "") for nm, us in line.items() if us),
                flush=True)
        if time.time() - T0 < budget:  # sync: in-place refresh of both experts' humming layouts vs Hopper
            row = dict(humming_refresh_ms=wall_ms(lambda: [p.write_parts_(q.parts) for p, q in zip(prep_m, (qgu, qdn))],
                                                  reps=2),
                       hopper_layout_ms=wall_ms(lambda: [HOPPER.prepare_weight(q.parts, out=p)
                                                         for p, q in zip(prep_h, (qgu, qdn))], reps=2))
            record("sync", shape=tag, **row)
            print(f"sync moe {tag}: humming refresh {row['humming_refresh_ms']} ms | Hopper layout "
                  f"{row['hopper_layout_ms']} ms", flush=True)
            refresh_check(f"moe {tag}", prep_m, (qgu.parts, qdn.parts))
        qgu = qdn = prep_h = prep_m = gu_t = dn_t = None  # this block's weights go before the next is built
        if not DRY:
            torch.cuda.empty_cache()


# -- summary -----------------------------------------------------------------------------------------

HYBRIDS = {
    # what the fast policy could run per M, memory target kept (no held fp16 weight)
    "hybrid W4A4+res: exact / humming / dense per call, fastest": (
        "quads exact k=100% (default)", "humming W4A4+res stacked [default]", "humming W4A4+res summed [default]",
        "dense summed, W dequantized per call", "dense stacked, W dequantized per call"),
    "hybrid W4A4+res: exact / humming, fastest": (
        "quads exact k=100% (default)", "humming W4A4+res stacked [default]", "humming W4A4+res summed [default]"),
    "hybrid W4A4+res incl. held fp16 weight (over memory target)": (
        "quads exact k=100% (default)", "humming W4A4+res stacked [default]", "humming W4A4+res summed [default]",
        "dense summed, W dequantized per call", "dense summed, W held fp16 (3.6x mem)"),
    "hybrid W4A16: exact / humming, fastest": ("quads exact W4A16", "humming W4A16 [default]"),
}


def _geomean(vals):
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def _derived(times):
    """Per (shape, M): the faster residual layout of each mode, and the hybrids (issue: keep the
    Triton kernel at the M where it wins)."""
    by = {(r["shape"], r["m"], r["name"]): r for r in times}
    out = []
    for shape, m in sorted({(r["shape"], r["m"]) for r in times}):
        def pick(names, label):
            rows = [by[(shape, m, nm)] for nm in names if (shape, m, nm) in by]
            if rows:
                best = min(rows, key=lambda r: r["us"])
                out.append({**best, "name": label, "picked": best["name"]})
        for mode in hg.HUMMING_MODES:
            pick([f"humming W4A4+res {lay} [{mode}]" for lay in ("stacked", "summed")],
                 f"humming W4A4+res best layout [{mode}]")
        for label, names in HYBRIDS.items():
            pick(names, label)
    return out


def summary():
    times = [r for r in ROWS if r["section"] == "time" and r["name"] not in ("bf16",)]
    times += _derived(times)
    for r in times:
        if r["name"].startswith("hybrid W4A4+res: exact / humming / dense"):
            print(f"  picked {r['shape']} M={r['m']}: {r['picked']} ({r['x_vs_bf16']:.2f}x)")
    names = sorted({r["name"] for r in times})
    print("\n=== geomean x BF16 per M bucket (targets: " + ", ".join(f"{b} >= {t}" for b, t in TARGETS.items())
          + "; W4A16: M<=16 >= 1.4, M=64 >= 1.1) ===")
    out = {}
    for name in names:
        cells = []
        for bucket, ms in BUCKETS.items():
            vals = [r["x_vs_bf16"] for r in times if r["name"] == name and r["m"] in ms]
            gm = _geomean(vals)
            worst = min(vals) if vals else None
            out.setdefault(name, {})[bucket] = {"geomean": gm, "min": worst, "n": len(vals)}
            cells.append(f"{bucket} {gm:.2f} (min {worst:.2f}, n {len(vals)})" if gm else f"{bucket} -")
        w64 = _geomean([r["x_vs_bf16"] for r in times if r["name"] == name and r["m"] == 64])
        out[name]["M=64"] = w64
        print(f"{name:60s} " + " | ".join(cells) + (f" | M=64 {w64:.2f}" if w64 else ""))
    print("\n=== per M: geomean us of the residual layouts and the prefill candidates (default mode) ===")
    cols = ("humming W4A4+res stacked [default]", "humming W4A4+res summed [default]",
            "humming W4A4+res summed 4-kernel (stage 1) [default]", "dense summed, W dequantized per call",
            "dense summed, W held fp16 (3.6x mem)", "quads exact k=100% (default)", "fp8")
    for m in sorted({r["m"] for r in times}):
        cells = []
        for c in cols:
            gm = _geomean([r["us"] for r in ROWS if r["section"] == "time" and r["m"] == m and r["name"] == c])
            cells.append(f"{c.split(' [')[0].replace('humming W4A4+res ', '')} {gm:.1f}" if gm else f"{c[:12]} -")
        print(f"M={m:5d}: " + " | ".join(cells))
    moe = [r for r in ROWS if r["section"] == "moe"]
    if moe:
        print("\n=== MoE: geomean x BF16 grouped_mm over T (target >= 1.5x) ===")
        for shape in sorted({r["shape"] for r in moe}):
            for name in sorted({r["name"] for r in moe if r["shape"] == shape}):
                vals = [r["x_vs_bf16"] for r in moe if r["shape"] == shape and r["name"] == name]
                gm = _geomean(vals)
                out.setdefault("moe", {}).setdefault(shape, {})[name] = gm
                print(f"{shape} {name:40s} " + (f"{gm:.2f}x (min {min(v for v in vals if v):.2f})" if gm else "-"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, humming's GEMM emulated")
    ap.add_argument("--sections", default="linear,moe", help="comma list of linear, moe")
    ap.add_argument("--shapes", default=None, help="K:N,K:N (default: the issue's five)")
    ap.add_argument("--ms", default=None, help="comma list of M (default: 1..2048)")
    ap.add_argument("--modes", default="default", help="humming modes timed (and checked)")
    ap.add_argument("--check-modes", default="no_stream_k,batch_invariant",
                    help="humming modes checked (determinism, batch invariance) on the first shape only")
    ap.add_argument("--dense-from", type=int, default=128, help="time the dense prefill candidates from this M")
    ap.add_argument("--moe-ts", default=None, help="comma list of T (default 1,4,16,64)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="total time budget (timings cut after it)")
    ap.add_argument("--linear-budget-s", type=float, default=210.0, help="the linear section stops here")
    ap.add_argument("--full-jit", action="store_true", help="time humming's full M table once (4096^2)")
    ap.add_argument("--probe-fp8", action="store_true", help="try humming's own FP8-activation mode")
    add_csv_argument(ap)
    args = ap.parse_args()
    if DRY and args.csv == str(RESULTS_CSV):  # a dry run's rows never go to the results table
        args.csv = os.path.join(args.out, "kernels.csv")
    os.makedirs(args.out, exist_ok=True)
    modes = tuple(m for m in args.modes.split(",") if m)
    check_modes = tuple(m for m in args.check_modes.split(",") if m)
    moe_ts = MOE_TS
    if DRY:
        install_cpu_emulation()
        dev, shapes, ms = "cpu", [(128, 64), (64, 32)], (1, 5)
        global CHECK_MS
        CHECK_MS = (1, 4, 8)
        args.dense_from, args.budget_s, args.linear_budget_s = 5, 1e9, 1e9  # every code path, no cuts
    else:
        hg.check_humming_device("cuda")
        humming = hg.import_humming()
        dev, shapes, ms = "cuda", SHAPES, MS
        import triton

        record("meta", torch=torch.__version__, triton=triton.__version__, humming=humming.__version__,
               device=torch.cuda.get_device_name(), cache=os.environ.get("HUMMING_CACHE_DIR"), argv=sys.argv[1:])
        print(ROWS[-1], flush=True)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    if args.ms:
        ms = tuple(int(v) for v in args.ms.split(","))
    if args.moe_ts:
        moe_ts = tuple(int(v) for v in args.moe_ts.split(","))
    sections = args.sections.split(",")
    linear_budget = min(args.budget_s, args.linear_budget_s) if "moe" in sections else args.budget_s
    for j, (k, n) in enumerate(shapes if "linear" in sections else ()):
        t = time.time()
        try:
            bench_shape(k, n, ms, modes, check_modes, linear_budget, dev, args.dense_from, j == 0, args.probe_fp8,
                        args.full_jit)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        if not DRY:
            torch.cuda.empty_cache()  # the shape's weights and layouts, freed on return
        print(f"--- K={k} N={n}: {time.time() - t:.0f} s (total {time.time() - T0:.0f} s)", flush=True)
        write(args.out, None)
    if "moe" in sections:
        t = time.time()
        try:
            if DRY:
                bench_moe(args.budget_s, dev, configs=((4, 2, 64, 32),), ts=(3, 5), modes=modes)
            else:
                bench_moe(args.budget_s, dev, ts=moe_ts, modes=modes)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"--- moe: {time.time() - t:.0f} s (total {time.time() - T0:.0f} s)", flush=True)
        write(args.out, None)
    write(args.out, summary())
    append_table(args.csv, args.out)
    print(f"total {time.time() - T0:.0f} s; wrote {args.out}/bench_humming.json, .csv"
          + (f"; appended to {args.csv}" if args.csv else ""))


def table_rows() -> list[dict]:
    """The timing rows of this run as rows of the one results table (kernel, shape, variant, us)."""
    out = []
    for r in ROWS:
        if r["section"] == "time" and r.get("us"):
            out.append({"kernel": "humming linear", "shape": f"K={r['k']} N={r['n']} M={r['m']}", "variant": r["name"],
                        "us": r["us"]})
        elif r["section"] == "moe" and r.get("us"):
            out.append({"kernel": "humming moe", "shape": f"{r['shape']} T={r['t']}", "variant": r["name"], "us": r["us"]})
        elif r["section"] == "sync":
            for key in ("humming_refresh_ms", "hopper_layout_ms", "dense_fp16_ms"):
                if r.get(key) is not None:
                    out.append({"kernel": "weight sync", "shape": r["shape"], "variant": key[:-3],
                                "us": 1e3 * r[key]})
    return out


def append_table(csv_path, out_dir) -> None:
    """The one call into ``benchmarks.timing.append_results`` (``--csv``; '' : none)."""
    if not csv_path:
        return
    from pathlib import Path

    append_results(table_rows(), raw=os.path.abspath(out_dir), csv_path=Path(csv_path))


def write(out_dir, summ):
    write_atomically(os.path.join(out_dir, "bench_humming.json"),
                     json.dumps({"rows": ROWS, "summary": summ}, indent=1, default=str))
    keys = sorted({k for r in ROWS for k in r})
    buf = io.StringIO(newline="")
    wr = csv.DictWriter(buf, fieldnames=keys)
    wr.writeheader()
    wr.writerows(ROWS)
    write_atomically(os.path.join(out_dir, "bench_humming.csv"), buf.getvalue())


if __name__ == "__main__":
    main()
