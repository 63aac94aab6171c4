"""The Hopper weight layout built by a Triton kernel: plain NVFP4 parts -> lane words, one pass.

Why: the layout (:mod:`quads.kernels.hopper_weight_layout`) is rebuilt at every weight sync; in
torch ops (fragment permutes and a bit-placement loop over int32 copies of every code) it ran at
1% of the H200's bandwidth and was the sync's largest cost. This kernel reads each code byte and
scale byte once and writes each layout byte once, with no intermediate tensor, into a given
layout in place (the sync keeps the layout's addresses for captured CUDA graphs).

What one work item does: item ``j`` = (row block ``rb``, k block ``kb``, row ``g``) of one weight
(or expert), numbered as the layout's memory is laid out, so item ``j`` owns bytes
``[64 j, 64 j + 64)`` of ``values`` (lanes ``4g .. 4g+3`` of the 16 x 64 tile) and bytes
``[8 j, 8 j + 8)`` of ``scales``. It reads the 32 code bytes (eight int32 words) of rows
``g`` and ``g + 8`` of the tile and their four scale bytes each:

* code word ``w = 2t + o`` of row ``br*8 + g`` holds in its byte ``c`` the codes of channels
  ``t*16 + o*8 + c*2 + (0, 1)``: the fragment register ``o*2 + br`` of lane ``4g + c``, k16 tile
  ``t``; :func:`_place` puts the byte's two codes at that register's bits (``_BIT_PLACES``);
* lane word ``(c, t)`` is the OR of those four placed bytes; scale byte ``t*2 + br`` is the
  scale of row ``br*8 + g``, k16 block ``kb*4 + t``.

Rows past N and channels past K read as code 0 / scale 0 (masked loads), which is the padding.
A thread owns whole items (no data crosses threads: no shared memory, no atomics). Consecutive
items are consecutive rows of the same k block, so a warp's two loads of a row read 8 rows x 128
contiguous bytes and its four stores write 2 KB contiguous; per item 4 + 4 16-byte code/value
accesses (K a multiple of 128; narrower otherwise) and 4-byte scale loads (K a multiple of 256),
one 8-byte scale store. Compiled for sm_90 (Triton 3.6): 64 registers, no spills, no layout
conversion. Bit-identical to :func:`~quads.kernels.hopper_weight_layout.to_hopper_layout_reference`
(tests/kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads.kernels.hopper_weight_layout import _BIT_PLACES, HopperWeight, hopper_layout_destination

__all__ = ["to_hopper_layout_triton"]

ITEMS_PER_PROGRAM = 256  # (row block, k block, row) items: 16 KB of values per program
NUM_WARPS = 4

# the kernel's bit places (constexprs R{register}_MAG / _SIGN): those of a register's low fp16 half;
# the high half's are 16 above (the kernel places a byte's high code 16 bits above its low one)
_LOW_HALF_BITS = {f"R{reg}_{what}": bit for (reg, half), bits in _BIT_PLACES.items() if half == 0
                  for what, bit in zip(("MAG", "SIGN"), bits)}
assert all(_BIT_PLACES[(reg, 1)] == (mag + 16, sign + 16) for (reg, half), (mag, sign) in _BIT_PLACES.items()
           if half == 0)


@triton.jit
def _place(word, C: tl.constexpr, MAG: tl.constexpr, SIGN: tl.constexpr):
    """Byte ``C`` of int32 code words (two E2M1 codes, low nibble first) at its fragment register's
    bits: the low code's magnitude at ``MAG..MAG+2`` and sign at ``SIGN``, the high code 16 above."""
    byte = (word >> (8 * C)) & 0xFF
    both = (byte & 0xF) | ((byte & 0xF0) << 12)  # low code at bits 0-3, high code at 16-19
    return ((both & 0x00070007) << MAG) | (((both >> 3) & 0x00010001) << SIGN)


@triton.jit
def _lane_words(w0_o0, w0_o1, w1_o0, w1_o1, C: tl.constexpr,
                R0_MAG: tl.constexpr, R0_SIGN: tl.constexpr, R1_MAG: tl.constexpr, R1_SIGN: tl.constexpr,
                R2_MAG: tl.constexpr, R2_SIGN: tl.constexpr, R3_MAG: tl.constexpr, R3_SIGN: tl.constexpr):
    """The four lane words (k16 tiles t = 0..3) of lane ``4g + C``: ``w{br}_o{o}`` (items, 4 t) are
    the code words ``2t + o`` of rows ``g`` (br 0) and ``g + 8`` (br 1); register = o*2 + br."""
    return (_place(w0_o0, C, R0_MAG, R0_SIGN) | _place(w1_o0, C, R1_MAG, R1_SIGN)
            | _place(w0_o1, C, R2_MAG, R2_SIGN) | _place(w1_o1, C, R3_MAG, R3_SIGN))


@triton.jit
def _hopper_layout_kernel(
    CODES, SCALE_IN, VALUES, SCALES, rows, code_words, scale_bytes, row_blocks, k_blocks, num_items,
    ITEMS: tl.constexpr,
    R0_MAG: tl.constexpr, R0_SIGN: tl.constexpr, R1_MAG: tl.constexpr, R1_SIGN: tl.constexpr,
    R2_MAG: tl.constexpr, R2_SIGN: tl.constexpr, R3_MAG: tl.constexpr, R3_SIGN: tl.constexpr,
):
    """CODES int32 (B*rows, code_words), SCALE_IN uint8 (B*rows, scale_bytes) -> VALUES int32
    (num_items * 16), SCALES uint8 (num_items * 8); items as in the module doc."""
    j = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    live = j < num_items
    g = j % 8
    kb = (j // 8) % k_blocks
    block = j // (8 * k_blocks)  # row block over all experts
    row0 = (block % row_blocks) * 16 + g  # row br*8 + g of the expert is row0 + 8*br
    first_row = (block // row_blocks) * rows  # the expert's first row in CODES / SCALE_IN
    w = tl.arange(0, 8)
    t = tl.arange(0, 4)
    word_live = (kb * 8)[:, None] + w[None, :] < code_words
    scale_live = (kb * 4)[:, None] + t[None, :] < scale_bytes

    # code words (items, 8) of rows g (br 0) and g + 8 (br 1); split: word 2t + o -> (items, 4 t) per o
    r = (first_row + row0).to(tl.int64)
    live0 = (live & (row0 < rows))[:, None]
    live1 = (live & (row0 + 8 < rows))[:, None]
    c0 = tl.load(CODES + (r * code_words + kb * 8)[:, None] + w[None, :], mask=live0 & word_live, other=0)
    c1 = tl.load(CODES + ((r + 8) * code_words + kb * 8)[:, None] + w[None, :], mask=live1 & word_live, other=0)
    w0_o0, w0_o1 = tl.split(tl.reshape(c0, (ITEMS, 4, 2)))
    w1_o0, w1_o1 = tl.split(tl.reshape(c1, (ITEMS, 4, 2)))
    out = (j.to(tl.int64) * 16)[:, None] + t[None, :]  # lane 4g + c at out + 4c
    for c in tl.static_range(4):
        tl.store(VALUES + out + 4 * c, _lane_words(w0_o0, w0_o1, w1_o0, w1_o1, c, R0_MAG, R0_SIGN, R1_MAG, R1_SIGN,
                                                   R2_MAG, R2_SIGN, R3_MAG, R3_SIGN), mask=live[:, None])

    # scale bytes (items, 4 t) of rows g and g + 8 -> (items, 8) in the order t*2 + br
    s0 = tl.load(SCALE_IN + (r * scale_bytes + kb * 4)[:, None] + t[None, :], mask=live0 & scale_live, other=0)
    s1 = tl.load(SCALE_IN + ((r + 8) * scale_bytes + kb * 4)[:, None] + t[None, :], mask=live1 & scale_live,
                 other=0)
    tl.store(SCALES + (j.to(tl.int64) * 8)[:, None] + tl.arange(0, 8)[None, :],
             tl.reshape(tl.join(s0, s1), (ITEMS, 8)), mask=live[:, None])


def _int32_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 tensor (last dim a multiple of 4) viewed as int32 words (copied first if
    its storage offset is not 4-byte aligned)."""
    t = t.contiguous()
    return (t if t.storage_offset() % 4 == 0 else t.clone()).view(torch.int32)


def to_hopper_layout_triton(qdata: torch.Tensor, scale: torch.Tensor, out: HopperWeight | None = None) -> HopperWeight:
    """:func:`~quads.kernels.hopper_weight_layout.to_hopper_layout` by the kernel (any device Triton
    runs on: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). ``out``: written in place and
    returned (checked first: a wrong one raises before anything is written)."""
    dest = hopper_layout_destination(qdata, scale, out)
    n, k = dest.n, dest.k
    row_blocks, k_blocks = dest.values.shape[-4:-2]
    num_items = dest.values.numel() // 64
    if num_items == 0:
        return dest
    _hopper_layout_kernel[(triton.cdiv(num_items, ITEMS_PER_PROGRAM),)](
        _int32_words(qdata), scale.contiguous().view(torch.uint8), dest.values.view(torch.int32),
        dest.scales, n, k // 8, k // 16, row_blocks, k_blocks, num_items,
        ITEMS=ITEMS_PER_PROGRAM, num_warps=NUM_WARPS, **_LOW_HALF_BITS)
    return dest
