"""GPU correctness checks of the quads kernels at real shapes (H200; run before bench_kernels.py).

    python -m benchmarks.gpu_checks [--out DIR] [--only act_quant,weights,...]
    python -m pytest -m gpu tests/gpu        # the same checks as pytest tests (skipped without CUDA)

Each check prints PASS/FAIL and goes into DIR/checks.json:
* activation quantization bit-exact vs the torch reference on the GPU (M=4096, K=4096 bf16 with
  adversarial rows; per-token residual (both top-k searches), k = 100%, static mask, tensor scale,
  naive), stacked fp16 operands exact;
* weight quantization bit-exact (4096x4096, 3-D experts); the Hopper weight layout round trip and
  its in-register decode (inline PTX) == the portable decode == the reference, E4M3-subnormal and
  zero block scales included; the layout kernel's bytes == the torch reference's (4096x4096,
  (128, 1536, 2048) experts, a padded odd shape; random code and scale bytes; in place);
* decode GEMM (M = 1, 8, 16, 64; with and without residual; bias; K = 14336) and prefill GEMM
  (M = 256 split-K, 2048) vs an fp64 reference within the fp32-summation bound;
* batch invariance: a row's bits equal across M = 1 / 8 / 16 / 64 (decode) and 256 / 2048
  (prefill); determinism; CUDA-graph replay of the split-K decode kernel;
* ``humming`` (``kernel="fast"``; skipped, with the reason, where humming is not installed): each
  path (stacked / summed residual, plain W4A4, W4A16) within its stated bound of the exact fp32
  product, the in-place refresh bit-exact against a layout built from scratch (same addresses),
  the packed parts derived back from the layout, one layout per rollout module (<= 1.1x); under
  ``torch.compile`` (``quads::linear`` over the layouts) bit-equal to eager, before and after a sync;
  the exact kernels compiled the same way (a linear stack and a whole Qwen3-MoE rollout, ``compiled``);
  a sibling set's one GEMM over its stacked weight (group mode) against the members' own GEMMs:
  the stated bound, the bits compared, both timed under CUDA graphs (``humming_siblings``);
* W4A16 decode vs the dense bf16 product; MoE experts (E=128 top-8 and E=8 top-2) vs the torch
  reference loop, grouped rows == dense decode bits, the whole experts op captured in a CUDA graph;
* Four Over Six (``block_scaling="4over6"``): the weight quantizer and the fused fake-quant pass
  bit-exact against the reference on the GPU (benchmark and SmolLM2 shapes, experts, adversarial
  rows, a group's amax bits), the standard pass unchanged;
* MoE routing: the one-launch kernel == the torch ops (T=64 top-6 E=64, T=1,
  T=256 top-8 E=128, sentinels, the size limit's fallback), CUDA-graph replay; all timed (µs);
* routing recorded inside the captured decode step (``GraphedDecoder(record_routing=True)``): the
  step still captures (no host sync), the graph's tokens and recorded expert ids == the eager
  step's, a second call on the same graph overwrites them, every fed token recorded (a quads
  rollout MoE and a transformers-experts MoE); ms per decode step with and without recording;
* the graphed weight sync (``GraphedSync``) == the eager sync's bits over repeated syncs (dense
  exact / W4A16 fast / W4A4 fast, MoE experts fast), a NaN master refused with nothing written,
  an interrupt after the write restored; ms per sync of both;
* ``save_pretrained`` / ``from_pretrained`` (``quant_method: "quads"``, ``device_map="cuda"``): a
  dense Qwen3 and a Qwen3-MoE rollout (exact and fast kernels) and trainer, every stored tensor and
  the logits bit-equal to the saved model's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
import torch.nn.attention  # noqa: F401  (sdpa_kernel: one attention backend in eager and compiled runs)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import quads  # noqa: E402
from quads.kernels.hopper.weight_decode import load_weight_tile  # noqa: E402
from quads.kernels.hopper.weight_layout import (  # noqa: E402
    HopperWeight,
    from_hopper_layout,
    to_hopper_layout,
    to_hopper_layout_reference,
)
from quads.kernels.quantize_activations import quantize_rows  # noqa: E402
from quads.kernels.hopper.w4a4_decode import DecodeConfig, decode_gemm  # noqa: E402
from quads.kernels.hopper.w4a4_gemm import GemmConfig, w4a4_gemm  # noqa: E402
from quads.ops import ActivationQuant, get_backend, rollout_experts  # noqa: E402
from quads.ops.activation_quant import (  # noqa: E402
    activation_operands_triton,
    num_residual_channels,
    quantize_activation_reference,
)
from quads.ops.linear_op import unscaled_values, w4a16_linear  # noqa: E402
from quads.ops.weight_quant import quantize_weight_triton  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402

RESULTS: dict = {}
HOPPER = get_backend("hopper")
TORCH = get_backend("torch")


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
    if a.dtype in (torch.float32, torch.float16, torch.bfloat16):
        an, bn = torch.isnan(a), torch.isnan(b)
        iv = torch.int32 if a.dtype == torch.float32 else torch.int16
        return bool(torch.equal(an, bn) and torch.equal(a.view(iv)[~an], b.view(iv)[~bn]))
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
    mask = torch.rand(4096, device="cuda") > 0.5
    for cfg, search in [
        (ActivationQuant(), "binary"), (ActivationQuant(), "packed5"),
        (ActivationQuant(residual_fraction=1.0), "auto"),
        (ActivationQuant(residual_fraction=0.0), "auto"),
        (ActivationQuant(residual_fraction=0.1), "packed5"),
        (ActivationQuant(granularity="tensor"), "binary"),
        (ActivationQuant(selection="static"), "auto"),
    ]:
        sm = mask if cfg.selection == "static" else None
        ref = quantize_activation_reference(x, cfg, sm)
        k_top = num_residual_channels(4096, cfg.residual_fraction)
        res = "none" if cfg.residual_fraction == 0 else cfg.selection
        if res == "per_token" and k_top == 4096:
            res = "all"
        out = quantize_rows(x, residual=res, k_top=k_top, static_mask=sm, granularity=cfg.granularity,
                            write_packed=True, write_operand=True, topk_search=search)
        ok = parts_equal(out.main.parts(), ref.main)
        dq_ok = bits_equal(out.main.operand, unscaled_values(ref.main).to(torch.float16))
        if ref.residual is not None:
            ok = ok and parts_equal(out.residual.parts(), ref.residual)
            dq_ok = dq_ok and bits_equal(out.residual.operand, unscaled_values(ref.residual).to(torch.float16))
        record(f"act_quant k={cfg.residual_fraction}/{cfg.selection}/{cfg.granularity} search={search}", ok and dq_ok,
               f"packed={ok} operand={dq_ok}")
    ops = activation_operands_triton(x[:64], ActivationQuant())
    ref = quantize_activation_reference(x[:64], ActivationQuant())
    st = torch.cat([unscaled_values(ref.main), unscaled_values(ref.residual)]).to(torch.float16)
    record("stacked operands (main rows, then residual rows)", bits_equal(ops.stacked, st)
           and bits_equal(ops.main_scale, ref.main.global_encode_scale))
    # the humming backend's summed operand, written by the quantization kernel (write_sum)
    from quads.ops.activation_quant import summed_operand_triton

    idx = torch.randint(0, 4096, (512,), device="cuda")
    for cfg in (ActivationQuant(), ActivationQuant(residual_fraction=0.5), ActivationQuant(residual_fraction=0.0),
                ActivationQuant(selection="static")):
        sm = mask if cfg.selection == "static" else None
        for rows in (x[:16], x):  # 16 rows: row programs cut into chunks (k = 100%); 4096: whole rows
            ref = quantize_activation_reference(rows, cfg, sm)
            want = unscaled_values(ref.main)
            if ref.residual is not None:
                want = want + unscaled_values(ref.residual)
            got, scale = summed_operand_triton(rows, cfg, sm)
            ok = bits_equal(got, want.to(torch.float16)) and bits_equal(scale, ref.main.global_encode_scale)
            if rows.shape[0] == 4096:
                got_g, scale_g = summed_operand_triton(rows, cfg, sm, row_idx=idx)
                ok = ok and bits_equal(got_g, got[idx]) and bits_equal(scale_g, scale[idx])
            record(f"summed operand k={cfg.residual_fraction}/{cfg.selection} rows={rows.shape[0]}"
                   + (" (+ gathered rows)" if rows.shape[0] == 4096 else ""), ok)


@triton.jit
def _decode_tiles(VALS, SCALES, OUT, num_kb, KBI: tl.constexpr, USE_ASM: tl.constexpr):
    pid = tl.program_id(0)
    kb = tl.program_id(1) * KBI
    w = load_weight_tile(VALS, SCALES, pid * 4, kb, num_kb, 64, KBI, USE_ASM)
    n = pid * 64 + tl.arange(0, 64)
    kk = kb * 64 + tl.arange(0, KBI * 64)
    tl.store(OUT + n[:, None] * (num_kb * 64) + kk[None, :], w, mask=(kk < num_kb * 64)[None, :])


@check("weights: quantization, layout, decode")
def check_weights():
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    w[0] = 0
    w[1, :16] = 1e-9
    w[2] *= 1e-5  # E4M3-subnormal block scales
    ref = nvfp4_quantize(w)
    record("weight 4096x4096 tensor-scale", parts_equal(quantize_weight_triton(w), ref))
    e = (torch.randn(128, 1536, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    record("weight (128,1536,2048) expert-scale", parts_equal(quantize_weight_triton(e), nvfp4_quantize(e)))
    hw = to_hopper_layout(ref.qdata, ref.scale)
    q, s = from_hopper_layout(hw)
    record("layout round trip 4096x4096", bits_equal(q, ref.qdata) and bits_equal(s, ref.scale))
    num_kb = hw.values.shape[1]
    want = (unscaled_values(ref) * 2.0**-14).to(torch.float16)
    # The inline-PTX decode assumes the registers of a wgmma dot operand (one 32-bit word per
    # thread in fragment order); a plain store of the tile uses another layout, so only the
    # portable decode is checked standalone. The PTX decode is checked inside the GEMM
    # (check_gemm: use_asm=False config == default bits).
    for use_asm in (False,):
        for kbi in (1, 2, 4):
            out = torch.full((4096, 4096), float("nan"), dtype=torch.float16, device="cuda")
            _decode_tiles[(64, num_kb // kbi)](hw.values, hw.scales, out, num_kb, KBI=kbi, USE_ASM=use_asm)
            bad = (out != want).nonzero()
            detail = ""
            if bad.numel():
                r0, c0 = bad[0].tolist()
                detail = (f"{bad.shape[0]} elements differ, rows {sorted(set(bad[:, 0].tolist()))[:8]}, "
                          f"e.g. [{r0},{c0}] got {out[r0, c0].item():.6g} want {want[r0, c0].item():.6g}; "
                          f"scale byte {ref.scale.view(torch.uint8)[r0, c0 // 16].item()}")
            record(f"tile decode == e2m1*s*2^-14 (asm={use_asm}, kbi={kbi})", bad.numel() == 0, detail)


@check("layout kernel == torch reference")
def check_layout_kernel():
    g = torch.Generator(device="cuda").manual_seed(7)
    # (3, 1000, 1040): N and K need padding, K = 65 * 16 is no multiple of 64
    for shape in ((4096, 4096), (128, 1536, 2048), (3, 1000, 1040)):
        *lead, n, k = shape
        qdata = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        scale = torch.randint(0, 256, (*lead, n, k // 16), dtype=torch.uint8, device="cuda",
                              generator=g).view(torch.float8_e4m3fn)  # every byte, NaN codes included
        want = to_hopper_layout_reference(qdata, scale)
        held = HopperWeight(torch.zeros_like(want.values), torch.zeros_like(want.scales), n, k)
        got = to_hopper_layout(qdata, scale, out=held)
        in_place = got.values.data_ptr() == held.values.data_ptr() and got.scales.data_ptr() == held.scales.data_ptr()
        same = bits_equal(got.values, want.values) and bits_equal(got.scales, want.scales)
        nbad = int((got.values != want.values).sum()) + int((got.scales != want.scales).sum())
        record(f"layout kernel {shape} == reference bytes, in place", same and in_place,
               f"{nbad} bytes differ, in place={in_place}")
        del qdata, scale, want, held, got
        torch.cuda.empty_cache()


def ref64(x16, sx, r16, wp):
    """fp64 product and its |.| bound; the residual shares the rows' global scales."""
    w = unscaled_values(wp).double()
    den = sx.double()[:, None] * wp.global_encode_scale.double()
    y, b = x16.double() @ w.T, x16.double().abs() @ w.abs().T
    if r16 is not None:
        y, b = y + r16.double() @ w.T, b + r16.double().abs() @ w.abs().T
    return y / den, b / den


def within(y, x16, sx, r16, wp, k, bias=None):
    yr, bound = ref64(x16.float(), sx, None if r16 is None else r16.float(), wp)
    if bias is not None:
        yr = yr + bias.double()
    err = (y.double() - yr).abs()
    tol = 2 * k * 2.0**-24 * bound + 1e-30 + (0 if bias is None else 1e-6 * bias.double().abs())
    return bool(torch.all(err <= tol)), float((err / tol).max())


@check("gemm")
def check_gemm():
    k = n = 4096
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w[3] *= 1e-4  # E4M3-subnormal block scales -> fp16-subnormal MMA operands
    w[5, :2048] *= 1e-3
    wp = nvfp4_quantize(w.bfloat16())
    hw = to_hopper_layout(wp.qdata, wp.scale)
    x = adversarial(2048, k, seed=3)
    x[4] = torch.randn(k, device="cuda")  # drop the inf row for the GEMM tolerance check
    x[6] = torch.randn(k, device="cuda")
    act = ActivationQuant(residual_fraction=1.0)
    q = activation_operands_triton(x, act)
    outs = {}
    for m in (1, 8, 16, 64):
        qm = activation_operands_triton(x[:m], act)
        y = decode_gemm(qm.stacked, qm.main_scale, hw, wp.global_encode_scale, m, True)
        ok, worst = within(y, qm.main, qm.main_scale, qm.residual, wp, k)
        record(f"decode M={m} + residual within bound", ok, f"max err/bound={worst:.3g}")
        y2 = decode_gemm(qm.stacked, qm.main_scale, hw, wp.global_encode_scale, m, True)
        record(f"decode M={m} deterministic", bits_equal(y, y2))
        for cfg in (DecodeConfig(64, 1, 4, 1), DecodeConfig(64, 2, 4, 1), DecodeConfig(64, 4, 4, 1),
                    DecodeConfig(128, 2, 8, 1), DecodeConfig(128, 4, 8, 1), DecodeConfig(64, 2, 4, 1, use_asm=False),
                    DecodeConfig(64, 4, 4, 1, prefetch=True), DecodeConfig(64, 4, 4, 1, prefetch=True, pdl=True),
                    DecodeConfig(64, 4, 4, 1, prefetch=True, pdl=True, reduce_kernel=True),
                    DecodeConfig(64, 2, 4, 1, reduce_kernel=True)):
            yc = decode_gemm(qm.stacked, qm.main_scale, hw, wp.global_encode_scale, m, True, config=cfg)
            record(f"decode M={m} {cfg} == default bits", bits_equal(yc, y))
        outs[m] = y
    qp = activation_operands_triton(x[:16], ActivationQuant(residual_fraction=0.0))
    bias = torch.randn(n, device="cuda")
    y = decode_gemm(qp.stacked, qp.main_scale, hw, wp.global_encode_scale, 16, False, bias)
    ok, worst = within(y, qp.main, qp.main_scale, None, wp, k, bias)
    record("decode M=16 plain + bias within bound", ok, f"max err/bound={worst:.3g}")
    for m, cfg in ((256, GemmConfig(64, 128, 64, num_warps=4, num_stages=3, loads="pointer")),
                   (2048, GemmConfig(128, 128, 64, loads="pointer")), (256, None), (2048, None)):
        # None: the default (flat walk, TMA loads), last, so its rows feed the batch-invariance check
        y = w4a4_gemm(q.main[:m], q.main_scale[:m], wp.qdata, wp.scale, wp.global_encode_scale,
                      q.residual[:m], config=cfg)
        ok, worst = within(y, q.main[:m], q.main_scale[:m], q.residual[:m], wp, k)
        record(f"prefill M={m} {cfg or 'default'} within bound", ok, f"max err/bound={worst:.3g}")
        if cfg is not None:
            outs[("pointer", m)] = y
        else:
            record(f"prefill M={m} TMA loads == pointer loads bits", bits_equal(y, outs[("pointer", m)]))
            outs[m] = y
    for m in (8, 16, 64, 256, 2048):
        same = [bits_equal(outs[1][0], outs[m][0])] + [bits_equal(outs[8][i], outs[m][i]) for i in range(8)]
        record(f"batch invariance: rows of M=1/8 == rows of M={m}", all(same), f"{sum(same)}/{len(same)} rows equal")
    # K = 14336 (28 segments), N = 4096
    k2 = 14336
    w2 = nvfp4_quantize((torch.randn(4096, k2, device="cuda", generator=g) * 0.02).bfloat16())
    hw2 = to_hopper_layout(w2.qdata, w2.scale)
    x2 = torch.randn(16, k2, device="cuda", generator=g).bfloat16()
    q2 = activation_operands_triton(x2, act)
    y = decode_gemm(q2.stacked, q2.main_scale, hw2, w2.global_encode_scale, 16, True)
    ok, worst = within(y, q2.main, q2.main_scale, q2.residual, w2, k2)
    record("decode K=14336 M=16 within bound", ok, f"max err/bound={worst:.3g}")
    # CUDA-graph replay of the split-K kernel (arrival counters reset between launches)
    qm = activation_operands_triton(x[:16], act)
    xs, ss = qm.stacked.clone(), qm.main_scale.clone()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        decode_gemm(xs, ss, hw, wp.global_encode_scale, 16, True)
    torch.cuda.current_stream().wait_stream(st)
    gph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gph, stream=st):
        yo = decode_gemm(xs, ss, hw, wp.global_encode_scale, 16, True)
    ok = True
    for _ in range(5):
        gph.replay()
        torch.cuda.synchronize()
        ok = ok and bits_equal(yo, outs[16])
    record("decode M=16 graph replay x5 == eager", ok)


@check("w4a16")
def check_w4a16():
    g = torch.Generator(device="cuda").manual_seed(5)
    wp = nvfp4_quantize((torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).bfloat16())
    for m in (1, 16, 300):
        x = torch.randn(m, 4096, device="cuda", generator=g).bfloat16()
        ref = w4a16_linear(x.float(), wp, None)  # exact DQ(W) in fp32
        got = HOPPER.linear(x, wp, None, None, None, HOPPER.prepare_weight(wp))
        dense = w4a16_linear(x, wp, None)  # the trainer's bf16 product
        e_got = float(((got.float() - ref).norm() / ref.norm()))
        e_dense = float(((dense.float() - ref).norm() / ref.norm()))
        record(f"w4a16 M={m} vs exact fp32 product", e_got <= 1.5 * e_dense + 1e-4,
               f"rel err {e_got:.2e} (bf16 cuBLAS with bf16 DQ(W): {e_dense:.2e})")


def _gate(inter):
    def gate(h):
        return F.silu(h[:, :inter]) * h[:, inter:]
    return gate


@check("moe")
def check_moe():
    for E, TOPK, H, I, T in ((128, 8, 2048, 768, 16), (8, 2, 4096, 14336, 4)):
        g = torch.Generator(device="cuda").manual_seed(4)
        gu = NVFP4Tensor.from_float((torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16())
        dn = NVFP4Tensor.from_float((torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16())
        hid = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(T)])
        wts = torch.softmax(torch.randn(T, TOPK, device="cuda", generator=g), -1).bfloat16()
        act = ActivationQuant(residual_fraction=1.0)
        gate = _gate(I)
        ref = rollout_experts(hid, idx, wts, gu, dn, gate, act, backend=TORCH)
        prep = (HOPPER.prepare_weight(gu.parts), HOPPER.prepare_weight(dn.parts))
        got = rollout_experts(hid, idx, wts, gu, dn, gate, act, backend=HOPPER, prepared=prep)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        record(f"moe E={E} top{TOPK} T={T} vs reference loop", err < 1e-2, f"rel err {err:.3g}")
        got2 = rollout_experts(hid, idx, wts, gu, dn, gate, act, backend=HOPPER, prepared=prep)
        record(f"moe E={E} deterministic", bits_equal(got, got2))
        # the whole experts op in a CUDA graph (no host synchronisation)
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            rollout_experts(hid, idx, wts, gu, dn, gate, act, backend=HOPPER, prepared=prep)
        torch.cuda.current_stream().wait_stream(st)
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph, stream=st):
            yo = rollout_experts(hid, idx, wts, gu, dn, gate, act, backend=HOPPER, prepared=prep)
        gph.replay()
        torch.cuda.synchronize()
        record(f"moe E={E} captured in a CUDA graph, replay == eager", bits_equal(yo, got))
    # grouped rows == dense decode rows
    E, TOPK, H, I, T = 16, 2, 1024, 512, 9
    g = torch.Generator(device="cuda").manual_seed(6)
    p = nvfp4_quantize((torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16())
    hw = to_hopper_layout(p.qdata, p.scale)
    hid = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(T)])
    from quads.kernels.hopper.moe_grouped_gemm import moe_w4a4_gemm

    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0)
    q = activation_operands_triton(hid, ActivationQuant())
    y = moe_w4a4_gemm(q.stacked, q.main_scale, (order // TOPK).to(torch.int32), offsets, hw,
                      p.global_encode_scale, flat.numel(), T, True)
    same = []
    for e in range(E):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        if hi == lo:
            continue
        toks = order[lo:hi] // TOPK
        st_ = torch.cat([q.main[toks], q.residual[toks]])
        sc = q.main_scale[toks]
        dense = decode_gemm(st_, sc, HopperWeight(hw.values[e], hw.scales[e], hw.n, hw.k), p.global_encode_scale[e],
                            hi - lo, True)
        same.append(bits_equal(y[lo:hi], dense))
    record("grouped rows == dense decode rows", all(same), f"{sum(same)}/{len(same)} experts")
    from quads.kernels.hopper.moe_grouped_gemm import MoeConfig

    for split in (False, True):
        ys = moe_w4a4_gemm(q.stacked, q.main_scale, (order // TOPK).to(torch.int32), offsets, hw,
                           p.global_encode_scale, flat.numel(), T, True, config=MoeConfig(64, 16, 2, 4, 1, split=split))
        record(f"grouped kernel split={split} == default bits", bits_equal(ys, y))
    qp = activation_operands_triton(hid, ActivationQuant(residual_fraction=0.0))  # no residual rows
    yp = [moe_w4a4_gemm(qp.stacked, qp.main_scale, (order // TOPK).to(torch.int32), offsets, hw, p.global_encode_scale,
                        flat.numel(), T, False, config=MoeConfig(64, 16, 2, 4, 1, split=split)) for split in (False, True)]
    record("grouped kernel without residual: split == one pass bits", bits_equal(yp[0], yp[1]))


@check("fused")
def check_fused_projections():
    """Stacked weights with per-row global scales, and a fused-projection model: the unfused bits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quads.policies import build_rollout_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    base = LlamaForCausalLM(cfg).bfloat16().cuda()
    policy = quads.QuadsPolicy(side="rollout")
    fused = build_rollout_model(base, policy)
    plain = build_rollout_model(base, policy, fuse_projections=False)
    groups = sum(1 for m in fused.modules() if getattr(m, "quads_group", None) is not None)
    record("fuse_projections_ grouped every q/k/v and gate/up", groups == 10, f"{groups} of 2 x 5 members")
    stacked = sum(1 for m in fused.modules() if getattr(getattr(m, "quads_group", None), "stacked", None) is not None)
    record("every group has the stacked layout (one GEMM)", stacked == 10, f"{stacked} of 10 members")
    with torch.no_grad():
        for rows in ((8, 1), (2, 3), (1, 64)):
            ids = torch.randint(0, 1000, rows, device="cuda")
            record(f"fused projections == unfused logits {rows}", bits_equal(fused(ids).logits, plain(ids).logits))
    # the RL loop: a decoder's captured graphs replayed after a sync see the new weights
    from quads.engine import GraphedDecoder, SamplingSpec

    spec = SamplingSpec(max_new_tokens=12, eos_token_ids=(), pad_token_id=0, do_sample=False)
    prompts = torch.randint(0, 1000, (4, 16), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    decoder = GraphedDecoder(fused)
    before = decoder.generate(prompts, torch.ones_like(prompts), spec)[0]
    with torch.no_grad():
        for p_ in base.parameters():
            p_.add_(torch.randn_like(p_) * 0.02)
    quads.sync_weights_(fused, base, plain_trainer=True)  # base: plain BF16 weights
    after = decoder.generate(prompts, torch.ones_like(prompts), spec)[0]  # the same captured graph
    fresh = build_rollout_model(base, policy, fuse_projections=False)
    want = GraphedDecoder(fresh, use_cuda_graph=False).generate(prompts, torch.ones_like(prompts), spec)[0]
    record("fused model: graphed tokens after a sync == a fresh unfused model's eager tokens",
           bits_equal(after, want) and not bits_equal(before, after),
           f"changed by the sync: {int((before != after).sum())} of {after.numel()} tokens")
    record("the sync kept the captured step (what it reads was written in place)", decoder.num_captures == 1,
           f"{decoder.num_captures} captures")
    from quads.policies.fused_projections import unfuse_projections_

    unfuse_projections_(fused)  # the stacked layouts freed: the captured step must not read them
    again = decoder.generate(prompts, torch.ones_like(prompts), spec)[0]
    record("after unfuse_projections_: captured again, the fresh unfused model's tokens",
           decoder.num_captures == 2 and bits_equal(again, want), f"{decoder.num_captures} captures")


def humming_unavailable() -> str | None:
    """Why the ``kernel="fast"`` (humming) check cannot run here, or None."""
    from quads.ops.backends.humming.library import HUMMING_REQUIREMENT, check_humming_device, import_humming

    try:
        import_humming()
        check_humming_device(torch.device("cuda"))
    except ImportError as e:
        return f"humming is not installed (pip install {HUMMING_REQUIREMENT}): {e}"
    except RuntimeError as e:
        return str(e)
    return None


def _worst_over_bound(backend, act, hw, parts, kind: str, ms, g) -> float:
    """The largest ``|humming - exact fp32 product| / stated bound`` (``bench_humming.bounds`` of
    ``kind``) of ``backend.linear`` over the prepared weight ``hw`` (in ``backend``'s mode: the same
    layout), on fresh bf16 inputs with an outlier channel at each M of ``ms``."""
    from benchmarks.ops.bench_humming import bounds

    prep = hw if backend.mode == hw.mode else hw.with_mode(backend.mode)
    k, worst = hw.shape[-1] * 2, 0.0
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=g)
        x[:, 3] *= 30.0  # an outlier channel
        x = x.bfloat16()
        y = backend.linear(x, hw.shape_parts, None, act, None, prep)
        ref, b = bounds(x, parts, kind)
        worst = max(worst, float(((y.float() - ref).abs() / b.clamp(min=1e-30)).max()))
    return worst


@check("humming")
def check_humming():
    """``kernel="fast"`` (humming): every path within its stated bound of the exact fp32 product
    (``benchmarks.ops.bench_humming.bounds``, docs/humming.md), the in-place refresh bit-exact against a
    layout built from scratch at the same addresses, the packed parts derived back from the layout
    bit-exact, and a rollout module holding one layout (<= 1.1x the packed bytes)."""
    why = humming_unavailable()
    if why:
        RESULTS["humming"] = {"ok": True, "skipped": True, "detail": why}
        print(f"[SKIP] humming: {why}", flush=True)
        return
    from quads.ops.backends.humming.backend import HummingBackend, HummingWeight

    paths = {"stacked": (HummingBackend(residual_layout="stacked"), ActivationQuant(residual_fraction=1.0)),
             "summed": (HummingBackend(residual_layout="summed"), ActivationQuant(residual_fraction=1.0)),
             "plain": (HummingBackend(), ActivationQuant(residual_fraction=0.0)),
             "w4a16": (HummingBackend(mode="no_stream_k"), None),  # the per-element bound holds without Stream-K
             "w4a16-sk": (HummingBackend(), None)}  # default mode: bf16 Stream-K partials, bench_humming.STREAM_K_BF16_REL
    g = torch.Generator(device="cuda").manual_seed(21)
    for k, n in ((4096, 4096), (4096, 14336)):
        parts = nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16())
        hw = paths["stacked"][0].prepare_weight(parts)
        hw.warmup(dtypes=(torch.float16, torch.bfloat16), ms=(1,))
        for kind, (backend, act) in paths.items():
            worst = _worst_over_bound(backend, act, hw, parts, kind, (1, 16, 64, 256), g)
            record(f"humming {kind} K={k} N={n} within the stated bound of the exact path", worst <= 1,
                   f"max |err| / bound = {worst:.3f} (M = 1, 16, 64, 256)")
        new = nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16())
        ptrs = {dt: [t.data_ptr() for t in lay.layer.parameters()] for dt, lay in hw.layers.items()}
        hw.write_parts_(new)
        fresh = HummingWeight(new, "default")
        fresh.layer(torch.bfloat16)
        same = all(bits_equal(a.data, b.data) for dt in hw.layers
                   for a, b in zip(hw.layers[dt].layer.parameters(), fresh.layers[dt].layer.parameters()))
        kept = ptrs == {dt: [t.data_ptr() for t in lay.layer.parameters()] for dt, lay in hw.layers.items()}
        record(f"humming refresh K={k} N={n} in place == built from scratch", same and kept,
               f"bits {same}, addresses kept {kept}")
        q, sc = hw.packed_parts()
        record(f"humming packed parts derived from the layout K={k} N={n}",
               bits_equal(q, new.qdata) and bits_equal(sc, new.scale))
        del hw, fresh
    lin = torch.nn.Linear(4096, 4096, bias=False).bfloat16().cuda()
    quads.quantize_(lin, quads.QuadsPolicy(side="rollout", kernel="fast"))
    held = lin.quads_prepared[0].nbytes + (0 if lin.weight.kernel_layout is not None else 4096 * (2048 + 256))
    ratio = held / (4096 * (2048 + 256))
    record("humming rollout module holds one layout (<= 1.1x the packed bytes)",
           lin.weight.kernel_layout is not None and ratio <= 1.1, f"{ratio:.5f}x")


def _graph_us(fn, reps=200) -> float:
    """Microseconds per replay of ``fn`` captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


@check("humming_siblings")
def check_humming_siblings():
    """Sibling sets on humming (group mode: one global scale): one GEMM over the stacked weight
    against each member's own GEMM on the same operands, at SmolLM2 (K=576) and Qwen3 dense
    (K=3072) shapes, M = 1, 16, 64, W4A4 + residual and W4A16: each output within the stated bound
    of the exact path (``bench_humming.bounds``), whether the bits equal the per-member GEMM's
    (reported), and the time of both under CUDA graphs (the quantization included in both)."""
    why = humming_unavailable()
    if why:
        RESULTS["humming_siblings"] = {"ok": True, "skipped": True, "detail": why}
        print(f"[SKIP] humming_siblings: {why}", flush=True)
        return
    from benchmarks.ops.bench_humming import bounds
    from quads.ops.backend_registry import LinearArgs
    from quads.ops.activation_quant import as_operands, operand_row_args
    from quads.ops.backends.humming.backend import (HummingBackend, HummingLinearKernel, humming_residual_layout,
                                           humming_shape_problem)
    from quads.ops.sibling_linear import SiblingSet
    from quads.tensor.nvfp4_math import NVFP4Parts, shared_global_encode_scale

    act = ActivationQuant(residual_fraction=1.0)
    g = torch.Generator(device="cuda").manual_seed(31)
    sets = {"smollm2 q/k/v": (576, (576, 192, 192)), "smollm2 gate/up": (576, (1536, 1536)),
            "qwen3 q/k/v": (3072, (3072, 1024, 1024)), "qwen3 gate/up": (3072, (8192, 8192))}
    for mode in ("no_stream_k", "default"):
        backend = HummingBackend(mode=mode, stack_siblings=True)
        for name, (k, sizes) in sets.items():
            problem = humming_shape_problem(sum(sizes), k) or next(
                (humming_shape_problem(n, k) for n in sizes if humming_shape_problem(n, k)), None)
            if problem:  # the exact Hopper kernels serve these weights (and stack them) on the humming backend
                record(f"humming siblings {name}: not on humming", True, problem)
                continue
            masters = [(torch.randn(n, k, device="cuda", generator=g) * 0.02 * (i + 1)).bfloat16()
                       for i, n in enumerate(sizes)]
            shared = shared_global_encode_scale(masters)
            parts = [nvfp4_quantize(w, None, shared) for w in masters]
            prepared = [backend.prepare_weight(p) for p in parts]
            siblings = SiblingSet(backend, act, sizes)  # a vLLM merged layer's form: apply(x) gives every column
            siblings.stack(prepared, [shared] * len(sizes), shared_scale=True)
            stack, kernel = siblings.stacked, siblings.kernel()
            whole = NVFP4Parts(torch.cat([p.qdata for p in parts]), torch.cat([p.scale for p in parts]), shared)
            each = [HummingLinearKernel(backend, LinearArgs(p, act, None, w)) for p, w in zip(parts, prepared)]
            for hw in (stack.weight, *prepared):
                hw.warmup(ms=(1, 16, 64))
            for m in (1, 16, 64):
                x = torch.randn(m, k, device="cuda", generator=g)
                x[:, 3] *= 30.0
                x = x.bfloat16()
                y, _ = kernel.apply(x)
                ops = as_operands(quantize_rows(x, **operand_row_args(x, act)), m)
                ys = torch.cat([kern.apply(x, None, ops) for kern in each], dim=-1)
                ref, b = bounds(x, whole, humming_residual_layout(m, backend.residual_layout, mode))
                worst = float(((y.float() - ref).abs() / b.clamp(min=1e-30)).max())
                worst_each = float(((ys.float() - ref).abs() / b.clamp(min=1e-30)).max())
                t_one = _graph_us(lambda: kernel.apply(x))
                t_each = _graph_us(lambda: [kern.apply(x, None, o) for o in [as_operands(
                    quantize_rows(x, **operand_row_args(x, act)), m)] for kern in each])
                shifts = [float(w.layer(torch.float16).shift["w4a4"]) for w in prepared]
                shift = float(stack.weight.layer(torch.float16).shift["w4a4"])
                record(f"humming siblings {name} {mode} M={m}: stacked GEMM within the stated bound",
                       worst <= 1 and worst_each <= 1,
                       f"max |err|/bound stacked {worst:.3f}, per member {worst_each:.3f}; bits == per member "
                       f"{bits_equal(y, ys)}; shifts {shifts} -> {shift}; "
                       f"graphs: stacked {t_one:.1f} us, per member {t_each:.1f} us")
            del prepared, siblings, stack, kernel, each
    # W4A16 (bf16 activations as they are), the default mode: one GEMM over the stacked weight
    # against the members' own
    backend = HummingBackend(mode="default", stack_siblings=True)
    for name, (k, sizes) in sets.items():
        masters = [(torch.randn(n, k, device="cuda", generator=g) * 0.02 * (i + 1)).bfloat16()
                   for i, n in enumerate(sizes)]
        shared = shared_global_encode_scale(masters)
        parts = [nvfp4_quantize(w, None, shared) for w in masters]
        prepared = [backend.prepare_weight(p) for p in parts]
        each = [HummingLinearKernel(backend, LinearArgs(p, None, None, w)) for p, w in zip(parts, prepared)]
        siblings = SiblingSet(backend, None, sizes)
        stacked = siblings.stack(prepared, [shared] * len(sizes), shared_scale=True) is not None
        kernel = siblings.kernel()
        whole = NVFP4Parts(torch.cat([p.qdata for p in parts]), torch.cat([p.scale for p in parts]), shared)
        for hw in ((siblings.stacked.weight,) if stacked else ()) + tuple(prepared):
            hw.warmup(dtypes=(torch.bfloat16,), ms=(1, 16, 64))
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda", generator=g)
            x[:, 3] *= 30.0
            x = x.bfloat16()
            y, _ = kernel.apply(x)
            ys = torch.cat([kern.apply(x) for kern in each], dim=-1)
            ref, b = bounds(x, whole, "w4a16-sk")  # the default mode: humming's Stream-K configurations
            worst = float(((y.float() - ref).abs() / b.clamp(min=1e-30)).max()) if y is not None else float("inf")
            worst_each = float(((ys.float() - ref).abs() / b.clamp(min=1e-30)).max())
            t_one = _graph_us(lambda: kernel.apply(x))
            t_each = _graph_us(lambda: [kern.apply(x) for kern in each])
            record(f"humming siblings {name} W4A16 M={m}: stacked GEMM within the stated bound",
                   stacked and worst <= 1 and worst_each <= 1,
                   f"stacked {stacked}; max |err|/bound stacked {worst:.3f}, per member {worst_each:.3f}; "
                   f"bits == per member {y is not None and bits_equal(y, ys)}; "
                   f"graphs: stacked {t_one:.1f} us, per member {t_each:.1f} us")
        del prepared, siblings, kernel, each


#: (N, K) of the padded-layout check: SmolLM2 (576, k/v 192, MLP 1536), Qwen2.5-0.5B-like 960,
#: GPT-OSS's 2880, a K humming's tiles do not divide (720), and 4096 (no padding: the control)
PADDED_SHAPES = ((576, 576), (192, 576), (576, 1536), (960, 960), (2880, 2880), (256, 720), (4096, 4096))


@check("humming_padded")
def check_humming_padded():
    """Widths humming cannot tile as they are (N % 128, K % 64), held in the zero-padded layout
    (``humming_padded_shape``), against 4096 (none): every path within its stated bound of the exact
    fp32 product (``bench_humming.bounds``) at M = 1, 16, 64; a sync rewrites the padded layout in
    place (addresses kept, == a layout built from scratch, padding zero, parts read back); bytes held
    / packed bytes against ``humming_padding_cost``; the W4A4+res GEMM timed under CUDA graphs
    against the exact kernels; an experts block of width 2880 (grouped GEMM; the down projection's N
    padded to 2944)."""
    why = humming_unavailable()
    if why:
        RESULTS["humming_padded"] = {"ok": True, "skipped": True, "detail": why}
        print(f"[SKIP] humming_padded: {why}", flush=True)
        return
    from benchmarks.ops.bench_humming import QUADS_DEFAULT
    from quads.kernels.humming.layout import scale_unlayout, unrepack_reference
    from quads.ops.backend_registry import LinearArgs
    from quads.ops.experts_op import Routing
    from quads.ops.backends.humming.backend import HummingBackend, HummingWeight, humming_padded_shape, humming_padding_cost

    def padding_zero(lay):
        q = unrepack_reference(lay.layer.weight.data)
        sc = scale_unlayout(lay.layer.weight_scale.data, bool(lay.layer.humming_config.should_apply_bs_on_c))
        n, k, sc = lay.shape_n, lay.shape_k, sc.view(torch.uint8)
        return bool((q[..., n:, :] == 0).all() and (q[..., k // 2:] == 0).all()
                    and (sc[..., n:, :] == 0).all() and (sc[..., k // 16:] == 0).all())

    paths = {"stacked": (HummingBackend(residual_layout="stacked"), QUADS_DEFAULT),
             "summed": (HummingBackend(residual_layout="summed"), QUADS_DEFAULT),
             "w4a16": (HummingBackend(mode="no_stream_k"), None)}
    hopper = get_backend("hopper")
    g = torch.Generator(device="cuda").manual_seed(41)
    for n, k in PADDED_SHAPES:
        tag = f"N={n} K={k} (held {'x'.join(map(str, humming_padded_shape(n, k)))})"
        parts = nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16())
        hw = paths["stacked"][0].prepare_weight(parts)
        hw.warmup(dtypes=(torch.float16, torch.bfloat16), ms=(1, 16, 64))
        for kind, (backend, act) in paths.items():
            worst = _worst_over_bound(backend, act, hw, parts, kind, (1, 16, 64), g)
            record(f"humming padded {kind} {tag} within the stated bound", worst <= 1,
                   f"max |err| / bound = {worst:.3f} (M = 1, 16, 64)")
        packed = n * (k // 2 + k // 16)
        ratio = hw.nbytes / packed  # everything held: the layouts (one, shared by fp16 and bf16), the rest
        layout = {t.data_ptr(): t.numel() * t.element_size() for lay in hw.layers.values()
                  for t in (lay.layer.weight.data, lay.layer.weight_scale.data)}
        in_layout = sum(layout.values()) / packed
        rest = hw.nbytes - sum(layout.values())  # Stream-K locks, run-time global scales: per layer, not per weight byte
        cost = humming_padding_cost(n, k)
        record(f"humming padded {tag} layout bytes / packed == humming_padding_cost", abs(in_layout - cost) < 1e-9
               and 0 <= rest <= 65536, f"layout {in_layout:.5f}x, humming_padding_cost {cost:.5f}x; all held "
               f"{ratio:.5f}x (+{rest} bytes: Stream-K locks, run-time scales)")
        times, hp = [], hopper.prepare_weight(parts)
        fast_kernel = paths["stacked"][0].linear_kernel(LinearArgs(hw.shape_parts, QUADS_DEFAULT, None, hw))
        exact_kernel = hopper.linear_kernel(LinearArgs(parts, QUADS_DEFAULT, None, hp))
        for m in (1, 64):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            t_h, t_e = _graph_us(lambda: fast_kernel.apply(x)), _graph_us(lambda: exact_kernel.apply(x))
            times.append(f"M={m}: humming {t_h:.1f} us, exact {t_e:.1f} us")
        del hp, fast_kernel, exact_kernel
        record(f"humming padded {tag} timed (W4A4+res, graphs)", True, "; ".join(times))
        new = nvfp4_quantize((torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16())
        ptrs = {dt: [t.data_ptr() for t in lay.written_tensors()] for dt, lay in hw.layers.items()}
        hw.write_parts_(new)
        fresh = HummingWeight(new, "default")
        fresh.layer(torch.bfloat16)
        same = all(bits_equal(a.data, b.data) for dt in hw.layers
                   for a, b in zip(hw.layers[dt].layer.parameters(), fresh.layers[dt].layer.parameters()))
        kept = ptrs == {dt: [t.data_ptr() for t in lay.written_tensors()] for dt, lay in hw.layers.items()}
        zero = all(padding_zero(lay) for lay in hw.layers.values())
        q, sc = hw.packed_parts()
        back = bits_equal(q, new.qdata) and bits_equal(sc, new.scale)
        record(f"humming padded {tag} sync in place == built from scratch, padding zero",
               same and kept and zero and back,
               f"bits {same}, addresses kept {kept}, padding zero {zero}, parts read back {back}")
        del hw, fresh
    # experts of width 2880 (gate_up 5760 x 2880 as it is; down 2880 x 2880 held 2944 x 2880): grouped GEMM
    e, h = 8, 2880
    backend, torch_be = paths["summed"][0], get_backend("torch")
    route = Routing(torch.randint(0, e, (64, 2), device="cuda", generator=g), e)
    for name, (n, k) in (("gate_up", (2 * h, h)), ("down", (h, h))):
        w = nvfp4_quantize((torch.randn(e, n, k, device="cuda", generator=g) * 0.02).bfloat16(), "expert")
        prep = backend.prepare_weight(w)
        prep.warmup(ms=(route.num_rows,))
        x = torch.randn(64 if name == "gate_up" else route.num_rows, k, device="cuda", generator=g).bfloat16()
        rows = route.token_of_row if name == "gate_up" else None
        y = backend.grouped_linear(x, rows, route.offsets, w, None, QUADS_DEFAULT, None, route.num_rows, prep)
        ref = torch_be.grouped_linear(x.float(), rows, route.offsets, w, None, QUADS_DEFAULT, None, route.num_rows)
        rel = float((y.float() - ref).abs().max() / ref.abs().max())
        record(f"humming padded experts {name} E={e} N={n} K={k} (held {humming_padded_shape(n, k)})",
               rel <= 2**-7 and padding_zero(prep.layer(torch.float16)), f"max |err| / max |ref| = {rel:.2e}")
        del prep


@torch.no_grad()
def compiled_matches_eager(rollout, trainer, xs, run=lambda module: module,
                           backend: str = "inductor") -> tuple[bool, str]:
    """``torch.compile(rollout, fullgraph=True, backend=backend)`` against eager on ``xs``, then after
    ``sync_weights_(rollout, trainer)``: bits equal both times, the sync changed the output, no
    recompile. ``run``: how a module's output is read (``lambda m: lambda x: m(x).logits``)."""
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    compiled, eager = run(torch.compile(rollout, fullgraph=True, backend=backend)), run(rollout)
    before = [compiled(x) for x in xs]
    same = all(bits_equal(y, eager(x)) for x, y in zip(xs, before))
    graphs = counters["stats"]["unique_graphs"]
    quads.sync_weights_(rollout, trainer)
    after = [compiled(x) for x in xs]
    synced = all(bits_equal(y, eager(x)) for x, y in zip(xs, after))
    kept = counters["stats"]["unique_graphs"] == graphs
    changed = not bits_equal(after[-1], before[-1])
    return same and synced and kept and changed, \
        f"equal {same}, after sync {synced} (changed {changed}), no recompile {kept}"


@check("humming_compiled")
def check_humming_compiled():
    """``kernel="fast"`` under ``torch.compile`` (fullgraph, inductor): linears held in humming layouts
    run as ``quads::linear`` over the layouts' tensors, bit-equal to eager (W4A4 + residual, W4A16;
    M = 1, 16, 256; a bias), and again after a sync that rewrites the layouts in place (no
    recompile). Humming's deterministic ``no_stream_k`` mode: Stream-K's bits vary run to run."""
    why = humming_unavailable()
    if why:
        RESULTS["humming_compiled"] = {"ok": True, "skipped": True, "detail": why}
        print(f"[SKIP] humming_compiled: {why}", flush=True)
        return
    from quads.ops.backend_registry import register_backend
    from quads.ops.backends.humming.backend import HummingBackend

    def stack():
        return torch.nn.Sequential(torch.nn.Linear(4096, 2048, bias=True),
                                   torch.nn.Linear(2048, 4096, bias=False)).bfloat16().cuda()

    default = get_backend("humming")
    register_backend(HummingBackend(mode="no_stream_k"))
    try:
        for activations in ("nvfp4", "bf16"):
            torch.manual_seed(0)
            rollout, trainer = stack(), stack()
            with quads.use_backend("humming"):
                quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", kernel="fast", activations=activations))
            quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
            held = all(m.weight.kernel_layout is not None for m in rollout)
            g = torch.Generator(device="cuda").manual_seed(5)
            xs = [torch.randn(m, 4096, device="cuda", generator=g).bfloat16() for m in (1, 16, 256)]
            ok, detail = compiled_matches_eager(rollout, trainer, xs)
            record(f"humming compiled ({activations} activations) == eager bits, and after a sync",
                   held and ok, f"layout-held {held}, {detail}")
    finally:
        register_backend(default)
        torch._dynamo.reset()


@check("compiled")
def check_compiled():
    """The exact kernels under ``torch.compile`` (fullgraph) on the GPU's torch: a linear stack
    (W4A4 + residual, W4A16; inductor) and a whole Qwen3-MoE rollout (16 experts top-4; aot_eager:
    inductor's own norm, attention and routing kernels round differently from eager's; attention
    on the math SDPA backend in both), bit-equal to eager, and again after a sync (the graph runs the modules' own kernels: no recompile). Both
    compiled paths where this torch has opaque custom-op objects: the kernel objects
    (``quads::linear_kernel`` / ``quads::experts_gemm``) and the plain fields a torch without them
    takes (``quads::linear`` / ``quads::grouped_linear`` over ``KernelOpArgs``)."""
    import quads.ops.experts_op as experts_op
    import quads.ops.linear_op as linear_op

    default = linear_op.KERNEL_OPS
    try:
        for kernel_ops in ((True, False) if default else (False,)):
            linear_op.KERNEL_OPS = experts_op.KERNEL_OPS = kernel_ops
            _compiled_exact("kernel objects" if kernel_ops else "plain fields")
    finally:
        linear_op.KERNEL_OPS = experts_op.KERNEL_OPS = default


def _compiled_exact(path: str) -> None:
    from transformers import Qwen3MoeForCausalLM

    from quads.policies import build_rollout_model

    _, moe = _qwen3_configs(dense_layers=2)
    g = torch.Generator(device="cuda").manual_seed(5)
    for name in ("stack nvfp4", "stack bf16", "qwen3-moe"):
        torch.manual_seed(0)
        if name == "qwen3-moe":
            trainer = quads.quantize_(Qwen3MoeForCausalLM(moe).bfloat16().cuda(), quads.QuadsPolicy(side="trainer"))
            rollout = build_rollout_model(trainer, quads.QuadsPolicy(side="rollout"))
            xs = [torch.randint(0, 4096, (b, t), device="cuda", generator=g) for b, t in ((1, 1), (4, 16), (2, 64))]
            run = (lambda mod: lambda x: mod(x).logits)
        else:
            rollout, trainer = (torch.nn.Sequential(torch.nn.Linear(2880, 1408, bias=True),
                                                    torch.nn.Linear(1408, 2880, bias=False)).bfloat16().cuda()
                                for _ in range(2))
            quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations=name.split()[1]))
            quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
            xs = [torch.randn(m, 2880, device="cuda", generator=g).bfloat16() for m in (1, 16, 256)]
            run = (lambda mod: mod)
        with torch.no_grad():
            for p_ in trainer.parameters():  # a training step's worth of change before the sync
                p_.add_(torch.randn_like(p_) * 0.02)
        # a whole model under inductor: its own kernels for the norms, attention and routing round
        # differently from eager's (not quads' ops), so the model's bits are compared under aot_eager
        # (the same graph, the same quads ops, eager aten kernels around them)
        backend = "aot_eager" if name == "qwen3-moe" else "inductor"
        # attention on one SDPA backend in both: eager and a trace may pick different ones (cuDNN,
        # flash, math), whose bits differ
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            record(f"compiled exact ({name}, {path}, {backend}) == eager bits, and after a sync",
                   *compiled_matches_eager(rollout, trainer, xs, run, backend))
    torch._dynamo.reset()


@check("four_over_six")
def check_four_over_six():
    """``block_scaling="4over6"``: the weight quantizer, the fused fake-quant pass and the
    activation row kernel (compiled without FMA contraction) against the torch reference run on
    the same GPU, bit for bit, on the benchmark models' shapes, SmolLM2's, 3-D experts,
    adversarial rows and a group's amax bits; the standard path's bits unchanged beside it."""
    from quads.ops.weight_quant import fake_quantize_weight_reference, fake_quantize_weight_triton, group_amax_bits_triton
    from quads.tensor.nvfp4_math import nvfp4_fake_quantize, shared_global_encode_scale

    fos = "4over6"
    g = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(4096, 4096), (9728, 2560), (2560, 9728), (1536, 576), (576, 1536), (64, 2816, 2048), (64, 2048, 1408)]
    for shape in shapes:
        w = (torch.randn(shape, device="cuda", generator=g) * 0.02).bfloat16()
        record(f"4over6 weight quantizer {shape}", parts_equal(quantize_weight_triton(w, None, None, fos),
                                                                nvfp4_quantize(w, None, None, fos)))
        got, gs = fake_quantize_weight_triton(w.float(), torch.bfloat16, None, fos)  # FP32 masters (autocast)
        ref, gs_ref = fake_quantize_weight_reference(w.float(), torch.bfloat16, None, fos)
        again, _ = fake_quantize_weight_triton(w.float(), torch.bfloat16, gs, fos)  # the backward's recomputation
        record(f"4over6 fused fake-quant {shape}", bits_equal(got, ref) and bits_equal(gs, gs_ref)
               and bits_equal(again, ref))
        six, _ = fake_quantize_weight_triton(w.float(), torch.bfloat16)
        record(f"standard fused fake-quant unchanged {shape}",
               bits_equal(six, nvfp4_fake_quantize(w.float(), dtype=torch.bfloat16)) and not bits_equal(six, got))
    x = adversarial(256, 4096, dtype=torch.float32)
    for gran in ("row", "tensor"):
        record(f"4over6 weight quantizer adversarial {gran}",
               parts_equal(quantize_weight_triton(x, gran, None, fos), nvfp4_quantize(x, gran, None, fos)))
    e = x.reshape(256, 1, 4096)  # one expert per adversarial row: every row its own global scale
    got, _ = fake_quantize_weight_triton(e, torch.float32, None, fos)
    record("4over6 fused fake-quant adversarial rows", bits_equal(got, nvfp4_fake_quantize(e, block_scaling=fos)))
    members = [(torch.randn(n, 2048, device="cuda", generator=g) * 0.02 * (i + 1)).bfloat16()
               for i, n in enumerate((2048, 512, 512))]
    bits = group_amax_bits_triton(members)
    shared = shared_global_encode_scale(members, fos)
    ok = True
    for w in members:
        got, gs = fake_quantize_weight_triton(w, None, bits, fos)
        ok &= bits_equal(gs.reshape(()), shared) and bits_equal(got, nvfp4_fake_quantize(w, global_encode_scale=shared,
                                                                                         block_scaling=fos))
    record("4over6 fused fake-quant from a group's amax bits (q/k/v)", ok)
    xa = adversarial(4096, 4096)
    for cfg in (ActivationQuant(block_scaling=fos), ActivationQuant(0.5, block_scaling=fos),
                ActivationQuant(0.0, block_scaling=fos), ActivationQuant(granularity="tensor", block_scaling=fos)):
        got = HOPPER.quantize_activation(xa, cfg)
        ref = quantize_activation_reference(xa, cfg)
        ok = parts_equal(got.main, ref.main) and (ref.residual is None or parts_equal(got.residual, ref.residual))
        record(f"4over6 activations {cfg.residual_fraction}/{cfg.granularity} 4096x4096", ok)


@check("moe_routing")
def check_moe_routing():
    """The one-launch routing kernel == Routing's torch ops on the GPU (decode sizes, sentinels),
    replayed in a CUDA graph; the kernel and the torch ops timed in CUDA graphs (µs printed, no bound)."""
    from benchmarks.timing import graph_time
    from quads.kernels import moe_routing as mr
    from quads.ops import experts_op as ex

    def routing(idx, e, kernel):
        applies = ex._routing_kernel_applies
        ex._routing_kernel_applies = applies if kernel else (lambda flat, n: False)
        try:
            return ex.Routing(idx, e)
        finally:
            ex._routing_kernel_applies = applies

    def same(a, b):
        return all(getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f))
                   for f in ("order", "counts", "offsets", "token_of_row"))

    for T, K, E in ((64, 6, 64), (1, 6, 64), (256, 8, 128), (128, 8, 128), (mr.MAX_ROWS // 8 + 1, 8, 128)):
        g = torch.Generator(device="cuda").manual_seed(T * K + E)
        sets = []
        for s in range(4):
            idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
            if s == 1:  # expert-parallel sentinels mixed in
                idx = torch.where(torch.rand(T, K, device="cuda", generator=g) < 0.2, -1, idx)
                idx[0, 0] = E
            sets.append(idx)
        fits = mr.routing_fits(T * K, E)
        ok = ex._routing_kernel_applies(sets[0].reshape(-1), E) == fits  # the kernel where it fits, on CUDA
        ok = ok and all(same(routing(i, E, True), routing(i, E, False)) for i in sets)
        record(f"moe_routing T={T} top{K} E={E} ({'kernel' if fits else 'torch ops'}) == torch ops", ok)
        if not fits:
            continue
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        static = sets[1].clone()  # captured on one set of ids, replayed on others: nothing fixed at capture
        with torch.cuda.stream(st):
            routing(static, E, True)
        torch.cuda.current_stream().wait_stream(st)
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph, stream=st):
            rg = routing(static, E, True)
        ok = True
        for i in (sets[2], sets[1], sets[3]):
            static.copy_(i)
            gph.replay()
            torch.cuda.synchronize()
            ok = ok and same(rg, routing(i, E, False))
        record(f"moe_routing T={T} top{K} E={E} CUDA-graph replay on new ids == torch ops", ok)
        us = {"kernel": graph_time([lambda i=i: routing(i, E, True) for i in sets]),
              "torch ops": graph_time([lambda i=i: routing(i, E, False) for i in sets])}
        print(f"   moe_routing T={T} top{K} E={E} (us per call, CUDA graph): "
              + ", ".join(f"{k} {v:.1f}" for k, v in us.items()), flush=True)


def _rollout_state(model) -> list[torch.Tensor]:
    """Every tensor a sync writes in ``model``, in order (a packed weight's storage, dense parameters)."""
    out = []
    for p_ in model.parameters():
        out += list(p_.written_storage()) if isinstance(p_, NVFP4Tensor) else [p_.detach()]
    return out


def _qwen3_configs(dense_layers: int):
    """A dense Qwen3 (hidden 1024, MLP 2816) and a Qwen3-MoE (16 experts top-4 of width 768, 2
    layers) small enough for a check, at real head and GEMM shapes."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    dense = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=dense_layers,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    moe = Qwen3MoeConfig(vocab_size=4096, hidden_size=1024, moe_intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=16,
                         num_experts_per_tok=4, tie_word_embeddings=False)
    return dense, moe


@torch.no_grad()
def logits_agree(reference, other, ids, fast: bool) -> tuple[bool, str]:
    """``other``'s logits against ``reference``'s on ``ids``: bit-equal on the exact kernels; on
    humming's (Stream-K GEMMs differ run to run) no further from them than ``reference``'s own
    repeated forwards are from each other (twice that spread). (ok, a note for the row)."""
    if not fast:
        same = bits_equal(reference(ids).logits, other(ids).logits)
        return same, f"logits bit-equal {same}"
    runs = [reference(ids).logits.float() for _ in range(3)]
    noise = max((a - b).abs().max().item() for i, a in enumerate(runs) for b in runs[i + 1:])
    gap = max((other(ids).logits.float() - r).abs().max().item() for r in runs)
    ok = gap <= 2 * noise + 1e-6
    return ok, f"logits |other - reference| {gap:.3g} <= 2 x run-to-run {noise:.3g}: {ok}"


@check("graphed_sync")
def check_graphed_sync():
    """``GraphedSync`` (the sync captured as CUDA graphs and replayed) against the eager
    ``sync_weights_`` on a twin rollout, three optimizer-like steps apart: every written tensor
    bit-equal (packed storages, humming layouts, dense parameters), the replays used, a NaN master
    refused with the rollout unchanged, an interrupt after the write restored; ms per sync of both
    (dense Qwen3 4 layers 1024/2816 and an MoE of 16 experts; exact and fast kernels)."""

    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from quads.policies import POLICY_PRESETS, build_rollout_model
    from quads.policies.graphed_sync import GraphedSync
    from quads.policies.presets import with_kernel

    fast_ok = humming_unavailable() is None
    dense, moe = _qwen3_configs(dense_layers=4)
    cases = [("dense", dense, Qwen3ForCausalLM, "quads", False), ("dense", dense, Qwen3ForCausalLM, "w4a16", True),
             ("dense", dense, Qwen3ForCausalLM, "quads", True), ("moe", moe, Qwen3MoeForCausalLM, "quads-experts", True)]
    for model_name, cfg, cls, preset_name, fast in cases:
        label = f"graphed_sync {model_name} {preset_name}{'-fast' if fast else ''}"
        if fast and not fast_ok:
            print(f"[SKIP] {label}: {humming_unavailable()}", flush=True)
            continue
        preset = POLICY_PRESETS[preset_name]
        if fast:
            preset = with_kernel(preset, "fast")
        torch.manual_seed(0)
        trainer = cls(cfg).bfloat16().cuda()
        quads.quantize_(trainer, preset.trainer)
        rollout = build_rollout_model(trainer, preset.rollout)
        twin = build_rollout_model(trainer, preset.rollout)
        graphed = GraphedSync(rollout, trainer)
        equal, times = [], {"eager": [], "graphed": []}
        for step in range(4):
            with torch.no_grad():
                for p_ in trainer.parameters():
                    p_.add_(torch.randn_like(p_) * 1e-3)
            for name, fn in (("eager", lambda: quads.sync_weights_(twin, trainer)), ("graphed", graphed)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t) * 1e3)
            equal.append(all(bits_equal(a, b) for a, b in zip(_rollout_state(rollout), _rollout_state(twin))))
        ids = torch.randint(0, cfg.vocab_size, (4, 8), device="cuda")
        same_logits, logits_note = logits_agree(twin, rollout, ids, fast)
        what = "the logits within the eager run-to-run bound" if fast else "the logits"
        record(f"{label}: == eager sync bits after each of 4 syncs ({what}), replays used",
               all(equal) and same_logits and graphed.replays == 3 and graphed.blocker is None,
               f"equal {equal}, {logits_note}, replays {graphed.replays}, captures {graphed.captures}, blocker {graphed.blocker}; "
               f"ms per sync (steps 2-4) eager {sorted(times['eager'][1:])[1]:.1f}, "
               f"graphed {sorted(times['graphed'][1:])[1]:.1f} (first call {times['graphed'][0]:.0f})")
        before = [t.clone() for t in _rollout_state(rollout)]
        master = next(p_ for n, p_ in trainer.named_parameters() if "proj" in n)
        keep = master.detach().clone()
        with torch.no_grad():
            master.view(-1)[7] = float("nan")
        try:
            graphed()
            refused = False
        except ValueError as e:
            refused = "non-finite" in str(e)
        with torch.no_grad():
            master.copy_(keep)
        unchanged = all(bits_equal(a, b) for a, b in zip(_rollout_state(rollout), before))
        # an interrupt after the write's replay: every tensor restored
        module = next(m for m in rollout.modules() if hasattr(m, "quads_weights_rewritten"))
        original = module.quads_weights_rewritten

        reached = []

        def interrupted():
            reached.append(True)
            raise KeyboardInterrupt

        module.quads_weights_rewritten = interrupted
        with torch.no_grad():
            for p_ in trainer.parameters():
                p_.add_(torch.randn_like(p_) * 1e-3)
        try:
            graphed()
            restored = False
        except KeyboardInterrupt:
            restored = all(bits_equal(a, b) for a, b in zip(_rollout_state(rollout), before))
        finally:
            del module.quads_weights_rewritten
        served = bool(reached)  # the interrupted call ran the graphs (an eager call never reaches the patch)
        record(f"{label}: a NaN master refused, nothing written; an interrupt after the write restored",
               refused and unchanged and restored and served and original is not None,
               f"refused {refused}, unchanged {unchanged}, restored {restored}"
               + ("" if served else " (the graphs were not used: see the line above)"))


@check("graphed_routing")
def check_graphed_routing():
    """Routing recorded inside the captured decode step: it captures, and the graph's tokens and
    recorded ids equal the eager step's (two calls on one graph), every fed token recorded."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from quads.engine import GraphedDecoder, SamplingSpec
    from quads.policies import POLICY_PRESETS, build_rollout_model

    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=1024, moe_intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=16,
                         num_experts_per_tok=4, tie_word_embeddings=False)
    cfg._experts_implementation = "grouped_mm"  # what the decoder's capture plan runs: the eager reference runs it too
    torch.manual_seed(0)
    trainer = Qwen3MoeForCausalLM(cfg).bfloat16().cuda()
    preset = POLICY_PRESETS["quads"]
    cases = [("quads rollout", lambda: build_rollout_model(trainer, preset.rollout)),
             ("transformers experts", lambda: build_rollout_model(trainer, None))]
    spec = SamplingSpec(max_new_tokens=24, eos_token_ids=(), pad_token_id=0, do_sample=False)
    for label, make in cases:
        model = make().eval()
        ids = torch.randint(1, cfg.vocab_size, (8, 12), device="cuda")
        am = torch.ones_like(ids)
        am[:3, :4] = 0
        ids = ids.masked_fill(am == 0, 0)
        graphed = GraphedDecoder(model, use_cuda_graph=True, record_routing=True)
        eager = GraphedDecoder(model, use_cuda_graph=False, record_routing=True)
        plain = GraphedDecoder(model, use_cuda_graph=True)
        same, times = [], {}
        for call in range(2):
            g_tokens, _ = graphed.generate(ids, am, spec)
            e_tokens, _ = eager.generate(ids, am, spec)
            fed = graphed.last_routing[:, ids.shape[1]:]
            same.append(bits_equal(g_tokens, e_tokens) and bits_equal(graphed.last_routing, eager.last_routing)
                        and bool((fed >= 0).all()) and bool((graphed.last_routing[:, :ids.shape[1]][am.bool()] >= 0).all()))
            ids = torch.roll(ids, 1, dims=0)  # another batch on the same graph
            am = torch.roll(am, 1, dims=0)
        for name, dec in (("recording", graphed), ("plain", plain)):
            dec.generate(ids, am, spec)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                dec.generate(ids, am, spec)
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t) / 5 / spec.max_new_tokens * 1e3
        record(f"graphed_routing {label}: captured, tokens and recorded experts == eager (2 calls on one graph)",
               all(same) and graphed.capture_blocker is None and graphed.num_captures == 1,
               f"equal {same}, captures {graphed.num_captures}, blocker {graphed.capture_blocker}; ms per token "
               f"(prefill included) recording {times['recording']:.3f}, plain {times['plain']:.3f}")


@check("save_load")
def check_save_load():
    """``save_pretrained`` / ``from_pretrained`` of quads rollouts on the GPU (``quant_method:
    "quads"``): a dense Qwen3 and a Qwen3-MoE, exact and fast kernels, loaded with
    ``device_map="cuda"``: every packed storage (Hopper / humming layouts included), dense
    parameter bit-equal to the saved model's, the logits too (on humming's kernels within their
    run-to-run spread: ``logits_agree``); a trainer's masters and logits too."""
    import tempfile

    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    fast_ok = humming_unavailable() is None
    dense, moe = _qwen3_configs(dense_layers=2)
    cases = [(n, cfg, cls, side, fast) for n, cfg, cls in (("dense", dense, Qwen3ForCausalLM), ("moe", moe, Qwen3MoeForCausalLM))
             for side, fast in (("rollout", False), ("rollout", True), ("trainer", False))]
    for model_name, cfg, cls, side, fast in cases:
        label = f"save_load {model_name} {side}{'-fast' if fast else ''}"
        if fast and not fast_ok:
            print(f"[SKIP] {label}: {humming_unavailable()}", flush=True)
            continue
        policy = quads.QuadsPolicy(side=side, kernel="fast" if fast else "exact")
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            cls(cfg).bfloat16().save_pretrained(f"{tmp}/plain")
            model = AutoModelForCausalLM.from_pretrained(f"{tmp}/plain", dtype=torch.bfloat16, device_map="cuda")
            quads.quantize_(model, policy)
            t = time.perf_counter()
            model.save_pretrained(f"{tmp}/q")
            save_s = time.perf_counter() - t
            t = time.perf_counter()
            back = AutoModelForCausalLM.from_pretrained(f"{tmp}/q", device_map="cuda")
            load_s = time.perf_counter() - t
            same = [bits_equal(a, b) for a, b in zip(_rollout_state(model), _rollout_state(back))]
            ids = torch.randint(0, cfg.vocab_size, (4, 8), device="cuda")
            backends = {m.quads_backend.name for m in back.modules() if hasattr(m, "quads_packed_names")}
            logits, note = logits_agree(model, back, ids, "humming" in backends)
        record(f"{label}: from_pretrained == the saved model (every stored tensor; the logits, within humming's "
               "run-to-run spread on the fast kernels)",
               all(same) and len(same) == len(_rollout_state(model)) and logits,
               f"{sum(same)}/{len(same)} tensors equal, {note}, backends {sorted(backends)}, "
               f"save {save_s:.1f} s, load {load_s:.1f} s")


#: every check by name (the runner's --only, and tests/gpu/test_gpu_checks.py: one pytest test each)
CHECKS = {"act_quant": check_act_quant, "weights": check_weights, "layout": check_layout_kernel,
          "gemm": check_gemm, "w4a16": check_w4a16, "moe": check_moe, "fused": check_fused_projections,
          "humming": check_humming, "humming_compiled": check_humming_compiled, "compiled": check_compiled,
          "humming_siblings": check_humming_siblings, "humming_padded": check_humming_padded,
          "four_over_six": check_four_over_six,
          "moe_routing": check_moe_routing, "graphed_sync": check_graphed_sync,
          "graphed_routing": check_graphed_routing, "save_load": check_save_load}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default=",".join(CHECKS))
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for name in args.only.split(","):
        CHECKS[name]()
    os.makedirs(args.out, exist_ok=True)
    write_atomically(os.path.join(args.out, "checks.json"), json.dumps(RESULTS, indent=1))
    nfail = sum(not r["ok"] for r in RESULTS.values())
    print(f"CHECKS: {len(RESULTS) - nfail} passed, {nfail} failed", flush=True)


if __name__ == "__main__":
    main()
