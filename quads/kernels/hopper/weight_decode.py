"""The in-register decode of the Hopper weight layout (:mod:`quads.kernels.hopper.weight_layout`),
called inside the GEMM kernels.

A lane word holds one thread's codes of one k16 tile; a handful of bit operations turn it into
the thread's four fp16x2 wgmma A-fragment registers (:data:`DECODE_PTX`):

* R0 = a01 = ``w & 0x8E008E00`` (magnitude bits at 9-11, sign at 15, per 16-bit half);
* R1 = a23 = ``(w << 8) & 0x8E008E00``;
* R2 = a45 = ``((w << 5) & 0x0E000E00) | ((w << 15) & 0x80008000)``;
* R3 = a67 = ``((w >> 3) & 0x0E000E00) | ((w << 7) & 0x80008000)``.

An fp16 with the E2M1 magnitude bits at 9-11 is ``e2m1 * 2^-14`` (0.5 lands on the subnormal
2^-15); times the block scale (E4M3 -> fp16 by ``cvt.rn.f16x2.e4m3x2``, exact) it is the MMA
operand ``e2m1 * s * 2^-14``: a multiple of 2^-24 below 0.17, exact in fp16 (docs/background.md
section 2). Every GEMM in this package multiplies that operand and scales the fp32 sum by 2^14
in its epilogue. :func:`load_weight_tile` loads and decodes one (BN, 64) tile straight into the
dot-operand layout (checked in the TTGIR: no layout conversion, no shared memory for the weight).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["DECODE_PTX", "load_weight_tile", "load_weight_raw", "decode_weight_raw", "decode_words"]


DECODE_PTX = tl.constexpr("""
{
.reg .b32 t1, t2, t3, t4, u, s01, s23;
.reg .b16 slo, shi;
mov.b32 {slo, shi}, $5;
cvt.rn.f16x2.e4m3x2 s01, slo;
cvt.rn.f16x2.e4m3x2 s23, shi;
and.b32 t1, $4, 0x8E008E00;
mul.rn.f16x2 $0, t1, s01;
shl.b32 t2, $4, 8;
and.b32 t2, t2, 0x8E008E00;
mul.rn.f16x2 $1, t2, s23;
shl.b32 t3, $4, 5;
and.b32 t3, t3, 0x0E000E00;
shl.b32 u, $4, 15;
and.b32 u, u, 0x80008000;
or.b32 t3, t3, u;
mul.rn.f16x2 $2, t3, s01;
shr.b32 t4, $4, 3;
and.b32 t4, t4, 0x0E000E00;
shl.b32 u, $4, 7;
and.b32 u, u, 0x80008000;
or.b32 t4, t4, u;
mul.rn.f16x2 $3, t4, s23;
}
""")


@triton.jit
def _e4m3_to_f16(code):
    """E4M3 byte (int32 0..255, scales are >= 0) -> fp16 value (exact)."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    val = tl.where((code & 0x7F) == 0x7F, float("nan"), val)
    return val.to(tl.float16)


@triton.jit
def _half(bits):
    """uint32 holding a 16-bit pattern in its low half -> fp16."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _decode_words_plain(raw, sc, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Portable twin of DECODE_PTX (the interpreter cannot run PTX): same bits."""
    R: tl.constexpr = ROWS * COLS // 16
    b = tl.reshape(raw.to(tl.uint32), (R, 4, 4))
    sh = (tl.arange(0, 4) * 8).to(tl.uint32)
    w = tl.sum(b << sh[None, None, :], axis=2)  # (R, 4) uint32 words (bytes do not overlap: sum = or)
    s = tl.reshape(sc.to(tl.int32), (R, 4, 4))
    s_lo = _e4m3_to_f16(tl.sum(tl.where(sh[None, None, :] == 0, s, 0), axis=2))  # byte 0: row g
    s_hi = _e4m3_to_f16(tl.sum(tl.where(sh[None, None, :] == 16, s, 0), axis=2))  # byte 2: row g+8
    m_full = tl.full((), 0x8E008E00, tl.uint32)
    m_mag = tl.full((), 0x0E000E00, tl.uint32)
    m_sign = tl.full((), 0x80008000, tl.uint32)
    r0 = w & m_full
    r1 = (w << 8) & m_full
    r2 = ((w << 5) & m_mag) | ((w << 15) & m_sign)
    r3 = ((w >> 3) & m_mag) | ((w << 7) & m_sign)
    # join's new dim is the minor one: join(join(a, c), join(b, d)) flattens to a, b, c, d
    lo = tl.join(tl.join(_half(r0) * s_lo, _half(r1) * s_hi), tl.join(_half(r0 >> 16) * s_lo, _half(r1 >> 16) * s_hi))
    hi = tl.join(tl.join(_half(r2) * s_lo, _half(r3) * s_hi), tl.join(_half(r2 >> 16) * s_lo, _half(r3 >> 16) * s_hi))
    return tl.reshape(lo, (ROWS, COLS)), tl.reshape(hi, (ROWS, COLS))


@triton.jit
def decode_words(raw, sc, ROWS: tl.constexpr, COLS: tl.constexpr, USE_ASM: tl.constexpr):
    """Decode (ROWS, COLS) layout bytes (COLS a multiple of 16: whole words per thread) with their
    scale bytes (per word: the scale of row g, g, g+8, g+8) into two fp16 (ROWS, COLS) tensors:
    the k+0 registers (a01, a23) and the k+8 ones (a45, a67), elements ``e2m1 * s * 2^-14``."""
    if USE_ASM:
        o0, o1 = tl.inline_asm_elementwise(DECODE_PTX, "=r,=r,=r,=r,r,r", [raw, sc],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        o0, o1 = _decode_words_plain(raw, sc, ROWS, COLS)
    return o0, o1


@triton.jit
def load_weight_raw(VALS, SCALES, rb0, kb0, num_kb, BN: tl.constexpr, KBI: tl.constexpr, num_rb=None):
    """Issue the loads of a (BN, 64*KBI) weight tile (16-byte value loads, 8-byte scale loads per
    thread); :func:`decode_weight_raw` turns them into the MMA operand. Split in two so a kernel
    can have the next tile's loads in flight while it decodes and multiplies the current one.
    ``num_rb`` (row blocks stored): when given, row blocks past it read as zero (a tile of BN
    rows may overhang the 64-row padding)."""
    W: tl.constexpr = BN // 16
    i = tl.arange(0, W * 32)
    q = tl.arange(0, KBI)
    rb = (rb0 + i // 32).to(tl.int64)
    lane = i % 32
    blk = (rb * num_kb + kb0)[:, None] + q[None, :]  # (W*32, KBI) block index
    live = ((kb0 + q) < num_kb)[None, :, None]  # blocks past K (KBI not dividing it) read as zero
    if num_rb is not None:
        live = live & (rb < num_rb)[:, None, None]
    raw = tl.load(VALS + (blk * 512 + (lane * 16)[:, None])[:, :, None] + tl.arange(0, 16)[None, None, :],
                  mask=live, other=0)
    s8 = tl.load(SCALES + (blk * 64 + ((lane // 4) * 8)[:, None])[:, :, None] + tl.arange(0, 8)[None, None, :],
                 mask=live, other=0)
    return raw, s8


@triton.jit
def decode_weight_raw(raw, s8, BN: tl.constexpr, KBI: tl.constexpr, USE_ASM: tl.constexpr):
    """The loads of :func:`load_weight_raw` -> fp16 (BN, 64*KBI) ``e2m1 * s * 2^-14`` in the wgmma
    register-operand layout (checked in the TTGIR: no layout conversion, no shared memory)."""
    W: tl.constexpr = BN // 16
    # per word t: [s(g), s(g), s(g+8), s(g+8)] (the scale of each fp16 pair's row)
    s16 = tl.reshape(tl.broadcast_to(tl.reshape(s8, (W * 32, KBI, 4, 2, 1)), (W * 32, KBI, 4, 2, 2)),
                     (W * 32, KBI * 16))
    o0, o1 = decode_words(tl.reshape(raw, (W * 32, KBI * 16)), s16, W * 32, KBI * 16, USE_ASM)
    # (i = w*32 + 4g + c, j = q*16 + 4t + 2br + h, o) -> (n = w*16 + br*8 + g, k = q*64 + t*16 + o*8 + c*2 + h)
    x = tl.reshape(tl.join(o0, o1), (W, 8, 4, KBI, 4, 2, 2, 2))  # w, g, c, q, t, br, h, o
    x = tl.permute(x, (0, 5, 1, 3, 4, 7, 2, 6))  # w, br, g, q, t, o, c, h
    return tl.reshape(x, (BN, KBI * 64))


@triton.jit
def load_weight_tile(VALS, SCALES, rb0, kb0, num_kb, BN: tl.constexpr, KBI: tl.constexpr, USE_ASM: tl.constexpr,
                     num_rb=None):
    """The (BN, 64*KBI) fp16 weight tile of row blocks ``rb0 .. rb0 + BN/16`` and k blocks
    ``kb0 .. kb0 + KBI``, decoded (``e2m1 * s * 2^-14``) into the wgmma register-operand layout.
    All its loads are issued before any decode (KBI 16-byte loads in flight per thread).
    ``num_rb``: see :func:`load_weight_raw`."""
    raw, s8 = load_weight_raw(VALS, SCALES, rb0, kb0, num_kb, BN, KBI, num_rb)
    return decode_weight_raw(raw, s8, BN, KBI, USE_ASM)
