"""Triton device functions shared by the NVFP4 quantization kernels, bit-exact with
:mod:`quads.tensor.nvfp4_math` (all float32, as the recipe):

* every division is ``tl.math.div_rn`` (IEEE round-to-nearest), never the approximate ``/``;
* the E4M3 cast (round-to-nearest-even, subnormals, NaN) is done with integer arithmetic, so it
  does not depend on the Triton version's fp8 conversion;
* clamps are written as ``where(v > hi, hi, v)`` so NaN propagates like ``torch.clamp``
  (``tl.minimum`` would drop NaN on the GPU);
* amax is a max over ``|x|`` bit patterns: for non-negative floats the integer order is the
  float order and every NaN pattern sorts above +inf, so NaN propagates like ``torch.amax``;
* the sign nibble of an element whose scaled value is NaN is platform-defined in the reference
  too (x86 propagates the NaN operand's sign, CUDA returns a canonical NaN); dequantization gives
  NaN either way;
* ``DQ = (e2m1 * s) / S_enc`` is computed as ``2^e * div_rn(f * s, S_enc)`` with ``e2m1 = 2^e * f``,
  ``f in {1, 1.5}``: exact because scaling by a power of two commutes with rounding while the
  results stay normal; rows where a result could be subnormal take the per-element ``div_rn``
  (:mod:`quads.kernels.quantize_activations`);
* Four Over Six block scaling (:func:`quant_blocks_4over6`) compares float32 sums of squared
  errors, whose bits depend on every rounding: it sums in the reference's pairwise order and its
  kernels launch with :func:`no_fp_fusion` (no FMA contraction); the other paths' results do
  not depend on contraction.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["abs_bits", "with_sign", "e4m3_encode", "e4m3_decode", "global_scale", "e2m1_mag_code", "quant_blocks",
           "quant_blocks_4over6", "squared", "pairwise_block_sum", "no_fp_fusion"]


@triton.jit
def abs_bits(v):
    """|v| as int32 bit pattern (non-negative; NaN patterns sort above +inf)."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def with_sign(mag, neg):
    """Set the sign bit of ``mag`` (>= 0) where ``neg``: bit operation, so -0.0 is kept (a float
    negation may be lowered as ``0 - x``, which turns -0.0 into +0.0)."""
    b = mag.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_encode(v):
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
def e4m3_decode(code):
    """E4M3 byte (int32 0..255) -> float32 value (exact)."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    val = tl.where(e == 0, sub, normal)
    val = tl.where((code & 0x7F) == 0x7F, float("nan"), val)
    return with_sign(val, (code & 0x80) != 0)


@triton.jit
def global_scale(amax, NUMERATOR: tl.constexpr = 2688.0):
    """S_enc = 2688 / amax (1536 / amax under 4over6), clamped to FLT_MAX; 1 where amax == 0 or
    S_enc == 0 (NaN stays)."""
    s = tl.math.div_rn(NUMERATOR + tl.zeros_like(amax), amax)
    s = tl.where(s > 3.4028234663852886e38, 3.4028234663852886e38, s)
    return tl.where((amax == 0.0) | (s == 0.0), 1.0, s)


@triton.jit
def e2m1_mag_code(a):
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
def quant_blocks(x, s_enc):
    """Quantize blocks ``x`` (B, 16) float32 with per-block global scale ``s_enc`` (B,), each
    block's max mapped to 6 (the recipe's ``S_enc * f32(1/6)``).

    Returns (codes (B,16) int32 with sign bit 8, magnitude value qv (B,16) fp32 (unsigned),
    negative mask (B,16), scale byte (B,) int32, f32(scale) (B,)).
    """
    return _quant_blocks_to(x, s_enc, 0.1666666716337204)


@triton.jit
def quant_blocks_4over6(x, s_enc):
    """``quant_blocks`` with Four Over Six block scaling (nvfp4_math, ``block_scaling="4over6"``):
    each block quantized with its max mapped to 6 and to 4, keeping the candidate of smaller
    squared error (``block_squared_error``'s units and pairwise order; a tie keeps 6). Bit-exact
    with the reference only without FMA contraction: launch with ``enable_fp_fusion=False``."""
    codes, qv, neg, s_code, s_f32 = _quant_blocks_to(x, s_enc, 0.1666666716337204)
    codes4, qv4, neg4, s_code4, s_f32_4 = _quant_blocks_to(x, s_enc, 0.25)
    target = x * s_enc[:, None]
    err6 = pairwise_block_sum(squared(with_sign(qv, neg) * s_f32[:, None] - target))
    err4 = pairwise_block_sum(squared(with_sign(qv4, neg4) * s_f32_4[:, None] - target))
    pick4 = err4 < err6
    p2 = pick4[:, None]
    return (tl.where(p2, codes4, codes), tl.where(p2, qv4, qv), tl.where(p2, neg4, neg),
            tl.where(pick4, s_code4, s_code), tl.where(pick4, s_f32_4, s_f32))


@triton.jit
def squared(d):
    return d * d


@triton.jit
def pairwise_block_sum(e):
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
    """``quant_blocks`` with each block's max mapped to ``1 / INV_MAX`` (6 or 4)."""
    blk_amax = tl.max(abs_bits(x), axis=1).to(tl.float32, bitcast=True)
    t = s_enc * INV_MAX
    sc = blk_amax * t
    sc = tl.where(sc > 448.0, 448.0, sc)
    s_code = e4m3_encode(sc)
    s_f32 = e4m3_decode(s_code)
    decode_scale = s_f32 * tl.math.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)
    enc = tl.math.div_rn(1.0 + tl.zeros_like(decode_scale), decode_scale)
    enc = tl.where(enc > 3.4028234663852886e38, 3.4028234663852886e38, enc)
    v = x * enc[:, None]
    v = tl.where(v > 6.0, 6.0, v)
    v = tl.where(v < -6.0, -6.0, v)
    a = tl.abs(v)
    mag = e2m1_mag_code(a)
    neg = v.to(tl.int32, bitcast=True) < 0
    codes = mag | tl.where(neg, 8, 0)
    qv = tl.where(mag < 4, mag.to(tl.float32) * 0.5, tl.where(mag < 7, mag.to(tl.float32) - 2.0, 6.0))
    return codes, qv, neg, s_code, s_f32


def no_fp_fusion(four_over_six: bool) -> dict:
    """Launch options of a 4over6 kernel: no FMA contraction (``a * b + c`` kept as two roundings),
    since its error comparison must round as the reference does; the standard path keeps the
    default (its results do not depend on contraction, see the module doc)."""
    return {"enable_fp_fusion": False} if four_over_six else {}

