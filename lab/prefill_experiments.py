"""Prefill GEMM variants on one GPU (H200): bits against the default kernel, times against cuBLAS BF16.

    python -m lab.prefill_experiments [--out DIR] [--variants a,b]
        [--shapes 4096x4096,...] [--ms 256,2048]

For each weight shape (K x N), token count M and mode (plain W4A4; QUADS default = residual
k = 100%), in one run:

* every variant's fp32 output is compared bit for bit with the default kernel's (``pick_config``);
  the opt-in cuBLAS path is not batch invariant, so for it the largest |difference| relative to
  the output's largest |value| is printed instead;
* every variant is timed with ``timing.graph_time`` (CUDA graphs, median of replays) over ``S``
  rotating input sets (weights and activations) that together exceed the 50 MB L2, next to
  cuBLAS BF16 ``torch.matmul`` and to the activation quantization alone, with a bf16 output as a
  rollout layer writes it. "GEMM" times take the
  quantized operands (the fp16-weight variants include the per-call weight decode, as the
  library runs them); "layer" = quantization + GEMM, the quantity of docs/kernels.md's table.

One line per (shape, M, mode, variant): GEMM us, layer us, layer ratio vs BF16, bits. A failing
variant prints its error and the run goes on. JSON: ``--out`` (default ``$OUT``)/prefill_experiments.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch


from benchmarks.timing import graph_time  # noqa: E402

from quads.kernels.hopper.weight_layout import to_hopper_layout  # noqa: E402
from quads.kernels.hopper.w4a4_gemm import (  # noqa: E402
    GemmConfig,
    dequant_weight_fp16,
    pick_config,
    w4a4_gemm,
)
from lab.cublas_prefill import cublas_prefill  # noqa: E402
from quads.ops.activation_quant import ActivationQuant, activation_operands_triton  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402

SHAPES = ((4096, 4096), (2048, 4096), (4096, 14336), (14336, 4096))  # (K, N)
MODES = {"plain": ActivationQuant(residual_fraction=0.0), "residual": ActivationQuant(residual_fraction=1.0)}
L2_BYTES = 50e6
ROWS: list = []


def _flat(bn, bk, warps, stages, **kw):
    """A flat-walk config builder: bm = 64 tokens with the residual (128 MMA columns) or for
    M <= 256 (more programs), else 128."""
    def build(m, res):
        return GemmConfig(bn, 64 if res or m <= 256 else 128, bk, False, warps, stages, loop="flat", **kw)
    return build


# name ("flat-<loads>-<bn>x<bk>") -> (config builder (m, residual) -> GemmConfig, or None for cuBLAS;
# how the weight is passed: "per-call" (the library decodes it per call), "cached" (a precomputed fp16
# operand), "hopper" (the packed Hopper layout))
VARIANTS = {
    "default": (lambda m, res: pick_config(m, 0, 0, res), "per-call"),
    "segment walk (the default before 2026-12-01)": (
        lambda m, res: GemmConfig(64, 128, 64, True, 4, 3) if m <= 256 else GemmConfig(128, 128, 64, False, 8, 4),
        "per-call"),
    "flat-ptr-128x64": (_flat(128, 64, 8, 4), "per-call"),
    "flat-tma-128x64": (_flat(128, 64, 8, 4, loads="tma"), "per-call"),
    "flat-tma-128x128": (_flat(128, 128, 8, 3, loads="tma"), "per-call"),
    "flat-tma-64x64": (_flat(64, 64, 4, 4, loads="tma"), "per-call"),
    "flat-tma-persist-128x64": (_flat(128, 64, 8, 4, loads="tma", persistent=1), "per-call"),
    "flat-tma-persist-64x64": (_flat(64, 64, 4, 4, loads="tma", persistent=2), "per-call"),
    "flat-tma-packed-128x64": (_flat(128, 64, 8, 4, loads="tma", weight="packed"), "hopper"),
    "flat-tma-128x64+cached-w16": (_flat(128, 64, 8, 4, loads="tma"), "cached"),
    "cublas-opt-in": (None, "per-call"),
    "cublas-opt-in+cached-w16": (None, "cached"),
}


class WeightSet:
    """One rotating weight: packed parts, the Hopper layout, and (when asked) the fp16 operand."""

    def __init__(self, k, n, g, cached):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        self.bf16 = w
        self.parts = nvfp4_quantize(w)
        self.hopper = to_hopper_layout(self.parts.qdata, self.parts.scale)
        self.w16 = dequant_weight_fp16(self.parts.qdata, self.parts.scale) if cached else None


def _num_sets(k, n, m, res):
    """Input sets so that one pass over them touches more than twice the L2."""
    per = n * k // 2 + n * k // 16 + 2 * m * k * (3 if res else 2) + 2 * m * n
    return max(2, min(32, int(2 * L2_BYTES // per) + 1))


def _call(name, w, ops, m, res, out_dtype=torch.bfloat16):
    """The GEMM call of variant ``name`` on one input set."""
    build, weight = VARIANTS[name]
    p = w.parts
    r16 = ops.residual if res else None
    w16 = w.w16 if weight == "cached" else None
    if build is None:
        return lambda: cublas_prefill(ops.main, ops.main_scale, p.qdata, p.scale, p.global_encode_scale, r16,
                                      out_dtype=out_dtype, w16=w16)
    cfg = build(m, res)
    hw = w.hopper if weight == "hopper" else None
    return lambda: w4a4_gemm(ops.main, ops.main_scale, p.qdata, p.scale, p.global_encode_scale, r16,
                             out_dtype=out_dtype, config=cfg, w16=w16, hopper_weight=hw)


def _record(tag, name, gemm_us, quant_us, bf16_us, bits, **extra):
    layer = gemm_us + quant_us
    r = {"case": tag, "variant": name, "gemm_us": round(gemm_us, 2), "layer_us": round(layer, 2),
         "bf16_us": round(bf16_us, 2), "x_vs_bf16": round(bf16_us / layer, 3), "bits": bits, **extra}
    ROWS.append(r)
    print(f"{tag:34s} {name:28s} gemm {gemm_us:8.1f} us  layer {layer:8.1f} us  {r['x_vs_bf16']:5.2f}x bf16  {bits}",
          flush=True)


def _bits(y, ref, name):
    if name.startswith("cublas"):
        rel = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        return f"not batch invariant: max|diff|/max|y| = {rel:.2e}"
    return "bits == default" if torch.equal(y, ref) else "BITS DIFFER"


def run_case(k, n, m, mode, weights, g, names):
    res = mode == "residual"
    act = MODES[mode]
    s = min(len(weights), _num_sets(k, n, m, res))
    xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(s)]
    ops = [activation_operands_triton(x, act) for x in xs]
    tag = f"K={k} N={n} M={m} {mode}"
    bf16 = graph_time([lambda i=i: torch.matmul(xs[i], weights[i].bf16.t()) for i in range(s)])
    quant = graph_time([lambda i=i: activation_operands_triton(xs[i], act) for i in range(s)])
    print(f"{tag:34s} {'cuBLAS BF16':28s} {bf16:8.1f} us; activation quantization {quant:.1f} us ({s} sets)",
          flush=True)
    ROWS.append({"case": tag, "variant": "cuBLAS BF16", "us": round(bf16, 2), "quant_us": round(quant, 2), "sets": s})
    ref = _call("default", weights[0], ops[0], m, res, torch.float32)()
    for name in names:
        try:
            y = _call(name, weights[0], ops[0], m, res, torch.float32)()
            bits = _bits(y, ref, name)
            t = graph_time([_call(name, weights[i], ops[i], m, res) for i in range(s)])
            cfg = VARIANTS[name][0]
            _record(tag, name, t, quant, bf16, bits, config=repr(cfg(m, res)) if cfg else "cuBLAS")
        except Exception as e:  # noqa: BLE001
            print(f"{tag:34s} {name:28s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=3)
    del xs, ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default="256,2048")
    args = ap.parse_args()
    import triton

    names = args.variants.split(",")
    cached = any(VARIANTS[v][1] == "cached" for v in names)
    meta = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "variants": {v: repr(VARIANTS[v][0](2048, True)) if VARIANTS[v][0] else "cuBLAS" for v in names}}
    print(meta, flush=True)
    t0 = time.time()
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(k + n)
        ms = [int(v) for v in args.ms.split(",")]
        s_max = max(_num_sets(k, n, m, res) for m in ms for res in (False, True))
        weights = [WeightSet(k, n, g, cached) for _ in range(s_max)]
        for m in ms:
            for mode in MODES:
                run_case(k, n, m, mode, weights, g, names)
        del weights
        torch.cuda.empty_cache()
        print(f"--- {shape}: {time.time() - t0:.0f}s", flush=True)
        with open(os.path.join(args.out, "prefill_experiments.json"), "w") as f:
            json.dump({"meta": meta, "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    main()
