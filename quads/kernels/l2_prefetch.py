"""Bulk L2 prefetch of a contiguous byte range, issued at a kernel's start (Hopper and newer).

A decode GEMM is a stream of weight bytes; in Triton a program keeps only as many loads in
flight as its registers (or its software pipeline's shared-memory stages) hold, which is far
less than HBM needs to run at bandwidth (bandwidth x latency ~ 3 MB across the GPU). A program
that owns a contiguous slab of the weight (a row tile of the Hopper layout: every K block of
its row blocks) asks the memory system for the whole slab at once with
``cp.async.bulk.prefetch.L2`` (the TMA unit fetches it; no registers, no shared memory), then
runs its normal loop, whose loads now hit L2 lines that are arriving or have arrived.
Prefetching has no effect on results. Not for the interpreter (PTX).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["prefetch_l2", "PREFETCH_CHUNK"]

#: bytes per prefetch instruction
PREFETCH_CHUNK = 16384

_PREFETCH_PTX = tl.constexpr(
    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def prefetch_l2(base, nbytes, CHUNK: tl.constexpr = PREFETCH_CHUNK):
    """Prefetch bytes ``[base, base + nbytes)`` into L2 (``base`` 16-byte aligned, ``nbytes`` a
    multiple of 16): chunk ``i`` of ``CHUNK`` bytes by the thread holding element ``i`` of a
    128-element range (one instruction per chunk, not one per warp: lanes without a chunk are
    predicated off)."""
    for c0 in range(0, tl.cdiv(nbytes, CHUNK), 128):
        c = c0 + tl.arange(0, 128)
        size = tl.where(c * CHUNK < nbytes, tl.minimum(nbytes - c * CHUNK, CHUNK), 0)
        tl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l,r", [base + c.to(tl.int64) * CHUNK, size],
                                  dtype=tl.int32, is_pure=False, pack=1)
