"""The humming fast path (issue 24, stage 1) on one H200: correctness, determinism, batch invariance, speed.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python -m benchmarks.bench_humming --out $OUT
    PYTHONPATH=$PWD python -m benchmarks.bench_humming --dry-run --out /tmp/x   # CPU: the code, no numbers

One run, same process, for each linear shape (K, N) of the issue and each M:

1. **Correctness** (weight set 0, M = 1, 64, 512 rows of one input): every variant against the fp32
   exact reference (``w4a4_linear_reference`` on fp32 inputs: exact products, fp32 sums; for W4A16
   ``x @ DQ(W)ᵀ`` in fp32): ``rel`` = max|Δ| / max|ref|, and ``bound`` = max over outputs of
   |Δ| / (its stated bound), PASS when <= 1. Bounds (per output element, ``|a|@|W|ᵀ`` the sums of
   absolute products of the operand and the dequantized weight): every variant ``2^-8 |y|`` (the
   bf16 output rounding 2^-9 and slack) ``+ K 2^-24 (|a|@|W|ᵀ)`` (fp32 sums in another order);
   W4A4 variants ``+ 2^-11 (|x̂|@|W|ᵀ [+ |r̂|@|W|ᵀ])`` (the fp16 GEMM output rows) ``+ 2^-20 |W|_1/S_w`` (the
   fp16 subnormal range after the output shift, generous); ``summed`` ``+ 2^-11 (|x̂+r̂|@|W|ᵀ)`` (its
   one fp16 rounding per operand element). humming's FP8-activation mode is lossy: its ``rel`` only.
2. **Determinism** (the same input twice, 3 times: max |Δ|) and **batch invariance** (row 0 alone,
   inside M = 64 and M = 512: max |Δ|), per variant and humming mode.
3. **Speed**: median µs per call of a CUDA graph over ``S`` weight sets (more than the 60 MB L2
   between two uses of a set; ``benchmarks/timing.py``); peers cuBLAS BF16 and the fused FP8 W8A8 peer
   (``benchmarks/fp8_peer.py``); quads' exact Hopper path (today's default: k = 100% residual, and
   W4A16); humming W4A16 (bf16 in directly), W4A4 + residual ``stacked`` (2M rows) and ``summed``
   (M rows), plain W4A4, each under the three humming modes (``default``: Stream-K heuristics;
   ``no_stream_k``; ``batch_invariant``), the stacked GEMM alone (operands pre-built), and humming's
   own FP8-activation W4A8 mode. Activation quantization is included in every quads/humming W4A4
   row. Also: the JIT compile time of each layer/mode (first call; the tables are pruned to the row
   counts run here, same kernel per M; one full table is timed on 4096^2 for the production
   cost), the in-place sync time (humming refresh vs the Hopper layout kernel) and the layout
   bytes. humming's FP8-activation mode is probed once per shape (expected to fail on sm_90 with
   NVFP4's 16-wide scale groups; the error is recorded).

Cut to stay under 4 minutes on the H200: MoE blocks (humming's MoE GEMMs are not wired yet), the
k = 50% top-k variant, humming's FP8 mode under non-default modes; ``--budget-s`` (default 210 s)
skips the remaining timing rows (printed as CUT) if the run is slower than planned.
Writes ``bench_humming.json`` and ``bench_humming.csv`` to ``--out`` (after every shape).
"""

from __future__ import annotations

import argparse
import csv
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


from quads.kernels import humming_gemm as hg
from quads.kernels.hopper_weight_layout import to_hopper_layout
from quads.ops import ActivationQuant, get_backend
from quads.ops.activation_quant import activation_operands_triton, quantize_activation_reference
from quads.ops.humming_backend import HummingBackend, HummingWeight
from quads.ops.linear import unscaled_values, w4a4_linear_reference
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize, nvfp4_quantize

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
        for _ in range(3):
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
        w = unscaled_values(NVFP4Parts(self.layer.weight, self.layer.weight_scale, torch.ones(())))
        if expert_layout is None:
            return ((a.float() @ w.T) * self.ws2[scaling]).to(self.dtype)
        y = torch.zeros(a.shape[0], w.shape[-2], dtype=self.dtype)
        b = expert_layout.tolist()
        for e in range(len(b) - 1):
            y[b[e]:b[e + 1]] = ((a[b[e]:b[e + 1]].float() @ w[e].T) * self.ws2[scaling][e]).to(self.dtype)
        return y

    hg.check_humming_device = lambda d: torch.device(d)
    hg.import_humming = lambda: None
    hg.HummingNVFP4._build = lambda self, q, s, g: Layer(q, s, self.dtype)
    hg.HummingNVFP4._configs = lambda self: (None, None)
    hg.HummingNVFP4.__call__ = call


# -- variants ----------------------------------------------------------------------------------------

def variants(mode_weights: dict, modes) -> dict:
    """name -> fn(x, i): every humming variant under every mode, on weight set i."""
    out = {}
    for mode in modes:
        hw = mode_weights[mode]
        out[f"humming W4A16 [{mode}]"] = ("w4a16", lambda x, i, hw=hw: hw[i].layer(torch.bfloat16)(x))
        for lay in ("stacked", "summed"):
            out[f"humming W4A4+res {lay} [{mode}]"] = (
                lay,
                lambda x, i, hw=hw, lay=lay: BACKENDS[lay].linear(x, hw[i].parts, None, QUADS_DEFAULT, None, hw[i]))
        out[f"humming W4A4 plain [{mode}]"] = (
            "plain", lambda x, i, hw=hw: BACKENDS["stacked"].linear(x, hw[i].parts, None, PLAIN, None, hw[i]))
    return out


def bounds(x: torch.Tensor, parts: NVFP4Parts, kind: str):
    """(fp32 reference, per-element error bound) of a variant kind (module doc)."""
    k = x.shape[1]
    w = nvfp4_dequantize(*parts, dtype=torch.float32)
    aw = w.abs().T
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
        inv = max(float((outs[m] - outs[1]).abs().max()) for m in CHECK_MS)
        res = dict(rel=worst_rel, bound=None if kind == "fp8" else worst_bound, det_maxdiff=det, inv_maxdiff=inv)
        ok = "" if kind == "fp8" else ("PASS" if worst_bound <= 1 else "FAIL")
        shown = None if res["bound"] is None else round(worst_bound, 3)
        print(f"check {tag} {name:40s} rel {worst_rel:.2e} bound {shown}"
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


def bench_shape(k, n, ms, modes, budget, dev, shapes_first=((4096, 4096),)):
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
    fp8w = None
    if not DRY:
        from fp8_peer import fp8_weight

        fp8w = [fp8_weight(w) for w in ws]
    t = time.time()
    # compile only the kernels humming picks for the row counts run here (stacked: 2M rows): the
    # same kernel per M as its full table (quads.kernels.humming_gemm.prune_table), ~8 instead of ~33
    hint = sorted({1, 2, *ms, *(2 * m for m in ms), *CHECK_MS, *(2 * m for m in CHECK_MS)})
    base = [HummingWeight(p, "default", rows_hint=hint) for p in parts]
    for hw in base:
        hw.layer(torch.float16), hw.layer(torch.bfloat16)
    sync()
    record("build", shape=tag, seconds=round(time.time() - t, 3), sets=s_sets,
           layout_bytes_fp16=base[0].layers[torch.float16].nbytes if not DRY else None, nvfp4_bytes=per)
    mode_weights = {m: [hw.with_mode(m) for hw in base] for m in modes}
    x1 = torch.randn(1, k, device=dev, generator=g)
    if not DRY and (k, n) == shapes_first[0]:  # the production cost: humming's full table, one layer
        try:
            t = time.time()
            full = hg.HummingNVFP4(*parts[0], dtype=torch.float16, mode="default")
            full(x1.half())
            sync()
            record("jit", shape=tag, mode="default", dtype="float16", full_table=True,
                   seconds=round(time.time() - t, 2))
            print(f"jit {tag} default fp16, humming's full M table: {time.time() - t:.2f} s", flush=True)
            del full
        except Exception as e:  # noqa: BLE001
            print(f"jit full table FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    # JIT: the first call of each (layout dtype, mode) compiles its (pruned) M-interval table
    for mode in modes:
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
    if not DRY:  # expected to fail on sm_90: FP8 MMA has K=32 > NVFP4's 16-wide weight scale groups
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

    var = variants(mode_weights, modes)
    exact = {"quads exact k=100% (default)": ("stacked", lambda x, i: HOPPER.linear(x, parts[i], None, QUADS_DEFAULT,
                                                                                      None, prep[i])),
             "quads exact W4A16": ("w4a16", lambda x, i: HOPPER.linear(x, parts[i], None, None, None, prep[i]))}
    if fp8_layers:
        var["humming W4A8 FP8-act (own quant)"] = ("fp8", lambda x, i: fp8_layers[i](x))
    # 1-2: correctness, determinism, batch invariance
    x_big = torch.randn(max(CHECK_MS), k, device=dev, generator=g).bfloat16()
    x_big[:, 7] *= 20  # an outlier channel
    for name, (kind, fn) in {**exact, **var}.items():
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
            from fp8_peer import fp8_linear

            line["fp8"] = timed([lambda i=i: fp8_linear(xs[i], *fp8w[i]) for i in range(S)], budget)
        ops = [activation_operands_triton(x, QUADS_DEFAULT) for x in xs]
        gemm_only = {"humming stacked GEMM only [default]":
                     lambda i: mode_weights["default"][i].layer(torch.float16)(ops[i].stacked, "w4a4")}
        for name, fn in [*((nm, f) for nm, (_, f) in {**exact, **var}.items())]:
            try:
                line[name] = timed([lambda i=i, fn=fn: fn(xs[i], i) for i in range(S)], budget)
            except Exception as e:  # noqa: BLE001
                print(f"time {mt} {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if "default" in modes:
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
    # sync: in-place refresh of the humming layout vs the Hopper layout kernel
    if time.time() - T0 < budget and (k, n) in ((4096, 4096), (14336, 4096), (128, 64)):
        hw = base[0]
        ts, th = [], []
        for _ in range(3):
            t = time.perf_counter()
            hw.refresh_(parts[1])
            sync()
            ts.append(time.perf_counter() - t)
            t = time.perf_counter()
            to_hopper_layout(parts[1].qdata, parts[1].scale, out=prep[0])
            sync()
            th.append(time.perf_counter() - t)
        record("sync", shape=tag, humming_refresh_ms=round(1e3 * statistics.median(ts), 3),
               hopper_layout_ms=round(1e3 * statistics.median(th), 3), layers=len(hw.layers))
        print(f"sync {tag}: humming refresh (fp16+bf16 layouts) {1e3 * statistics.median(ts):.2f} ms, "
              f"Hopper layout kernel {1e3 * statistics.median(th):.3f} ms", flush=True)
    del ws, parts, prep, fp8w, base, mode_weights, fp8_layers
    if not DRY:
        torch.cuda.empty_cache()


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


def bench_moe(budget, dev, configs=MOE_CONFIGS, ts=MOE_TS):
    """MoE blocks, captured: BF16 grouped_mm, quads exact (k = 100%, W4A16), humming (default mode:
    W4A16, W4A4 + residual summed, plain W4A4); rel error of each vs quads' exact output."""
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
        prep_m = (HummingWeight(qgu.parts, "default", rows_hint=[T * TOPK for T in ts]),
                  HummingWeight(qdn.parts, "default", rows_hint=[T * TOPK for T in ts]))
        t = time.time()
        for p in prep_m:
            p.layer(torch.float16), p.layer(torch.bfloat16)
        sync()
        record("build", shape=tag, seconds=round(time.time() - t, 3))

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
                    print(f"check moe {mt} {name}: rel vs exact {rel:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"check moe {mt} {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if DRY:
                record("jit", shape=mt, seconds=round(time.time() - t, 2))
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
        del qgu, qdn, prep_h, prep_m, gu_t, dn_t
        if not DRY:
            torch.cuda.empty_cache()


# -- summary -----------------------------------------------------------------------------------------

def _geomean(vals):
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def _derived(times):
    """Per (shape, M): the faster residual layout of each mode, and the faster of the exact path and
    humming's (issue: keep the Triton kernel at the M where it wins)."""
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
        pick(["quads exact k=100% (default)", "humming W4A4+res stacked [default]",
              "humming W4A4+res summed [default]"], "hybrid W4A4+res: exact or humming [default], faster")
        pick(["quads exact W4A16", "humming W4A16 [default]"], "hybrid W4A16: exact or humming [default], faster")
    return out


def summary():
    times = [r for r in ROWS if r["section"] == "time" and r["name"] != "bf16"]
    times += _derived(times)
    for r in times:
        if r["name"].startswith("hybrid"):
            print(f"  {r['name']} {r['shape']} M={r['m']}: {r['picked']}")
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
            cells.append(f"{bucket} {gm:.2f} (min {worst:.2f})" if gm else f"{bucket} -")
        w64 = _geomean([r["x_vs_bf16"] for r in times if r["name"] == name and r["m"] == 64])
        out[name]["M=64"] = w64
        print(f"{name:52s} " + " | ".join(cells) + (f" | M=64 {w64:.2f}" if w64 else ""))
    # stacked vs summed per M (sets SUMMED_FROM_ROWS), humming modes vs default (the 10% rule)
    print("\n=== per M: faster residual layout (default mode), and each mode's time / default's ===")
    for m in sorted({r["m"] for r in times}):
        pick = {}
        for lay in ("stacked", "summed"):
            v = [r["us"] for r in times if r["m"] == m and r["name"] == f"humming W4A4+res {lay} [default]"]
            pick[lay] = _geomean(v)
        ratios = []
        for mode in ("no_stream_k", "batch_invariant"):
            for kind in ("W4A16", "W4A4+res stacked"):
                a = {r["shape"]: r["us"] for r in times if r["m"] == m and r["name"] == f"humming {kind} [{mode}]"}
                b = {r["shape"]: r["us"] for r in times if r["m"] == m and r["name"] == f"humming {kind} [default]"}
                common = a.keys() & b.keys()
                gm = _geomean([a[s] / b[s] for s in common])
                if gm:
                    ratios.append(f"{kind} {mode} {gm:.2f}")
        best = min((v, k) for k, v in pick.items() if v) if any(pick.values()) else (None, None)
        st, su = (f"{pick[k]:.1f}" if pick[k] else "-" for k in ("stacked", "summed"))
        print(f"M={m:5d}: geomean us stacked {st}, summed {su} -> {best[1]} | time / default: " + ", ".join(ratios))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shape, humming's GEMM emulated")
    ap.add_argument("--shapes", default=None, help="K:N,K:N (default: the issue's five)")
    ap.add_argument("--ms", default=None, help="comma list of M (default: 1..2048)")
    ap.add_argument("--modes", default=",".join(hg.HUMMING_MODES))
    ap.add_argument("--budget-s", type=float, default=210.0)
    ap.add_argument("--sections", default="linear,moe")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    modes = tuple(args.modes.split(","))
    if DRY:
        install_cpu_emulation()
        dev, shapes, ms = "cpu", [(128, 64)], (1, 3)
        global CHECK_MS
        CHECK_MS = (1, 4, 8)
    else:
        hg.check_humming_device("cuda")
        humming = hg.import_humming()
        dev, shapes, ms = "cuda", SHAPES, MS
        import triton

        record("meta", torch=torch.__version__, triton=triton.__version__, humming=humming.__version__,
               device=torch.cuda.get_device_name(), cache=os.environ.get("HUMMING_CACHE_DIR"))
        print(ROWS[-1], flush=True)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    if args.ms:
        ms = tuple(int(v) for v in args.ms.split(","))
    sections = args.sections.split(",")
    for k, n in shapes if "linear" in sections else ():
        t = time.time()
        try:
            bench_shape(k, n, ms, modes, args.budget_s, dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"--- K={k} N={n}: {time.time() - t:.0f} s (total {time.time() - T0:.0f} s)", flush=True)
        write(args.out, None)
    if "moe" in sections:
        t = time.time()
        try:
            if DRY:
                bench_moe(args.budget_s, dev, configs=((4, 2, 64, 32),), ts=(3,))
            else:
                bench_moe(args.budget_s, dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"--- moe: {time.time() - t:.0f} s (total {time.time() - T0:.0f} s)", flush=True)
        write(args.out, None)
    write(args.out, summary())
    print(f"total {time.time() - T0:.0f} s; wrote {args.out}/bench_humming.json, .csv")


def write(out_dir, summ):
    tmp = os.path.join(out_dir, "bench_humming.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"rows": ROWS, "summary": summ}, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "bench_humming.json"))
    keys = sorted({k for r in ROWS for k in r})
    tmp = os.path.join(out_dir, "bench_humming.csv.tmp")
    with open(tmp, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(ROWS)
    os.replace(tmp, os.path.join(out_dir, "bench_humming.csv"))


if __name__ == "__main__":
    main()
