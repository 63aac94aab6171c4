"""GPU correctness checks of the quads kernels at real shapes (H200; run before bench_kernels.py).

    PYTHONPATH=. python benchmarks/gpu_checks.py [--out DIR]

Checks (each prints PASS/FAIL and goes into DIR/checks.json):
* activation quantization bit-exact vs the torch reference on the GPU (M=4096, K=4096 bf16 with
  adversarial rows; per-token residual, radix 1/2/3; tensor scale; static mask; fp16 operands);
* weight quantization bit-exact (4096x4096, MoE 3-D experts);
* W4A4 GEMM (+ residual) vs an fp64 reference within the fp32-summation bound, M = 1, 16, 128,
  4096, every tile config that pick_config can return, inline-PTX vs plain dequant bit-equal,
  a weight row with E4M3-subnormal scales (catches fp16 subnormal flushing in the MMA);
* determinism (same bits twice, also under CUDA-graph replay) and batch invariance (rows of
  M = 1 / 16 / 128 / 4096 runs compared bit for bit);
* MoE experts (E=128, top-8, H=2048, I=768) vs the torch reference loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quads.kernels import quantize_weight_kernel, rollout_experts_kernel  # noqa: E402
from quads.kernels.quantize_nvfp4 import quantize_rows  # noqa: E402
from quads.kernels.w4a4_gemm_hopper import LAST_LAUNCH, GemmConfig, pick_config, w4a4_gemm  # noqa: E402
from quads.ops import use_backend  # noqa: E402
from quads.ops.activation_quant import ActivationQuant, quantize_activation_reference  # noqa: E402
from quads.ops.moe_experts import rollout_experts  # noqa: E402
from quads.ops.rollout_linear import _unscaled  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402

RESULTS: dict = {}


def record(name, ok, detail=""):
    RESULTS[name] = {"ok": bool(ok), "detail": str(detail)}
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)


def check(name):
    def deco(fn):
        def run(*a, **k):
            t = time.time()
            try:
                fn(*a, **k)
            except Exception as e:  # noqa: BLE001
                record(name, False, f"EXC {type(e).__name__}: {e}")
                traceback.print_exc()
            print(f"   ({time.time() - t:.1f}s)", flush=True)
        return run
    return deco


def bits_equal(a, b):
    if a.dtype == torch.float32:
        an, bn = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(an, bn) and torch.equal(a.view(torch.int32)[~an], b.view(torch.int32)[~bn]))
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def parts_equal(got, ref):
    return bits_equal(got.qdata, ref.qdata) and bits_equal(got.scale, ref.scale) and bits_equal(
        got.global_encode_scale, ref.global_encode_scale)


def adversarial(m, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * 3
    x[1] = 0
    x[2, :16] = 1e-6
    x[2, 16:32] = 3e-3
    x[3] = torch.tensor([1.0, -1.0, 0.5, -0.25], device="cuda").repeat(k // 4)
    x[4, 5], x[4, 7] = float("inf"), -float("inf")
    x[5] *= 1e30
    x[6] *= 1e-38
    x[8:64] *= torch.logspace(-3, 3, 56, device="cuda")[:, None]
    return x.to(dtype)


@check("act_quant bit-exact")
def check_act_quant():
    x = adversarial(4096, 4096)
    for cfg, radix, sm in [
        (ActivationQuant(), 0, None), (ActivationQuant(), 1, None), (ActivationQuant(), 4, None),
        (ActivationQuant(residual_fraction=0.0), 1, None),
        (ActivationQuant(residual_fraction=0.1), 4, None),
        (ActivationQuant(global_scale="tensor"), 1, None),
        (ActivationQuant(selection="static"), 1, torch.rand(4096, device="cuda") > 0.5),
    ]:
        ref = quantize_activation_reference(x, cfg, sm)
        res = "none" if cfg.residual_fraction == 0 else cfg.selection
        k_top = int(cfg.residual_fraction * 4096 + 0.5)
        out = quantize_rows(x, residual=res, k_top=k_top, static_mask=sm, global_scale=cfg.global_scale,
                            write_packed=True, write_dq=True, radix_bits=radix)
        ok = parts_equal(out.main_parts(), ref.main)
        dq_ok = bits_equal(out.dx, _unscaled(ref.main).to(torch.float16))
        if ref.residual is not None:
            ok = ok and parts_equal(out.residual_parts(), ref.residual)
            dq_ok = dq_ok and bits_equal(out.dr, _unscaled(ref.residual).to(torch.float16))
        record(f"act_quant {cfg.residual_fraction}/{cfg.selection}/{cfg.global_scale} radix={radix}", ok and dq_ok,
               f"packed={ok} dq={dq_ok}")
    h = LAST_LAUNCH.get("act_quant")
    if h is not None:
        print(f"   act_quant kernel: regs={h.n_regs} spills={h.n_spills}")


@check("weight quant bit-exact")
def check_weight_quant():
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    w[0] = 0
    w[1, :16] = 1e-9
    record("weight 4096x4096 tensor-scale", parts_equal(quantize_weight_kernel(w), nvfp4_quantize(w)))
    e = (torch.randn(128, 1536, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    record("weight (128,1536,2048) expert-scale", parts_equal(quantize_weight_kernel(e), nvfp4_quantize(e)))


def ref64(x16, sx, r16, sr, wp):
    w = _unscaled(wp).double()
    y = (x16.double() @ w.T) / (sx.double()[:, None] * wp.global_encode_scale.double())
    b = (x16.double().abs() @ w.abs().T) / (sx.double()[:, None] * wp.global_encode_scale.double())
    if r16 is not None:
        y = y + (r16.double() @ w.T) / (sr.double()[:, None] * wp.global_encode_scale.double())
        b = b + (r16.double().abs() @ w.abs().T) / (sr.double()[:, None] * wp.global_encode_scale.double())
    return y, b


@check("gemm")
def check_gemm():
    k = n = 4096
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w[3] *= 1e-4  # E4M3-subnormal block scales -> fp16-subnormal MMA operands
    w[5, :2048] *= 1e-3
    wp = nvfp4_quantize(w.bfloat16())
    x = adversarial(4096, k, seed=3)
    x[4] = torch.randn(k, device="cuda")  # drop the inf row for the GEMM tolerance check
    x[6] = torch.randn(k, device="cuda")
    q = quantize_rows(x, residual="per_token", k_top=2048, write_packed=False, write_dq=True)
    outs = {}
    cfgs = {}
    for m in (1, 16, 128, 4096):
        base = pick_config(m, n, k)
        cfgs[m] = base
        variants = [base, GemmConfig(base.bn, base.bm, base.bk, base.split, base.num_warps, base.num_stages, False)]
        ys = []
        for cfg in variants:
            y = w4a4_gemm(q.dx[:m], q.gx[:m], wp.qdata, wp.scale, wp.global_encode_scale, q.dr[:m], q.gr[:m], config=cfg)
            ys.append(y)
        yr, bound = ref64(q.dx[:m].float(), q.gx[:m], q.dr[:m].float(), q.gr[:m], wp)
        err = (ys[0].double() - yr).abs()
        tol = 2 * k * 2.0**-24 * bound + 1e-30
        ok = bool(torch.all(err <= tol))
        worst = float((err / tol).max())
        record(f"gemm M={m} {base}", ok, f"max err/bound={worst:.3g} max|err|={float(err.max()):.3g}")
        record(f"gemm M={m} asm==plain", bits_equal(ys[0], ys[1]))
        y2 = w4a4_gemm(q.dx[:m], q.gx[:m], wp.qdata, wp.scale, wp.global_encode_scale, q.dr[:m], q.gr[:m], config=base)
        record(f"gemm M={m} deterministic", bits_equal(ys[0], y2))
        outs[m] = ys[0]
        h = LAST_LAUNCH.get("gemm")
        if h is not None:
            ptx = h.asm.get("ptx", "")
            print(f"   regs={h.n_regs} spills={h.n_spills} wgmma={'wgmma' in ptx} mma.sync={'mma.sync' in ptx} "
                  f"ld.local={'ld.local' in ptx}")
    # numerics of other instruction shapes / operand orders (informative)
    for label, cfg in [("mma.sync BN=32 warps=2", GemmConfig(32, 16, 128, True, 2, 4, True)),
                       ("K-permuted w_mode=3", GemmConfig(64, 16, 128, True, 4, 4, True, w_mode=3)),
                       ("fp16-W w_mode=1 BN=64", GemmConfig(64, 16, 128, True, 4, 4, True, w_mode=1))]:
        try:
            yv = w4a4_gemm(q.dx[:16], q.gx[:16], wp.qdata, wp.scale, wp.global_encode_scale, q.dr[:16], q.gr[:16],
                           config=cfg)
            yr, bound = ref64(q.dx[:16].float(), q.gx[:16], q.dr[:16].float(), q.gr[:16], wp)
            okb = bool(torch.all((yv.double() - yr).abs() <= 2 * k * 2.0**-24 * bound + 1e-30))
            same = sum(bits_equal(yv[i], outs[16][i]) for i in range(16))
            record(f"gemm {label}: within bound", okb, f"rows bit-equal to the default decode kernel: {same}/16")
        except Exception as e:  # noqa: BLE001
            record(f"gemm {label}", False, f"EXC {type(e).__name__}: {str(e)[:200]}")
    # plain (no residual) also within bound
    y = w4a4_gemm(q.dx[:16], q.gx[:16], wp.qdata, wp.scale, wp.global_encode_scale)
    yr, bound = ref64(q.dx[:16].float(), q.gx[:16], None, None, wp)
    record("gemm plain M=16", bool(torch.all((y.double() - yr).abs() <= 2 * k * 2.0**-24 * bound + 1e-30)))
    # batch invariance: first rows across regimes
    for m in (16, 128, 4096):
        same = [bits_equal(outs[1][0], outs[m][0])] + [bits_equal(outs[16][i], outs[m][i]) for i in range(16)]
        record(f"batch invariance M=1/16 rows vs M={m} ({cfgs[m]})", all(same), f"{sum(same)}/{len(same)} rows equal")
    # single rows alone vs in the batch, same config family
    for i in (3, 7, 15):
        yi = w4a4_gemm(q.dx[i:i + 1], q.gx[i:i + 1], wp.qdata, wp.scale, wp.global_encode_scale, q.dr[i:i + 1], q.gr[i:i + 1])
        record(f"row {i} alone == in M=16 batch", bits_equal(yi[0], outs[16][i]))
    # CUDA-graph replay of the split-K kernel (arrival counters reset between launches)
    xs, ss, rs, srs = q.dx[:16].clone(), q.gx[:16].clone(), q.dr[:16].clone(), q.gr[:16].clone()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        yo = w4a4_gemm(xs, ss, wp.qdata, wp.scale, wp.global_encode_scale, rs, srs)
    torch.cuda.current_stream().wait_stream(st)
    gph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gph, stream=st):
        yo = w4a4_gemm(xs, ss, wp.qdata, wp.scale, wp.global_encode_scale, rs, srs)
    ok = True
    for _ in range(5):
        gph.replay()
        torch.cuda.synchronize()
        ok = ok and bits_equal(yo, outs[16])
    record("gemm M=16 graph replay x5 == eager", ok)


@check("moe")
def check_moe():
    E, TOPK, H, I, T = 128, 8, 2048, 768, 16
    g = torch.Generator(device="cuda").manual_seed(4)
    gu = NVFP4Tensor.from_float((torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16())
    dn = NVFP4Tensor.from_float((torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16())
    hid = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, TOPK, device="cuda", generator=g), -1).bfloat16()

    def gate(h):
        return torch.nn.functional.silu(h[:, :I]) * h[:, I:]

    act = ActivationQuant()
    with use_backend("torch"):
        ref = rollout_experts(hid, idx, wts, gu, dn, gate, act)
    got = rollout_experts_kernel(hid, idx, wts, gu, dn, gate, act)
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    record("moe E=128 top8 T=16 vs reference loop", err < 1e-2, f"rel err {err:.3g}")
    got2 = rollout_experts_kernel(hid, idx, wts, gu, dn, gate, act)
    record("moe deterministic", bits_equal(got, got2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    import triton

    print("triton", triton.__version__, flush=True)
    check_act_quant()
    check_weight_quant()
    check_gemm()
    check_moe()
    with open(os.path.join(args.out, "checks.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    nfail = sum(not r["ok"] for r in RESULTS.values())
    print(f"CHECKS: {len(RESULTS) - nfail} passed, {nfail} failed", flush=True)


if __name__ == "__main__":
    main()
