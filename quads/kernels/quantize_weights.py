"""NVFP4 weight quantization tiles (Triton), bit-exact with :mod:`quads.tensor.nvfp4_math`.

``_quant_given_scale_kernel`` quantizes tiles of a 2-D tensor with a given per-row-group global
scale (weights: ``"tensor"`` / ``"expert"`` granularity); the caller takes the global amax from
:func:`quads.kernels.amax.amax_rows` and ``S_enc`` from the reference function. The block
arithmetic is :mod:`quads.kernels.nvfp4_blocks`'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreter_safe_input, interpreting
from quads.kernels.nvfp4_blocks import no_fp_fusion, quant_blocks, quant_blocks_4over6, with_sign
from quads.tensor.nvfp4_math import check_block_scaling

__all__ = ["quantize_given_scale"]


@triton.jit
def _quant_given_scale_kernel(
    X, stride_xm, K, GS, rows_per_group,
    Q, S, D,
    n_rows,
    BR: tl.constexpr, BB: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DQ: tl.constexpr, FOUR_OVER_SIX: tl.constexpr,
):
    """Quantize a (BR rows) x (BB blocks of 16) tile with global scale GS[row // rows_per_group]
    (FOUR_OVER_SIX: each block's max to 4 or 6, see ``quant_blocks_4over6``)."""
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
        codes, qv, neg, s_code, s_f32 = quant_blocks_4over6(x2, s2)
    else:
        codes, qv, neg, s_code, s_f32 = quant_blocks(x2, s2)
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
        u = with_sign(qv, neg) * s_f32[:, None]
        u3 = tl.reshape(u, (BR, BB, 16))
        doffs = rows[:, None, None] * K + blks[None, :, None] * 16 + jj[None, None, :]
        tl.store(D + doffs, u3.to(tl.float16), mask=m3)



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
        num_warps=nw, **no_fp_fusion(four_over_six),
    )
    return q, s, d

