"""The Hopper kernel layout of a packed NVFP4 weight, built from the plain parts once per sync.

The decode GEMM keeps the weight as the wgmma register operand (swap-AB: weight rows are the MMA
rows, tokens its columns). Each thread of a warp owns, per 16x16 tile of the weight, the fp16
pairs ``a01 = (row g, k 2c..2c+1)``, ``a23 = (row g+8, same k)``, ``a45 = (row g, k 8+2c..)`` and
``a67 = (row g+8, k 8+2c..)`` (lane ``4g + c``, the mma/wgmma A fragment). This layout stores
exactly those codes of one thread and one k16 tile in one 32-bit word, so a thread loads the
four k16 tiles of a 16 x 64 block with one 16-byte load and decodes a word into its four fp16x2
registers with a handful of bit operations (:mod:`quads.kernels.hopper.weight_decode`).

Storage (both uint8, sizes equal to the plain parts' after padding N to 64 and K to 64):

* ``values``: ``(N/16, K/64, 32, 16)``: row block of 16, k block of 64, lane, the lane's 4 words;
* ``scales``: ``(N/16, K/64, 8, 8)``: row block, k block, row ``g`` of the lane, then per k16
  tile ``t`` the scale bytes of rows ``g`` and ``g+8`` (``[t*2 + half]``).

:func:`to_hopper_layout` builds it at quantize/sync time, in place into the previous layout on a
sync (a Triton kernel on CUDA, :func:`to_hopper_layout_triton`; the torch reference
:func:`to_hopper_layout_reference` elsewhere); :func:`from_hopper_layout` inverts it (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "HopperWeight",
    "ROW_BLOCK",
    "K_BLOCK",
    "to_hopper_layout",
    "to_hopper_layout_reference",
    "to_hopper_layout_triton",
    "hopper_layout_destination",
    "hopper_layout_fits",
    "from_hopper_layout",
]

ROW_BLOCK = 16  # weight rows per warp tile
K_BLOCK = 64  # channels per 16-byte load (four k16 tiles)
ROW_PAD = 64  # rows are padded to whole warpgroup tiles


class HopperWeight(NamedTuple):
    """A packed weight (N, K) (or experts (E, N, K)) in the Hopper kernel layout."""

    values: torch.Tensor  # uint8 (..., N_pad/16, K_pad/64, 32, 16)
    scales: torch.Tensor  # uint8 (..., N_pad/16, K_pad/64, 8, 8)
    n: int
    k: int


# --------------------------------------------------------------------------------------------
# Host side: plain parts <-> kernel layout
# --------------------------------------------------------------------------------------------

# (register, half) -> (word bit of the magnitude's lowest bit, word bit of the sign)
_BIT_PLACES = {
    (0, 0): (9, 15), (0, 1): (25, 31),
    (1, 0): (1, 7), (1, 1): (17, 23),
    (2, 0): (4, 0), (2, 1): (20, 16),
    (3, 0): (12, 8), (3, 1): (28, 24),
}


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pr, pc = rows - t.shape[-2], cols - t.shape[-1]
    if pr == 0 and pc == 0:
        return t
    return torch.nn.functional.pad(t, (0, pc, 0, pr))


def _fragment_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes (B, N_pad, K_pad) uint8 (one 4-bit code per element) ->
    (B, N_pad/16, K_pad/64, 8 g, 4 c, 4 t, 4 register, 2 half): each thread's fragment elements."""
    b, n, k = codes.shape
    # n = rb*16 + br*8 + g ; k = (kb*4 + t)*16 + o*8 + c*2 + h
    x = codes.reshape(b, n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # b, rb, br, g, kb, t, o, c, h
    x = x.permute(0, 1, 4, 3, 7, 5, 6, 2, 8)  # b, rb, kb, g, c, t, o, br, h
    # register index = o*2 + br (R0=a01: o0 br0, R1=a23: o0 br1, R2=a45: o1 br0, R3=a67: o1 br1)
    return x.reshape(b, n // 16, k // 64, 8, 4, 4, 4, 2)


def _layout_shapes(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[tuple, tuple, int, int]:
    """The layout's ``values`` and ``scales`` shapes and the weight's ``(n, k)`` for plain parts;
    raises, naming the culprit, for parts that are not a packed NVFP4 weight."""
    if not isinstance(qdata, torch.Tensor) or qdata.dtype != torch.uint8:
        raise TypeError(f"to_hopper_layout: qdata must be a uint8 tensor (two E2M1 codes per byte), got "
                        f"{getattr(qdata, 'dtype', type(qdata).__name__)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"to_hopper_layout: scale must be a torch.float8_e4m3fn tensor (E4M3 block scales), got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if qdata.dim() < 2:
        raise ValueError(f"to_hopper_layout: qdata must be (..., N, K/2), got shape {tuple(qdata.shape)}")
    *lead, n, half_k = qdata.shape
    k = 2 * half_k
    if k % 16:
        raise ValueError(f"to_hopper_layout: K = {k} (qdata's last dim {half_k} x 2) is not a multiple of 16, "
                         "the NVFP4 block")
    if tuple(scale.shape) != (*lead, n, k // 16):
        raise ValueError(f"to_hopper_layout: scale has shape {tuple(scale.shape)}; qdata {tuple(qdata.shape)} "
                         f"needs {(*lead, n, k // 16)}")
    if scale.device != qdata.device:
        raise ValueError(f"to_hopper_layout: qdata is on {qdata.device}, scale on {scale.device}")
    row_blocks, k_blocks = triton.cdiv(n, ROW_PAD) * ROW_PAD // ROW_BLOCK, triton.cdiv(k, K_BLOCK)
    return (*lead, row_blocks, k_blocks, 32, 16), (*lead, row_blocks, k_blocks, 8, 8), n, k


def _out_mismatch(out, values_shape: tuple, scales_shape: tuple, n: int, k: int, device: torch.device) -> str | None:
    """Why ``out`` cannot take a layout of these shapes in place (None: it can)."""
    if not isinstance(out, HopperWeight):
        return f"out must be a HopperWeight, got {type(out).__name__}"
    for name, t, shape in (("values", out.values, values_shape), ("scales", out.scales, scales_shape)):
        if not isinstance(t, torch.Tensor):
            return f"out.{name} is a {type(t).__name__}, not a tensor"
        if t.dtype != torch.uint8:
            return f"out.{name} is {t.dtype}, not torch.uint8"
        if tuple(t.shape) != shape:
            return f"out.{name} has shape {tuple(t.shape)}, the layout of these parts has {shape}"
        if t.device != device:
            return f"out.{name} is on {t.device}, the parts on {device}"
        if not t.is_contiguous():
            return f"out.{name} is not contiguous"
    if (out.n, out.k) != (n, k):
        return f"out is the layout of an N x K = {out.n} x {out.k} weight, the parts are {n} x {k}"
    return None


def hopper_layout_fits(out, qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``out`` (an earlier layout, or anything) can take the layout of these parts in place."""
    return _out_mismatch(out, *_layout_shapes(qdata, scale), qdata.device) is None


def hopper_layout_destination(qdata: torch.Tensor, scale: torch.Tensor,
                              out: HopperWeight | None = None) -> HopperWeight:
    """Where the layout of these parts goes: ``out`` (checked) or new empty tensors. Raises, naming
    the culprit, for bad parts or an ``out`` of the wrong shape, dtype or device (nothing written)."""
    values_shape, scales_shape, n, k = _layout_shapes(qdata, scale)
    if out is None:
        return HopperWeight(torch.empty(values_shape, dtype=torch.uint8, device=qdata.device),
                            torch.empty(scales_shape, dtype=torch.uint8, device=qdata.device), n, k)
    problem = _out_mismatch(out, values_shape, scales_shape, n, k, qdata.device)
    if problem:
        raise ValueError(f"to_hopper_layout: {problem}")
    return out


def to_hopper_layout(qdata: torch.Tensor, scale: torch.Tensor, out: HopperWeight | None = None) -> HopperWeight:
    """Plain packed parts (``qdata`` uint8 (..., N, K/2), ``scale`` E4M3 (..., N, K/16)) -> the
    kernel layout. Padding rows / channels get code 0 and scale 0 (value 0).

    CUDA tensors: the Triton kernel (:func:`to_hopper_layout_triton`); others: the torch
    reference :func:`to_hopper_layout_reference` (same bytes). ``out``: an earlier layout of a
    weight of the same shape, rewritten in place (its tensors keep their addresses) and returned."""
    if qdata.is_cuda:
        return to_hopper_layout_triton(qdata, scale, out)
    dest = None if out is None else hopper_layout_destination(qdata, scale, out)  # checked before any write
    fresh = to_hopper_layout_reference(qdata, scale)
    if dest is None:
        return fresh
    dest.values.copy_(fresh.values)
    dest.scales.copy_(fresh.scales)
    return dest


def to_hopper_layout_reference(qdata: torch.Tensor, scale: torch.Tensor) -> HopperWeight:
    """:func:`to_hopper_layout` in torch ops (any device): the layout's definition, which the
    kernel is tested against, and the CPU path."""
    _layout_shapes(qdata, scale)
    lead = qdata.shape[:-2]
    n, kh = qdata.shape[-2:]
    k = kh * 2
    q = qdata.reshape(-1, n, kh)
    s = scale.reshape(-1, n, k // 16).view(torch.uint8)
    n_pad = triton.cdiv(n, ROW_PAD) * ROW_PAD
    k_pad = triton.cdiv(k, K_BLOCK) * K_BLOCK
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], n, k)
    codes = _pad(codes, n_pad, k_pad)
    frag = _fragment_codes(codes).to(torch.int32)  # (..., g, c, t, reg, half)
    mag, sign = frag & 0x7, (frag >> 3) & 0x1
    word = torch.zeros(frag.shape[:-2], dtype=torch.int32, device=qdata.device)  # (..., g, c, t)
    for (reg, half), (mag_bit, sign_bit) in _BIT_PLACES.items():
        word |= (mag[..., reg, half] << mag_bit) | (sign[..., reg, half] << sign_bit)
    # word (B, rb, kb, g, c, t) -> bytes (B, rb, kb, lane = 4g + c, 16 = 4 words x 4 bytes)
    values = word.contiguous().view(torch.uint8).reshape(q.shape[0], n_pad // 16, k_pad // 64, 32, 16)
    # scales: (B, N_pad, K_pad/16) -> (B, rb, br, g, kb, t) -> (B, rb, kb, g, t, br)
    sp = _pad(s, n_pad, k_pad // 16).reshape(q.shape[0], n_pad // 16, 2, 8, k_pad // 64, 4)
    scales = sp.permute(0, 1, 4, 3, 5, 2).reshape(q.shape[0], n_pad // 16, k_pad // 64, 8, 8)
    return HopperWeight(values.reshape(*lead, *values.shape[1:]).contiguous(),
                        scales.reshape(*lead, *scales.shape[1:]).contiguous(), n, k)


# --------------------------------------------------------------------------------------------
# The layout kernel (CUDA path of to_hopper_layout; the reference above is its spec)
# --------------------------------------------------------------------------------------------
#
# The Hopper weight layout built by a Triton kernel: plain NVFP4 parts -> lane words, one pass.
#
# Why: the layout (:mod:`quads.kernels.hopper.weight_layout`) is rebuilt at every weight sync; in
# torch ops (fragment permutes and a bit-placement loop over int32 copies of every code) it ran at
# 1% of the H200's bandwidth and was the sync's largest cost. This kernel reads each code byte and
# scale byte once and writes each layout byte once, with no intermediate tensor, into a given
# layout in place (the sync keeps the layout's addresses for captured CUDA graphs).
#
# What one work item does: item ``j`` = (row block ``rb``, k block ``kb``, row ``g``) of one weight
# (or expert), numbered as the layout's memory is laid out, so item ``j`` owns bytes
# ``[64 j, 64 j + 64)`` of ``values`` (lanes ``4g .. 4g+3`` of the 16 x 64 tile) and bytes
# ``[8 j, 8 j + 8)`` of ``scales``. It reads the 32 code bytes (eight int32 words) of rows
# ``g`` and ``g + 8`` of the tile and their four scale bytes each:
#
# * code word ``w = 2t + o`` of row ``br*8 + g`` holds in its byte ``c`` the codes of channels
#   ``t*16 + o*8 + c*2 + (0, 1)``: the fragment register ``o*2 + br`` of lane ``4g + c``, k16 tile
#   ``t``; :func:`_place` puts the byte's two codes at that register's bits (``_BIT_PLACES``);
# * lane word ``(c, t)`` is the OR of those four placed bytes; scale byte ``t*2 + br`` is the
#   scale of row ``br*8 + g``, k16 block ``kb*4 + t``.
#
# Rows past N and channels past K read as code 0 / scale 0 (masked loads), which is the padding.
# A thread owns whole items (no data crosses threads: no shared memory, no atomics). Consecutive
# items are consecutive rows of the same k block, so a warp's two loads of a row read 8 rows x 128
# contiguous bytes and its four stores write 2 KB contiguous; per item 4 + 4 16-byte code/value
# accesses (K a multiple of 128; narrower otherwise) and 4-byte scale loads (K a multiple of 256),
# one 8-byte scale store. Compiled for sm_90 (Triton 3.6): 64 registers, no spills, no layout
# conversion. Bit-identical to :func:`~quads.kernels.hopper.weight_layout.to_hopper_layout_reference`
# (tests/kernels).

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
    (num_items * 16), SCALES uint8 (num_items * 8); items as in the comment above."""
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
    """:func:`to_hopper_layout` by the kernel (any device Triton
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


def from_hopper_layout(w: HopperWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_hopper_layout`: plain ``(qdata, scale)`` (padding dropped)."""
    lead = w.values.shape[:-4]
    v = w.values.reshape(-1, *w.values.shape[-4:])
    b, rbs, kbs = v.shape[:3]
    word = v.contiguous().view(torch.int32).reshape(b, rbs, kbs, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF
    frag = torch.zeros(b, rbs, kbs, 8, 4, 4, 4, 2, dtype=torch.int64, device=v.device)
    for (reg, half), (mag_bit, sign_bit) in _BIT_PLACES.items():
        frag[..., reg, half] = ((word >> mag_bit) & 0x7) | (((word >> sign_bit) & 0x1) << 3)
    # invert _fragment_codes: (b, rb, kb, g, c, t, o, br, h) -> (b, rb, br, g, kb, t, o, c, h)
    x = frag.reshape(b, rbs, kbs, 8, 4, 4, 2, 2, 2).permute(0, 1, 7, 3, 2, 5, 6, 4, 8)
    codes = x.reshape(b, rbs * 16, kbs * 64)[:, : w.n, : w.k].to(torch.uint8)
    qdata = codes[..., 0::2] | (codes[..., 1::2] << 4)
    s = w.scales.reshape(b, rbs, kbs, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(b, rbs * 16, kbs * 4)
    scale = s[:, : w.n, : w.k // 16].contiguous().view(torch.float8_e4m3fn)
    return qdata.reshape(*lead, w.n, w.k // 2), scale.reshape(*lead, w.n, w.k // 16)
