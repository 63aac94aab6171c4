"""Benchmark of the quads rollout kernels on one GPU, against cuBLAS BF16 and FP8 W8A8 (H200).

    python -m benchmarks.ops.bench_kernels [--out DIR] [--sections linear,decode,quant,moe,sync]

Every time is the median over replays of a CUDA graph that runs the op on ``S`` different input
sets in turn (rotating weights: more than the 60 MB L2 is touched between two uses of one set),
divided by ``S``: microseconds per call, launch gaps inside a graph included. Peers, in the same
run: ``torch.matmul`` in BF16 (cuBLAS) and FP8 W8A8 (``benchmarks/ops/fp8_peer.py``: a fused
per-token E4M3 activation quantization kernel + ``torch._scaled_mm`` row-wise). quads rows go
through ``quads.ops`` as a rollout module does (activation quantization included, the weight in
the Hopper layout built beforehand); "GEMM only" rows take pre-quantized operands. The bytes
floor is (bytes read once + bytes written once) / the measured device-to-device copy bandwidth.
Ratios are peer time / quads time (> 1: quads is faster). Rows marked ``[fast: humming]`` run the
same ops through ``QuadsPolicy(kernel="fast")``'s backend (humming, docs/humming.md), next to the
exact rows and with their own BF16 / FP8 peers of the same run; absent, with the reason printed,
where humming is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F


from benchmarks.ops.fp8_peer import fp8_linear, fp8_quantize_rows, fp8_weight  # noqa: E402
from benchmarks.timing import RESULTS_CSV, append_results, graph_time  # noqa: E402

from quads.kernels.hopper.weight_layout import to_hopper_layout, to_hopper_layout_reference  # noqa: E402
from quads.kernels.quantize_activations import quantize_rows  # noqa: E402
from quads.kernels.hopper.w4a4_decode import DecodeConfig, decode_gemm  # noqa: E402
from quads.ops import ActivationQuant, get_backend, rollout_experts  # noqa: E402
from quads.ops.activation_quant import activation_operands_triton  # noqa: E402
from quads.ops.weight_quant import quantize_weight_triton  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402

HOPPER = get_backend("hopper")
ROWS: list = []
COPY_BW = None  # bytes/s, measured
QUADS_DEFAULT = ActivationQuant(residual_fraction=1.0)  # see docs/kernels.md: the measured default
TOPK50 = ActivationQuant(residual_fraction=0.5)
PLAIN = ActivationQuant(residual_fraction=0.0)
SHAPES = [(4096, 4096), (2048, 4096), (4096, 2048), (4096, 14336), (14336, 4096)]  # (K, N)


def row(section, name, us, floor_bytes=None, peers=None, **extra):
    floor_us = floor_bytes / COPY_BW * 1e6 if (floor_bytes and COPY_BW) else None
    r = {"section": section, "name": name, "us": round(us, 2), "floor_us": round(floor_us, 2) if floor_us else None,
         "bytes": floor_bytes, **extra}
    for k, v in (peers or {}).items():
        r[f"x_vs_{k}"] = round(v / us, 2)
    if floor_us:
        r["bw_frac"] = round(floor_us / us, 3)
    ROWS.append(r)
    ratios = " ".join(f"{k}:{r[f'x_vs_{k}']}x" for k in (peers or {}))
    fl = f" floor {floor_us:.2f} ({100 * floor_us / us:.0f}% bw)" if floor_us else ""
    print(f"{section:8s} {name:64s} {us:9.2f} us{fl} {ratios}", flush=True)
    return r


def fast_backend():
    """The ``kernel="fast"`` backend (humming, docs/humming.md), or None with the reason printed:
    its rows are then absent (humming not installed, or not sm_90)."""
    from quads.ops.backends.humming.library import HUMMING_REQUIREMENT, check_humming_device, import_humming

    try:
        import_humming()
        check_humming_device(torch.device("cuda"))
    except (ImportError, RuntimeError) as e:
        print(f"[fast rows skipped] kernel='fast' (humming) unavailable: {e} (pip install {HUMMING_REQUIREMENT})",
              flush=True)
        return None
    return get_backend("humming")


def measure_copy():
    global COPY_BW
    n = 512 * 1024 * 1024
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    us = graph_time([lambda: torch.mul(a, 1.0, out=b)], iters=10)
    COPY_BW = 2 * a.numel() * 2 / (us * 1e-6)
    print(f"device-to-device copy (SM kernel, read+write): {COPY_BW / 1e12:.2f} TB/s", flush=True)
    a = b = None  # free them now (not `del`: closures above read the names)


def nvfp4_bytes(k, n):
    return n * k // 2 + n * k // 16  # codes + E4M3 block scales (global scale negligible)


def _sets(k, n):
    per = nvfp4_bytes(k, n)
    return max(4, min(32, int(200e6 // per) + 1))


def bench_linear(ms=(1, 8, 16, 64, 256, 2048)):
    for k, n in SHAPES:
        s_sets = _sets(k, n)
        g = torch.Generator(device="cuda").manual_seed(k + n)
        ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(s_sets)]
        parts = [nvfp4_quantize(w) for w in ws]
        prep = [to_hopper_layout(p.qdata, p.scale) for p in parts]
        fp8w = [fp8_weight(w) for w in ws]
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(s_sets)]
            S = s_sets if m <= 256 else 4
            tag = f"K={k} N={n} M={m}"
            bf16 = graph_time([lambda i=i: torch.matmul(xs[i], ws[i].t()) for i in range(S)])
            row("linear", f"{tag} cuBLAS BF16", bf16, 2 * (n * k + m * k + m * n))
            fp8 = graph_time([lambda i=i: fp8_linear(xs[i], *fp8w[i]) for i in range(S)])
            row("linear", f"{tag} FP8 W8A8 (fused act quant + _scaled_mm)", fp8, n * k + 2 * m * k + 2 * m * n,
                {"bf16": bf16})
            peers = {"bf16": bf16, "fp8": fp8}
            fb = nvfp4_bytes(k, n) + 2 * m * k + 2 * m * n
            for label, act in (("QUADS k=100% (default)", QUADS_DEFAULT), ("QUADS k=50% top-k", TOPK50),
                               ("W4A4 plain", PLAIN)):
                try:
                    t = graph_time([lambda i=i: HOPPER.linear(xs[i], parts[i], None, act, None, prep[i])
                                    for i in range(S)])
                    row("linear", f"{tag} {label} incl. quantize", t, fb, peers)
                except Exception as e:  # noqa: BLE001
                    print(f"linear {tag} {label} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            try:
                t = graph_time([lambda i=i: HOPPER.linear(xs[i], parts[i], None, None, None, prep[i]) for i in range(S)])
                row("linear", f"{tag} W4A16 weight-only", t, fb, peers)
            except Exception as e:  # noqa: BLE001
                print(f"linear {tag} W4A16 failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if m <= 64:  # GEMM only (pre-quantized operands): bandwidth of the weight stream
                ops = [activation_operands_triton(x, QUADS_DEFAULT) for x in xs]
                t = graph_time([lambda i=i: decode_gemm(ops[i].stacked, ops[i].main_scale, prep[i],
                                                        parts[i].global_encode_scale, m, True, out_dtype=torch.bfloat16)
                                for i in range(S)])
                row("linear", f"{tag} decode GEMM only (+residual columns)", t, fb, peers)
                t = graph_time([lambda i=i: activation_operands_triton(xs[i], QUADS_DEFAULT) for i in range(S)])
                row("linear", f"{tag} activation quantization k=100% alone", t)
        ws = parts = prep = fp8w = None  # free them now (not `del`: closures above read the names)
        torch.cuda.empty_cache()
        bench_linear_fast(k, n, ms)


def bench_linear_fast(k, n, ms):
    """The same rows as :func:`bench_linear` through ``kernel="fast"`` (humming; JIT paid before
    capture), with their own BF16 and FP8 peers of this run."""
    fast = fast_backend()
    if fast is None:
        return
    s_sets = _sets(k, n)
    g = torch.Generator(device="cuda").manual_seed(k + n)
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(s_sets)]
    parts = [nvfp4_quantize(w) for w in ws]
    prep = [fast.prepare_weight(p) for p in parts]  # one humming layout per weight (the packed parts derived)
    fp8w = [fp8_weight(w) for w in ws]
    for hw in prep:
        hw.warmup(dtypes=(torch.float16, torch.bfloat16), ms=(1,))  # every kernel of the tables JIT-compiled
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(s_sets)]
        S = s_sets if m <= 256 else 4
        tag = f"K={k} N={n} M={m}"
        bf16 = graph_time([lambda i=i: torch.matmul(xs[i], ws[i].t()) for i in range(S)])
        fp8 = graph_time([lambda i=i: fp8_linear(xs[i], *fp8w[i]) for i in range(S)])
        peers = {"bf16": bf16, "fp8": fp8}
        fb = nvfp4_bytes(k, n) + 2 * m * k + 2 * m * n
        for label, act in (("QUADS k=100% (default)", QUADS_DEFAULT), ("W4A4 plain", PLAIN), ("W4A16 weight-only", None)):
            try:
                for i in range(S):  # eager first (humming's per-M dispatch), then the graph
                    fast.linear(xs[i], prep[i].shape_parts, None, act, None, prep[i])
                t = graph_time([lambda i=i: fast.linear(xs[i], prep[i].shape_parts, None, act, None, prep[i])
                                for i in range(S)])
                row("linear", f"{tag} {label} incl. quantize [fast: humming]", t, fb, peers)
            except Exception as e:  # noqa: BLE001
                print(f"linear {tag} {label} [fast] failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    ws = parts = prep = fp8w = None  # free them now (not `del`: closures above read the names)
    torch.cuda.empty_cache()


def bench_decode_configs():
    for k, n in ((4096, 4096), (14336, 4096), (4096, 14336)):
        s_sets = _sets(k, n)
        g = torch.Generator(device="cuda").manual_seed(7)
        parts = [nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()) for _ in range(s_sets)]
        prep = [to_hopper_layout(p.qdata, p.scale) for p in parts]
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            ops = activation_operands_triton(x, QUADS_DEFAULT)
            fb = nvfp4_bytes(k, n) + 2 * m * k + 2 * m * n
            for cfg in (DecodeConfig(64, 1, 4, 1), DecodeConfig(64, 2, 4, 1), DecodeConfig(64, 4, 4, 1),
                        DecodeConfig(128, 2, 8, 1), DecodeConfig(128, 4, 8, 1), DecodeConfig(64, 2, 4, 2),
                        DecodeConfig(64, 2, 4, 3)):
                try:
                    t = graph_time([lambda i=i: decode_gemm(ops.stacked, ops.main_scale, prep[i],
                                                            parts[i].global_encode_scale, m, True, None,
                                                            torch.bfloat16, cfg) for i in range(s_sets)])
                    row("decode", f"K={k} N={n} M={m} {cfg}", t, fb)
                except Exception as e:  # noqa: BLE001
                    print(f"decode {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        parts = prep = None  # free them now (not `del`: closures above read the names)
        torch.cuda.empty_cache()


def bench_quant():
    k = 4096
    for m in (1, 16, 64, 4096):
        S = 16 if m <= 64 else 4
        xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(S)]
        fb = 2 * m * k + 2 * m * k  # bf16 in, fp16 operand out
        for label, res, k_top, search in (("plain", "none", 0, "auto"), ("k=100% all", "all", 0, "auto"),
                                          ("k=50% top-k packed5", "per_token", k // 2, "packed5"),
                                          ("k=50% top-k binary", "per_token", k // 2, "binary")):
            variants = [(nw, None) for nw in ((4, 8, 16, 32) if m <= 16 else (8, 16))]
            if res != "per_token" and m <= 16:
                variants += [(None, 512), (None, 256), (8, 512)]
            variants.append((None, "default"))
            for nw, chunk in variants:
                try:
                    kw = {} if chunk == "default" else dict(num_warps=nw, row_chunk=chunk)
                    t = graph_time([lambda i=i: quantize_rows(xs[i], residual=res, k_top=k_top, write_packed=False,
                                                              write_operand=True, stacked=True, topk_search=search,
                                                              **kw) for i in range(S)])
                    row("quant", f"M={m} K={k} {label} warps={nw} row_chunk={chunk}", t,
                        fb * (2 if res != "none" else 1))
                except Exception as e:  # noqa: BLE001
                    print(f"quant {label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        t = graph_time([lambda i=i: fp8_quantize_rows(xs[i]) for i in range(S)])
        row("quant", f"M={m} K={k} FP8 per-token (peer)", t, 2 * m * k + m * k)


def _bf16_experts(hid, idx, wts, gate_up_t, down_t, inter):
    """transformers-5 grouped_mm experts (BF16): sort rows by expert, two torch._grouped_mm."""
    num_tokens, top_k = idx.shape
    e = gate_up_t.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=hid.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hid[order // top_k]
    h = torch._grouped_mm(x, gate_up_t, offs=offs)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(h, down_t, offs=offs)
    out = torch.zeros_like(y).index_copy_(0, order, y)
    return (out.view(num_tokens, top_k, -1) * wts.unsqueeze(-1)).sum(1)


def bench_moe():
    fast = fast_backend()
    for E, TOPK, H, I in ((128, 8, 2048, 768), (8, 2, 4096, 14336)):
        g = torch.Generator(device="cuda").manual_seed(9)
        gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
        dn = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
        gu_t, dn_t = gu.transpose(1, 2), dn.transpose(1, 2)
        qgu, qdn = NVFP4Tensor.from_float(gu), NVFP4Tensor.from_float(dn)
        prep = (HOPPER.prepare_weight(qgu.parts), HOPPER.prepare_weight(qdn.parts))
        prep_f = (fast.prepare_weight(qgu.parts), fast.prepare_weight(qdn.parts)) if fast is not None else None
        for hw in prep_f or ():
            hw.warmup(ms=(1,))

        def gate(h, inter=I):
            return F.silu(h[:, :inter]) * h[:, inter:]

        for T in (1, 4, 16, 64):
            S = 8
            hid = [torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(S)]
            idx = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(T)]) for _ in range(S)]
            wts = [torch.softmax(torch.randn(T, TOPK, device="cuda", generator=g), -1).bfloat16() for _ in range(S)]
            active = sum(len(set(i.reshape(-1).tolist())) for i in idx) / S
            bytes_bf16 = active * (3 * H * I) * 2
            bytes_fp4 = active * nvfp4_bytes(H, 3 * I)
            tag = f"E={E} top{TOPK} H={H} I={I} T={T} (~{active:.0f} experts)"
            try:
                base = graph_time([lambda i=i: _bf16_experts(hid[i], idx[i], wts[i], gu_t, dn_t, I) for i in range(S)])
                row("moe", f"{tag} BF16 grouped_mm", base, bytes_bf16)
            except Exception as e:  # noqa: BLE001
                base = None
                print(f"moe bf16 failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            for label, act in (("QUADS k=100%", QUADS_DEFAULT), ("W4A4 plain", PLAIN)):
                try:
                    t = graph_time([lambda i=i: rollout_experts(hid[i], idx[i], wts[i], qgu, qdn, gate, act,
                                                                backend=HOPPER, prepared=prep) for i in range(S)])
                    row("moe", f"{tag} {label} (graph-captured)", t, bytes_fp4, {"bf16": base} if base else None)
                except Exception as e:  # noqa: BLE001
                    print(f"moe {label} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                if fast is not None:
                    try:
                        for i in range(S):
                            rollout_experts(hid[i], idx[i], wts[i], qgu, qdn, gate, act, backend=fast, prepared=prep_f)
                        t = graph_time([lambda i=i: rollout_experts(hid[i], idx[i], wts[i], qgu, qdn, gate, act,
                                                                    backend=fast, prepared=prep_f) for i in range(S)])
                        row("moe", f"{tag} {label} (graph-captured) [fast: humming]", t, bytes_fp4,
                            {"bf16": base} if base else None)
                    except Exception as e:  # noqa: BLE001
                        print(f"moe {label} [fast] failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        gu = dn = gu_t = dn_t = qgu = qdn = prep = prep_f = None  # free them now (not `del`: closures above read the names)
        torch.cuda.empty_cache()


def bench_sync():
    g = torch.Generator(device="cuda").manual_seed(11)
    for shape in ((4096, 4096), (128, 1536, 2048)):
        w = (torch.randn(*shape, device="cuda", generator=g) * 0.02).bfloat16()
        n = w.numel()
        t = graph_time([lambda: quantize_weight_triton(w)], iters=10)
        row("sync", f"{shape} bf16 -> NVFP4 parts (quantize_weight_triton)", t, 2 * n + n // 2 + n // 16)
        p = quantize_weight_triton(w)
        held = to_hopper_layout(p.qdata, p.scale)
        layout_bytes = 2 * (n // 2 + n // 16)
        kernel = graph_time([lambda: to_hopper_layout(p.qdata, p.scale, out=held)], iters=10)
        reference = graph_time([lambda: to_hopper_layout_reference(p.qdata, p.scale)], iters=10)
        row("sync", f"{shape} parts -> Hopper layout, in place (to_hopper_layout: kernel)", kernel, layout_bytes,
            {"torch_reference": reference})
        row("sync", f"{shape} parts -> Hopper layout (to_hopper_layout_reference: torch ops)", reference, layout_bytes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="linear,decode,quant,moe,sync")
    ap.add_argument("--csv", default=str(RESULTS_CSV), help="the results table the rows are appended to ('' : none)")
    args = ap.parse_args()
    import triton

    meta = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(meta, flush=True)
    measure_copy()
    meta["copy_bw_TBps"] = round(COPY_BW / 1e12, 3)
    sections = {"linear": bench_linear, "decode": bench_decode_configs, "quant": bench_quant, "moe": bench_moe,
                "sync": bench_sync}
    for name in args.sections.split(","):
        t = time.time()
        try:
            sections[name]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"--- {name}: {time.time() - t:.0f}s", flush=True)
        write_atomically(os.path.join(args.out, "bench.json"), json.dumps({"meta": meta, "rows": ROWS}, indent=1))
    if args.csv:
        import pathlib

        append_results([{"kernel": r["section"], "shape": r.get("shape", ""), "variant": r["name"], "us": r["us"]}
                        for r in ROWS], raw=os.path.join(args.out, "bench.json"), csv_path=pathlib.Path(args.csv))


if __name__ == "__main__":
    main()
