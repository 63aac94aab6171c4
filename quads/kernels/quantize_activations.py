"""Fused NVFP4 activation quantization with residual compensation (Triton), bit-exact with
:mod:`quads.tensor.nvfp4_math`.

``_act_quant_row_kernel``: one program per activation row (or per chunk of a row when there are
few rows). The whole row lives in registers, so the per-row global scale (``granularity="row"``),
the main quantization, the residual ``r = x - DQ(Q(x))``, the per-token top-k selection of
``|r|`` (exact, ties included) and the residual's quantization (with the same global scale) are
one pass over ``x``. Outputs: the packed NVFP4 parts (bit-exact with the reference) and/or the
*unscaled* dequantized values ``e2m1 * f32(scale)`` in fp16 (exact, see docs/background.md
section 2), which is what the GEMM kernels consume. The block arithmetic and its bit-exactness
rules are in :mod:`quads.kernels.nvfp4_blocks`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from quads.kernels._interpreter import interpreter_safe_input, interpreting
from quads.kernels.amax import amax_rows
from quads.kernels.nvfp4_blocks import (
    abs_bits,
    global_scale,
    no_fp_fusion,
    quant_blocks,
    quant_blocks_4over6,
    with_sign,
)
from quads.tensor.nvfp4_math import BLOCK_SIZE, NVFP4Parts, check_block_scaling, global_encode_scale_from_amax

__all__ = ["QuantizedRows", "RowQuantization", "TOPK_SEARCHES", "quantize_rows"]


@triton.jit
def _dequant_blocks(qv, neg, s_f32, s_enc, FAST: tl.constexpr):
    """(±qv * s) / S_enc in float32, exactly as the reference (see :mod:`quads.kernels.nvfp4_blocks`)."""
    if FAST:
        q1 = tl.math.div_rn(s_f32, s_enc)
        q3 = tl.math.div_rn(s_f32 * 1.5, s_enc)
        qb = qv.to(tl.int32, bitcast=True)
        pow2 = (qb & 0x7F800000).to(tl.float32, bitcast=True)  # 2^e (0 for qv == 0)
        f = tl.where((qb & 0x00400000) != 0, q3[:, None], q1[:, None])
        mag = f * pow2
    else:
        mag = tl.math.div_rn(qv * s_f32[:, None], s_enc[:, None] + tl.zeros_like(qv))
    return with_sign(mag, neg)


@triton.jit
def _dequant_exact(qv, neg, s_f32, s_enc_scalar):
    """Row-level choice of the fast exact path (all results normal) or per-element div_rn."""
    q1 = tl.math.div_rn(s_f32, s_enc_scalar + tl.zeros_like(s_f32))
    bad = (s_f32 > 0.0) & (q1 < 2.350988701644575e-38)
    nbad = tl.sum(bad.to(tl.int32), axis=0)
    s_vec = s_enc_scalar + tl.zeros_like(s_f32)
    if nbad == 0:
        out = _dequant_blocks(qv, neg, s_f32, s_vec, True)
    else:
        out = _dequant_blocks(qv, neg, s_f32, s_vec, False)
    return out


@triton.jit
def _pack_store(codes, q_ptr, s_ptr, s_code, row_q_off, row_s_off, blk, jj8, bmask,
                NB: tl.constexpr):
    """Store codes (NB,16) as bytes (even element low nibble) and scale bytes (NB,)."""
    c3 = tl.reshape(codes, (NB, 8, 2))
    lo, hi = tl.split(c3)
    byte = (lo | (hi << 4)).to(tl.uint8)
    tl.store(q_ptr + row_q_off + blk[:, None] * 8 + jj8[None, :], byte, mask=bmask[:, None])
    tl.store(s_ptr + row_s_off + blk, s_code.to(tl.uint8), mask=bmask)


@triton.jit
def _topk_threshold_bits(bits, k, PACKED_SEARCH: tl.constexpr):
    """Bit pattern of the k-th largest of ``bits`` (1-D int32, entries >= 0; padding -1).

    Exact search over the int32 order (= float order for |r|; NaN patterns sort above +inf):

    * ``PACKED_SEARCH=False``: binary search on the threshold (31 count rounds, early exit when a
      candidate has exactly k elements above it: the answer is then the smallest of those);
    * ``PACKED_SEARCH=True``: 5-ary search whose 4 candidate counts travel in one packed int64
      reduction per round (~13 rounds; the reduction's latency, not the compares, bounds a
      round). Needs K < 65536 (the launcher checks).
    """
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.full((), 0x7F800000, tl.int32)  # +inf; NaN rows end here and select nothing
    if PACKED_SEARCH:
        while lo < hi:
            step = (hi - lo + 5) // 5
            c1 = lo + step
            c2 = lo + 2 * step
            c3 = lo + 3 * step
            c4 = lo + 4 * step
            packed = ((bits >= c1).to(tl.int64) + ((bits >= c2).to(tl.int64) << 16)
                      + ((bits >= c3).to(tl.int64) << 32) + ((bits >= c4).to(tl.int64) << 48))
            tot = tl.sum(packed, axis=0)
            n1 = ((tot & 0xFFFF) >= k) & (c1 <= hi)
            n2 = (((tot >> 16) & 0xFFFF) >= k) & (c2 <= hi)
            n3 = (((tot >> 32) & 0xFFFF) >= k) & (c3 <= hi)
            n4 = (((tot >> 48) & 0xFFFF) >= k) & (c4 <= hi)
            n = n1.to(tl.int32) + n2.to(tl.int32) + n3.to(tl.int32) + n4.to(tl.int32)
            cnt_sel = ((tot >> (16 * tl.maximum(n - 1, 0)).to(tl.int64)) & 0xFFFF).to(tl.int32)
            new_lo = lo + n * step
            new_hi = tl.minimum(lo + (n + 1) * step - 1, hi)
            if (n > 0) & (cnt_sel == k):
                lo = tl.min(tl.where(bits >= new_lo, bits, 0x7FFFFFFF), axis=0)
                hi = lo
            else:
                lo = new_lo
                hi = new_hi
    else:
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.sum((bits >= mid).to(tl.int32), axis=0)
            if cnt == k:
                lo = tl.min(tl.where(bits >= mid, bits, 0x7FFFFFFF), axis=0)
                hi = lo
            elif cnt > k:
                lo = mid
            else:
                hi = mid - 1
    return lo



@triton.jit
def _act_quant_row_kernel(
    X, ROW_IDX, stride_xm, K,
    GS_IN,
    QX, SX, GX, DX,
    QR, SR, DR,
    DSUM,
    SMASK,
    k_top,
    NB: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr,
    MAIN_GS_GIVEN: tl.constexpr,
    RES_MODE: tl.constexpr,  # 0 none, 1 per-token top-k, 2 static mask, 3 every channel
    WRITE_PACKED: tl.constexpr,
    WRITE_DQ: tl.constexpr,
    WRITE_SUM: tl.constexpr,  # the summed operand fp16(main + residual) (M rows), see quantize_rows
    PACKED_SEARCH: tl.constexpr,
    FULL: tl.constexpr,  # > 0: this program quantizes blocks [c*NB, (c+1)*NB) of a row of <= FULL elements
    LAUNCH_DEPENDENTS: tl.constexpr,  # let a programmatic dependent GEMM start prefetching its weights now
    FOUR_OVER_SIX: tl.constexpr = False,  # 4over6 block scaling of the main term and the residual
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if HAS_ROW_IDX:
        src = tl.load(ROW_IDX + row).to(tl.int64)
    else:
        src = row
    blk = chunk * NB + tl.arange(0, NB)
    jj = tl.arange(0, 16)
    jj8 = tl.arange(0, 8)
    nblk = K // 16
    bmask = blk < nblk
    offs = blk[:, None] * 16 + jj[None, :]
    emask = bmask[:, None] & (jj[None, :] < 16)
    x = tl.load(X + src * stride_xm + offs, mask=emask, other=0.0).to(tl.float32)

    if MAIN_GS_GIVEN:
        s_main = tl.load(GS_IN)
    elif FULL > 0:  # a chunk of the row: every program takes the whole row's amax (one cheap pass)
        kk = tl.arange(0, FULL)
        xr = tl.load(X + src * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        s_main = global_scale(tl.max(abs_bits(xr), axis=0).to(tl.float32, bitcast=True),
                               1536.0 if FOUR_OVER_SIX else 2688.0)
    else:
        amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0).to(tl.float32, bitcast=True)
        s_main = global_scale(amax, 1536.0 if FOUR_OVER_SIX else 2688.0)
    s_vec = s_main + tl.zeros((NB,), dtype=tl.float32)
    if FOUR_OVER_SIX:
        codes, qv, neg, s_code, s_f32 = quant_blocks_4over6(x, s_vec)
    else:
        codes, qv, neg, s_code, s_f32 = quant_blocks(x, s_vec)

    q_off = row * (K // 2)
    s_off = row * (K // 16)
    if not MAIN_GS_GIVEN:
        if chunk == 0:
            tl.store(GX + row, s_main)
    if WRITE_PACKED:
        _pack_store(codes, QX, SX, s_code, q_off, s_off, blk, jj8, bmask, NB)
    if WRITE_DQ:
        u = with_sign(qv, neg) * s_f32[:, None]
        tl.store(DX + row * K + offs, u.to(tl.float16), mask=emask)

    if RES_MODE != 0:
        xh = _dequant_exact(qv, neg, s_f32, s_main)
        r = x - xh
        if RES_MODE == 1:
            mbits = tl.where(emask, abs_bits(r), -1)
            thr_bits = _topk_threshold_bits(tl.reshape(mbits, (NB * 16,)), k_top, PACKED_SEARCH)
            thr = thr_bits.to(tl.float32, bitcast=True)
            sel = (tl.abs(r) >= thr) & (k_top > 0) & emask
        elif RES_MODE == 2:
            sm = tl.load(SMASK + offs, mask=emask, other=0)
            sel = (sm != 0) & emask
        else:
            sel = emask
        rs = tl.where(sel, r, 0.0)
        # the residual shares the row's (or tensor's) global scale: its E4M3 block scales cover the
        # ~10x smaller range (measured: same error as an own global scale, docs/design.md)
        if FOUR_OVER_SIX:
            rcodes, rqv, rneg, rs_code, rs_f32 = quant_blocks_4over6(rs, s_vec)
        else:
            rcodes, rqv, rneg, rs_code, rs_f32 = quant_blocks(rs, s_vec)
        if WRITE_PACKED:
            _pack_store(rcodes, QR, SR, rs_code, q_off, s_off, blk, jj8, bmask, NB)
        if WRITE_DQ or WRITE_SUM:
            ru = with_sign(rqv, rneg) * rs_f32[:, None]
            if WRITE_DQ:
                tl.store(DR + row * K + offs, ru.to(tl.float16), mask=emask)
            if WRITE_SUM:
                # both terms are exact fp16 values (<= 6 significant bits, < 2^12): the fp32 add and
                # one rounding give the bits of fp16(f32(fp16 main) + f32(fp16 residual))
                xu = with_sign(qv, neg) * s_f32[:, None]
                tl.store(DSUM + row * K + offs, (xu + ru).to(tl.float16), mask=emask)



class QuantizedRows(NamedTuple):
    """One quantization of a set of rows (fields are None where not requested).

    ``qdata``/``scale``/``global_encode_scale`` are the NVFP4 parts (bit-exact with
    ``nvfp4_quantize``); ``operand`` is the fp16 GEMM operand ``e2m1 * f32(scale)`` (unscaled:
    exact, docs/background.md section 2).
    """

    qdata: torch.Tensor | None
    scale: torch.Tensor | None
    global_encode_scale: torch.Tensor
    operand: torch.Tensor | None

    def parts(self) -> NVFP4Parts:
        return NVFP4Parts(self.qdata, self.scale, self.global_encode_scale)


class RowQuantization(NamedTuple):
    """What :func:`quantize_rows` produced: the main quantization and the residual's (or None);
    with ``stacked=True``, also the one buffer both operands (and per-row scales) are views of."""

    main: QuantizedRows
    residual: QuantizedRows | None
    stacked_operand: torch.Tensor | None = None
    stacked_scale: torch.Tensor | None = None
    #: with ``write_sum``: fp16 (R, K) ``fp16(main + residual)`` operand (the main operand without a residual)
    summed_operand: torch.Tensor | None = None


RESIDUAL_MODES = {"none": 0, "per_token": 1, "static": 2, "all": 3}
#: top-k threshold searches (see ``_topk_threshold_bits``); "auto" picks by row count
TOPK_SEARCHES = ("auto", "binary", "packed5")


def _num_warps_for(k: int, rows: int) -> int:
    """Warps per row program: more for few rows (each row is one program, latency-bound)."""
    if k <= 1024:
        return 4
    if rows <= 64:
        return 16
    return 8 if k <= 4096 else 16


#: a row is cut into programs of this many channels when there are few rows (latency) and no
#: per-token top-k (which needs the whole row in one program)
ROW_CHUNK = 512
SPLIT_ROWS_BELOW = 65


def _row_chunks(k: int, rows: int, residual: str, granularity: str, chunk: int | None) -> int:
    if chunk is not None:
        return triton.cdiv(k, chunk)
    if rows >= SPLIT_ROWS_BELOW or residual == "per_token" or granularity != "row" or k < 2 * ROW_CHUNK:
        return 1
    return triton.cdiv(k, ROW_CHUNK)


def _packed_search(search: str, rows: int, k: int) -> bool:
    if search not in TOPK_SEARCHES:
        raise ValueError(f"topk_search must be one of {TOPK_SEARCHES}, got {search!r}")
    if k >= 65536:
        return False  # the packed search counts in 16-bit fields
    if search == "auto":
        return rows <= 256  # latency-optimal for few rows (measured, docs/kernels.md)
    return search == "packed5"



def quantize_rows(
    x2d: torch.Tensor,
    *,
    residual: str = "none",
    k_top: int = 0,
    static_mask: torch.Tensor | None = None,
    granularity: str = "row",
    write_packed: bool = True,
    write_operand: bool = False,
    row_idx: torch.Tensor | None = None,
    topk_search: str = "auto",
    num_warps: int | None = None,
    stacked: bool = False,
    row_chunk: int | None = None,
    write_sum: bool = False,
    block_scaling: str = "6",
) -> RowQuantization:
    """One pass per row: main NVFP4 quantization (+ residual compensation), see module doc.

    ``residual``: ``"none"``, ``"per_token"`` (top ``k_top`` |r| channels of each row, ties at
    the threshold included), ``"static"`` (``static_mask``, K channels) or ``"all"`` (every
    channel: no selection, the k = 100% two-level quantization). ``granularity``:
    ``"row"`` (one global scale per row) or ``"tensor"``. ``row_idx`` (optional int (R,)):
    quantize ``x2d[row_idx]`` without materializing it. ``topk_search``/``num_warps``: kernel
    choices (benchmarks sweep them; the defaults are the measured best); ``row_chunk``: channels
    per program (each program then also reads the whole row for its amax; default: whole rows,
    or ``ROW_CHUNK`` for fewer than ``SPLIT_ROWS_BELOW`` rows without top-k). ``stacked``: with
    ``write_operand`` and a per-row residual, the main and residual operands (and per-row global
    scales) are views of one buffer of ``2R`` rows, main rows first: the decode GEMM's operand.
    ``write_sum``: also (or, without ``write_operand``, only) the *summed* operand
    ``fp16(main + residual)`` (R, K) in the same pass: both terms are exact fp16 values, so it has
    the bits of an fp32 add of the two fp16 operands and one rounding (relative error <= 2^-11 of
    the sum). Without a residual it is the main operand itself. ``block_scaling``: ``"6"`` or
    ``"4over6"`` (main term and residual; :data:`~quads.tensor.nvfp4_math.BLOCK_SCALINGS`).
    """
    four_over_six = check_block_scaling(block_scaling) == "4over6"
    if x2d.dim() != 2 or x2d.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"quantize_rows expects (M, K) with K % 16 == 0, got {tuple(x2d.shape)}")
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"residual must be one of {tuple(RESIDUAL_MODES)}, got {residual!r}")
    if granularity not in ("row", "tensor"):
        raise ValueError(f"granularity must be 'row' or 'tensor', got {granularity!r}")
    x2d = interpreter_safe_input(x2d)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    k = x2d.shape[1]
    n_rows = x2d.shape[0] if row_idx is None else row_idx.shape[0]
    dev = x2d.device
    res_mode = RESIDUAL_MODES[residual]
    f32 = dict(dtype=torch.float32, device=dev)

    def u8(*shape):
        return torch.empty(shape, dtype=torch.uint8, device=dev)

    def f16(*shape):
        return torch.empty(shape, dtype=torch.float16, device=dev)

    if write_sum and res_mode == 0:
        write_operand = True  # the summed operand of a plain W4A4 row is its main operand
    stack = stacked and write_operand and res_mode != 0
    dsum = f16(n_rows, k) if write_sum and res_mode != 0 else None
    if granularity == "tensor":
        src = x2d if row_idx is None else x2d[row_idx.long()]
        amax = amax_rows(src).amax() if n_rows else torch.zeros((), **f32)
        s_main = global_encode_scale_from_amax(amax, block_scaling).reshape(1).contiguous()
        gx = s_main.reshape(())
    else:
        s_main = None
        gx = torch.empty(n_rows, **f32)
    qx, sx = (u8(n_rows, k // 2), u8(n_rows, k // 16)) if write_packed else (None, None)
    d_all = f16(2 * n_rows if stack else n_rows, k) if write_operand else None
    dx = None if d_all is None else d_all[:n_rows]
    qr = sr = dr = None
    if res_mode != 0:
        if write_packed:
            qr, sr = u8(n_rows, k // 2), u8(n_rows, k // 16)
        if write_operand:
            dr = d_all[n_rows:] if stack else f16(n_rows, k)
    smask = None
    if res_mode == 2:
        if static_mask is None:
            raise ValueError("residual='static' needs a static_mask")
        smask = static_mask.reshape(-1).to(device=dev, dtype=torch.uint8).contiguous()
        if smask.numel() != k:
            raise ValueError(f"static mask has {smask.numel()} channels, K={k}")

    if n_rows > 0:
        dummy = gx if gx.numel() else torch.zeros(1, **f32)
        d = lambda t: t if t is not None else dummy  # noqa: E731
        ridx = row_idx.contiguous() if row_idx is not None else None
        chunks = _row_chunks(k, n_rows, residual, granularity, row_chunk)
        if chunks > 1 and residual == "per_token":
            raise ValueError("per-token top-k needs whole rows (row_chunk=None)")
        nb = triton.next_power_of_2(max(triton.cdiv(k // 16, chunks), 1))
        _act_quant_row_kernel[(n_rows, chunks)](
            x2d, d(ridx), x2d.stride(0), k,
            d(s_main),
            d(qx), d(sx), d(gx), d(dx),
            d(qr), d(sr), d(dr),
            d(dsum),
            d(smask),
            int(k_top),
            NB=nb,
            FULL=triton.next_power_of_2(k) if chunks > 1 else 0,
            HAS_ROW_IDX=ridx is not None,
            MAIN_GS_GIVEN=s_main is not None,
            RES_MODE=res_mode,
            WRITE_PACKED=write_packed,
            WRITE_DQ=write_operand,
            WRITE_SUM=dsum is not None,
            PACKED_SEARCH=_packed_search(topk_search, n_rows, k),
            LAUNCH_DEPENDENTS=not interpreting(),
            FOUR_OVER_SIX=four_over_six,
            num_warps=num_warps or (max(4, min(16, triton.next_power_of_2(k) // 1024)) if chunks > 1
                                    else _num_warps_for(k, n_rows)),
            **no_fp_fusion(four_over_six),
        )
    e4m3 = lambda t: None if t is None else t.view(torch.float8_e4m3fn)  # noqa: E731
    main = QuantizedRows(qx, e4m3(sx), gx, dx)
    if res_mode == 0:
        return RowQuantization(main, None, summed_operand=dx if write_sum else None)
    residual_rows = QuantizedRows(qr, e4m3(sr), gx, dr)  # the residual shares the global scale
    if stack:
        return RowQuantization(main, residual_rows, d_all, gx, dsum)
    return RowQuantization(main, residual_rows, summed_operand=dsum)
