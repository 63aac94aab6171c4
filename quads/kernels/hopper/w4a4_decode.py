"""Decode GEMM on Hopper: few tokens (M <= 64) times a packed NVFP4 weight in the Hopper layout.

``y (M, N) = (x̂ Ŵᵀ [+ r̂ Ŵᵀ]) / (S_x S_w) [+ bias]``, exact W4A4 emulation
(docs/background.md section 2), or the weight-only product with an fp16 activation operand.

* The weight streams from HBM once, 16 bytes per thread per load, in the layout of
  :mod:`quads.kernels.hopper.weight_layout`, and is decoded in registers
  (:mod:`quads.kernels.hopper.weight_decode`) straight into the wgmma register operand
  (swap-AB: weight rows are the MMA's M, tokens its N).
* Tokens are the MMA's N: the main operand rows and, with residual compensation, the residual
  rows stacked after them (one MMA over ``2M`` columns; for M <= 8 the residual fills columns
  the instruction computes anyway).
* Deterministic, batch-invariant order: K is cut into canonical segments of ``SEG_K`` channels.
  Each program sums one segment from zero by a chain of k16 wgmma steps; the last program of an
  output tile to arrive (an int32 arrival counter it resets, so CUDA-graph replays work) adds
  the segment sums in segment order and applies the epilogue. No atomics touch the data. The
  prefill kernel (:mod:`quads.kernels.hopper.w4a4_gemm`) walks the same segments with the same
  operand values, so a row's bits do not depend on M or on which kernel ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quads.kernels._interpreter import interpreting
from quads.kernels.hopper.arrival_counters import arrival_counters
from quads.kernels.hopper.weight_decode import decode_weight_raw, load_weight_raw, load_weight_tile
from quads.kernels.hopper.weight_layout import K_BLOCK, HopperWeight

__all__ = ["SEG_K", "OPERAND_SHIFT", "DecodeConfig", "pick_decode_config", "decode_gemm", "max_decode_columns"]

#: canonical K segment (channels) of every quads GEMM: fixes the fp32 summation order
SEG_K = 512
#: the weight operand is e2m1 * s * 2^-14 (hopper.weight_decode); epilogues multiply by 2^14
OPERAND_SHIFT = 14
_MAX_COLUMNS = 128


def max_decode_columns() -> int:
    """The most MMA columns (tokens, residual rows included) one decode launch takes."""
    return _MAX_COLUMNS


@triton.jit
def _reduce_segments_store(PART, SX, SW, BIAS, Y, M, N, cols, num_seg, offs_n, nmask, stride_ym,
                           BN: tl.constexpr, BM: tl.constexpr, RED: tl.constexpr,
                           HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SW_PER_ROW: tl.constexpr):
    """The epilogue of a (BN,) output tile: segment sums from PART (num_seg, cols, N) added in
    segment order (RED loads in flight at a time), the residual's after the main one's, then
    ``y = tot * 2^14 / (S_x S_w) [+ bias]`` for every token row. ``SW_PER_ROW``: ``S_w`` per
    weight row (several weights stacked along N, each with its own global scale)."""
    rows = tl.arange(0, BM)
    if SW_PER_ROW:
        sw = tl.load(SW + offs_n, mask=nmask, other=1.0)
    else:
        sw = tl.load(SW)
    for m0 in range(0, M, BM):
        m = m0 + rows
        mmask = m < M
        pmask = nmask[:, None] & mmask[None, :]
        tot = tl.zeros((BN, BM), dtype=tl.float32)
        totr = tl.zeros((BN, BM), dtype=tl.float32)
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
        if SW_PER_ROW:
            den = sx[None, :] * sw[:, None]
        else:
            den = (sx * sw)[None, :] + tl.zeros_like(tot)
        y = tl.math.div_rn(tot * 16384.0, den)
        if HAS_BIAS:
            y = y + tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty), mask=pmask)


@triton.jit
def _decode_gemm_kernel(
    VALS, SCALES, X, SX, SW, BIAS, Y, PART, LOCKS,
    M, N, K, num_kb, num_rb, stride_xm, stride_ym,
    SEG_KB: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, BM: tl.constexpr, KBI: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
    RED: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    REDUCE_KERNEL: tl.constexpr, GDC: tl.constexpr, SW_PER_ROW: tl.constexpr,
):
    """``PDL`` (with ``PREFETCH``): launched as a programmatic dependent of the activation
    quantization: the weight loads are issued before waiting for that kernel's output.
    ``REDUCE_KERNEL``: only write the segment sums; :func:`_decode_reduce_kernel` (launched
    as this kernel's programmatic dependent) adds them, instead of the last-arriving program.
    ``GDC``: grid dependency control instructions available (a GPU, not the interpreter)."""
    if REDUCE_KERNEL and GDC:
        gdc_launch_dependents()
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
        raw0, sc0 = load_weight_raw(VALS, SCALES, rb0, kb_lo, num_kb, BN, KBI, num_rb)
        raw1, sc1 = load_weight_raw(VALS, SCALES, rb0, kb_lo + KBI, num_kb, BN, KBI, num_rb)
        if PDL:
            gdc_wait()  # the activations are the previous kernel's output
        kk0 = kb_lo * 64 + tl.arange(0, KBI * 64)
        kk1 = kk0 + KBI * 64
        xrow = X + tok[:, None].to(tl.int64) * stride_xm
        x0 = tl.load(xrow + kk0[None, :], mask=tmask[:, None] & (kk0 < K)[None, :], other=0.0)
        x1 = tl.load(xrow + kk1[None, :], mask=tmask[:, None] & (kk1 < K)[None, :], other=0.0)
        acc = tl.dot(decode_weight_raw(raw0, sc0, BN, KBI, USE_ASM), tl.trans(x0), acc)
        acc = tl.dot(decode_weight_raw(raw1, sc1, BN, KBI, USE_ASM), tl.trans(x1), acc)
    else:  # a fixed trip count, unrolled; blocks past K (the last segment) load as zeros
        for it in tl.static_range(SEG_KB // KBI):
            kb = kb_lo + it * KBI
            w = load_weight_tile(VALS, SCALES, pid_n * (BN // 16), kb, num_kb, BN, KBI, USE_ASM, num_rb)
            kk = kb * 64 + tl.arange(0, KBI * 64)
            x = tl.load(X + tok[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=tmask[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)

    # this segment's sums -> workspace PART (num_seg, cols, N) fp32
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    seg_base = PART + (pid_s * cols).to(tl.int64) * N
    tl.store(seg_base + tok[None, :] * N + offs_n[:, None], acc, mask=nmask[:, None] & tmask[None, :])
    if not REDUCE_KERNEL:
        tl.debug_barrier()
        arrived = tl.atomic_add(LOCKS + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_seg - 1:  # the last program of this tile adds the segment sums
            _reduce_segments_store(PART, SX, SW, BIAS, Y, M, N, cols, num_seg, offs_n, nmask, stride_ym,
                                   BN, BM, RED, HAS_RES, HAS_BIAS, SW_PER_ROW)
            tl.atomic_xchg(LOCKS + pid_n, 0)


@triton.jit
def _decode_reduce_kernel(PART, SX, SW, BIAS, Y, M, N, cols, num_seg, stride_ym,
                          BN: tl.constexpr, BM: tl.constexpr, RED: tl.constexpr,
                          HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, SW_PER_ROW: tl.constexpr):
    """The split-K epilogue as its own launch (``REDUCE_KERNEL``): the same sums, same order."""
    if PDL:
        gdc_wait()  # the GEMM's segment sums
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    _reduce_segments_store(PART, SX, SW, BIAS, Y, M, N, cols, num_seg, offs_n, offs_n < N, stride_ym,
                           BN, BM, RED, HAS_RES, HAS_BIAS, SW_PER_ROW)


class DecodeConfig:
    """Tile choice: ``bn`` weight rows per program (64 per warpgroup), ``kbi`` 64-channel blocks
    per load step (the segment's steps unrolled), warps, stages (of the launch); ``prefetch``: a
    segment's loads all issued before its first decode (needs ``kbi`` = half a segment); ``pdl``
    (with ``prefetch``): launched as a programmatic dependent of the previous kernel (the
    activation quantization), weights loaded before waiting for it; ``reduce_kernel``: the
    cross-segment sums in a second launch instead of by the last-arriving program. Every choice
    gives the same bits."""

    __slots__ = ("bn", "kbi", "num_warps", "num_stages", "use_asm", "prefetch", "pdl", "reduce_kernel")

    def __init__(self, bn: int = 64, kbi: int = 2, num_warps: int = 4, num_stages: int = 1, use_asm: bool = True,
                 prefetch: bool = False, pdl: bool = False, reduce_kernel: bool = False):
        if pdl and not prefetch:
            raise ValueError("pdl overlaps the weight loads with the previous kernel: it needs prefetch=True")
        self.bn, self.kbi, self.num_warps, self.num_stages = bn, kbi, num_warps, num_stages
        self.use_asm, self.prefetch = use_asm, prefetch
        self.pdl, self.reduce_kernel = pdl, reduce_kernel

    def __repr__(self):
        return (f"DecodeConfig(bn={self.bn}, kbi={self.kbi}, warps={self.num_warps}, stages={self.num_stages}, "
                f"asm={self.use_asm}, prefetch={self.prefetch}, pdl={self.pdl}, "
                f"reduce_kernel={self.reduce_kernel})")


def pick_decode_config(columns: int, n: int, k: int) -> DecodeConfig:
    """Default tiles (see docs/kernels.md for the measurements behind them). Under the Triton
    interpreter the same branch runs (prefetch, second-launch reduction) with the portable decode
    instead of the inline PTX (and no programmatic dependent launch): the CPU suite runs the code
    the GPU runs."""
    native = not interpreting()
    # measured on the H200 (docs/kernels.md)
    if columns <= 16:  # prefetch: 5-17% faster than the per-step loads at every shape measured
        return DecodeConfig(bn=64, kbi=4, num_warps=4, num_stages=1, prefetch=True, use_asm=native)
    if columns <= 32 or n > 8192:
        return DecodeConfig(bn=128, kbi=4, num_warps=8, num_stages=1, use_asm=native)
    # up to 64 tokens with the residual: 64-row tiles, the reduction as its own launch: 1.1-1.5x
    return DecodeConfig(bn=64, kbi=4, num_warps=4, num_stages=1, prefetch=True, pdl=native, reduce_kernel=True,
                        use_asm=native)


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
) -> torch.Tensor:
    """``y (m, N)`` from the stacked fp16 operand ``x16`` (``2m`` rows with the residual rows
    after the main ones, else ``m``; unscaled ``e2m1 * s`` values, width >= K) and the rows'
    global scales ``sx`` (``m``, fp32; the residual shares them); ``sw``: the weight's fp32 global
    scale, a scalar tensor, or one per weight row (N,) for weights stacked along N."""
    cols = 2 * m if has_residual else m
    if cols > _MAX_COLUMNS:
        raise ValueError(f"decode_gemm takes at most {_MAX_COLUMNS} columns, got {cols} (use the prefill GEMM)")
    n, k = weight.n, weight.k
    cfg = config or pick_decode_config(cols, n, k)
    dev = x16.device
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 store truncates instead of rounding to nearest even
        return decode_gemm(x16, sx, weight, sw, m, has_residual, bias, torch.float32, config).to(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0:
        return y
    num_kb = weight.values.shape[-3]
    seg_kb = SEG_K // K_BLOCK
    num_seg = triton.cdiv(triton.cdiv(k, K_BLOCK), seg_kb)
    if cfg.prefetch and seg_kb != 2 * cfg.kbi:
        raise ValueError(f"prefetch splits a segment in two: needs kbi = {seg_kb // 2}, got {cfg.kbi}")
    sw_per_row = sw.dim() == 1 and sw.numel() == n and n > 1
    if not sw_per_row and sw.numel() != 1:
        raise ValueError(f"decode_gemm: sw must be a scalar or one scale per weight row ({n}), got {tuple(sw.shape)}")
    native = not interpreting()  # PTX (decode, grid dependency control) needs a GPU
    pdl = cfg.pdl and native
    grid = (triton.cdiv(n, cfg.bn), num_seg)
    part = torch.empty((num_seg, cols, n), dtype=torch.float32, device=dev)
    nt = max(16, triton.next_power_of_2(cols))
    bm = max(16, min(64, triton.next_power_of_2(m)))
    bias_arg = bias if bias is not None else sx
    _decode_gemm_kernel[grid](
        weight.values, weight.scales, x16, sx, sw.reshape(-1), bias_arg, y, part,
        arrival_counters(dev, grid[0], 4096),
        m, n, k, num_kb, weight.values.shape[-4], x16.stride(0), y.stride(0),
        SEG_KB=seg_kb, BN=cfg.bn, NT=nt, BM=bm, KBI=cfg.kbi, HAS_RES=has_residual, HAS_BIAS=bias is not None,
        USE_ASM=cfg.use_asm and native, RED=8, PREFETCH=cfg.prefetch,
        PDL=pdl, REDUCE_KERNEL=cfg.reduce_kernel, GDC=native, SW_PER_ROW=sw_per_row,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    if cfg.reduce_kernel:
        _decode_reduce_kernel[(grid[0],)](
            part, sx, sw.reshape(-1), bias_arg, y, m, n, cols, num_seg, y.stride(0),
            BN=cfg.bn, BM=bm, RED=8, HAS_RES=has_residual, HAS_BIAS=bias is not None, PDL=native, SW_PER_ROW=sw_per_row,
            num_warps=4, **({"launch_pdl": True} if native else {}),
        )
    return y
