"""Prefill GEMM on Hopper (many tokens): exact W4A4 (+ residual), bits independent of M.

docs/background.md section 2: an E2M1 value times an E4M3 scale is exact in fp16, so
``y = x̂ Ŵᵀ + r̂ Ŵᵀ`` is reproduced by multiplying the *unscaled* operands on fp16 tensor cores
with fp32 accumulation and dividing the sum by ``S_x[row] * S_w`` (the residual shares the row's
global scale) in the epilogue, as :func:`quads.ops.linear_op.w4a4_matmul_reference` does (only the
fp32 summation order differs).

The weight operand is ``e2m1 * s * 2^-14`` (the values the decode kernel builds in registers,
see :mod:`quads.kernels.hopper.weight_decode`): dequantized once per call by
:func:`dequant_weight_fp16`, read from shared memory; swap-AB as in the decode kernel.

Batch invariance: K is cut into the canonical segments of :data:`quads.kernels.hopper.w4a4_decode.SEG_K`;
one software-pipelined loop walks all of K, the chain of k16 MMA steps restarts from zero at
every segment start and each segment sum is added in segment order at the segment's end, with
the decode kernel's epilogue formula, so a row's bits are those of the decode kernel (checked on
the H200: the MMA instruction's arithmetic does not depend on the tile shape, but ``mma.sync``
differs from wgmma, so every config uses wgmma: >= 4 warps, >= 64 weight rows per warpgroup).
With the residual the main and residual rows of the same tokens are the two halves of one MMA's
columns (one weight-tile read, two accumulators); grouped program order for L2 reuse; TMA loads
where the operands allow them, else pointer (cp.async) loads of the same tiles.

Only the walk :func:`pick_config` selects ships here; the variants it was measured against are
recorded in ``docs/kernel_log.md``. Under the Triton interpreter :func:`pick_config` returns the
GPU config on smaller tiles, so the CPU suite runs the kernel the GPU runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from quads.kernels._interpreter import interpreting
from quads.kernels.hopper.w4a4_decode import SEG_K

__all__ = ["w4a4_gemm", "GemmConfig", "pick_config", "dequant_weight_fp16"]


# ---------------------------------------------------------------------------------------------
# Weight tile dequantization
# ---------------------------------------------------------------------------------------------


def _nibbles_to_f16x2_ptx(shift: int) -> str:
    """Inline PTX: 4 packed bytes -> 2 f16x2 registers of one nibble per byte (the low nibbles
    for ``shift=9``, the high ones for ``shift=5``), each ``e2m1 * 2^-14`` (sign at bit 15)
    times the f16x2 scale operand. ``prmt`` spreads bytes 0,1 / 2,3 into the two 16-bit halves."""
    lines = ["{", ".reg .b32 z, s0, s1, t0, t1, a, b;", "mov.b32 z, 0;", "mov.b32 s0, 0x4140;",
             "mov.b32 s1, 0x4342;", "prmt.b32 t0, $2, z, s0;", "prmt.b32 t1, $2, z, s1;"]
    for t, out, scale in (("t0", "$0", "$3"), ("t1", "$1", "$4")):
        lines += [f"shl.b32 a, {t}, {shift};", "and.b32 a, a, 0x0E000E00;",
                  f"shl.b32 b, {t}, {shift + 3};", "and.b32 b, b, 0x80008000;",
                  "or.b32 a, a, b;", f"mul.rn.f16x2 {out}, a, {scale};"]
    return "\n".join(lines + ["}"])


_ASM_LO = tl.constexpr(_nibbles_to_f16x2_ptx(9))
_ASM_HI = tl.constexpr(_nibbles_to_f16x2_ptx(5))


@triton.jit
def _e2m1_bits_f16(c):
    """4-bit code (uint8) -> fp16 with value e2m1 * 2^-14 (exact; 0.5 -> subnormal 2^-15)."""
    c16 = c.to(tl.uint16)
    bits = ((c16 & 7) << 9) | ((c16 & 8) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _dequant_w(b, sb, BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed bytes (BN, BK/2) + scale bytes (BN, BK/16) -> fp16 (BN, BK) = e2m1 * s * 2^-14."""
    # E4M3 byte -> fp16 bits << 7 is s * 2^-8 (exact, subnormals included); * 2^8 -> s.
    s16 = ((sb.to(tl.uint16) & 0x7F) << 7).to(tl.float16, bitcast=True) * 256.0
    if USE_ASM:
        sbb = tl.reshape(tl.broadcast_to(s16[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
        lo = tl.inline_asm_elementwise(_ASM_LO, "=r,=r,r,r,r", [b, sbb], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_ASM_HI, "=r,=r,r,r,r", [b, sbb], dtype=tl.float16, is_pure=True, pack=4)
        w = tl.reshape(tl.join(lo, hi), (BN, BK))
    else:
        lo = _e2m1_bits_f16(b & 0xF)
        hi = _e2m1_bits_f16(b >> 4)
        w = tl.reshape(tl.join(lo, hi), (BN, BK // 16, 16))
        w = tl.reshape(w * s16[:, :, None], (BN, BK))
    return w


@triton.jit
def _epilogue(acc, accr, SX, sw, BIAS, Y, offs_m, mmask, offs_n, nmask, stride_ym,
              HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[m, n] = (acc [+ accr]) * 2^14 / (Sx[m] Sw) (+ bias[n]), as the reference (the residual
    shares the row's global scale)."""
    sx = tl.load(SX + offs_m, mask=mmask, other=1.0)
    den = sx * sw
    if HAS_RES:
        acc = acc + accr
    y = tl.math.div_rn(acc * 16384.0, den[None, :] + tl.zeros_like(acc))
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)
        y = y + bias[:, None]
    ptrs = Y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(ptrs, y.to(Y.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


# ---------------------------------------------------------------------------------------------
# The GEMM: one pipelined loop over every k-step of an output tile
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(pid, grid_n, grid_m, GROUP: tl.constexpr):
    """Program id -> (weight tile, token tile): groups of ``GROUP`` weight tiles, each group
    sweeping every token tile before the next starts (L2 reuse of the group's weight rows)."""
    per_group = GROUP * grid_m
    first_n = (pid // per_group) * GROUP
    size = tl.minimum(grid_n - first_n, GROUP)
    return first_n + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _column_rows(X, R, m0, M, stride_xm, stride_rm, BM: tl.constexpr, HAS_RES: tl.constexpr):
    """Row pointers and validity of the MMA columns of the ``BM`` tokens from ``m0``: the tokens'
    main rows, then (with the residual) their residual rows: ``2 * BM`` columns, one MMA."""
    if HAS_RES:
        col = tl.arange(0, 2 * BM)
        tok = m0 + col % BM
        rows = tl.where(col < BM, X + tok.to(tl.int64) * stride_xm, R + tok.to(tl.int64) * stride_rm)
    else:
        tok = m0 + tl.arange(0, BM)
        rows = X + tok.to(tl.int64) * stride_xm
    return rows, tok < M


@triton.jit
def _act_tile(rows, cmask, x_desc, m0, k0, K, BM: tl.constexpr, BK: tl.constexpr,
              HAS_RES: tl.constexpr, TMA: tl.constexpr):
    """The (columns, BK) fp16 activation tile at channel ``k0``, columns as :func:`_column_rows`
    (TMA: one (2, BM, BK) box of the (main, residual) x tokens x K view, the same order)."""
    if TMA:
        if HAS_RES:
            t = tl.reshape(x_desc.load([0, m0, k0]), (2 * BM, BK))
        else:
            t = x_desc.load([m0, k0])
    else:
        kk = k0 + tl.arange(0, BK)
        t = tl.load(rows[:, None] + kk[None, :], mask=cmask[:, None] & (kk < K)[None, :], other=0.0)
    return t


@triton.jit
def _weight_tile(W16, w_desc, n0, k0, N, K, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """(BN, BK) fp16 weight operand ``e2m1 * s * 2^-14`` of rows ``n0 ..`` at channel ``k0``, read
    from the materialized fp16 weight (:func:`dequant_weight_fp16`)."""
    if TMA:
        w = w_desc.load([n0, k0])
    else:
        rows = n0 + tl.arange(0, BN)
        kk = k0 + tl.arange(0, BK)
        w = tl.load(W16 + rows[:, None].to(tl.int64) * K + kk[None, :], mask=(rows < N)[:, None] & (kk < K)[None, :],
                    other=0.0)
    return w


@triton.jit
def _column_halves(t, BN: tl.constexpr, BM: tl.constexpr):
    """(BN, 2 * BM) -> its column halves ``[:, :BM]``, ``[:, BM:]``."""
    return tl.split(tl.permute(tl.reshape(t, (BN, 2, BM)), (0, 2, 1)))


@triton.jit
def _w4a4_gemm_kernel(
    X, R, x_desc, SX, W16, w_desc, SW, BIAS, Y,
    M, N, K, stride_xm, stride_rm, stride_ym,
    SEG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr,
):
    """One program per output tile (BN weight rows x BM tokens), K walked by one
    software-pipelined loop: the k16 chain restarts from zero at every canonical segment and each
    segment sum is added to ``tot`` in segment order (the decode kernel's order, so its bits) with
    no pipeline drain between segments. With the residual the MMA has ``2 * BM`` columns (main
    rows, then residual rows): one MMA per k-step, two accumulators; ``tot``'s column halves are
    the main and residual sums."""
    COLS: tl.constexpr = 2 * BM if HAS_RES else BM
    sw = tl.load(SW)
    pid_n, pid_m = _tile_coords(tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(M, BM), GROUP)
    n0 = pid_n * BN
    m0 = pid_m * BM
    rows, cmask = _column_rows(X, R, m0, M, stride_xm, stride_rm, BM, HAS_RES)
    steps_per_seg: tl.constexpr = SEG // BK
    n_steps = tl.cdiv(K, BK)
    acc = tl.zeros((BN, COLS), dtype=tl.float32)
    tot = tl.zeros((BN, COLS), dtype=tl.float32)
    for i in tl.range(0, n_steps, num_stages=STAGES):
        w = _weight_tile(W16, w_desc, n0, i * BK, N, K, BN, BK, TMA)
        x = _act_tile(rows, cmask, x_desc, m0, i * BK, K, BM, BK, HAS_RES, TMA)
        acc = tl.dot(w, tl.trans(x), acc)
        if ((i + 1) % steps_per_seg == 0) | (i == n_steps - 1):  # a canonical segment ends
            tot += acc
            acc = tl.zeros((BN, COLS), dtype=tl.float32)
    offs_n = n0 + tl.arange(0, BN)
    offs_m = m0 + tl.arange(0, BM)
    if HAS_RES:
        main, res = _column_halves(tot, BN, BM)
    else:
        main, res = tot, tot
    _epilogue(main, res, SX, sw, BIAS, Y, offs_m, offs_m < M, offs_n, offs_n < N, stride_ym, HAS_RES, HAS_BIAS)


@triton.jit
def _dequant_weight_kernel(WQ, WS, W16, N, K, KH, KS, BR: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """W16 (N, K) fp16 = e2m1 * s * 2^-14: the prefill path's MMA operand (exact, the values the
    decode kernel builds in registers)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * BK
    rmask = rows < N
    kb = tl.arange(0, BK // 2)
    ks = tl.arange(0, BK // 16)
    kk = tl.arange(0, BK)
    r64 = rows.to(tl.int64)
    b = tl.load(WQ + r64[:, None] * KH + (k0 // 2 + kb)[None, :],
                mask=rmask[:, None] & ((k0 // 2 + kb) < KH)[None, :], other=0)
    sb = tl.load(WS + r64[:, None] * KS + (k0 // 16 + ks)[None, :],
                 mask=rmask[:, None] & ((k0 // 16 + ks) < KS)[None, :], other=0)
    w = _dequant_w(b, sb, BR, BK, USE_ASM)
    tl.store(W16 + r64[:, None] * K + (k0 + kk)[None, :], w, mask=rmask[:, None] & ((k0 + kk) < K)[None, :])


_LOADS = ("pointer", "tma")


class GemmConfig:
    """Tile config of the prefill GEMM (docs/kernel_log.md has the measurements behind it).

    * ``bn``: weight rows per program (64 per warpgroup: wgmma); ``bm``: tokens per program (with
      the residual: ``2 * bm`` MMA columns); ``bk``: channels per k-step (divides the segment);
    * ``loads``: ``"tma"`` (tensor-memory-accelerator boxes where the operands allow them, else
      pointer loads) or ``"pointer"`` (cp.async loads always);
    * ``group``: weight tiles per program group (L2 reuse of their rows).

    Every choice keeps the bits: the same k16 chains and segment order.
    """

    __slots__ = ("bn", "bm", "bk", "num_warps", "num_stages", "loads", "group")

    def __init__(self, bn, bm, bk, *, num_warps=8, num_stages=4, loads="tma", group=8):
        if loads not in _LOADS:
            raise ValueError(f"loads in {_LOADS}, got {loads}")
        if SEG_K % bk:
            raise ValueError(f"BLOCK_K={bk} must divide the K segment {SEG_K}")
        self.bn, self.bm, self.bk = bn, bm, bk
        self.num_warps, self.num_stages, self.loads, self.group = num_warps, num_stages, loads, group

    def __repr__(self):
        return (f"GemmConfig(bn={self.bn}, bm={self.bm}, bk={self.bk}, warps={self.num_warps}, "
                f"stages={self.num_stages}, {self.loads}, group={self.group})")


def pick_config(m: int, n: int, k: int, residual: bool = False) -> GemmConfig:
    """Tile choice by token count: TMA loads, 128 weight rows x 64 tokens with the residual (128
    MMA columns) or for M <= 256, else 128 tokens. Measured on the H200 (docs/kernel_log.md): the
    best bit-exact variant at every shape, 1.1-3.2x faster than the per-segment walk. Under the Triton interpreter:
    the same config on 16 x 16 tiles, one warp, one stage (the CPU suite runs the branch the GPU
    runs, on shapes it can afford)."""
    if interpreting():
        return GemmConfig(bn=16, bm=16, bk=64, num_warps=1, num_stages=1)
    return GemmConfig(bn=128, bm=64 if residual or m <= 256 else 128, bk=64, num_warps=8, num_stages=4)


def dequant_weight_fp16(wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """(N, K) fp16 = e2m1 * s * 2^-14 of a packed NVFP4 weight (no global scale)."""
    n, kh = wq.shape
    k = kh * 2
    out = torch.empty((n, k), dtype=torch.float16, device=wq.device)
    ws_u8 = ws.view(torch.uint8) if ws.dtype != torch.uint8 else ws
    br, bk = (16, 32) if interpreting() else (32, 256)
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    _dequant_weight_kernel[(triton.cdiv(n, br), triton.cdiv(k, bk))](
        wq, ws_u8, out, n, k, k // 2, k // 16, BR=br, BK=bk, USE_ASM=not interpreting(), num_warps=4)
    return out


def _residual_row_offset(x16: torch.Tensor, r16: torch.Tensor) -> int | None:
    """Rows from ``x16``'s first row to ``r16``'s when both are row ranges of one buffer with
    the same row stride and the residual after the main rows (the stacked operand); else None."""
    if r16.stride(0) != x16.stride(0) or r16.untyped_storage().data_ptr() != x16.untyped_storage().data_ptr():
        return None
    gap = r16.data_ptr() - x16.data_ptr()
    row_bytes = x16.stride(0) * x16.element_size()
    if gap <= 0 or gap % row_bytes or gap // row_bytes < x16.shape[0]:
        return None
    return gap // row_bytes


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA's requirements on a 2-D fp16 operand: 16-byte aligned base and row stride, unit inner stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _activation_desc(x16, r16, cfg):
    """TMA descriptor of the activation operand: (M, K) boxes of (bm, bk); with the residual a
    3-D (main / residual, M, K) view of the stacked buffer (boxes (2, bm, bk)), or None when the
    operands are not TMA-addressable that way (the launcher then loads by pointer: same bits)."""
    m, k = x16.shape
    if not _tma_ok(x16):
        return None
    if r16 is None:
        return TensorDescriptor(x16, [m, k], [x16.stride(0), 1], [cfg.bm, cfg.bk])
    gap = _residual_row_offset(x16, r16)
    if gap is None or (gap * x16.stride(0) * x16.element_size()) % 16:
        return None
    return TensorDescriptor(x16, [2, m, k], [gap * x16.stride(0), x16.stride(0), 1], [2, cfg.bm, cfg.bk])


def _launch(x16, r16, sx, sw, bias, y, cfg, w16):
    """:func:`_w4a4_gemm_kernel` on one output: TMA descriptors when ``cfg.loads == "tma"`` and
    the operands allow them, else pointer loads (same tiles, same bits)."""
    m, k = x16.shape
    n = y.shape[1]
    has_res = r16 is not None
    x_desc = _activation_desc(x16, r16, cfg) if cfg.loads == "tma" else None
    w_desc = TensorDescriptor.from_tensor(w16, [cfg.bn, cfg.bk]) if x_desc is not None else None
    r = r16 if has_res else x16
    grid = (triton.cdiv(n, cfg.bn) * triton.cdiv(m, cfg.bm),)
    _w4a4_gemm_kernel[grid](
        x16, r, x_desc, sx, w16, w_desc, sw.reshape(1), bias if bias is not None else sx, y,
        m, n, k, x16.stride(0), r.stride(0), y.stride(0),
        SEG=SEG_K, BN=cfg.bn, BM=cfg.bm, BK=cfg.bk, GROUP=cfg.group, HAS_RES=has_res, HAS_BIAS=bias is not None,
        TMA=x_desc is not None, STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def w4a4_gemm(
    x16: torch.Tensor,
    sx: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    sw: torch.Tensor,
    r16: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: GemmConfig | None = None,
    w16: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y (M, N) = (x16 @ Ŵᵀ [+ r16 @ Ŵᵀ]) / (sx Sw) [+ bias]``, see module doc.

    x16/r16: fp16 (M, K) unscaled activations (the residual shares the rows' scales; rows of
    the stacked operand are what TMA loads take as one box); sx fp32 (M,); wq uint8 (N, K/2);
    ws uint8 or float8_e4m3fn (N, K/16); sw fp32 scalar tensor; ``w16``: the materialized weight
    if the caller has it already (:func:`dequant_weight_fp16`, else decoded here).
    """
    m, k = x16.shape
    n = wq.shape[0]
    cfg = config or pick_config(m, n, k, r16 is not None)
    if interpreting() and out_dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even
        return w4a4_gemm(x16, sx, wq, ws, sw, r16, bias, torch.float32, config, w16).to(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x16.device)
    if m == 0:
        return y
    _launch(x16, r16, sx, sw, bias, y, cfg, w16 if w16 is not None else dequant_weight_fp16(wq, ws))
    return y
