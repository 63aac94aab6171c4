"""Grouped W4A4 (+ residual) GEMM over packed 3-D expert weights, driven by top-k routing.

Rows are the (token, choice) pairs sorted by expert (:class:`quads.ops.experts_op.Routing`):
``offsets[e] .. offsets[e+1]`` are expert ``e``'s rows. One program per (output tile, expert)
walks that expert's rows in chunks of ``BM``; experts without rows exit at once, so only routed
experts' weights are read. Activation rows are gathered through ``rows`` (sorted position ->
activation row: the token, for ``gate_up``; None = identity, for ``down``), so token activations
are quantized once (per-row global scales make that bit-identical to quantizing each copy).

The weight streams in the Hopper layout (:mod:`quads.kernels.hopper.weight_layout`, one per
expert) and is decoded in registers, as in the dense decode kernel; per-expert global weight
scales ``S_w[e]``. Each program walks the canonical K segments of
:data:`quads.kernels.hopper.w4a4_decode.SEG_K` itself (sum each from zero, add them in order) and
applies the same epilogue, so a row's result has the bits of the dense kernels on that expert.
Activations: the stacked operand of the dense decode kernel (``2 * rows_x`` rows, the residual
rows after the main ones; or ``rows_x`` without residual) and the rows' global scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreting
from quads.kernels.hopper.weight_decode import load_weight_tile
from quads.kernels.hopper.weight_layout import K_BLOCK, HopperWeight
from quads.kernels.hopper.w4a4_decode import SEG_K

__all__ = ["moe_w4a4_gemm", "MoeConfig", "pick_moe_config"]


@triton.jit
def _source_rows(ROWS, p, pmask, HAS_ROWS: tl.constexpr):
    """Activation rows (int64) of sorted positions ``p``: gathered through ``ROWS``, or ``p``
    itself (identity: ``rows`` None)."""
    if HAS_ROWS:
        src = tl.load(ROWS + p, mask=pmask, other=0).to(tl.int64)
    else:
        src = p.to(tl.int64)
    return src


@triton.jit
def _expert_segment_sums(vals, scales, X, src, pmask, rows_x, stride_xm, rb0, kb_lo, num_kb, K,
                         SEG_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, KBI: tl.constexpr,
                         HAS_RES: tl.constexpr, USE_ASM: tl.constexpr):
    """One canonical segment's sums (from zero, a chain of k16 MMAs) of BN weight rows of one
    expert against BM gathered activation rows ``src`` (and their residual rows): (main, residual)."""
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    accr = tl.zeros((BN, BM), dtype=tl.float32)
    for it in tl.static_range(SEG_KB // KBI):
        kb = kb_lo + it * KBI
        w = load_weight_tile(vals, scales, rb0, kb, num_kb, BN, KBI, USE_ASM)
        kk = kb * 64 + tl.arange(0, KBI * 64)
        xmask = pmask[:, None] & (kk < K)[None, :]
        x = tl.load(X + src[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if HAS_RES:
            r = tl.load(X + (src + rows_x)[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
            accr = tl.dot(w, tl.trans(r), accr)
    return acc, accr


@triton.jit
def _moe_w4a4_kernel(
    VALS, SCALES, X, SX, SW, ROWS, OFFS, Y,
    N, K, num_kb, rows_x, stride_xm, stride_ym, vals_stride_e, scales_stride_e,
    SEG_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, KBI: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    if end > start:
        vals = VALS + e.to(tl.int64) * vals_stride_e
        scales = SCALES + e.to(tl.int64) * scales_stride_e
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        sw = tl.load(SW + e)
        num_seg = tl.cdiv(num_kb, SEG_KB)
        for m0 in range(start, end, BM):
            p = m0 + tl.arange(0, BM)
            pmask = p < end
            src = _source_rows(ROWS, p, pmask, HAS_ROWS)
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            totr = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(0, num_seg):
                acc, accr = _expert_segment_sums(vals, scales, X, src, pmask, rows_x, stride_xm, pid_n * (BN // 16),
                                                 s * SEG_KB, num_kb, K, SEG_KB, BN, BM, KBI, HAS_RES, USE_ASM)
                tot += acc
                totr += accr
            sx = tl.load(SX + src, mask=pmask, other=1.0)
            if HAS_RES:  # the residual shares the row's global scale
                tot = tot + totr
            y = tl.math.div_rn(tot * 16384.0, (sx * sw)[None, :] + tl.zeros_like(tot))
            tl.store(Y + p[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty),
                     mask=nmask[:, None] & pmask[None, :])


@triton.jit
def _moe_segment_kernel(
    VALS, SCALES, X, ROWS, OFFS, PART,
    N, K, num_kb, rows_x, num_rows, stride_xm, vals_stride_e, scales_stride_e,
    SEG_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, KBI: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Split-K over the canonical segments: program (tile, expert, segment) writes that
    segment's sums (from zero, the k16 chain of :func:`_moe_w4a4_kernel`) of the expert's rows
    to PART (num_seg, 1 + HAS_RES, num_rows, N) (main [, residual]); :func:`_moe_reduce_kernel` adds them
    in segment order."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    seg = tl.program_id(2)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    if end > start:
        vals = VALS + e.to(tl.int64) * vals_stride_e
        scales = SCALES + e.to(tl.int64) * scales_stride_e
        rb0 = pid_n * (BN // 16)
        kb_lo = seg * SEG_KB
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        for m0 in range(start, end, BM):
            p = m0 + tl.arange(0, BM)
            pmask = p < end
            src = _source_rows(ROWS, p, pmask, HAS_ROWS)
            acc, accr = _expert_segment_sums(vals, scales, X, src, pmask, rows_x, stride_xm, rb0, kb_lo, num_kb, K,
                                             SEG_KB, BN, BM, KBI, HAS_RES, USE_ASM)
            base = PART + (seg * (2 if HAS_RES else 1)).to(tl.int64) * num_rows * N
            ptrs = base + p[None, :].to(tl.int64) * N + offs_n[:, None]
            smask = nmask[:, None] & pmask[None, :]
            tl.store(ptrs, acc, mask=smask)
            if HAS_RES:
                tl.store(ptrs + num_rows * N, accr, mask=smask)


@triton.jit
def _moe_reduce_kernel(PART, SX, SW, ROWS, OFFS, Y, N, num_rows, num_seg, num_experts, stride_ym,
                       BN: tl.constexpr, BM: tl.constexpr, E_POW2: tl.constexpr,
                       HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Rows' segment sums in segment order (main, then residual), then the epilogue of
    :func:`_moe_w4a4_kernel`: ``(tot + totr) * 2^14 / (S_x[row] S_w[expert])``. Rows routed to no
    expert (position >= offsets[E]) are left as they are (zeros)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = offs_n < N
    p = tl.program_id(1) * BM + tl.arange(0, BM)
    ev = tl.arange(0, E_POW2)
    bounds = tl.load(OFFS + 1 + ev, mask=ev < num_experts, other=2147483647)  # offsets[1..E]
    expert = tl.sum((bounds[None, :] <= p[:, None]).to(tl.int32), axis=1)  # the expert of row p
    pmask = (p < num_rows) & (expert < num_experts)
    src = _source_rows(ROWS, p, pmask, HAS_ROWS)
    lmask = nmask[:, None] & pmask[None, :]
    ofs = p[None, :].to(tl.int64) * N + offs_n[:, None]
    tot = tl.zeros((BN, BM), dtype=tl.float32)
    totr = tl.zeros((BN, BM), dtype=tl.float32)
    seg_stride = ((2 if HAS_RES else 1) * num_rows * N).to(tl.int64)
    for seg in range(0, num_seg):
        base = PART + seg * seg_stride
        tot += tl.load(base + ofs, mask=lmask, other=0.0, cache_modifier=".cg")
        if HAS_RES:
            totr += tl.load(base + num_rows * N + ofs, mask=lmask, other=0.0, cache_modifier=".cg")
    sx = tl.load(SX + src, mask=pmask, other=1.0)
    sw = tl.load(SW + expert, mask=pmask, other=1.0)
    if HAS_RES:
        tot = tot + totr
    y = tl.math.div_rn(tot * 16384.0, (sx * sw)[None, :] + tl.zeros_like(tot))
    tl.store(Y + p[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty), mask=lmask)


class MoeConfig:
    """Tiles of the grouped kernel: ``bn`` weight rows and ``bm`` routed rows per program, ``kbi``
    64-channel blocks per load step, warps, stages. ``split``: one program per (tile, expert,
    K segment) writing partial sums, a second launch adding them in segment order (more
    programs when each expert has few rows). Every choice gives the same bits."""

    __slots__ = ("bn", "bm", "kbi", "num_warps", "num_stages", "use_asm", "split")

    def __init__(self, bn=64, bm=16, kbi=2, num_warps=4, num_stages=1, use_asm=True, split=False):
        self.bn, self.bm, self.kbi = bn, bm, kbi
        self.num_warps, self.num_stages, self.use_asm = num_warps, num_stages, use_asm
        self.split = split

    def __repr__(self):
        return (f"MoeConfig(bn={self.bn}, bm={self.bm}, kbi={self.kbi}, warps={self.num_warps}, "
                f"stages={self.num_stages}, asm={self.use_asm}, split={self.split})")


def pick_moe_config(rows: int, num_experts: int, n: int, k: int) -> MoeConfig:
    """The measured tiles; under the Triton interpreter the same ones with the portable decode
    instead of the inline PTX (the CPU suite runs the branch the GPU runs)."""
    per_expert = rows / max(num_experts, 1)
    # split-K (measured on the H200, docs/kernels.md): faster for
    # K >= 2048 (gate_up of both MoE shapes at T = 1..64: 1.1-1.2x; down K = 14336 at <= 2 rows per
    # expert: 1.6x), slower for down K = 14336 at 4 rows per expert (1.3x) and K = 768 (1.1x); its
    # fp32 partials (segments x 2 x rows x N) stay small at <= 16 rows per expert
    split = k >= 2048 and per_expert <= 16 and (k <= 4096 or per_expert <= 2)
    return MoeConfig(bn=64, bm=16 if per_expert <= 16 else 64, kbi=2, num_warps=4, num_stages=1, split=split,
                     use_asm=not interpreting())


def moe_w4a4_gemm(
    x16: torch.Tensor,
    sx: torch.Tensor,
    rows: torch.Tensor | None,
    offsets: torch.Tensor,
    weight: HopperWeight,
    sw: torch.Tensor,
    num_rows: int,
    rows_x: int,
    has_residual: bool,
    out_dtype: torch.dtype = torch.float32,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Y (num_rows, N): row p = expert(p)'s W4A4 product of activation row ``rows[p]``.

    Rows at positions >= offsets[E] (tokens routed to no valid expert) are zero. ``x16``: the
    stacked fp16 operand (``2 * rows_x`` rows with the residual, else ``rows_x``); ``sx`` the
    rows' global scales (``rows_x``); ``weight``: 3-D experts in the Hopper layout; ``sw`` fp32 (E,); ``offsets``
    int32 (E+1,); ``rows`` int32 (num_rows,) or None (identity).
    """
    num_experts = weight.values.shape[0]
    n, k = weight.n, weight.k
    cfg = config or pick_moe_config(num_rows, num_experts, n, k)
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even
        return moe_w4a4_gemm(x16, sx, rows, offsets, weight, sw, num_rows, rows_x, has_residual,
                             torch.float32, config).to(out_dtype)
    y = torch.zeros((num_rows, n), dtype=out_dtype, device=x16.device)
    if num_rows == 0:
        return y
    num_kb = weight.values.shape[-3]
    if cfg.split:
        seg_kb = SEG_K // K_BLOCK
        num_seg = triton.cdiv(num_kb, seg_kb)
        # fp32 segment sums: (segment, main [, residual], row, N)
        part = torch.empty((num_seg, 2 if has_residual else 1, num_rows, n), dtype=torch.float32, device=x16.device)
        _moe_segment_kernel[(triton.cdiv(n, cfg.bn), num_experts, num_seg)](
            weight.values, weight.scales, x16, rows if rows is not None else offsets, offsets, part,
            n, k, num_kb, rows_x, num_rows, x16.stride(0), weight.values[0].numel(), weight.scales[0].numel(),
            SEG_KB=seg_kb, BN=cfg.bn, BM=cfg.bm, KBI=cfg.kbi, HAS_RES=has_residual, HAS_ROWS=rows is not None,
            USE_ASM=cfg.use_asm and not interpreting(), num_warps=cfg.num_warps, num_stages=1,
        )
        _moe_reduce_kernel[(triton.cdiv(n, cfg.bn), triton.cdiv(num_rows, 16))](
            part, sx, sw.reshape(-1), rows if rows is not None else offsets, offsets, y, n, num_rows, num_seg,
            num_experts, y.stride(0), BN=cfg.bn, BM=16, E_POW2=triton.next_power_of_2(num_experts),
            HAS_RES=has_residual, HAS_ROWS=rows is not None, num_warps=4,
        )
        return y
    grid = (triton.cdiv(n, cfg.bn), num_experts)
    _moe_w4a4_kernel[grid](
        weight.values, weight.scales, x16, sx, sw.reshape(-1), rows if rows is not None else offsets, offsets, y,
        n, k, num_kb, rows_x, x16.stride(0), y.stride(0), weight.values[0].numel(), weight.scales[0].numel(),
        SEG_KB=SEG_K // K_BLOCK, BN=cfg.bn, BM=cfg.bm, KBI=cfg.kbi, HAS_RES=has_residual, HAS_ROWS=rows is not None,
        USE_ASM=cfg.use_asm and not interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
