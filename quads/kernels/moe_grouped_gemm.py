"""Grouped W4A4 (+ residual) GEMM over packed 3-D expert weights, driven by top-k routing.

Rows are the (token, choice) pairs sorted by expert (:class:`quads.ops.experts.Routing`):
``offsets[e] .. offsets[e+1]`` are expert ``e``'s rows. One program per (output tile, expert)
walks that expert's rows in chunks of ``BM``; experts without rows exit at once, so only routed
experts' weights are read. Activation rows are gathered through ``rows`` (sorted position ->
activation row: the token, for ``gate_up``; None = identity, for ``down``), so token activations
are quantized once (per-row global scales make that bit-identical to quantizing each copy).

The weight streams in the Hopper layout (:mod:`quads.kernels.hopper_weight_layout`, one per
expert) and is decoded in registers, as in the dense decode kernel; per-expert global weight
scales ``S_w[e]``. Each program walks the canonical K segments of
:data:`quads.kernels.w4a4_decode_hopper.SEG_K` itself (sum each from zero, add them in order) and
applies the same epilogue, so a row's result has the bits of the dense kernels on that expert.
Activations: the stacked operand of the dense decode kernel (``2 * rows_x`` rows, the residual
rows after the main ones; or ``rows_x`` without residual) and the rows' global scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreting
from quads.kernels.hopper_weight_layout import K_BLOCK, HopperWeight, load_weight_tile
from quads.kernels.l2_prefetch import prefetch_l2
from quads.kernels.w4a4_decode_hopper import SEG_K

__all__ = ["moe_w4a4_gemm", "MoeConfig", "pick_moe_config"]


@triton.jit
def _moe_w4a4_kernel(
    VALS, SCALES, X, SX, SW, ROWS, OFFS, Y,
    N, K, num_kb, num_rb, rows_x, stride_xm, stride_ym, vals_stride_e, scales_stride_e,
    SEG_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, KBI: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, USE_ASM: tl.constexpr, STAGES: tl.constexpr,
    PREFETCH_L2: tl.constexpr,
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
        if PREFETCH_L2:  # this tile's weight slab of expert e (contiguous in the layout) into L2
            rb0 = pid_n * (BN // 16)
            rbs = tl.minimum(BN // 16, num_rb - rb0).to(tl.int64)
            prefetch_l2(vals + rb0.to(tl.int64) * num_kb * 512, (rbs * num_kb * 512).to(tl.int32))
            prefetch_l2(scales + rb0.to(tl.int64) * num_kb * 64, (rbs * num_kb * 64).to(tl.int32))
        num_steps = tl.cdiv(num_kb, KBI)
        STEPS_PER_SEG: tl.constexpr = SEG_KB // KBI
        for m0 in range(start, end, BM):
            p = m0 + tl.arange(0, BM)
            pmask = p < end
            if HAS_ROWS:
                src = tl.load(ROWS + p, mask=pmask, other=0).to(tl.int64)
            else:
                src = p.to(tl.int64)
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            totr = tl.zeros((BN, BM), dtype=tl.float32)
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            accr = tl.zeros((BN, BM), dtype=tl.float32)
            # K steps of KBI blocks (STAGES deep software pipeline); a segment's sums join the
            # totals at its last step, in segment order
            for step in tl.range(0, num_steps, num_stages=STAGES):
                kb = step * KBI
                w = load_weight_tile(vals, scales, pid_n * (BN // 16), kb, num_kb, BN, KBI, USE_ASM)
                kk = kb * 64 + tl.arange(0, KBI * 64)
                xmask = pmask[:, None] & (kk < K)[None, :]
                x = tl.load(X + src[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
                acc = tl.dot(w, tl.trans(x), acc)
                if HAS_RES:
                    r = tl.load(X + (src + rows_x)[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
                    accr = tl.dot(w, tl.trans(r), accr)
                if (step + 1) % STEPS_PER_SEG == 0:
                    tot += acc
                    totr += accr
                    acc = tl.zeros_like(acc)
                    accr = tl.zeros_like(accr)
            if num_steps % STEPS_PER_SEG != 0:  # the last, partial segment
                tot += acc
                totr += accr
            sx = tl.load(SX + src, mask=pmask, other=1.0)
            if HAS_RES:  # the residual shares the row's global scale
                tot = tot + totr
            y = tl.math.div_rn(tot * 16384.0, (sx * sw)[None, :] + tl.zeros_like(tot))
            tl.store(Y + p[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty),
                     mask=nmask[:, None] & pmask[None, :])


class MoeConfig:
    """Tiles of the grouped kernel: ``bn`` weight rows and ``bm`` routed rows per program, ``kbi``
    64-channel blocks per K step, warps, software-pipeline stages; ``l2_prefetch`` requests the
    program's weight slab into L2 first (:mod:`quads.kernels.l2_prefetch`)."""

    __slots__ = ("bn", "bm", "kbi", "num_warps", "num_stages", "use_asm", "l2_prefetch")

    def __init__(self, bn=64, bm=16, kbi=2, num_warps=4, num_stages=1, use_asm=True, l2_prefetch=False):
        self.bn, self.bm, self.kbi = bn, bm, kbi
        self.num_warps, self.num_stages, self.use_asm, self.l2_prefetch = num_warps, num_stages, use_asm, l2_prefetch

    def __repr__(self):
        return (f"MoeConfig(bn={self.bn}, bm={self.bm}, kbi={self.kbi}, warps={self.num_warps}, "
                f"stages={self.num_stages}, asm={self.use_asm}, l2_prefetch={self.l2_prefetch})")


def pick_moe_config(rows: int, num_experts: int, n: int, k: int) -> MoeConfig:
    if interpreting():
        return MoeConfig(bn=64, bm=16, kbi=1, num_warps=4, num_stages=1, use_asm=False)
    per_expert = rows / max(num_experts, 1)
    return MoeConfig(bn=64, bm=16 if per_expert <= 16 else 64, kbi=2, num_warps=4, num_stages=1)


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
    grid = (triton.cdiv(n, cfg.bn), num_experts)
    _moe_w4a4_kernel[grid](
        weight.values, weight.scales, x16, sx, sw.reshape(-1), rows if rows is not None else offsets, offsets, y,
        n, k, num_kb, weight.values.shape[-4], rows_x, x16.stride(0), y.stride(0), weight.values[0].numel(), weight.scales[0].numel(),
        SEG_KB=SEG_K // K_BLOCK, BN=cfg.bn, BM=cfg.bm, KBI=cfg.kbi, HAS_RES=has_residual, HAS_ROWS=rows is not None,
        USE_ASM=cfg.use_asm and not interpreting(), STAGES=cfg.num_stages,
        PREFETCH_L2=cfg.l2_prefetch and not interpreting(), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
