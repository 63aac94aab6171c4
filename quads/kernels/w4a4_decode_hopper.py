"""Decode GEMM on Hopper: few tokens (M <= 64) times a packed NVFP4 weight in the Hopper layout.

``y (M, N) = (x̂ Ŵᵀ [+ r̂ Ŵᵀ]) / (S_x S_w) [+ bias]``, exact W4A4 emulation
(QUADS.md section 3), or the weight-only product with an fp16 activation operand.

* The weight streams from HBM once, 16 bytes per thread per load, in the layout of
  :mod:`quads.kernels.hopper_weight_layout`, and is decoded in registers straight into the wgmma
  register operand (swap-AB: weight rows are the MMA's M, tokens its N).
* Tokens are the MMA's N: the main operand rows and, with residual compensation, the residual
  rows stacked after them (one MMA over ``2M`` columns; for M <= 8 the residual fills columns
  the instruction computes anyway).
* Deterministic, batch-invariant order: K is cut into canonical segments of ``SEG_K`` channels.
  Each program sums one segment from zero by a chain of k16 wgmma steps; the last program of an
  output tile to arrive (an int32 arrival counter it resets, so CUDA-graph replays work) adds
  the segment sums in segment order and applies the epilogue. No atomics touch the data. The
  prefill kernel (:mod:`quads.kernels.w4a4_gemm_hopper`) walks the same segments with the same
  operand values, so a row's bits do not depend on M or on which kernel ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from quads.kernels._interpreter import interpreting
from quads.kernels.arrival_counters import arrival_counters
from quads.kernels.hopper_weight_layout import (
    K_BLOCK,
    HopperWeight,
    decode_weight_raw,
    load_weight_raw,
    load_weight_tile,
)
from quads.kernels.l2_prefetch import prefetch_l2

__all__ = ["SEG_K", "OPERAND_SHIFT", "DecodeConfig", "pick_decode_config", "decode_gemm", "max_decode_columns"]

#: canonical K segment (channels) of every quads GEMM: fixes the fp32 summation order
SEG_K = 512
#: the weight operand is e2m1 * s * 2^-14 (hopper_weight_layout); epilogues multiply by 2^14
OPERAND_SHIFT = 14
_MAX_COLUMNS = 128


def max_decode_columns() -> int:
    """The most MMA columns (tokens, residual rows included) one decode launch takes."""
    return _MAX_COLUMNS


@triton.jit
def _decode_gemm_kernel(
    VALS, SCALES, X, SX, SW, BIAS, Y, PART, LOCKS,
    M, N, K, num_kb, stride_xm, stride_ym,
    SEG_KB: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, BM: tl.constexpr, KBI: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, UNROLL: tl.constexpr,
    STAGES: tl.constexpr, RED: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_seg = tl.num_programs(1)
    cols = 2 * M if HAS_RES else M  # MMA columns: main rows, then residual rows
    tok = tl.arange(0, NT)
    tmask = tok < cols
    acc = tl.zeros((BN, NT), dtype=tl.float32)
    kb_lo = pid_s * SEG_KB
    if PREFETCH:  # the segment in two halves, every load of both issued before the first decode
        rb0 = pid_n * (BN // 16)
        raw0, s0 = load_weight_raw(VALS, SCALES, rb0, kb_lo, num_kb, BN, KBI)
        raw1, s1 = load_weight_raw(VALS, SCALES, rb0, kb_lo + KBI, num_kb, BN, KBI)
        kk0 = kb_lo * 64 + tl.arange(0, KBI * 64)
        kk1 = kk0 + KBI * 64
        xrow = X + tok[:, None].to(tl.int64) * stride_xm
        x0 = tl.load(xrow + kk0[None, :], mask=tmask[:, None] & (kk0 < K)[None, :], other=0.0)
        x1 = tl.load(xrow + kk1[None, :], mask=tmask[:, None] & (kk1 < K)[None, :], other=0.0)
        acc = tl.dot(decode_weight_raw(raw0, s0, BN, KBI, USE_ASM), tl.trans(x0), acc)
        acc = tl.dot(decode_weight_raw(raw1, s1, BN, KBI, USE_ASM), tl.trans(x1), acc)
    elif UNROLL:  # a fixed trip count, unrolled; blocks past K (the last segment) load as zeros
        for it in tl.static_range(SEG_KB // KBI):
            kb = kb_lo + it * KBI
            w = load_weight_tile(VALS, SCALES, pid_n * (BN // 16), kb, num_kb, BN, KBI, USE_ASM)
            kk = kb * 64 + tl.arange(0, KBI * 64)
            x = tl.load(X + tok[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=tmask[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
    else:  # a software-pipelined loop (STAGES deep)
        for kb in tl.range(kb_lo, tl.minimum(kb_lo + SEG_KB, num_kb), KBI, num_stages=STAGES):
            w = load_weight_tile(VALS, SCALES, pid_n * (BN // 16), kb, num_kb, BN, KBI, USE_ASM)
            kk = kb * 64 + tl.arange(0, KBI * 64)
            x = tl.load(X + tok[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=tmask[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)

    # this segment's sums -> workspace PART (num_seg, cols, N) fp32
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    seg_base = PART + (pid_s * cols).to(tl.int64) * N
    tl.store(seg_base + tok[None, :] * N + offs_n[:, None], acc, mask=nmask[:, None] & tmask[None, :])
    tl.debug_barrier()
    arrived = tl.atomic_add(LOCKS + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == num_seg - 1:
        # the last program of this tile: segment sums in segment order, then the epilogue
        rows = tl.arange(0, BM)
        sw = tl.load(SW)
        for m0 in range(0, M, BM):
            m = m0 + rows
            mmask = m < M
            pmask = nmask[:, None] & mmask[None, :]
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            totr = tl.zeros((BN, BM), dtype=tl.float32)
            # segment sums in segment order; RED loads in flight at a time (not one per round trip)
            for s0 in range(0, num_seg, RED):
                for j in tl.static_range(RED):
                    sj = s0 + j
                    sb = PART + (sj * cols).to(tl.int64) * N
                    lm = pmask & ((sj + 0 * m) < num_seg)[None, :]
                    tot += tl.load(sb + m[None, :] * N + offs_n[:, None], mask=lm, other=0.0, cache_modifier=".cg")
                    if HAS_RES:
                        totr += tl.load(sb + (M + m)[None, :] * N + offs_n[:, None], mask=lm, other=0.0,
                                        cache_modifier=".cg")
            sx = tl.load(SX + m, mask=mmask, other=1.0)
            if HAS_RES:  # the residual shares the row's global scale
                tot = tot + totr
            y = tl.math.div_rn(tot * 16384.0, (sx * sw)[None, :] + tl.zeros_like(tot))
            if HAS_BIAS:
                y = y + tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
            tl.store(Y + m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty), mask=pmask)
        tl.atomic_xchg(LOCKS + pid_n, 0)


@triton.jit
def _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, step, num_kb, K, BN: tl.constexpr, KBI: tl.constexpr):
    """Every load of one K step (KBI blocks of 64 channels): weight codes, scales, activations."""
    kb0 = step * KBI
    raw, s8 = load_weight_raw(VALS, SCALES, rb0, kb0, num_kb, BN, KBI)
    kk = kb0 * 64 + tl.arange(0, KBI * 64)
    x = tl.load(X + xrow[:, None] + kk[None, :], mask=xmask[:, None] & (kk < K)[None, :], other=0.0)
    return raw, s8, x


@triton.jit
def _stream_step_mma(acc, tot, raw, s8, x, step, BN: tl.constexpr, KBI: tl.constexpr,
                     STEPS_PER_SEG: tl.constexpr, USE_ASM: tl.constexpr):
    """One K step into the segment accumulator; at a segment's end its sum joins ``tot`` (in order)."""
    acc = tl.dot(decode_weight_raw(raw, s8, BN, KBI, USE_ASM), tl.trans(x), acc)
    if (step + 1) % STEPS_PER_SEG == 0:
        tot += acc
        acc = tl.zeros_like(acc)
    return acc, tot


@triton.jit
def _decode_stream_kernel(
    VALS, SCALES, X, SX, SW, BIAS, Y,
    M, N, K, num_kb, num_rb, stride_xm, stride_ym,
    SEG_KB: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, KBI: tl.constexpr, DEPTH: tl.constexpr,
    STAGES: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
    PREFETCH_L2: tl.constexpr, PDL: tl.constexpr,
):
    """One program per BN weight rows walks all of K (no cross-program reduction): the loads of
    the next ``DEPTH - 1`` K steps are in flight while a step is decoded and multiplied. Segment
    sums from zero, added in segment order: the bits of :func:`_decode_gemm_kernel`. With the
    residual, MMA column ``2m`` is token ``m``'s main row and ``2m + 1`` its residual row (the
    pair lands in one thread's accumulator registers, so the final add needs no exchange).
    ``PREFETCH_L2``: the program's whole weight slab is requested into L2 first
    (:mod:`quads.kernels.l2_prefetch`). ``PDL`` (launched as a programmatic dependent of the
    activation quantization): weights are prefetched before waiting for that kernel's output."""
    pid_n = tl.program_id(0)
    rb0 = pid_n * (BN // 16)
    if PREFETCH_L2:  # this tile's row blocks: contiguous in the layout, every K block
        rbs = tl.minimum(BN // 16, num_rb - rb0).to(tl.int64)
        prefetch_l2(VALS + rb0.to(tl.int64) * num_kb * 512, (rbs * num_kb * 512).to(tl.int32))
        prefetch_l2(SCALES + rb0.to(tl.int64) * num_kb * 64, (rbs * num_kb * 64).to(tl.int32))
    if PDL:
        gdc_wait()  # the activations below are the previous kernel's output
    t = tl.arange(0, NT)
    if HAS_RES:
        row = tl.where(t % 2 == 0, t // 2, M + t // 2)
        xmask = t // 2 < M
    else:
        row = t
        xmask = t < M
    xrow = row.to(tl.int64) * stride_xm
    num_steps = tl.cdiv(num_kb, KBI)
    STEPS_PER_SEG: tl.constexpr = SEG_KB // KBI
    acc = tl.zeros((BN, NT), dtype=tl.float32)
    tot = tl.zeros((BN, NT), dtype=tl.float32)
    if DEPTH == 1:  # Triton's software pipeline (async copies through shared memory, STAGES deep)
        for step in tl.range(0, num_steps, num_stages=STAGES):
            raw, s8, x = _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, step, num_kb, K, BN, KBI)
            acc, tot = _stream_step_mma(acc, tot, raw, s8, x, step, BN, KBI, STEPS_PER_SEG, USE_ASM)
    elif DEPTH == 2:  # loads of step + 1 issued before step is decoded (steps past K load nothing)
        raw0, s80, x0 = _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, 0, num_kb, K, BN, KBI)
        for step in range(0, num_steps):
            raw1, s81, x1 = _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, step + 1, num_kb, K, BN, KBI)
            acc, tot = _stream_step_mma(acc, tot, raw0, s80, x0, step, BN, KBI, STEPS_PER_SEG, USE_ASM)
            raw0, s80, x0 = raw1, s81, x1
    else:  # DEPTH == 3
        raw0, s80, x0 = _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, 0, num_kb, K, BN, KBI)
        raw1, s81, x1 = _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, 1, num_kb, K, BN, KBI)
        for step in range(0, num_steps):
            raw2, s82, x2 = _stream_step_loads(VALS, SCALES, X, xrow, xmask, rb0, step + 2, num_kb, K, BN, KBI)
            acc, tot = _stream_step_mma(acc, tot, raw0, s80, x0, step, BN, KBI, STEPS_PER_SEG, USE_ASM)
            raw0, s80, x0 = raw1, s81, x1
            raw1, s81, x1 = raw2, s82, x2
    if num_steps % STEPS_PER_SEG != 0:  # the last, partial segment
        tot += acc
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    sw = tl.load(SW)
    if HAS_RES:  # the residual shares the row's global scale
        main, res = tl.split(tl.reshape(tot, (BN, NT // 2, 2)))
        tot2 = main + res
        m = tl.arange(0, NT // 2)
    else:
        tot2 = tot
        m = tl.arange(0, NT)
    mmask = m < M
    sx = tl.load(SX + m, mask=mmask, other=1.0)
    y = tl.math.div_rn(tot2 * 16384.0, (sx * sw)[None, :] + tl.zeros_like(tot2))
    if HAS_BIAS:
        y = y + tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


class DecodeConfig:
    """Tile choice: ``bn`` weight rows per program (64 per warpgroup), ``kbi`` 64-channel blocks
    per K step, warps, pipeline stages. ``stream``: one program per row tile over all of K
    (:func:`_decode_stream_kernel`): ``depth`` 2 / 3 keeps 1 / 2 K steps of loads in registers
    ahead, ``depth`` 1 uses Triton's ``num_stages`` software pipeline; ``l2_prefetch`` requests
    the tile's weight slab into L2 first; ``pdl`` launches it as a programmatic dependent of the
    previous kernel. Otherwise split-K over segments with the last-arriving reduction
    (:func:`_decode_gemm_kernel`)."""

    __slots__ = ("bn", "kbi", "num_warps", "num_stages", "use_asm", "unroll", "prefetch", "stream", "depth",
                 "l2_prefetch", "pdl")

    def __init__(self, bn: int = 64, kbi: int = 2, num_warps: int = 4, num_stages: int = 1, use_asm: bool = True,
                 unroll: bool = True, prefetch: bool = False, stream: bool = False, depth: int = 2,
                 l2_prefetch: bool = False, pdl: bool = False):
        if depth not in (1, 2, 3):
            raise ValueError(f"depth must be 1 (Triton's pipeline, num_stages deep), 2 or 3, got {depth}")
        if (l2_prefetch or pdl) and not stream:
            raise ValueError("l2_prefetch and pdl are options of the streaming kernel (stream=True)")
        self.bn, self.kbi, self.num_warps, self.num_stages = bn, kbi, num_warps, num_stages
        self.use_asm, self.unroll, self.prefetch = use_asm, unroll, prefetch
        self.stream, self.depth, self.l2_prefetch, self.pdl = stream, depth, l2_prefetch, pdl

    def __repr__(self):
        if self.stream:
            return (f"DecodeConfig(stream, bn={self.bn}, kbi={self.kbi}, depth={self.depth}, stages={self.num_stages}, "
                    f"warps={self.num_warps}, asm={self.use_asm}, l2_prefetch={self.l2_prefetch}, pdl={self.pdl})")
        return (f"DecodeConfig(bn={self.bn}, kbi={self.kbi}, warps={self.num_warps}, stages={self.num_stages}, "
                f"asm={self.use_asm}, unroll={self.unroll}, prefetch={self.prefetch})")


def pick_decode_config(columns: int, n: int, k: int) -> DecodeConfig:
    """Default tiles (see docs/kernels.md for the measurements behind them)."""
    if interpreting():
        return DecodeConfig(bn=64, kbi=1, num_warps=4, num_stages=1, use_asm=False)
    if columns <= 16:  # measured on the H200, 2026-12-01 (docs/kernels.md)
        return DecodeConfig(bn=64, kbi=2, num_warps=4, num_stages=1)
    return DecodeConfig(bn=128, kbi=4, num_warps=8, num_stages=1)

def decode_gemm(
    x16: torch.Tensor,
    sx: torch.Tensor,
    weight: HopperWeight,
    sw: torch.Tensor,
    m: int,
    has_residual: bool,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: DecodeConfig | None = None,
    seg_k: int = SEG_K,
) -> torch.Tensor:
    """``y (m, N)`` from the stacked fp16 operand ``x16`` (``2m`` rows with the residual rows
    after the main ones, else ``m``; unscaled ``e2m1 * s`` values, width >= K) and the rows'
    global scales ``sx`` (``m``, fp32; the residual shares them); ``sw`` fp32 scalar tensor."""
    cols = 2 * m if has_residual else m
    if cols > _MAX_COLUMNS:
        raise ValueError(f"decode_gemm takes at most {_MAX_COLUMNS} columns, got {cols} (use the prefill GEMM)")
    n, k = weight.n, weight.k
    cfg = config or pick_decode_config(cols, n, k)
    dev = x16.device
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 store truncates instead of rounding to nearest even
        return decode_gemm(x16, sx, weight, sw, m, has_residual, bias, torch.float32, config, seg_k).to(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0:
        return y
    num_kb = weight.values.shape[-3]
    seg_kb = seg_k // K_BLOCK
    num_seg = triton.cdiv(triton.cdiv(k, K_BLOCK), seg_kb)
    if cfg.prefetch and seg_kb != 2 * cfg.kbi:
        raise ValueError(f"prefetch splits a segment in two: needs kbi = {seg_kb // 2}, got {cfg.kbi}")
    nt = max(16, triton.next_power_of_2(cols))
    if cfg.stream:
        if seg_kb % cfg.kbi:
            raise ValueError(f"kbi={cfg.kbi} must divide the segment's {seg_kb} blocks")
        native = not interpreting()  # PTX (prefetch, grid dependency control) needs a GPU
        extra = {"launch_pdl": True} if cfg.pdl and native else {}
        _decode_stream_kernel[(triton.cdiv(n, cfg.bn),)](
            weight.values, weight.scales, x16, sx, sw.reshape(1), bias if bias is not None else sx, y,
            m, n, k, num_kb, weight.values.shape[-4], x16.stride(0), y.stride(0),
            SEG_KB=seg_kb, BN=cfg.bn, NT=nt, KBI=cfg.kbi, DEPTH=cfg.depth, STAGES=cfg.num_stages,
            HAS_RES=has_residual, HAS_BIAS=bias is not None, USE_ASM=cfg.use_asm and native,
            PREFETCH_L2=cfg.l2_prefetch and native, PDL=cfg.pdl and native,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        )
        return y
    grid = (triton.cdiv(n, cfg.bn), num_seg)
    part = torch.empty((num_seg, cols, n), dtype=torch.float32, device=dev)
    bm = max(16, min(64, triton.next_power_of_2(m)))
    _decode_gemm_kernel[grid](
        weight.values, weight.scales, x16, sx, sw.reshape(1), bias if bias is not None else sx, y, part,
        arrival_counters(dev, grid[0], 4096),
        m, n, k, num_kb, x16.stride(0), y.stride(0),
        SEG_KB=seg_kb, BN=cfg.bn, NT=nt, BM=bm, KBI=cfg.kbi, HAS_RES=has_residual, HAS_BIAS=bias is not None,
        USE_ASM=cfg.use_asm and not interpreting(), UNROLL=cfg.unroll, STAGES=cfg.num_stages, RED=8, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
