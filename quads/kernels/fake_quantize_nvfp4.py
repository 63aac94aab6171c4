"""Fused NVFP4 fake quantization of weights (Triton): ``DQ(Q(w))`` in one pass over the master.

The trainer's forward weight is ``nvfp4_dequantize(*nvfp4_quantize(w))`` in the compute dtype.
The torch reference runs that as a chain of float32 elementwise kernels (block amax, scale,
E4M3 round trip, encode, E2M1 rounding, decode, division), each reading and writing the whole
weight. This kernel does the same steps per tile in registers: it reads the master once and
writes the forward weight once (plus the amax pass that the global scale needs first).

Launches per call: three (a zeroed amax buffer, the amax pass with an integer ``atomic_max`` on
the ``|x|`` bit patterns, the fused pass, which derives ``S_enc`` itself), one when the global
scale is given; the launch plan in detail: docs/trainer.md.

One fused pass (``_lean_quant_blocks`` / ``_lean_dequant_blocks``): the recipe's steps (block
scale, E4M3 round trip, E2M1 rounding, the exact ``(e2m1 * s) / S_enc``) done in float
arithmetic on the values, building no E2M1 codes and no scale byte: the trainer only needs
``DQ(Q(w))``, and the rollout quantizer (:mod:`quads.kernels.nvfp4_blocks`, ``quant_blocks``)
keeps the codes. Checked bit-exact against :mod:`quads.tensor.nvfp4_math`
(tests/kernels, and natively on the H200 on every weight of both benchmark models). The
dequantization takes the fast exact path (a power-of-two split, see
:mod:`quads.kernels.nvfp4_blocks`) unless a value of the tile could be subnormal in
float32; then every element of the tile takes ``div_rn``.

Output dtypes: float32, bfloat16, float16 (the cast from the float32 result rounds to nearest
even, as ``Tensor.to`` does); under ``TRITON_INTERPRET=1`` a 16-bit output is cast on the host
(:mod:`quads.kernels._interpreter`), so the interpreter checks the same recipe bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreter_safe_input, interpreting
from quads.kernels.nvfp4_blocks import abs_bits, pairwise_block_sum, squared
from quads.tensor.nvfp4_math import BLOCK_SIZE, check_block_scaling

__all__ = ["fake_quantize_rows", "shared_amax_bits", "FAKE_QUANT_OUT_DTYPES", "TILE_ROWS", "TILE_BLOCKS", "AMAX_ROWS", "AMAX_COLS",
           "AMAX_ITERS"]

FAKE_QUANT_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: tile of one program: TILE_ROWS rows x TILE_BLOCKS blocks of 16 (the same under the interpreter).
#: 8 x 16 x 4 warps: the fastest of the H200 sweep on every benchmark shape
#: (benchmarks/ops/bench_fake_quant.py: MoE experts gate_up 1083 vs 1214 us, down 592 vs 664 us,
#: dense gate/up 89 vs 97 us against 4 x 16 x 4); the tile changes which program writes which
#: element, never an element's bits
TILE_ROWS = 8
TILE_BLOCKS = 16
_NUM_WARPS = 4
#: amax pass: a program reduces AMAX_ROWS rows x (AMAX_ITERS x AMAX_COLS) columns, then one
#: atomic per group it touches (module globals, read at each call: the benchmark sweeps them)
AMAX_ROWS = 8
AMAX_COLS = 512
AMAX_ITERS = 4
_AMAX_WARPS = 4


@triton.jit
def _fake_quant_amax_kernel(
    X, stride_xm, K, GA, rows_per_group, n_rows,
    BR: tl.constexpr, BC: tl.constexpr, ITERS: tl.constexpr, ONE_GROUP: tl.constexpr,
):
    """GA[g] = max(GA[g], max |X| bits over this program's rows of group g and its column chunk).
    ONE_GROUP: every tile's rows lie in one group (rows_per_group % BR == 0): one scalar atomic."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BC)
    rmask = rows < n_rows
    acc = tl.zeros((BR, BC), dtype=tl.int32)
    c_start = pid_c * (BC * ITERS)
    for i in tl.static_range(ITERS):
        c = c_start + i * BC + cols
        m = rmask[:, None] & (c < K)[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    if ONE_GROUP:
        tl.atomic_max(GA + (pid_r * BR) // rows_per_group, tl.max(tl.max(acc, axis=1), axis=0))
    else:
        tl.atomic_max(GA + rows // rows_per_group, tl.max(acc, axis=1), mask=rmask)


@triton.jit
def _s_enc_from_amax_bits(bits, NUMERATOR: tl.constexpr):
    """global_encode_scale_from_amax (nvfp4_math) on float32 amax bit patterns, bit for bit
    (``NUMERATOR``: 448 * 6, or 256 * 6 under 4over6)."""
    amax = bits.to(tl.float32, bitcast=True)
    s = tl.math.div_rn(tl.full(amax.shape, NUMERATOR, tl.float32), amax)
    s = tl.where(s > 3.4028234663852886e38, 3.4028234663852886e38, s)  # clamp(max=FLT_MAX), NaN kept
    return tl.where((amax == 0.0) | (s == 0.0), 1.0, s)


@triton.jit
def _lean_quant_blocks(x, s_enc, r_enc):
    """Quantization half of ``DQ(Q(x))`` of blocks ``x`` (B, 16) float32, with S_enc ``s_enc``
    (B,) and ``r_enc = div_rn(1, S_enc)`` (B,): the bits of the rollout quantizer's
    ``_quant_blocks`` + ``_dequant_blocks`` with fewer instructions (no E2M1 codes, no scale
    byte: ncu found the code-building pass ALU-bound on the H200, 82% SM vs 52% DRAM throughput).
    Returns (E2M1 magnitude value qv (B, 16), v's bits (B, 16), f32(scale) (B,),
    enc == 0 (B,)); ``_lean_dequant_blocks`` finishes.

    Exactness (for every x and every S_enc >= 0 or NaN, which includes every S_enc that
    ``global_encode_scale_from_amax`` gives; checked bit for bit in tests/kernels):

    * E2M1 rounding in float: with ``c = min(|v|, 6)`` (integer min on the bit patterns: NaN -> 6)
      and ``M = 2^22 * 2^floor(log2(max(c, 1)))`` (2^22, 2^23, 2^24 on [0, 2), [2, 4), [4, 6]),
      ``(c + M) - M`` is ``c`` rounded to a multiple of ulp(M) = 0.5, 1, 2 (the E2M1 spacing),
      ties to even (M / ulp(M) = 2^23 is even), then subtracted exactly: the E2M1 value of the
      reference ladder (0.25 -> 0, 0.75 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, >= 5 -> 6 by
      the clamp; rounding up at 2 and 4 lands on the next range's grid point, which is exact).
      ``M = mp * 2^22`` is an exact product, so an FMA contraction of ``c + mp * 2^22`` gives the
      same bits.
    * E4M3 round trip in float, the same way: ``M = 2^20 * 2^floor(log2(max(|sc|, 2^-6)))``
      (ulp(M) = the E4M3 spacing, 2^-9 below 2^-6), sign bit copied back; ``sc <= 448`` (the
      clamp) so no rounding reaches 480. RNE like torch's cast (exhaustively checked on [0, 448]).
    * Sign: the sign bit of ``v`` is OR-ed in, as ``_with_sign``.
    * NaN ``v`` (the lean path rounds it to 6, the reference to 0): ``x`` NaN makes the block scale
      NaN, a NaN ``enc`` needs a NaN scale / S_enc or 0/0 quotients, so the output is NaN either
      way; the remaining case is ``x = inf`` with ``enc == 0`` (S_enc below ~1e-36, given): there
      every element's reference value is 0 (times the quotient), so such blocks take the
      quotients ``q1 * 0`` (FAST) / the scale ``s * 0`` (per-element division): the same bits
      as ``_dequant_blocks``. (Where ``q1 = s / S_enc`` overflows, S_enc < 448 / FLT_MAX, which
      no amax gives, the FAST ``q1 * 0`` is NaN, as in ``_dequant_blocks``, while the recipe
      gives 0: one of the two exceptions the tests allow, ``_fused_vs_recipe``; the other: on a
      GPU an FP32-subnormal given S_enc is flushed to zero as an operand, so a -0 of the recipe
      may come out +0.)
    * Dequantization as ``_dequant_blocks``: FAST ``2^e * div_rn(f * s, S_enc)`` (f in {1, 1.5}).
    """
    return _lean_quant_blocks_to(x, s_enc, r_enc, 0.1666666716337204)


@triton.jit
def _lean_quant_blocks_4over6(x, s_enc, r_enc):
    """``_lean_quant_blocks`` with Four Over Six block scaling: both candidates (each block's max
    to 6 and to 4), the one of smaller squared error kept (``block_squared_error`` of nvfp4_math:
    ``e2m1 * s`` against ``x * S_enc``, pairwise order, a tie keeps 6). ``e2m1 * s`` is the
    value's sign bit on ``qv * s`` (exact); where ``enc == 0`` the lean ``qv`` of an infinite ``x``
    is 6, not the reference's 0, but its target ``x * S_enc`` is infinite, so both candidates'
    errors are +inf either way. Bit-exact only without FMA contraction (``enable_fp_fusion=False``)."""
    qv, vb, s_f32, z = _lean_quant_blocks_to(x, s_enc, r_enc, 0.1666666716337204)
    qv4, vb4, s_f32_4, z4 = _lean_quant_blocks_to(x, s_enc, r_enc, 0.25)
    target = x * s_enc[:, None]
    err6 = pairwise_block_sum(squared(_signed_product(qv, s_f32, vb) - target))
    err4 = pairwise_block_sum(squared(_signed_product(qv4, s_f32_4, vb4) - target))
    pick4 = err4 < err6
    p2 = pick4[:, None]
    return (tl.where(p2, qv4, qv), tl.where(p2, vb4, vb), tl.where(pick4, s_f32_4, s_f32),
            tl.where(pick4, z4, z))


@triton.jit
def _signed_product(qv, s_f32, vb):
    """``qv * s`` (exact) with the sign bit of ``vb`` (the value's bits): ``e2m1 * s``."""
    mag = qv * s_f32[:, None]
    return (mag.to(tl.int32, bitcast=True) | (vb & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _lean_quant_blocks_to(x, s_enc, r_enc, INV_MAX: tl.constexpr):
    """``_lean_quant_blocks`` with each block's max mapped to ``1 / INV_MAX`` (6 or 4)."""
    blk_amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)
    t = s_enc * INV_MAX
    sc = blk_amax * t
    sc = tl.where(sc > 448.0, 448.0, sc)
    # E4M3 round trip (RNE) of sc in float
    scb = sc.to(tl.int32, bitcast=True)
    sca = scb & 0x7FFFFFFF
    smp = tl.maximum(sca & 0x7F800000, 0x3C800000).to(tl.float32, bitcast=True)  # 2^floor(log2), >= 2^-6
    st = sca.to(tl.float32, bitcast=True) + smp * 1048576.0
    s_r = st - smp * 1048576.0
    s_f32 = (s_r.to(tl.int32, bitcast=True) | (scb & -2147483648)).to(tl.float32, bitcast=True)
    decode_scale = s_f32 * r_enc
    enc = tl.math.div_rn(1.0 + tl.zeros_like(decode_scale), decode_scale)
    enc = tl.where(enc > 3.4028234663852886e38, 3.4028234663852886e38, enc)
    z = enc == 0.0
    v = x * enc[:, None]
    vb = v.to(tl.int32, bitcast=True)
    c = tl.minimum(vb & 0x7FFFFFFF, 0x40C00000)  # bits of min(|v|, 6); NaN -> 6
    mp = (tl.maximum(c, 0x3F800000) & 0x7F800000).to(tl.float32, bitcast=True)  # 1, 2 or 4
    tq = c.to(tl.float32, bitcast=True) + mp * 4194304.0
    qv = tq - mp * 4194304.0
    return qv, vb, s_f32, z


@triton.jit
def _lean_dequant_blocks(qv, vb, s_f32, z, s_enc, FAST: tl.constexpr):
    """(sign(v) qv * s) / S_enc as ``_dequant_blocks`` (see ``_lean_quant_blocks`` for z)."""
    if FAST:
        q1 = tl.math.div_rn(s_f32, s_enc)
        q3 = tl.math.div_rn(s_f32 * 1.5, s_enc)
        q0 = q1 * 0.0
        q1 = tl.where(z, q0, q1)
        q3 = tl.where(z, q0, q3)
        qb = qv.to(tl.int32, bitcast=True)
        pow2 = (qb & 0x7F800000).to(tl.float32, bitcast=True)
        f = tl.where((qb & 0x00400000) != 0, q3[:, None], q1[:, None])
        mag = f * pow2
    else:
        s_d = tl.where(z, s_f32 * 0.0, s_f32)
        mag = tl.math.div_rn(qv * s_d[:, None], s_enc[:, None] + tl.zeros_like(qv))
    out = mag.to(tl.int32, bitcast=True) | (vb & -2147483648)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _fake_quant_kernel(
    X, stride_xm, K, GS, GA, rows_per_group,
    OUT, n_rows,
    BR: tl.constexpr, BB: tl.constexpr, FROM_AMAX: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
):
    """OUT[r, :] = DQ(Q(X[r, :])) with S_enc = GS[r // rows_per_group], for a BR x (BB*16) tile.
    FROM_AMAX: S_enc from the group amax bits GA instead, written to GS by the programs holding a
    group's first row in their first column tile. FOUR_OVER_SIX: 4over6 block scaling (its S_enc
    numerator 256 * 6 and ``_lean_quant_blocks_4over6``)."""
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)
    blks = pid_b * BB + tl.arange(0, BB)
    jj = tl.arange(0, 16)
    rmask = rows < n_rows
    bmask = blks < (K // 16)
    m3 = rmask[:, None, None] & bmask[None, :, None] & (jj[None, None, :] < 16)
    offs = rows[:, None, None] * stride_xm + blks[None, :, None] * 16 + jj[None, None, :]
    x = tl.load(X + offs, mask=m3, other=0.0).to(tl.float32)
    if FROM_AMAX:
        s_enc = _s_enc_from_amax_bits(tl.load(GA + rows // rows_per_group, mask=rmask, other=0),
                                      1536.0 if FOUR_OVER_SIX else 2688.0)
        if pid_b == 0:
            tl.store(GS + rows // rows_per_group, s_enc, mask=rmask & (rows % rows_per_group == 0))
    else:
        s_enc = tl.load(GS + rows // rows_per_group, mask=rmask, other=1.0)
    x2 = tl.reshape(x, (BR * BB, 16))
    s2 = tl.reshape(tl.broadcast_to(s_enc[:, None], (BR, BB)), (BR * BB,))
    # 1 / S_enc once per row; no E2M1 codes or scale byte (_lean_quant_blocks)
    r_enc = tl.math.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)
    r2 = tl.reshape(tl.broadcast_to(r_enc[:, None], (BR, BB)), (BR * BB,))
    if FOUR_OVER_SIX:
        qv, vb, s_f32, z = _lean_quant_blocks_4over6(x2, s2, r2)
    else:
        qv, vb, s_f32, z = _lean_quant_blocks(x2, s2, r2)
    # fast exact dequantization unless some result of the tile could be subnormal (a quotient
    # below 2^-125 times the smallest E2M1 power, 2^-1)
    q1 = tl.math.div_rn(s_f32, s2)
    nbad = tl.sum(((s_f32 > 0.0) & (q1 < 2.350988701644575e-38)).to(tl.int32), axis=0)
    if nbad == 0:
        xh = _lean_dequant_blocks(qv, vb, s_f32, z, s2, True)
    else:
        xh = _lean_dequant_blocks(qv, vb, s_f32, z, s2, False)
    doffs = rows[:, None, None] * K + blks[None, :, None] * 16 + jj[None, None, :]
    tl.store(OUT + doffs, tl.reshape(xh, (BR, BB, 16)).to(OUT.dtype.element_ty), mask=m3)


def shared_amax_bits(tensors) -> torch.Tensor:
    """The ``|x|`` bit-pattern max over all of ``tensors`` (weights of any shape, last dim a
    multiple of 16), as a (1,) int32 tensor on the first one's device: the amax that one global
    scale shared by all of them (a sibling group's) comes from, for ``fake_quantize_rows(...,
    amax_bits=...)``, whose fused pass turns it into ``S_enc``.

    One zeroed buffer and one amax pass per tensor into it: ``atomic_max`` on the bit patterns
    makes it the max over the tensors, exact and independent of their order, NaN-propagating (a
    NaN pattern sorts above +inf); no torch reduction or elementwise ``S_enc`` glue per group.
    0 (amax 0, ``S_enc`` 1) when every tensor is zero or empty."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("shared_amax_bits needs at least one tensor")
    ga = torch.zeros(1, dtype=torch.int32, device=tensors[0].device)
    interp = interpreting()
    for t in tensors:
        x = t.detach()
        _amax_pass(_rows_2d(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), interp), ga)
    return ga


def _rows_2d(x2d: torch.Tensor, interp: bool) -> torch.Tensor:
    """``x2d`` as the kernels read it: unit stride along K (and a bf16 input made safe for the
    interpreter)."""
    if interp and x2d.dtype == torch.bfloat16:
        x2d = interpreter_safe_input(x2d)
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _amax_pass(x2d: torch.Tensor, ga: torch.Tensor) -> None:
    """Merge max ``|x|`` (bit patterns) of all rows of ``x2d`` into ``ga[0]`` (one group)."""
    n_rows, k = x2d.shape
    if n_rows:
        agrid, amax_meta, _, _ = _launch_config(n_rows, k, n_rows, True, TILE_ROWS, TILE_BLOCKS, AMAX_ROWS,
                                                AMAX_COLS, AMAX_ITERS)
        _fake_quant_amax_kernel[agrid](x2d, x2d.stride(0), k, ga, n_rows, n_rows, **amax_meta, num_warps=_AMAX_WARPS)


def fake_quantize_rows(
    x2d: torch.Tensor,
    rows_per_group: int,
    out_dtype: torch.dtype,
    global_encode_scale: torch.Tensor | None = None,
    out_shape: tuple | None = None,
    amax_bits: torch.Tensor | None = None,
    block_scaling: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DQ(Q(x))`` of the rows of ``x2d`` (R, K) in ``out_dtype``; groups of ``rows_per_group``
    consecutive rows share one global scale (all rows: "tensor"; N rows of (E, N, K): "expert").

    ``global_encode_scale`` (one per group) skips the amax pass; so does ``amax_bits`` (int32,
    one ``|x|`` bit-pattern amax per group, e.g. a sibling group's from :func:`shared_amax_bits`),
    from which the fused pass derives ``S_enc`` as it does from its own amax pass. Returns ``(out
    (R, K), global_encode_scale (R // rows_per_group,))``; ``out_shape`` (``R * K`` elements): the
    output is allocated in that shape instead (the caller's weight shape: no view on the way out).
    ``block_scaling``: ``"6"`` or ``"4over6"`` (:data:`~quads.tensor.nvfp4_math.BLOCK_SCALINGS`).
    """
    if x2d.dim() != 2 or x2d.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"fake_quantize_rows expects (R, K) with K % {BLOCK_SIZE} == 0, got {tuple(x2d.shape)}")
    if out_dtype not in FAKE_QUANT_OUT_DTYPES:
        raise TypeError(f"fake_quantize_rows: out_dtype must be one of {FAKE_QUANT_OUT_DTYPES}, got {out_dtype}")
    n_rows, k = x2d.shape
    if rows_per_group < 1 or n_rows % rows_per_group:
        raise ValueError(f"fake_quantize_rows: {n_rows} rows do not split into groups of {rows_per_group}")
    four_over_six = block_scaling == "4over6"
    if not four_over_six and block_scaling != "6":
        check_block_scaling(block_scaling)  # raises, naming the choices
    interp = interpreting()  # one environment lookup per call (a microsecond each)
    x2d = _rows_2d(x2d, interp)
    groups = n_rows // rows_per_group
    dev = x2d.device
    from_amax = global_encode_scale is None
    amax_pass = from_amax and amax_bits is None
    if from_amax:
        gs = torch.empty(groups, dtype=torch.float32, device=dev)
        if amax_pass:
            ga = torch.zeros(groups, dtype=torch.int32, device=dev)  # |x| bits; 0 = amax 0 (S_enc 1)
        else:
            ga = amax_bits
            if ga.dtype != torch.int32 or ga.device != dev or ga.numel() != groups:
                raise ValueError(f"fake_quantize_rows: amax_bits must be {groups} int32 values on {dev}, got "
                                 f"{ga.numel()} {ga.dtype} on {ga.device}")
        if not n_rows:
            gs.fill_(1.0)
    else:
        gs = global_encode_scale
        if gs.dtype != torch.float32 or gs.device != dev or gs.numel() != groups or not gs.is_contiguous():
            gs = gs.to(device=dev, dtype=torch.float32).reshape(-1).expand(groups).contiguous()
        ga = gs  # unused
    store_dtype = torch.float32 if interp else out_dtype
    out = torch.empty(out_shape or (n_rows, k), dtype=store_dtype, device=dev)
    if n_rows:
        agrid, amax_meta, grid, bb = _launch_config(n_rows, k, rows_per_group, amax_pass, TILE_ROWS, TILE_BLOCKS,
                                                    AMAX_ROWS, AMAX_COLS, AMAX_ITERS)
        if amax_pass:
            _fake_quant_amax_kernel[agrid](x2d, x2d.stride(0), k, ga, rows_per_group, n_rows, **amax_meta,
                                           num_warps=_AMAX_WARPS)
        if four_over_six:  # no FMA contraction: the error comparison rounds as the reference's
            _fake_quant_kernel[grid](x2d, x2d.stride(0), k, gs, ga, rows_per_group, out, n_rows,
                                     BR=TILE_ROWS, BB=bb, FROM_AMAX=from_amax, FOUR_OVER_SIX=True,
                                     num_warps=_NUM_WARPS, enable_fp_fusion=False)
        else:
            _fake_quant_kernel[grid](x2d, x2d.stride(0), k, gs, ga, rows_per_group, out, n_rows,
                                     BR=TILE_ROWS, BB=bb, FROM_AMAX=from_amax, FOUR_OVER_SIX=False,
                                     num_warps=_NUM_WARPS)
    return (out if out.dtype == out_dtype else out.to(out_dtype)), gs


@functools.lru_cache(maxsize=1024)
def _launch_config(n_rows, k, rows_per_group, amax_pass, tile_rows, tile_blocks, amax_rows, amax_cols, amax_iters):
    """``(amax grid, amax pass meta-parameters, fused grid, BB)`` of a call (the amax entries
    None without ``amax_pass``): pure integer
    arithmetic on the shape and the tile globals (all in the key, so a sweep of the globals is
    seen), cached because a trainer calls the same few shapes thousands of times and the host
    time of a small weight's call is what the GPU waits for when its queue is empty. Plain
    integer arithmetic, not ``triton.cdiv`` / ``next_power_of_2`` (jit functions, several
    microseconds each)."""
    nblk = k // 16
    agrid = amax_meta = None
    if amax_pass:
        ac = min(amax_cols, _next_pow2(k))
        ai = max(1, min(amax_iters, _cdiv(k, ac)))
        agrid = (_cdiv(n_rows, amax_rows), _cdiv(k, ac * ai))
        amax_meta = {"BR": amax_rows, "BC": ac, "ITERS": ai, "ONE_GROUP": rows_per_group % amax_rows == 0}
    bb = min(tile_blocks, _next_pow2(max(nblk, 1)))
    grid = (_cdiv(n_rows, tile_rows), _cdiv(nblk, bb))
    return agrid, amax_meta, grid, bb


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1
