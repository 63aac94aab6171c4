"""Benchmark of the quads rollout kernels on one GPU, against cuBLAS BF16 and FP8 (H200).

    PYTHONPATH=. python benchmarks/bench_kernels.py [--out DIR] [--sweep] [--tune] [--gemm-sweep]
    PYTHONPATH=. python benchmarks/bench_kernels.py --diag --out DIR   # TTGIR/PTX dumps

Every time is the median over replays of a CUDA graph that runs the op on ``S`` different
input sets in turn (rotating inputs: more than the 60 MB L2 is touched between two uses of one
set), divided by ``S``. Times are microseconds per call. Baselines: ``torch.matmul`` in BF16
(cuBLAS) and ``torch._scaled_mm`` FP8 E4M3 with row-wise scales (cuBLASLt; activation
quantization to FP8 *not* included, i.e. the FP8 number is a lower bound of an FP8 layer).
Ours includes the activation quantization (and the residual compensation where stated) unless
marked "GEMM only". The bytes-moved floor is (bytes read once + bytes written once) / measured
device-to-device copy bandwidth.

``--sweep`` times quantization-kernel variants (top-k search method, warps); ``--tune`` picks the
GEMM tile config per token bucket first (the defaults in ``w4a4_gemm_hopper.pick_config`` come
from it); ``--gemm-sweep`` runs the GEMM experiments (dequantization modes, mma.sync tiles).
Results of the 2026-11-29 H200 runs: ``benchmarks/results/h200_2026-11-29/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quads.kernels import quantize_weight_kernel, rollout_experts_kernel, rollout_linear_kernel  # noqa: E402
from quads.kernels.quantize_nvfp4 import quantize_rows  # noqa: E402
from quads.kernels import moe_grouped_gemm as moe_mod  # noqa: E402
from quads.kernels import w4a4_gemm_hopper as gemm_mod  # noqa: E402
from quads.kernels.w4a4_gemm_hopper import GemmConfig, pick_config, w4a4_gemm  # noqa: E402
from quads.ops.activation_quant import ActivationQuant  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402

ROWS: list = []
COPY_BW = None  # bytes/s, measured


def graph_time(calls, iters=30):
    """Median µs per call of a CUDA graph running ``calls`` (one per input set) back to back."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for c in calls:
            c()
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=st):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(ts), min(ts), max(ts)


def row(section, name, us, floor_bytes=None, base=None, extra=""):
    floor_us = floor_bytes / COPY_BW * 1e6 if (floor_bytes and COPY_BW) else None
    r = {"section": section, "name": name, "us": round(us, 2),
         "floor_us": round(floor_us, 2) if floor_us else None,
         "bytes": floor_bytes, "extra": extra}
    if base:
        for k, v in base.items():
            r[f"x_vs_{k}"] = round(v / us, 2)
    ROWS.append(r)
    ratios = " ".join(f"{k}:{r[f'x_vs_{k}']}x" for k in (base or {}))
    fl = f" floor {floor_us:.2f}" if floor_us else ""
    print(f"{section:10s} {name:58s} {us:9.2f} us{fl} {ratios} {extra}", flush=True)
    return r


def measure_copy():
    global COPY_BW
    n = 512 * 1024 * 1024  # 1 GiB of bf16 per buffer
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    us, _, _ = graph_time([lambda: b.copy_(a)], iters=10)
    us2, _, _ = graph_time([lambda: torch.mul(a, 1.0, out=b)], iters=10)
    bw1, bw2 = 2 * a.numel() * 2 / (us * 1e-6), 2 * a.numel() * 2 / (us2 * 1e-6)
    COPY_BW = max(bw1, bw2)
    print(f"device-to-device copy: memcpy {bw1 / 1e12:.2f} TB/s, SM copy kernel {bw2 / 1e12:.2f} TB/s "
          f"(read+write); using {COPY_BW / 1e12:.2f}", flush=True)
    del a, b


def fp8_rowwise(w):
    amax = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.float()


def bench_linear(sweep: bool):
    K = N = 4096
    act = ActivationQuant()
    plain = ActivationQuant(residual_fraction=0.0)
    for M in (1, 16, 128, 4096):
        S = 16 if M <= 128 else 4
        g = torch.Generator(device="cuda").manual_seed(M)
        ws = [torch.randn(N, K, device="cuda", generator=g).mul_(0.02).bfloat16() for _ in range(S)]
        xs = [torch.randn(M, K, device="cuda", generator=g).bfloat16() for _ in range(S)]
        wq = [nvfp4_quantize(w) for w in ws]
        w8 = [fp8_rowwise(w) for w in ws]
        x8 = [fp8_rowwise(x) for x in xs]
        base = {}
        t, _, _ = graph_time([lambda i=i: torch.matmul(xs[i], ws[i].T) for i in range(S)])
        base["bf16"] = t
        row("linear", f"M={M} cuBLAS BF16 torch.matmul", t, (M * K + N * K + M * N) * 2)
        try:
            t, _, _ = graph_time([lambda i=i: torch._scaled_mm(x8[i][0], w8[i][0].T, x8[i][1], w8[i][1].T,
                                                               out_dtype=torch.bfloat16) for i in range(S)])
        except Exception as e:  # noqa: BLE001  (cuBLASLt may want M % 16 == 0: pad)
            print(f"fp8 M={M}: {type(e).__name__} {str(e)[:200]}; padding M to 16", flush=True)
            x8 = [(F.pad(a.float(), (0, 0, 0, 16 - M)).to(torch.float8_e4m3fn), F.pad(s, (0, 0, 0, 16 - M), value=1.0))
                  for a, s in x8]
            t, _, _ = graph_time([lambda i=i: torch._scaled_mm(x8[i][0], w8[i][0].T, x8[i][1], w8[i][1].T,
                                                               out_dtype=torch.bfloat16) for i in range(S)])
        base["fp8"] = t
        row("linear", f"M={M} cuBLASLt FP8 _scaled_mm row-wise (GEMM only)", t, M * K + N * K + M * N * 2 + 4 * (M + N))
        wbytes = N * K // 2 + N * K // 16
        smask = torch.rand(K, device="cuda") < 0.5
        static = ActivationQuant(selection="static")
        for name, a in [("W4A4+res50% per-token top-k (incl. quantize)", act),
                        ("W4A4+res50% static mask (incl. quantize)", static),
                        ("W4A4 plain (incl. quantize)", plain)]:
            try:
                t, _, _ = graph_time([lambda i=i, a=a: rollout_linear_kernel(
                    xs[i], wq[i], None, a, smask if a.selection == "static" else None) for i in range(S)])
                row("linear", f"M={M} ours {name}", t, wbytes + M * K * 2 + M * N * 2, base)
            except Exception as e:  # noqa: BLE001
                print(f"linear {name} failed: {type(e).__name__}: {str(e)[:300]}")
        # GEMM only (pre-quantized operands)
        qs = [quantize_rows(x, residual="per_token", k_top=K // 2, write_packed=False, write_dq=True) for x in xs]
        cfg = pick_config(M, N, K)
        t_res, _, _ = graph_time([lambda i=i: w4a4_gemm(qs[i].dx, qs[i].gx, wq[i].qdata, wq[i].scale,
                                                        wq[i].global_encode_scale, qs[i].dr, qs[i].gr,
                                                        out_dtype=torch.bfloat16) for i in range(S)])
        row("linear", f"M={M} ours GEMM only, +res {cfg}", t_res, wbytes + 2 * M * K * 2 + M * N * 2, base)
        t_pl, _, _ = graph_time([lambda i=i: w4a4_gemm(qs[i].dx, qs[i].gx, wq[i].qdata, wq[i].scale,
                                                       wq[i].global_encode_scale, out_dtype=torch.bfloat16)
                                 for i in range(S)])
        row("linear", f"M={M} ours GEMM only, plain", t_pl, wbytes + M * K * 2 + M * N * 2, base,
            extra=f"residual overhead (GEMM) {100 * (t_res / t_pl - 1):.1f}%")
        tq, _, _ = graph_time([lambda i=i: quantize_rows(xs[i], residual="per_token", k_top=K // 2,
                                                         write_packed=False, write_dq=True) for i in range(S)])
        row("linear", f"M={M} ours act-quant +res (fp16 operands out)", tq, M * K * 2 + 2 * M * K * 2 + 8 * M)
        if sweep:
            sweep_gemm(M, N, K, qs, wq, S, base)
        del ws, xs, wq, w8, x8, qs
        torch.cuda.empty_cache()


def sweep_gemm(M, N, K, qs, wq, S, base):
    G = GemmConfig
    if M <= 16:
        cands = [G(64, 16, 128, True, 4, 4, True), G(64, 16, 256, True, 4, 4, True),
                 G(64, 16, 128, True, 4, 4, True, w_mode=2), G(64, 16, 128, True, 4, 4, True, w_mode=1),
                 G(64, 16, 128, True, 4, 4, True, w_mode=3), G(64, 16, 256, True, 4, 3, True, w_mode=3),
                 G(64, 16, 128, True, 4, 4, False, w_mode=3),
                 G(32, 16, 128, True, 2, 4, True), G(32, 16, 128, True, 2, 4, True, w_mode=3),
                 G(16, 16, 256, True, 1, 4, True, w_mode=3)]
        modes = (True,)
    elif M <= 128:
        cands = [G(64, 128, 128, True, 4, 3, True), G(64, 128, 128, True, 4, 3, True, w_mode=3),
                 G(64, 64, 128, True, 4, 4, True, w_mode=3), G(128, 128, 64, False, 8, 3, True, w_mode=1),
                 G(64, 128, 64, True, 4, 4, True, w_mode=1)]
        modes = (True,)
    else:
        cands = [G(128, 128, 64, False, 8, 4, True, w_mode=1), G(128, 256, 64, False, 8, 3, True, w_mode=1),
                 G(256, 128, 64, False, 8, 3, True, w_mode=1), G(128, 128, 128, False, 8, 3, True, w_mode=1),
                 G(128, 256, 64, False, 8, 4, True, w_mode=1)]
        modes = (False,)
    for cfg in cands:
        for res in modes:
            try:
                t, _, _ = graph_time([lambda i=i, c=cfg, r=res: w4a4_gemm(
                    qs[i].dx, qs[i].gx, wq[i].qdata, wq[i].scale, wq[i].global_encode_scale,
                    qs[i].dr if r else None, qs[i].gr if r else None, out_dtype=torch.bfloat16, config=c)
                    for i in range(S)], iters=15)
                row("sweep", f"M={M} {'res' if res else 'plain'} {cfg}", t, None, base)
            except Exception as e:  # noqa: BLE001
                print(f"sweep M={M} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


TUNE_CANDS = {
    "m16": [GemmConfig(64, 16, 128, True, 4, 4), GemmConfig(64, 16, 256, True, 4, 4),
            GemmConfig(64, 16, 128, True, 4, 3), GemmConfig(64, 16, 64, True, 4, 6),
            GemmConfig(128, 16, 128, True, 8, 3), GemmConfig(64, 16, 256, True, 4, 3)],
    "m256": [GemmConfig(64, 128, 128, True, 4, 3), GemmConfig(64, 64, 128, True, 4, 4),
             GemmConfig(128, 64, 64, True, 8, 4), GemmConfig(64, 128, 64, True, 4, 4, w_mode=1),
             GemmConfig(128, 128, 64, True, 8, 3)],
    "large": [GemmConfig(128, 128, 64, False, 8, 4, w_mode=1), GemmConfig(128, 256, 64, False, 8, 3, w_mode=1)],
}


def tune_gemm():
    """Pick the fastest tile config per token bucket (GEMM only, +residual for M<=256)."""
    K = N = 4096
    for bucket, M, res in (("m16", 16, True), ("m256", 128, True), ("large", 4096, False)):
        S = 8 if M <= 128 else 3
        ws = [nvfp4_quantize(torch.randn(N, K, device="cuda").mul_(0.02).bfloat16()) for _ in range(S)]
        qs = [quantize_rows(torch.randn(M, K, device="cuda").bfloat16(), residual="per_token", k_top=K // 2,
                            write_packed=False, write_dq=True) for _ in range(S)]
        best = None
        for cfg in TUNE_CANDS[bucket]:
            try:
                t, _, _ = graph_time([lambda i=i, c=cfg: w4a4_gemm(
                    qs[i].dx, qs[i].gx, ws[i].qdata, ws[i].scale, ws[i].global_encode_scale,
                    qs[i].dr if res else None, qs[i].gr if res else None, out_dtype=torch.bfloat16, config=c)
                    for i in range(S)], iters=15)
            except Exception as e:  # noqa: BLE001
                print(f"tune {bucket} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row("tune", f"{bucket} M={M} {'res' if res else 'plain'} {cfg}", t)
            if best is None or t < best[0]:
                best = (t, cfg)
        if best:
            gemm_mod.CONFIG_OVERRIDES[bucket] = best[1]
            if bucket == "m16":
                gemm_mod.CONFIG_OVERRIDES["m64"] = best[1]
            print(f"TUNED {bucket}: {best[1]} ({best[0]:.2f} us)", flush=True)
        del ws, qs
        torch.cuda.empty_cache()


def bench_quant(sweep: bool):
    K = 4096
    for M in (1, 4096):
        S = 16 if M <= 16 else 4
        xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(S)]
        inb = M * K * 2
        packed = M * K // 2 + M * K // 16 + 4 * M
        for label, kw, outb in [
            ("plain, packed out", dict(residual="none", write_packed=True), packed),
            ("plain, fp16 operand out", dict(residual="none", write_packed=False, write_dq=True), M * K * 2 + 4 * M),
            ("+res50%, packed out", dict(residual="per_token", k_top=K // 2, write_packed=True), 2 * packed),
            ("+res50%, fp16 operands out", dict(residual="per_token", k_top=K // 2, write_packed=False,
                                                write_dq=True), 2 * (M * K * 2 + 4 * M)),
        ]:
            if sweep and "res" in label:
                variants = [(1, 4), (4, 4), (4, 8)]
            elif sweep:
                variants = [(None, 4)]
            else:
                variants = [(None, None)]
            for rb, nw in variants:
                try:
                    t, _, _ = graph_time([lambda i=i, kw=kw, rb=rb, nw=nw: quantize_rows(
                        xs[i], radix_bits=rb, num_warps=nw, **kw) for i in range(S)])
                except Exception as e:  # noqa: BLE001
                    print(f"act-quant {label} radix={rb} warps={nw} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                bw = (inb + outb) / (t * 1e-6)
                row("act-quant", f"M={M} K={K} bf16 {label}" + (f" radix={rb}" if rb is not None else "")
                    + (f" warps={nw}" if nw else ""), t, inb + outb,
                    extra=f"{bw / 1e12:.2f} TB/s = {100 * bw / COPY_BW:.0f}% of copy")
    # weight sync
    for shape in [(4096, 4096), (128, 1536, 2048)]:
        w = torch.randn(*shape, device="cuda").mul_(0.02).bfloat16()
        n = w.numel()
        t, _, _ = graph_time([lambda: quantize_weight_kernel(w)], iters=10)
        b = n * 2 + n // 2 + n // 16
        bw = b / (t * 1e-6)
        row("weight-q", f"{tuple(shape)} bf16 -> NVFP4 (amax pass + quantize pass)", t, b,
            extra=f"{bw / 1e12:.2f} TB/s effective = {100 * bw / COPY_BW:.0f}% of copy (2 reads of the input)")
        del w


def bench_moe():
    E, TOPK, H, I = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(7)
    gu_w = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    dn_w = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    gu = NVFP4Tensor.from_float(gu_w)
    dn = NVFP4Tensor.from_float(dn_w)
    act = ActivationQuant()

    def gate(h):
        return F.silu(h[:, :I]) * h[:, I:]

    def bf16_experts(hid, idx, wts):
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device="cuda").scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = hid[order // TOPK]
        h = torch._grouped_mm(x, gu_w.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(gate(h), dn_w.transpose(-2, -1), offs=offs)
        out = torch.zeros(flat.numel(), H, dtype=hid.dtype, device="cuda")
        out.index_copy_(0, order, y)
        return (out.view(-1, TOPK, H) * wts.unsqueeze(-1)).sum(1)

    for T in (1, 4, 16, 64):
        S = 8
        hids = [torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(S)]
        idxs = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(T)]) for _ in range(S)]
        wtss = [torch.softmax(torch.randn(T, TOPK, device="cuda", generator=g), -1).bfloat16() for _ in range(S)]
        active = sum(int(torch.unique(i).numel()) for i in idxs) / S
        base = {}
        try:
            t, _, _ = graph_time([lambda i=i: bf16_experts(hids[i], idxs[i], wtss[i]) for i in range(S)])
            base["bf16_grouped"] = t
            row("moe", f"T={T} BF16 torch._grouped_mm experts fwd", t, int(active * 3 * I * H * 2))
        except Exception as e:  # noqa: BLE001
            print(f"bf16 grouped_mm failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        t, _, _ = graph_time([lambda i=i: rollout_experts_kernel(hids[i], idxs[i], wtss[i], gu, dn, gate, act)
                              for i in range(S)])
        row("moe", f"T={T} ours W4A4+res50% experts fwd (incl. quantize)", t,
            int(active * 3 * I * H * 0.5625), base, extra=f"~{active:.0f} active experts")


def diag(out_dir, launch_only=False):
    """Dump TTGIR/PTX of the main kernels (and, under ncu, launch each once)."""
    K = N = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    wp = nvfp4_quantize(torch.randn(N, K, device="cuda", generator=g).mul_(0.02).bfloat16())
    x16 = torch.randn(16, K, device="cuda", generator=g).bfloat16()
    x4k = torch.randn(4096, K, device="cuda", generator=g).bfloat16()
    from quads.kernels.quantize_nvfp4 import LAST_LAUNCH as QL
    from quads.kernels.w4a4_gemm_hopper import LAST_LAUNCH as GL

    q16 = quantize_rows(x16, residual="per_token", k_top=K // 2, write_packed=False, write_dq=True, radix_bits=1)
    hq = QL["act_quant"]
    q4k = quantize_rows(x4k, residual="none", write_packed=False, write_dq=True)
    runs = {
        "decode": lambda: w4a4_gemm(q16.dx, q16.gx, wp.qdata, wp.scale, wp.global_encode_scale, q16.dr, q16.gr),
        "prefill": lambda: w4a4_gemm(q4k.dx, q4k.gx, wp.qdata, wp.scale, wp.global_encode_scale),
    }
    handles = {"actq": hq}
    for name, fn in runs.items():
        fn()
        handles[name] = GL["gemm"]
    torch.cuda.synchronize()
    if launch_only:
        for fn in runs.values():
            fn()
        quantize_rows(x16, residual="per_token", k_top=K // 2, write_packed=False, write_dq=True, radix_bits=1)
        torch.cuda.synchronize()
        return
    for name, h in handles.items():
        print(f"{name}: regs={h.n_regs} spills={h.n_spills} shared={h.metadata.shared}", flush=True)
        with open(os.path.join(out_dir, f"{name}.ttgir"), "w") as f:
            f.write(h.asm["ttgir"])
    with open(os.path.join(out_dir, "decode.ptx"), "w") as f:
        f.write(handles["decode"].asm["ptx"])


def main():
    if "--diag-launch" in sys.argv:
        diag(".", launch_only=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="quantization-kernel variants (top-k search, warps)")
    ap.add_argument("--gemm-sweep", action="store_true", help="GEMM tile / dequantization-mode experiments")
    ap.add_argument("--only", default="quant,linear,moe")
    ap.add_argument("--diag", action="store_true", help="dump TTGIR/PTX of the main kernels and exit")
    ap.add_argument("--tune", action="store_true", help="pick GEMM tile configs first (sets CONFIG_OVERRIDES)")
    args = ap.parse_args()
    if args.diag:
        diag(args.out)
        return
    import triton

    meta = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%d"), "cmd": " ".join(sys.argv)}
    print(meta, flush=True)
    torch.manual_seed(0)
    measure_copy()
    meta["copy_TBps"] = round(COPY_BW / 1e12, 3)
    if args.tune:
        tune_gemm()
        meta["tuned"] = {k: repr(v) for k, v in gemm_mod.CONFIG_OVERRIDES.items()}
    for part in args.only.split(","):
        try:
            {"linear": lambda: bench_linear(args.gemm_sweep), "quant": lambda: bench_quant(args.sweep),
             "moe": bench_moe}[part]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": ROWS}, f, indent=1)
    print("\nSUMMARY (us per call; ratios = baseline time / ours)")
    for r in ROWS:
        if r["section"] == "sweep":
            continue
        ratios = " ".join(f"{k[5:]}={v}x" for k, v in r.items() if k.startswith("x_vs_"))
        print(f"{r['section']:9s} {r['name'][:70]:70s} {r['us']:9.2f} floor={r['floor_us']} {ratios} {r['extra']}")


if __name__ == "__main__":
    main()
