"""NVFP4 quantization kernels (Triton), bit-exact with :mod:`quads.tensor.nvfp4_math`.

Two kernels:

* ``_act_quant_row_kernel``: one program per activation row. The whole row lives in registers,
  so the per-row global scale (``granularity="row"``), the main quantization, the residual
  ``r = x - DQ(Q(x))``, the per-token top-k selection of ``|r|`` (exact, ties included) and the
  residual's quantization (with the same global scale) are one pass over ``x``. Outputs: the packed NVFP4 parts (bit-exact
  with the reference) and/or the *unscaled* dequantized values ``e2m1 * f32(scale)`` in fp16
  (exact, see docs/background.md section 2), which is what the GEMM kernels consume.
* ``_quant_given_scale_kernel``: tiles of a 2-D tensor quantized with a given per-row-group global
  scale (weights: ``"tensor"``/``"expert"`` granularity). The global amax comes from ``_amax_rows_kernel`` (max of |x| bit patterns, which
  is exact, order-independent and NaN-propagating), and ``S_enc`` from the reference function.

Bit-exactness notes (all float32, as the recipe):

* every division is ``tl.math.div_rn`` (IEEE round-to-nearest), never the approximate ``/``;
* the E4M3 cast (round-to-nearest-even, subnormals, NaN) is done with integer arithmetic, so it
  does not depend on the Triton version's fp8 conversion;
* clamps are written as ``where(v > hi, hi, v)`` so NaN propagates like ``torch.clamp``
  (``tl.minimum`` would drop NaN on the GPU);
* amax is a max over ``|x|`` bit patterns: for non-negative floats the integer order is the
  float order and every NaN pattern sorts above +inf, so NaN propagates like ``torch.amax``;
* the sign nibble of an element whose scaled value is NaN is platform-defined in the reference
  too (x86 propagates the NaN operand's sign, CUDA returns a canonical NaN); dequantization gives
  NaN either way.
* ``DQ = (e2m1 * s) / S_enc`` is computed as ``2^e * div_rn(f * s, S_enc)`` with ``e2m1 = 2^e * f``,
  ``f in {1, 1.5}``: exact because scaling by a power of two commutes with rounding while the
  results stay normal; rows where a result could be subnormal take the per-element ``div_rn``;
* the Four Over Six branches (``FOUR_OVER_SIX``, ``_quant_blocks_4over6``) of both kernels
  compares float32 sums of squared errors, whose bits depend on every rounding: it sums in the
  reference's pairwise order and is launched with ``enable_fp_fusion=False`` (no FMA
  contraction); the other paths' results do not depend on contraction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from quads.kernels._interpreter import interpreter_safe_input, interpreting
from quads.tensor.nvfp4_math import BLOCK_SIZE, NVFP4Parts, check_block_scaling, global_encode_scale_from_amax

__all__ = [
    "QuantizedRows",
    "RowQuantization",
    "TOPK_SEARCHES",
    "quantize_rows",
    "quantize_given_scale",
    "amax_rows",
]

# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _abs_bits(v):
    """|v| as int32 bit pattern (non-negative; NaN patterns sort above +inf)."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _with_sign(mag, neg):
    """Set the sign bit of ``mag`` (>= 0) where ``neg``: bit operation, so -0.0 is kept (a float
    negation may be lowered as ``0 - x``, which turns -0.0 into +0.0)."""
    b = mag.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(v):
    """float32 v (>= 0 or NaN, already clamped to <= 448) -> E4M3 byte (int32), RNE, like torch."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal range [2^-6, 448]: drop 20 mantissa bits with round-to-nearest-even
    rn = a + 0x7FFFF + ((a >> 20) & 1)
    normal_code = (rn >> 20) - (120 << 3)
    # subnormal range: round v * 2^9 to an integer (0..8), ties to even
    exp = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(141 - exp, 25)
    q = mant >> sh
    rem = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    code = tl.where(a < 0x3C800000, q, normal_code)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def _e4m3_decode(code):
    """E4M3 byte (int32 0..255) -> float32 value (exact)."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    val = tl.where(e == 0, sub, normal)
    val = tl.where((code & 0x7F) == 0x7F, float("nan"), val)
    return _with_sign(val, (code & 0x80) != 0)


@triton.jit
def _global_scale(amax, NUMERATOR: tl.constexpr = 2688.0):
    """S_enc = 2688 / amax (1536 / amax under 4over6), clamped to FLT_MAX; 1 where amax == 0 or
    S_enc == 0 (NaN stays)."""
    s = tl.math.div_rn(NUMERATOR + tl.zeros_like(amax), amax)
    s = tl.where(s > 3.4028234663852886e38, 3.4028234663852886e38, s)
    return tl.where((amax == 0.0) | (s == 0.0), 1.0, s)


@triton.jit
def _e2m1_mag_code(a):
    """|v| in [0, 6] (or NaN) -> E2M1 magnitude index 0..7, round to nearest even, NaN -> 0.

    The E2M1 grid has spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]: the index is
    ``rne(a * f) + o`` with (f, o) = (2, 0), (1, 2), (0.5, 4). ``rne`` by the 2^23 trick: for
    0 <= t <= 4, ``t + 2^23`` rounds t to an integer (ties to even) in the low mantissa bits
    (a * f is exact, so an FMA contraction gives the same bits). Same results as the
    reference's threshold ladder (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4): checked exhaustively against it in tests/kernels.
    """
    f = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    o = tl.where(a < 2.0, 0, tl.where(a < 4.0, 2, 4))
    t = a * f + 8388608.0
    m = (t.to(tl.int32, bitcast=True) - 0x4B000000) + o
    return tl.where(a == a, m, 0)


@triton.jit
def _quant_blocks(x, s_enc):
    """Quantize blocks ``x`` (B, 16) float32 with per-block global scale ``s_enc`` (B,), each
    block's max mapped to 6 (the recipe's ``S_enc * f32(1/6)``).

    Returns (codes (B,16) int32 with sign bit 8, magnitude value qv (B,16) fp32 (unsigned),
    negative mask (B,16), scale byte (B,) int32, f32(scale) (B,)).
    """
    return _quant_blocks_to(x, s_enc, 0.1666666716337204)


@triton.jit
def _quant_blocks_4over6(x, s_enc):
    """``_quant_blocks`` with Four Over Six block scaling (nvfp4_math, ``block_scaling="4over6"``):
    each block quantized with its max mapped to 6 and to 4, keeping the candidate of smaller
    squared error (``block_squared_error``'s units and pairwise order; a tie keeps 6). Bit-exact
    with the reference only without FMA contraction: launch with ``enable_fp_fusion=False``."""
    codes, qv, neg, s_code, s_f32 = _quant_blocks_to(x, s_enc, 0.1666666716337204)
    codes4, qv4, neg4, s_code4, s_f32_4 = _quant_blocks_to(x, s_enc, 0.25)
    target = x * s_enc[:, None]
    err6 = _pairwise_block_sum(_squared(_with_sign(qv, neg) * s_f32[:, None] - target))
    err4 = _pairwise_block_sum(_squared(_with_sign(qv4, neg4) * s_f32_4[:, None] - target))
    pick4 = err4 < err6
    p2 = pick4[:, None]
    return (tl.where(p2, codes4, codes), tl.where(p2, qv4, qv), tl.where(p2, neg4, neg),
            tl.where(pick4, s_code4, s_code), tl.where(pick4, s_f32_4, s_f32))


@triton.jit
def _squared(d):
    return d * d


@triton.jit
def _pairwise_block_sum(e):
    """Per row of ``e`` (B, 16): ((e0 + e1) + (e2 + e3)) + ... , the reference's fixed order."""
    b: tl.constexpr = e.shape[0]
    lo, hi = tl.split(tl.reshape(e, (b, 8, 2)))
    e = lo + hi
    lo, hi = tl.split(tl.reshape(e, (b, 4, 2)))
    e = lo + hi
    lo, hi = tl.split(tl.reshape(e, (b, 2, 2)))
    e = lo + hi
    lo, hi = tl.split(e)
    return lo + hi


@triton.jit
def _quant_blocks_to(x, s_enc, INV_MAX: tl.constexpr):
    """``_quant_blocks`` with each block's max mapped to ``1 / INV_MAX`` (6 or 4)."""
    blk_amax = tl.max(_abs_bits(x), axis=1).to(tl.float32, bitcast=True)
    t = s_enc * INV_MAX
    sc = blk_amax * t
    sc = tl.where(sc > 448.0, 448.0, sc)
    s_code = _e4m3_encode(sc)
    s_f32 = _e4m3_decode(s_code)
    decode_scale = s_f32 * tl.math.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)
    enc = tl.math.div_rn(1.0 + tl.zeros_like(decode_scale), decode_scale)
    enc = tl.where(enc > 3.4028234663852886e38, 3.4028234663852886e38, enc)
    v = x * enc[:, None]
    v = tl.where(v > 6.0, 6.0, v)
    v = tl.where(v < -6.0, -6.0, v)
    a = tl.abs(v)
    mag = _e2m1_mag_code(a)
    neg = v.to(tl.int32, bitcast=True) < 0
    codes = mag | tl.where(neg, 8, 0)
    qv = tl.where(mag < 4, mag.to(tl.float32) * 0.5, tl.where(mag < 7, mag.to(tl.float32) - 2.0, 6.0))
    return codes, qv, neg, s_code, s_f32


@triton.jit
def _dequant_blocks(qv, neg, s_f32, s_enc, FAST: tl.constexpr):
    """(±qv * s) / S_enc in float32, exactly as the reference (see module doc)."""
    if FAST:
        q1 = tl.math.div_rn(s_f32, s_enc)
        q3 = tl.math.div_rn(s_f32 * 1.5, s_enc)
        qb = qv.to(tl.int32, bitcast=True)
        pow2 = (qb & 0x7F800000).to(tl.float32, bitcast=True)  # 2^e (0 for qv == 0)
        f = tl.where((qb & 0x00400000) != 0, q3[:, None], q1[:, None])
        mag = f * pow2
    else:
        mag = tl.math.div_rn(qv * s_f32[:, None], s_enc[:, None] + tl.zeros_like(qv))
    return _with_sign(mag, neg)


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


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


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
        s_main = _global_scale(tl.max(_abs_bits(xr), axis=0).to(tl.float32, bitcast=True),
                               1536.0 if FOUR_OVER_SIX else 2688.0)
    else:
        amax = tl.max(tl.max(_abs_bits(x), axis=1), axis=0).to(tl.float32, bitcast=True)
        s_main = _global_scale(amax, 1536.0 if FOUR_OVER_SIX else 2688.0)
    s_vec = s_main + tl.zeros((NB,), dtype=tl.float32)
    if FOUR_OVER_SIX:
        codes, qv, neg, s_code, s_f32 = _quant_blocks_4over6(x, s_vec)
    else:
        codes, qv, neg, s_code, s_f32 = _quant_blocks(x, s_vec)

    q_off = row * (K // 2)
    s_off = row * (K // 16)
    if not MAIN_GS_GIVEN:
        if chunk == 0:
            tl.store(GX + row, s_main)
    if WRITE_PACKED:
        _pack_store(codes, QX, SX, s_code, q_off, s_off, blk, jj8, bmask, NB)
    if WRITE_DQ:
        u = _with_sign(qv, neg) * s_f32[:, None]
        tl.store(DX + row * K + offs, u.to(tl.float16), mask=emask)

    if RES_MODE != 0:
        xh = _dequant_exact(qv, neg, s_f32, s_main)
        r = x - xh
        if RES_MODE == 1:
            mbits = tl.where(emask, _abs_bits(r), -1)
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
            rcodes, rqv, rneg, rs_code, rs_f32 = _quant_blocks_4over6(rs, s_vec)
        else:
            rcodes, rqv, rneg, rs_code, rs_f32 = _quant_blocks(rs, s_vec)
        if WRITE_PACKED:
            _pack_store(rcodes, QR, SR, rs_code, q_off, s_off, blk, jj8, bmask, NB)
        if WRITE_DQ or WRITE_SUM:
            ru = _with_sign(rqv, rneg) * rs_f32[:, None]
            if WRITE_DQ:
                tl.store(DR + row * K + offs, ru.to(tl.float16), mask=emask)
            if WRITE_SUM:
                # both terms are exact fp16 values (<= 6 significant bits, < 2^12): the fp32 add and
                # one rounding give the bits of fp16(f32(fp16 main) + f32(fp16 residual))
                xu = _with_sign(qv, neg) * s_f32[:, None]
                tl.store(DSUM + row * K + offs, (xu + ru).to(tl.float16), mask=emask)


@triton.jit
def _quant_given_scale_kernel(
    X, stride_xm, K, GS, rows_per_group,
    Q, S, D,
    n_rows,
    BR: tl.constexpr, BB: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DQ: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
):
    """Quantize a (BR rows) x (BB blocks of 16) tile with global scale GS[row // rows_per_group]
    (FOUR_OVER_SIX: each block's max to 4 or 6, see ``_quant_blocks_4over6``)."""
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)
    blks = pid_b * BB + tl.arange(0, BB)
    jj = tl.arange(0, 16)
    jj8 = tl.arange(0, 8)
    rmask = rows < n_rows
    bmask = blks < (K // 16)
    m3 = rmask[:, None, None] & bmask[None, :, None] & (jj[None, None, :] < 16)
    offs = rows[:, None, None] * stride_xm + blks[None, :, None] * 16 + jj[None, None, :]
    x = tl.load(X + offs, mask=m3, other=0.0).to(tl.float32)
    s_enc = tl.load(GS + rows // rows_per_group, mask=rmask, other=1.0)
    x2 = tl.reshape(x, (BR * BB, 16))
    s2 = tl.reshape(tl.broadcast_to(s_enc[:, None], (BR, BB)), (BR * BB,))
    if FOUR_OVER_SIX:
        codes, qv, neg, s_code, s_f32 = _quant_blocks_4over6(x2, s2)
    else:
        codes, qv, neg, s_code, s_f32 = _quant_blocks(x2, s2)
    if WRITE_PACKED:
        c3 = tl.reshape(codes, (BR, BB, 8, 2))
        lo, hi = tl.split(c3)
        byte = (lo | (hi << 4)).to(tl.uint8)
        qoffs = rows[:, None, None] * (K // 2) + blks[None, :, None] * 8 + jj8[None, None, :]
        m8 = rmask[:, None, None] & bmask[None, :, None] & (jj8[None, None, :] < 8)
        tl.store(Q + qoffs, byte, mask=m8)
        sc = tl.reshape(s_code, (BR, BB)).to(tl.uint8)
        tl.store(S + rows[:, None] * (K // 16) + blks[None, :], sc, mask=rmask[:, None] & bmask[None, :])
    if WRITE_DQ:
        u = _with_sign(qv, neg) * s_f32[:, None]
        u3 = tl.reshape(u, (BR, BB, 16))
        doffs = rows[:, None, None] * K + blks[None, :, None] * 16 + jj[None, None, :]
        tl.store(D + doffs, u3.to(tl.float16), mask=m3)


@triton.jit
def _amax_rows_kernel(X, stride_xm, K, OUT, n_rows, BR: tl.constexpr, BC: tl.constexpr):
    """OUT[row] = max |X[row, :]| (as float32; NaN if any NaN), for BR rows per program."""
    pid = tl.program_id(0)
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BC)
    rmask = rows < n_rows
    acc = tl.zeros((BR, BC), dtype=tl.int32)
    for c0 in range(0, K, BC):
        m = rmask[:, None] & ((c0 + cols)[None, :] < K)
        x = tl.load(X + rows[:, None] * stride_xm + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.store(OUT + rows, tl.max(acc, axis=1).to(tl.float32, bitcast=True), mask=rmask)


@triton.jit
def _e2m1_probe_kernel(A, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(A + offs, mask=offs < n, other=0.0)
    tl.store(OUT + offs, _e2m1_mag_code(a), mask=offs < n)


# ---------------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------------


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


def e2m1_code_probe(a: torch.Tensor) -> torch.Tensor:
    """The kernel's E2M1 magnitude index of |v| values in [0, 6] (int32), for tests."""
    a = a.float().contiguous()
    out = torch.empty(a.shape, dtype=torch.int32, device=a.device)
    _e2m1_probe_kernel[(triton.cdiv(a.numel(), 1024),)](a, out, a.numel(), BLOCK=1024)
    return out


def amax_rows(x2d: torch.Tensor) -> torch.Tensor:
    """float32 (rows,) = max |x| per row (NaN-propagating)."""
    x2d = interpreter_safe_input(x2d)
    n_rows, k = x2d.shape
    out = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    br = 32 if interpreting() else 4  # per-row results: the tile changes no bit
    bc = min(1024, triton.next_power_of_2(max(k, 16)))
    _amax_rows_kernel[(triton.cdiv(n_rows, br),)](x2d, x2d.stride(0), k, out, n_rows, BR=br, BC=bc, num_warps=4)
    return out


def quantize_given_scale(
    x2d: torch.Tensor,
    global_encode_scale: torch.Tensor,
    rows_per_group: int,
    write_packed: bool = True,
    write_operand: bool = False,
    block_scaling: str = "6",
):
    """Quantize rows of ``x2d`` (R, K) with ``S_enc = global_encode_scale[row // rows_per_group]``
    and ``block_scaling`` (``"6"`` or ``"4over6"``, :data:`~quads.tensor.nvfp4_math.BLOCK_SCALINGS`).

    Returns (qdata uint8 (R,K/2), scale uint8 (R,K/16), operand fp16 (R,K)), None where not asked.
    """
    four_over_six = check_block_scaling(block_scaling) == "4over6"
    x2d = interpreter_safe_input(x2d)
    n_rows, k = x2d.shape
    dev = x2d.device
    gs = global_encode_scale.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    q = torch.empty((n_rows, k // 2), dtype=torch.uint8, device=dev) if write_packed else None
    s = torch.empty((n_rows, k // 16), dtype=torch.uint8, device=dev) if write_packed else None
    d = torch.empty((n_rows, k), dtype=torch.float16, device=dev) if write_operand else None
    br, bb, nw = (32, 16, 4) if interpreting() else (4, 16, 4)  # interpreter: few large programs (each costs ~ms)
    bb = min(bb, triton.next_power_of_2(max(k // 16, 1)))
    grid = (triton.cdiv(n_rows, br), triton.cdiv(k // 16, bb))
    dummy = gs
    _quant_given_scale_kernel[grid](
        x2d, x2d.stride(0), k, gs, rows_per_group,
        q if q is not None else dummy, s if s is not None else dummy, d if d is not None else dummy,
        n_rows, BR=br, BB=bb, WRITE_PACKED=write_packed, WRITE_DQ=write_operand, FOUR_OVER_SIX=four_over_six,
        num_warps=nw, **_no_fp_fusion(four_over_six),
    )
    return q, s, d


def _no_fp_fusion(four_over_six: bool) -> dict:
    """Launch options of a 4over6 kernel: no FMA contraction (``a * b + c`` kept as two roundings),
    since its error comparison must round as the reference does; the standard path keeps the
    default (its results do not depend on contraction, see the module doc)."""
    return {"enable_fp_fusion": False} if four_over_six else {}


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
            **_no_fp_fusion(four_over_six),
        )
    e4m3 = lambda t: None if t is None else t.view(torch.float8_e4m3fn)  # noqa: E731
    main = QuantizedRows(qx, e4m3(sx), gx, dx)
    if res_mode == 0:
        return RowQuantization(main, None, summed_operand=dx if write_sum else None)
    residual_rows = QuantizedRows(qr, e4m3(sr), gx, dr)  # the residual shares the global scale
    if stack:
        return RowQuantization(main, residual_rows, d_all, gx, dsum)
    return RowQuantization(main, residual_rows, summed_operand=dsum)
