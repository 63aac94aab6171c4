"""Prefill GEMM on Hopper (many tokens): exact W4A4 (+ residual) with a materialized fp16 weight.

QUADS.md section 3: an E2M1 value times an E4M3 scale is exact in fp16, so
``y = x̂ Ŵᵀ + r̂ Ŵᵀ`` is reproduced by multiplying the *unscaled* operands on fp16 tensor cores
with fp32 accumulation and dividing the sum by ``S_x[row] * S_w`` (the residual shares the row's
global scale) in the epilogue, exactly as :func:`quads.ops.linear.w4a4_matmul_reference` does; only the fp32
summation order differs from the reference.

For many tokens the weight is dequantized once per call by :func:`dequant_weight_fp16` to the
operand values the decode kernel builds in registers (``e2m1 * s * 2^-14``, see
:mod:`quads.kernels.hopper_weight_layout`), then a pipelined tensor-core GEMM with both operands
in shared memory runs. Swap-AB (weight rows are the MMA's M) as in the decode kernel.

Batch invariance: K is cut into the canonical segments of :data:`quads.kernels.w4a4_decode_hopper.SEG_K`;
each segment is summed from zero by a chain of k16 MMA steps and the segment sums are added in
order, with the decode kernel's epilogue formula, so a row's bits are those of the decode
kernel (checked on the H200: the MMA instruction's arithmetic does not depend on the tile shape,
but ``mma.sync`` differs from wgmma, so every config uses wgmma: >= 4 warps, >= 64 weight rows).
Optional split-K (segments over programs, the last program adds them in order) for mid-size M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreting
from quads.kernels.arrival_counters import arrival_counters
from quads.kernels.w4a4_decode_hopper import SEG_K

__all__ = ["w4a4_gemm", "GemmConfig", "pick_config", "dequant_weight_fp16"]


# ---------------------------------------------------------------------------------------------
# Weight tile dequantization
# ---------------------------------------------------------------------------------------------


def _nibbles_to_f16x2_ptx(shift: int) -> str:
    """Inline PTX: 4 packed bytes -> 2 f16x2 registers of one nibble per byte (the low nibbles
    for ``shift=9``, the high ones for ``shift=5``), each ``e2m1 * 2^-14`` (sign at bit 15)
    times the f16x2 scale operand. ``prmt`` spreads bytes 0,1 / 2,3 into the two 16-bit halves."""
    lines = ["{", ".reg .b32 z, s0, s1, t0, t1, a, b;", "mov.b32 z, 0;", "mov.b32 s0, 0x4140;",
             "mov.b32 s1, 0x4342;", "prmt.b32 t0, $2, z, s0;", "prmt.b32 t1, $2, z, s1;"]
    for t, out, scale in (("t0", "$0", "$3"), ("t1", "$1", "$4")):
        lines += [f"shl.b32 a, {t}, {shift};", "and.b32 a, a, 0x0E000E00;",
                  f"shl.b32 b, {t}, {shift + 3};", "and.b32 b, b, 0x80008000;",
                  "or.b32 a, a, b;", f"mul.rn.f16x2 {out}, a, {scale};"]
    return "\n".join(lines + ["}"])


_ASM_LO = tl.constexpr(_nibbles_to_f16x2_ptx(9))
_ASM_HI = tl.constexpr(_nibbles_to_f16x2_ptx(5))


@triton.jit
def _e2m1_bits_f16(c):
    """4-bit code (uint8) -> fp16 with value e2m1 * 2^-14 (exact; 0.5 -> subnormal 2^-15)."""
    c16 = c.to(tl.uint16)
    bits = ((c16 & 7) << 9) | ((c16 & 8) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _dequant_w(b, sb, BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed bytes (BN, BK/2) + scale bytes (BN, BK/16) -> fp16 (BN, BK) = e2m1 * s * 2^-14."""
    # E4M3 byte -> fp16 bits << 7 is s * 2^-8 (exact, subnormals included); * 2^8 -> s.
    s16 = ((sb.to(tl.uint16) & 0x7F) << 7).to(tl.float16, bitcast=True) * 256.0
    if USE_ASM:
        sbb = tl.reshape(tl.broadcast_to(s16[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
        lo = tl.inline_asm_elementwise(_ASM_LO, "=r,=r,r,r,r", [b, sbb], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_ASM_HI, "=r,=r,r,r,r", [b, sbb], dtype=tl.float16, is_pure=True, pack=4)
        w = tl.reshape(tl.join(lo, hi), (BN, BK))
    else:
        lo = _e2m1_bits_f16(b & 0xF)
        hi = _e2m1_bits_f16(b >> 4)
        w = tl.reshape(tl.join(lo, hi), (BN, BK // 16, 16))
        w = tl.reshape(w * s16[:, :, None], (BN, BK))
    return w


@triton.jit
def _segment_partial(
    X, R, W16, row_x, row_r, mmask, offs_n, nmask, k_lo, k_hi, K,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_RES: tl.constexpr,
):
    """fp32 sums over channels [k_lo, k_hi) (a canonical segment), accumulated from zero, with
    the materialized fp16 weight ``e2m1 * s * 2^-14``."""
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    accr = tl.zeros((BN, BM), dtype=tl.float32)
    kk = tl.arange(0, BK)
    for k0 in range(k_lo, k_hi, BK):
        kmask = (k0 + kk) < K
        w = tl.load(W16 + offs_n[:, None].to(tl.int64) * K + (k0 + kk)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(X + row_x[:, None] + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if HAS_RES:
            r = tl.load(R + row_r[:, None] + (k0 + kk)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            accr = tl.dot(w, tl.trans(r), accr)
    return acc, accr


@triton.jit
def _epilogue(acc, accr, SX, s_idx, sw, BIAS, Y, y_rows, mmask, offs_n, nmask, stride_ym,
              HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[m, n] = (acc [+ accr]) * 2^14 / (Sx[m] Sw) (+ bias[n]), as the reference (the residual
    shares the row's global scale). ``s_idx``: rows of SX (the activation rows); ``y_rows``: rows of Y."""
    sx = tl.load(SX + s_idx, mask=mmask, other=1.0)
    den = sx * sw
    if HAS_RES:
        acc = acc + accr
    y = tl.math.div_rn(acc * 16384.0, den[None, :] + tl.zeros_like(acc))
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)
        y = y + bias[:, None]
    ptrs = Y + y_rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(ptrs, y.to(Y.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _w4a4_gemm_kernel(
    X, R, SX, W16, SW,
    BIAS, Y, PART, LOCKS,
    M, N, K, stride_xm, stride_rm, stride_ym,
    SEG: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_m = pid_m * BM + tl.arange(0, BM)
    mmask = offs_m < M
    row_x = offs_m.to(tl.int64) * stride_xm
    row_r = offs_m.to(tl.int64) * stride_rm
    sw = tl.load(SW)
    num_seg = tl.cdiv(K, SEG)
    if SPLIT:
        k_lo = pid_s * SEG
        acc, accr = _segment_partial(X, R, W16, row_x, row_r, mmask, offs_n, nmask,
                                     k_lo, tl.minimum(k_lo + SEG, K), K, BN, BM, BK, HAS_RES)
        # workspace PART: (num_seg, 2, M_pad, N) fp32; this program's partials
        m_pad = tl.num_programs(2) * BM
        pofs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        pmask = nmask[:, None] & mmask[None, :]
        base = PART + pid_s.to(tl.int64) * 2 * m_pad * N
        tl.store(base + pofs, acc, mask=pmask)
        if HAS_RES:
            tl.store(base + m_pad * N + pofs, accr, mask=pmask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_seg - 1:
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            totr = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(0, num_seg):
                sbase = PART + s * 2 * m_pad * N
                tot += tl.load(sbase + pofs, mask=pmask, other=0.0, cache_modifier=".cg")
                if HAS_RES:
                    totr += tl.load(sbase + m_pad * N + pofs, mask=pmask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(LOCKS + tile, 0)
            _epilogue(tot, totr, SX, offs_m, sw, BIAS, Y, offs_m, mmask, offs_n, nmask, stride_ym, HAS_RES, HAS_BIAS)
    else:
        tot = tl.zeros((BN, BM), dtype=tl.float32)
        totr = tl.zeros((BN, BM), dtype=tl.float32)
        for s in range(0, num_seg):
            acc, accr = _segment_partial(X, R, W16, row_x, row_r, mmask, offs_n, nmask,
                                         s * SEG, tl.minimum(s * SEG + SEG, K), K, BN, BM, BK, HAS_RES)
            tot += acc
            totr += accr
        _epilogue(tot, totr, SX, offs_m, sw, BIAS, Y, offs_m, mmask, offs_n, nmask, stride_ym, HAS_RES, HAS_BIAS)


@triton.jit
def _dequant_weight_kernel(WQ, WS, W16, N, K, KH, KS, BR: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """W16 (N, K) fp16 = e2m1 * s * 2^-14: the prefill path's MMA operand (exact, the values the
    decode kernel builds in registers)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    rmask = rows < N
    kb = tl.arange(0, BK // 2)
    ks = tl.arange(0, BK // 16)
    kk = tl.arange(0, BK)
    r64 = rows.to(tl.int64)
    b = tl.load(WQ + r64[:, None] * KH + (k0 // 2 + kb)[None, :],
                mask=rmask[:, None] & ((k0 // 2 + kb) < KH)[None, :], other=0)
    sb = tl.load(WS + r64[:, None] * KS + (k0 // 16 + ks)[None, :],
                 mask=rmask[:, None] & ((k0 // 16 + ks) < KS)[None, :], other=0)
    w = _dequant_w(b, sb, BR, BK, USE_ASM)
    tl.store(W16 + r64[:, None] * K + (k0 + kk)[None, :], w, mask=rmask[:, None] & ((k0 + kk) < K)[None, :])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


class GemmConfig:
    """Tile config of the prefill GEMM (tuned on the H200, see docs/kernels.md)."""

    __slots__ = ("bn", "bm", "bk", "split", "num_warps", "num_stages")

    def __init__(self, bn, bm, bk, split, num_warps=4, num_stages=3):
        self.bn, self.bm, self.bk, self.split = bn, bm, bk, split
        self.num_warps, self.num_stages = num_warps, num_stages

    def __repr__(self):
        return (f"GemmConfig(bn={self.bn}, bm={self.bm}, bk={self.bk}, split={self.split}, "
                f"warps={self.num_warps}, stages={self.num_stages})")


def pick_config(m: int, n: int, k: int) -> GemmConfig:
    """Tile choice by token count."""
    if interpreting():
        return GemmConfig(bn=16, bm=16, bk=32, split=m <= 32, num_warps=1, num_stages=1)
    if m <= 256:
        return GemmConfig(bn=64, bm=128, bk=64, split=True, num_warps=4, num_stages=3)
    return GemmConfig(bn=128, bm=128, bk=64, split=False, num_warps=8, num_stages=4)


def dequant_weight_fp16(wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """(N, K) fp16 = e2m1 * s * 2^-14 of a packed NVFP4 weight (no global scale)."""
    n, kh = wq.shape
    k = kh * 2
    out = torch.empty((n, k), dtype=torch.float16, device=wq.device)
    ws_u8 = ws.view(torch.uint8) if ws.dtype != torch.uint8 else ws
    br, bk = (16, 32) if interpreting() else (32, 256)
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    _dequant_weight_kernel[(triton.cdiv(n, br), triton.cdiv(k, bk))](
        wq, ws_u8, out, n, k, k // 2, k // 16, BR=br, BK=bk, USE_ASM=not interpreting(), num_warps=4)
    return out

def w4a4_gemm(
    x16: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    sw: torch.Tensor,
    r16: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: GemmConfig | None = None,
    seg_k: int = SEG_K,
    w16: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y (M, N) = (x16 @ Ŵᵀ [+ r16 @ Ŵᵀ]) / (sx Sw) [+ bias]``, see module doc.

    x16/r16: fp16 (M, K) unscaled activations (the residual shares the rows' scales); sx fp32
    (M,); wq uint8 (N, K/2); ws uint8
    or float8_e4m3fn (N, K/16); sw fp32 scalar tensor; ``w16``: the materialized weight if the
    caller has it already (:func:`dequant_weight_fp16`).
    """
    m, k = x16.shape
    n = wq.shape[0]
    cfg = config or pick_config(m, n, k)
    if seg_k % cfg.bk:
        raise ValueError(f"BLOCK_K={cfg.bk} must divide the K segment {seg_k}")
    dev = x16.device
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even
        return w4a4_gemm(x16, sx, wq, ws, sw, r16, bias, torch.float32, config, seg_k, w16).to(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0:
        return y
    has_res = r16 is not None
    num_seg = triton.cdiv(k, seg_k)
    split = cfg.split and num_seg > 1
    grid_m = triton.cdiv(m, cfg.bm)
    grid = (triton.cdiv(n, cfg.bn), num_seg if split else 1, grid_m)
    if split:
        # split-K workspace, addressed by the kernel as (num_seg, 2, M_pad, N) fp32
        part = torch.empty((num_seg, 2, grid_m * cfg.bm, n), dtype=torch.float32, device=dev)
        locks = arrival_counters(dev, grid[0] * grid[2])
    else:
        part = locks = sx  # unused
    if w16 is None:
        w16 = dequant_weight_fp16(wq, ws)
    _w4a4_gemm_kernel[grid](
        x16, r16 if has_res else x16, sx, w16, sw.reshape(1) if sw.dim() == 0 else sw,
        bias if bias is not None else sx, y, part, locks,
        m, n, k, x16.stride(0), (r16 if has_res else x16).stride(0), y.stride(0),
        SEG=seg_k, BN=cfg.bn, BM=cfg.bm, BK=cfg.bk, SPLIT=split,
        HAS_RES=has_res, HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
