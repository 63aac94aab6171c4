"""Fused NVFP4 fake quantization of weights (Triton): ``DQ(Q(w))`` in one pass over the master.

The trainer's forward weight is ``nvfp4_dequantize(*nvfp4_quantize(w))`` in the compute dtype.
The torch reference runs that as a chain of float32 elementwise kernels (block amax, scale,
E4M3 round trip, encode, E2M1 rounding, decode, division), each reading and writing the whole
weight. This kernel does the same steps per tile in registers: it reads the master once and
writes the forward weight once (plus the amax pass that the global scale needs first).

The steps are the ones of :mod:`quads.kernels.quantize_nvfp4` (``_quant_blocks`` for the block
scale and E2M1 codes, ``_dequant_blocks`` for the exact ``(e2m1 * s) / S_enc``): one in-kernel
implementation of the recipe, checked bit-exact against :mod:`quads.tensor.nvfp4_math`. The
dequantization takes the fast exact path (a power-of-two split, see that module's doc) unless a
value of the tile could be subnormal in float32; then every element of the tile takes ``div_rn``.

Output dtypes: float32, bfloat16, float16 (the cast from the float32 result rounds to nearest
even, as ``Tensor.to`` does). Under ``TRITON_INTERPRET=1`` a bf16/fp16 output is written as
float32 and cast on the host (the interpreter's fp32 -> bf16 store truncates, see
:mod:`quads.kernels._interpreter`), so the interpreter checks the same recipe bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels._interpreter import interpreter_safe_input, interpreting
from quads.kernels.quantize_nvfp4 import _dequant_blocks, _quant_blocks, amax_rows
from quads.tensor.nvfp4_math import BLOCK_SIZE, global_encode_scale_from_amax

__all__ = ["fake_quantize_rows", "FAKE_QUANT_OUT_DTYPES", "TILE_ROWS", "TILE_BLOCKS"]

FAKE_QUANT_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: tile of one program: TILE_ROWS rows x TILE_BLOCKS blocks of 16 (the same under the interpreter)
TILE_ROWS = 4
TILE_BLOCKS = 16
_NUM_WARPS = 4


@triton.jit
def _fake_quant_kernel(
    X, stride_xm, K, GS, rows_per_group,
    OUT, n_rows,
    BR: tl.constexpr, BB: tl.constexpr,
):
    """OUT[r, :] = DQ(Q(X[r, :])) with S_enc = GS[r // rows_per_group], for a BR x (BB*16) tile."""
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
    s_enc = tl.load(GS + rows // rows_per_group, mask=rmask, other=1.0)
    x2 = tl.reshape(x, (BR * BB, 16))
    s2 = tl.reshape(tl.broadcast_to(s_enc[:, None], (BR, BB)), (BR * BB,))
    codes, qv, neg, s_code, s_f32 = _quant_blocks(x2, s2)
    # fast exact dequantization unless some result of the tile could be subnormal (a quotient
    # below 2^-125 times the smallest E2M1 power, 2^-1)
    q1 = tl.math.div_rn(s_f32, s2)
    nbad = tl.sum(((s_f32 > 0.0) & (q1 < 2.350988701644575e-38)).to(tl.int32), axis=0)
    if nbad == 0:
        xh = _dequant_blocks(qv, neg, s_f32, s2, True)
    else:
        xh = _dequant_blocks(qv, neg, s_f32, s2, False)
    doffs = rows[:, None, None] * K + blks[None, :, None] * 16 + jj[None, None, :]
    tl.store(OUT + doffs, tl.reshape(xh, (BR, BB, 16)).to(OUT.dtype.element_ty), mask=m3)


def fake_quantize_rows(
    x2d: torch.Tensor,
    rows_per_group: int,
    out_dtype: torch.dtype,
    global_encode_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DQ(Q(x))`` of the rows of ``x2d`` (R, K) in ``out_dtype``; groups of ``rows_per_group``
    consecutive rows share one global scale (all rows: "tensor"; N rows of (E, N, K): "expert").

    ``global_encode_scale`` (one per group) skips the amax pass. Returns ``(out (R, K),
    global_encode_scale (R // rows_per_group,))``.
    """
    if x2d.dim() != 2 or x2d.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"fake_quantize_rows expects (R, K) with K % {BLOCK_SIZE} == 0, got {tuple(x2d.shape)}")
    if out_dtype not in FAKE_QUANT_OUT_DTYPES:
        raise TypeError(f"fake_quantize_rows: out_dtype must be one of {FAKE_QUANT_OUT_DTYPES}, got {out_dtype}")
    n_rows, k = x2d.shape
    if rows_per_group < 1 or n_rows % rows_per_group:
        raise ValueError(f"fake_quantize_rows: {n_rows} rows do not split into groups of {rows_per_group}")
    x2d = interpreter_safe_input(x2d)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    groups = n_rows // rows_per_group
    if global_encode_scale is None:
        if n_rows:
            amax = amax_rows(x2d).reshape(groups, rows_per_group).amax(dim=1)
        else:
            amax = torch.zeros(groups, dtype=torch.float32, device=x2d.device)
        gs = global_encode_scale_from_amax(amax)
    else:
        gs = global_encode_scale.to(device=x2d.device, dtype=torch.float32).reshape(-1).expand(groups).contiguous()
    store_dtype = torch.float32 if interpreting() else out_dtype
    out = torch.empty((n_rows, k), dtype=store_dtype, device=x2d.device)
    if n_rows:
        bb = min(TILE_BLOCKS, triton.next_power_of_2(max(k // 16, 1)))
        grid = (triton.cdiv(n_rows, TILE_ROWS), triton.cdiv(k // 16, bb))
        _fake_quant_kernel[grid](x2d, x2d.stride(0), k, gs, rows_per_group, out, n_rows,
                                 BR=TILE_ROWS, BB=bb, num_warps=_NUM_WARPS)
    return out.to(out_dtype), gs
