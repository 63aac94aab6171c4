"""An independent, scalar (numpy float32) implementation of the NVFP4 recipe for tests.

It shares no code with quads: E4M3 rounding is a nearest search over all finite E4M3 values
(built from bit patterns) with ties to the even code, E2M1 rounding a nearest search over the
8 magnitudes with ties to the even code. Slow; use on small tensors only.
"""

import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _e4m3_values():
    vals = []
    for code in range(0x7F):  # 0x7F is NaN in e4m3fn
        e, m = code >> 3, code & 7
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append((v, code))
    return vals


E4M3 = _e4m3_values()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def round_e4m3(v: float) -> float:
    """RNE of a non-negative float32 (<= 448) to e4m3fn."""
    best = None
    for val, code in E4M3:
        d = abs(val - v)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, val, code)
    return best[1]


def round_e2m1(v: float) -> tuple[int, float]:
    """RNE of |v| <= 6 to an E2M1 magnitude code."""
    a = abs(v)
    best = None
    for code, val in enumerate(E2M1):
        d = abs(val - a)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, code)
    return best[1]


def _encode_block(blk: np.ndarray, s_enc: np.float32, inv_max: np.float32):
    """(E2M1 codes, f32 block scale, e2m1 * s per element) of one block, its max mapped to 1/inv_max."""
    bamax = F32(np.max(np.abs(blk)))
    s = F32(min(F32(bamax * F32(s_enc * inv_max)), F32(448.0)))
    s = F32(round_e4m3(float(s)))
    dec = F32(s * F32(F32(1.0) / s_enc))
    enc = F32(min(F32(1.0) / dec, FLT_MAX)) if dec != 0 else FLT_MAX
    codes, unscaled = [], []
    for v in blk:
        sv = F32(min(max(F32(v * enc), F32(-6.0)), F32(6.0)))
        mag = round_e2m1(float(sv))
        sign = 8 if np.signbit(v) else 0
        codes.append(mag | sign)
        val = F32(-E2M1[mag]) if sign else F32(E2M1[mag])
        unscaled.append(F32(val * s))
    return codes, s, unscaled


def pairwise_squared_error(unscaled, blk, s_enc) -> np.float32:
    """Sum over 16 values of (e2m1 * s - x * S_enc)^2, (0,1), (2,3), ... first, then the pair
    sums, in float32."""
    e = []
    for u, v in zip(unscaled, blk):
        d = F32(F32(u) - F32(F32(v) * s_enc))
        e.append(F32(d * d))
    while len(e) > 1:
        e = [F32(e[i] + e[i + 1]) for i in range(0, len(e), 2)]
    return e[0]


def quantize_row_groups(x: np.ndarray, s_enc: np.float32, block_scaling: str = "6"):
    """Quantize a 1-D float32 array (len multiple of 16) with encode scale s_enc.

    ``block_scaling="4over6"``: each block also maps its max to 4 and keeps that candidate when its
    pairwise-summed squared error is strictly smaller. Returns (codes int list, scales float list)."""
    codes, scales = [], []
    one_sixth = F32(1.0) / F32(6.0)
    for b in range(0, len(x), 16):
        blk = x[b : b + 16].astype(np.float32)
        c, s, unscaled = _encode_block(blk, s_enc, one_sixth)
        if block_scaling == "4over6":
            c4, s4, unscaled4 = _encode_block(blk, s_enc, F32(0.25))
            if pairwise_squared_error(unscaled4, blk, s_enc) < pairwise_squared_error(unscaled, blk, s_enc):
                c, s = c4, s4
        scales.append(float(s))
        codes.extend(c)
    return codes, scales


def global_encode_scale(amax: float, block_scaling: str = "6") -> np.float32:
    if amax == 0:
        return F32(1.0)
    s = F32(F32(2688.0 if block_scaling == "6" else 1536.0) / F32(amax))
    s = F32(min(s, FLT_MAX))
    return F32(1.0) if s == 0 else s
