"""Decode-GEMM and grouped-MoE kernel variants: bit checks against the default, then timings (H200).

    python -m lab.decode_variants [--out DIR] [--quick]

For each (K x N) weight and M tokens (W4A4 + residual, k = 100%; and plain W4A4 at M = 1):
every variant's output must equal the default's bit for bit (a variant that does not is
reported and not timed), then each is timed with CUDA graphs over rotating weight sets larger
than L2 against cuBLAS BF16 in the same run: the GEMM alone, and quantization + GEMM (the layer
as it runs). Variants of the split-K decode kernel: the segment's loads all issued first
(prefetch), programmatic dependent launch after the quantization (+PDL: only the
quant+GEMM column can show it), the cross-segment sums in a second launch (reduce kernel).
The grouped MoE kernel: one pass vs split-K over segments (the default picks by shape).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton


from quads.kernels.hopper.weight_layout import to_hopper_layout  # noqa: E402
from quads.kernels.hopper.moe_grouped_gemm import MoeConfig, moe_w4a4_gemm, pick_moe_config  # noqa: E402
from quads.kernels.hopper.w4a4_decode import DecodeConfig, decode_gemm  # noqa: E402
from quads.ops.activation_quant import ActivationQuant, activation_operands_triton  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402
from benchmarks.timing import graph_time  # noqa: E402

QUADS = ActivationQuant(residual_fraction=1.0)
PLAIN = ActivationQuant(residual_fraction=0.0)
SHAPES = ((4096, 4096), (2048, 4096), (4096, 2048), (4096, 14336), (14336, 4096), (2048, 6144), (2048, 1536))


def dense_variants(cols: int) -> dict[str, DecodeConfig | None]:
    if cols <= 16:
        bn, kbi, warps = 64, 2, 4
    else:
        bn, kbi, warps = 128, 4, 8
    v = {
        "split (default)": None,
        "reduce kernel": DecodeConfig(bn, kbi, warps, reduce_kernel=True),
        "prefetch": DecodeConfig(bn, 4, warps, prefetch=True),
        "prefetch +PDL": DecodeConfig(bn, 4, warps, prefetch=True, pdl=True),
        "prefetch +reduce kernel": DecodeConfig(bn, 4, warps, prefetch=True, reduce_kernel=True),
        "prefetch +PDL +reduce kernel": DecodeConfig(bn, 4, warps, prefetch=True, pdl=True, reduce_kernel=True),
    }
    if cols > 16:
        v["bn64 w4 prefetch +PDL +reduce kernel"] = DecodeConfig(64, 4, 4, prefetch=True, pdl=True, reduce_kernel=True)
    return v


def bench_dense(rows, quick):
    ms = (1, 16) if quick else (1, 8, 16, 64)
    for k, n in SHAPES:
        per = n * k // 2 + n * k // 16
        S = max(4, min(24, int(160e6 // per) + 1))
        g = torch.Generator(device="cuda").manual_seed(k + n)
        ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(S)]
        parts = [nvfp4_quantize(w) for w in ws]
        prep = [to_hopper_layout(p.qdata, p.scale) for p in parts]
        for m in ms:
            for act, res in ((QUADS, True), (PLAIN, False)):
                if not res and m not in (1, 16):
                    continue
                xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(S)]
                ops = [activation_operands_triton(x, act) for x in xs]
                tag = f"K={k} N={n} M={m} {'res' if res else 'plain'}"
                bf16 = graph_time([lambda i=i: torch.matmul(xs[i], ws[i].t()) for i in range(S)])
                quant = graph_time([lambda i=i: activation_operands_triton(xs[i], act) for i in range(S)])
                print(f"{tag:34s} {'cuBLAS BF16':34s} {bf16:8.2f} us   quantization alone {quant:6.2f} us", flush=True)
                rows.append(dict(K=k, N=n, M=m, residual=res, variant="cuBLAS BF16", us=bf16, quant_us=quant))
                cols = 2 * m if res else m
                want = decode_gemm(ops[0].stacked, ops[0].main_scale, prep[0], parts[0].global_encode_scale, m, res,
                                   None, torch.bfloat16)
                for name, cfg in dense_variants(cols).items():
                    if cfg is not None and cfg.prefetch and k % 512:
                        continue
                    try:
                        got = decode_gemm(ops[0].stacked, ops[0].main_scale, prep[0], parts[0].global_encode_scale, m,
                                          res, None, torch.bfloat16, cfg)
                        same = torch.equal(got.view(torch.int16), want.view(torch.int16))
                        if not same:
                            print(f"{tag:34s} {name:34s} BITS DIFFER ({(got != want).sum().item()} elements)", flush=True)
                            rows.append(dict(K=k, N=n, M=m, residual=res, variant=name, us=None, bits_equal=False))
                            continue

                        def gemm(i, cfg=cfg, o=None):
                            o = ops[i] if o is None else o
                            return decode_gemm(o.stacked, o.main_scale, prep[i], parts[i].global_encode_scale, m, res,
                                               None, torch.bfloat16, cfg)

                        us = graph_time([lambda i=i: gemm(i) for i in range(S)])
                        # the layer as it runs: quantization, then the GEMM (PDL overlaps the two)
                        lin = graph_time([lambda i=i: gemm(i, o=activation_operands_triton(xs[i], act))
                                          for i in range(S)])
                        floor = per / 4.0e12 * 1e6
                        print(f"{tag:34s} {name:34s} GEMM {us:7.2f} us ({bf16 / us:5.2f}x BF16, {100 * floor / us:3.0f}% "
                              f"of 4 TB/s)  quant+GEMM {lin:7.2f} us ({bf16 / lin:5.2f}x BF16)", flush=True)
                        rows.append(dict(K=k, N=n, M=m, residual=res, variant=name, us=us, bits_equal=True,
                                         vs_bf16=bf16 / us, linear_us=lin, linear_vs_bf16=bf16 / lin))
                    except Exception as e:  # noqa: BLE001
                        print(f"{tag} {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del ws, parts, prep
        torch.cuda.empty_cache()


def bench_moe(rows, quick):
    shapes = ((128, 8, 2048, 768), (8, 2, 4096, 14336))
    for E, top, H, I in shapes:
        g = torch.Generator(device="cuda").manual_seed(E)
        sets = 2 if E == 8 else 4
        w = [[(torch.randn(E, n, k, device="cuda", generator=g) * 0.02).bfloat16() for (n, k) in ((2 * I, H), (H, I))]
             for _ in range(sets)]
        parts = [[nvfp4_quantize(t) for t in ws] for ws in w]
        prep = [[to_hopper_layout(p.qdata, p.scale) for p in ps] for ps in parts]
        del w
        for T in ((1, 16) if quick else (1, 4, 16, 64)):
            logits = torch.randn(T, E, device="cuda", generator=g)
            idx = logits.topk(top, dim=-1).indices.reshape(-1)
            order = torch.argsort(idx, stable=True)
            counts = torch.bincount(idx, minlength=E)
            offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
            offsets[1:] = torch.cumsum(counts, 0)
            rows_idx = (order // top).to(torch.int32)
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            ops = activation_operands_triton(x, QUADS)
            for wi, (name_w, rx, rws) in enumerate((("gate_up", T, rows_idx), ("down", T * top, None))):
                if name_w == "down":
                    xd = torch.randn(T * top, I, device="cuda", generator=g).bfloat16()
                    ops_w = activation_operands_triton(xd, QUADS)
                else:
                    ops_w = ops
                tag = f"E={E} top{top} H={H} I={I} T={T} {name_w}"

                def call(cfg, s):
                    return moe_w4a4_gemm(ops_w.stacked, ops_w.main_scale, rws, offsets, prep[s][wi],
                                         parts[s][wi].global_encode_scale, T * top, rx, True, torch.bfloat16, cfg)

                base = pick_moe_config(T * top, E, prep[0][wi].n, prep[0][wi].k)
                one_pass = MoeConfig(base.bn, base.bm, base.kbi, base.num_warps, split=False)
                want = call(one_pass, 0)
                variants = [one_pass, MoeConfig(base.bn, base.bm, base.kbi, base.num_warps, split=True)]
                for cfg in variants:
                    try:
                        got = call(cfg, 0)
                        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                            print(f"{tag:44s} {cfg!r} BITS DIFFER", flush=True)
                            continue
                        us = graph_time([lambda s=s, cfg=cfg: call(cfg, s) for s in range(sets)])
                        print(f"{tag:44s} {cfg!r:60s} {us:8.2f} us", flush=True)
                        rows.append(dict(moe=tag, config=repr(cfg), us=us))
                    except Exception as e:  # noqa: BLE001
                        print(f"{tag} {cfg!r} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del parts, prep
        torch.cuda.empty_cache()


@triton.jit
def _empty_kernel(X):
    pass


def bench_floors(rows):
    """What a decode-GEMM call costs before its bytes: an empty kernel with the 4096 x 4096 grid
    (512 programs) and the decode kernel on a one-program weight (64 x 512), each per call in a
    graph of 16 back-to-back calls; and the activation quantization of one row."""
    out = torch.zeros(1, device="cuda")
    t = graph_time([lambda: _empty_kernel[(64, 8)](out) for _ in range(16)])
    print(f"floor: empty kernel, grid (64, 8), per call in a graph of 16: {t:.2f} us", flush=True)
    rows.append(dict(floor="empty kernel grid (64, 8)", us=t))
    for n, k in ((64, 512), (64, 4096), (4096, 512)):
        g = torch.Generator(device="cuda").manual_seed(n + k)
        parts = [nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()) for _ in range(16)]
        prep = [to_hopper_layout(p.qdata, p.scale) for p in parts]
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        ops = activation_operands_triton(x, QUADS)
        t = graph_time([lambda i=i: decode_gemm(ops.stacked, ops.main_scale, prep[i], parts[i].global_encode_scale, 1,
                                                True, None, torch.bfloat16) for i in range(16)])
        tq = graph_time([lambda: activation_operands_triton(x, QUADS) for _ in range(16)])
        print(f"floor: decode GEMM N={n} K={k} M=1 + residual: {t:.2f} us; its quantization {tq:.2f} us", flush=True)
        rows.append(dict(floor=f"decode N={n} K={k} M=1", us=t, quant_us=tq))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="fewer M / T values")
    ap.add_argument("--sections", default="floors,dense,moe")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows: list[dict] = []
    if "floors" in args.sections:
        bench_floors(rows)
    if "dense" in args.sections:
        bench_dense(rows, args.quick)
    if "moe" in args.sections:
        bench_moe(rows, args.quick)
    with open(os.path.join(args.out, "decode_variants.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
