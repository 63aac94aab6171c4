"""Where the decode GEMM's time goes (benchmark-only experiment kernels; H200).

    python -m lab.decode_experiments [--out DIR] [--ncu]

Times (CUDA graphs, rotating weight sets > L2, as bench_kernels.py), for K x N weights at M = 1:

* ``empty``: a kernel with the decode grid that returns at once (graph launch + drain);
* ``stream``: the decode kernel's loads only (weights, scales, activations), kept alive by a
  store that never fires: the memory system with this access pattern;
* ``decode-noepi``: the full K loop (loads, in-register decode, wgmma) writing its partial sums,
  without the split-K arrival counter and the reduction;
* the library kernel with several configs (unrolled / software-pipelined, segment sizes).

``--ncu``: run each kernel a few times without graphs (for ``ncu -k regex:...``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl


from quads.kernels.hopper.weight_decode import load_weight_tile  # noqa: E402
from quads.kernels.hopper.weight_layout import to_hopper_layout  # noqa: E402
from quads.kernels.hopper.w4a4_decode import DecodeConfig, decode_gemm  # noqa: E402
from quads.ops.activation_quant import ActivationQuant, activation_operands_triton  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402
from benchmarks.timing import graph_time  # noqa: E402


@triton.jit
def _empty_kernel(X):
    pass


@triton.jit
def _stream_kernel(VALS, SCALES, X, OUT, num_kb, K, SEG_KB: tl.constexpr, BN: tl.constexpr, KBI: tl.constexpr,
                   NT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    W: tl.constexpr = BN // 16
    i = tl.arange(0, W * 32)
    q = tl.arange(0, KBI)
    rb = (pid_n * W + i // 32).to(tl.int64)
    lane = i % 32
    acc = tl.zeros((W * 32, KBI, 16), dtype=tl.int32)
    accs = tl.zeros((W * 32, KBI, 8), dtype=tl.int32)
    accx = tl.zeros((NT, KBI * 64), dtype=tl.float16)
    tok = tl.arange(0, NT)
    for it in tl.static_range(SEG_KB // KBI):
        kb0 = pid_s * SEG_KB + it * KBI
        blk = (rb * num_kb + kb0)[:, None] + q[None, :]
        raw = tl.load(VALS + (blk * 512 + (lane * 16)[:, None])[:, :, None] + tl.arange(0, 16)[None, None, :])
        s8 = tl.load(SCALES + (blk * 64 + ((lane // 4) * 8)[:, None])[:, :, None] + tl.arange(0, 8)[None, None, :])
        kk = kb0 * 64 + tl.arange(0, KBI * 64)
        x = tl.load(X + tok[:, None] * K + kk[None, :], mask=(tok < 2)[:, None], other=0.0)
        acc = acc ^ raw.to(tl.int32)
        accs = accs ^ s8.to(tl.int32)
        accx = accx + x
    sel = (acc == 0x7123456)
    tl.store(OUT + tl.zeros_like(acc), acc, mask=sel)
    tl.store(OUT + tl.zeros_like(accs), accs, mask=accs == 0x7123456)
    tl.store(OUT + tl.zeros((NT, KBI * 64), dtype=tl.int32), accx.to(tl.int32), mask=accx == 12345.0)


@triton.jit
def _decode_noepi_kernel(VALS, SCALES, X, PART, num_kb, K, N, SEG_KB: tl.constexpr, BN: tl.constexpr,
                         KBI: tl.constexpr, NT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    tok = tl.arange(0, NT)
    tmask = tok < 2
    acc = tl.zeros((BN, NT), dtype=tl.float32)
    for it in tl.static_range(SEG_KB // KBI):
        kb = pid_s * SEG_KB + it * KBI
        w = load_weight_tile(VALS, SCALES, pid_n * (BN // 16), kb, num_kb, BN, KBI, True)
        kk = kb * 64 + tl.arange(0, KBI * 64)
        x = tl.load(X + tok[:, None].to(tl.int64) * K + kk[None, :], mask=tmask[:, None] & (kk < K)[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(PART + (pid_s * 2).to(tl.int64) * N + tok[None, :] * N + offs_n[:, None], acc, mask=tmask[None, :])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    rows = []
    for k, n in ((4096, 4096), (14336, 4096)):
        S = 16 if k == 4096 else 6
        g = torch.Generator(device="cuda").manual_seed(1)
        parts = [nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()) for _ in range(S)]
        prep = [to_hopper_layout(p.qdata, p.scale) for p in parts]
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        ops = activation_operands_triton(x, ActivationQuant(residual_fraction=1.0))
        num_kb = prep[0].values.shape[1]
        out = torch.zeros(16, dtype=torch.int32, device="cuda")
        part = torch.empty(64, 2, n, device="cuda")
        floor_us = (n * k // 2 + n * k // 16) / 4.21e12 * 1e6
        variants = {}
        for seg_kb, kbi in ((8, 2), (8, 4), (4, 2), (16, 4)):
            grid = (n // 64, triton.cdiv(num_kb, seg_kb))
            variants[f"empty grid{grid}"] = lambda grid=grid: _empty_kernel[grid](out)
            variants[f"stream seg={seg_kb * 64} kbi={kbi}"] = (
                lambda i, grid=grid, seg_kb=seg_kb, kbi=kbi: _stream_kernel[grid](
                    prep[i].values, prep[i].scales, ops.stacked, out, num_kb, k, SEG_KB=seg_kb, BN=64, KBI=kbi, NT=16,
                    num_warps=4))
            variants[f"decode-noepi seg={seg_kb * 64} kbi={kbi}"] = (
                lambda i, grid=grid, seg_kb=seg_kb, kbi=kbi: _decode_noepi_kernel[grid](
                    prep[i].values, prep[i].scales, ops.stacked, part, num_kb, k, n, SEG_KB=seg_kb, BN=64, KBI=kbi,
                    NT=16, num_warps=4))
        for cfg in (DecodeConfig(64, 2, 4, 1), DecodeConfig(64, 4, 4, 1), DecodeConfig(64, 1, 4, 2, unroll=False),
                    DecodeConfig(64, 1, 4, 3, unroll=False), DecodeConfig(64, 2, 4, 3, unroll=False),
                    DecodeConfig(64, 2, 4, 4, unroll=False)):
            for seg in (512, 256, 1024):
                variants[f"library {cfg} seg={seg}"] = (
                    lambda i, cfg=cfg, seg=seg: decode_gemm(ops.stacked, ops.main_scale, prep[i],
                                                             parts[i].global_encode_scale, 1, True, None,
                                                             torch.bfloat16, cfg, seg))
        for name, fn in variants.items():
            try:
                calls = [fn] if name.startswith("empty") else [lambda i=i, fn=fn: fn(i) for i in range(S)]
                if args.ncu:
                    for c in calls[:3]:
                        c()
                    torch.cuda.synchronize()
                    continue
                us = graph_time(calls)
                rows.append({"K": k, "N": n, "variant": name, "us": round(us, 2), "bw_frac": round(floor_us / us, 3)})
                print(f"K={k} N={n} {name:80s} {us:8.2f} us  ({100 * floor_us / us:.0f}% of the bytes floor {floor_us:.2f})",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del parts, prep
        torch.cuda.empty_cache()
    if not args.ncu:
        with open(os.path.join(args.out, "decode_experiments.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
