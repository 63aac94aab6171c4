"""Grouped W4A4 (+ residual) GEMM over packed 3-D expert weights, driven by top-k routing.

Rows are the (token, choice) pairs sorted by expert (stable argsort of the flattened top-k ids,
exactly as :func:`quads.ops.moe_experts.experts_loop` does); ``offsets[e] .. offsets[e+1]`` are
expert ``e``'s rows. One program per (output tile, expert) walks that expert's rows in chunks of
``BM``; experts without tokens exit at once, so only routed experts' weights are read. The
activation rows are gathered through ``rows`` (sorted position -> activation row: the token for
``gate_up``, the identity for ``down``), so the token activations are quantized once (per-row
global scales make that bit-identical to quantizing each expert's copy).

Per-expert global weight scales ``S_w[e]``; the per-row math, the canonical K-segment order and
the epilogue are those of :mod:`quads.kernels.w4a4_gemm_hopper`, so a row's result is the same
bits as the dense kernel's non-split path on that expert's weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreting
from quads.kernels.w4a4_gemm_hopper import SEG_K, _epilogue, _segment_partial

__all__ = ["moe_w4a4_gemm", "MoeConfig", "pick_moe_config"]


@triton.jit
def _moe_w4a4_kernel(
    X, R, SX, SR, ROWS,
    WQ, WS, SW, OFFS,
    Y,
    N, K, KH, KS, stride_xm, stride_rm, stride_ym,
    SEG: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_ROWS: tl.constexpr, USE_ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    if end > start:
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        e64 = e.to(tl.int64)
        wq = WQ + e64 * N * KH
        ws = WS + e64 * N * KS
        sw = tl.load(SW + e)
        num_seg = tl.cdiv(K, SEG)
        for m0 in range(start, end, BM):
            offs_p = m0 + tl.arange(0, BM)
            pmask = offs_p < end
            if HAS_ROWS:
                src = tl.load(ROWS + offs_p, mask=pmask, other=0)
            else:
                src = offs_p
            row_x = src.to(tl.int64) * stride_xm
            row_r = src.to(tl.int64) * stride_rm
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            totr = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(0, num_seg):
                acc, accr = _segment_partial(X, R, wq, ws, wq, row_x, row_r, pmask, offs_n, nmask,
                                             s * SEG, tl.minimum(s * SEG + SEG, K), K, KH, KS, BN, BM, BK,
                                             HAS_RES, USE_ASM, 0)
                tot += acc
                totr += accr
            _epilogue(tot, totr, SX, SR, src, sw, SX, Y, offs_p, pmask, offs_n, nmask, stride_ym,
                      HAS_RES, False)


class MoeConfig:
    __slots__ = ("bn", "bm", "bk", "num_warps", "num_stages", "use_asm")

    def __init__(self, bn, bm, bk, num_warps=4, num_stages=3, use_asm=True):
        self.bn, self.bm, self.bk = bn, bm, bk
        self.num_warps, self.num_stages, self.use_asm = num_warps, num_stages, use_asm

    def __repr__(self):
        return (f"MoeConfig(bn={self.bn}, bm={self.bm}, bk={self.bk}, warps={self.num_warps}, "
                f"stages={self.num_stages}, asm={self.use_asm})")


def pick_moe_config(rows: int, num_experts: int, n: int, k: int) -> MoeConfig:
    per_expert = rows / max(num_experts, 1)
    if interpreting():
        return MoeConfig(bn=16, bm=16, bk=32, num_warps=1, num_stages=1, use_asm=False)
    if per_expert <= 16:
        return MoeConfig(bn=64, bm=16, bk=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeConfig(bn=64, bm=64, bk=128, num_warps=4, num_stages=4)
    return MoeConfig(bn=128, bm=64, bk=64, num_warps=8, num_stages=3)


def moe_w4a4_gemm(
    x16: torch.Tensor,
    sx: torch.Tensor,
    rows: torch.Tensor | None,
    offsets: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    sw: torch.Tensor,
    num_rows: int,
    r16: torch.Tensor | None = None,
    sr: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: MoeConfig | None = None,
    seg_k: int = SEG_K,
) -> torch.Tensor:
    """Y (num_rows, N): row p = expert(p)'s W4A4 product of activation row ``rows[p]``.

    Rows at positions >= offsets[E] (tokens routed to no valid expert) are zero.
    x16/r16 fp16 (rows_x, K); sx/sr fp32 (rows_x,); wq uint8 (E, N, K/2); ws (E, N, K/16);
    sw fp32 (E,); offsets int32 (E+1,); rows int32 (num_rows,) or None (identity).
    """
    num_experts, n, _ = wq.shape
    k = x16.shape[1]
    cfg = config or pick_moe_config(num_rows, num_experts, n, k)
    if seg_k % cfg.bk:
        raise ValueError(f"BLOCK_K={cfg.bk} must divide the K segment {seg_k}")
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even
        return moe_w4a4_gemm(x16, sx, rows, offsets, wq, ws, sw, num_rows, r16, sr, torch.float32,
                             config, seg_k).to(out_dtype)
    y = torch.zeros((num_rows, n), dtype=out_dtype, device=x16.device)
    if num_rows == 0:
        return y
    ws_u8 = ws.view(torch.uint8) if ws.dtype != torch.uint8 else ws
    has_res = r16 is not None
    grid = (triton.cdiv(n, cfg.bn), num_experts)
    _moe_w4a4_kernel[grid](
        x16, r16 if has_res else x16, sx, sr if has_res else sx, rows if rows is not None else offsets,
        wq, ws_u8, sw.reshape(-1), offsets,
        y,
        n, k, k // 2, k // 16, x16.stride(0), (r16 if has_res else x16).stride(0), y.stride(0),
        SEG=seg_k, BN=cfg.bn, BM=cfg.bm, BK=cfg.bk,
        HAS_RES=has_res, HAS_ROWS=rows is not None, USE_ASM=cfg.use_asm and not interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
