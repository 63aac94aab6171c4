"""MoE routing in one launch: (token, choice) rows grouped by expert, for small problems.

One program holds every row (``R = T * top_k <= MAX_ROWS``) and every expert (``E + 2 <=
MAX_BINS``). The keys are the expert ids, ids outside ``[0, E)`` (expert-parallel sentinels)
mapped to ``E``; a bitonic sort (``tl.sort``) of the unique composites ``key * BLOCK + row``
gives the stable order; a histogram of the keys gives the counts and their exclusive prefix sum
the offsets. The outputs are those of ``torch.argsort(key, stable=True)`` and the scatter-add
counts (int64, bit for bit): the decode step's routing in one kernel instead of a radix sort
and about eight small kernels. No host synchronisation, static shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_BINS", "MAX_ROWS", "routing_fits", "moe_routing"]

#: the most rows (T * top_k) one program sorts
MAX_ROWS = 2048
#: the most histogram bins (E experts, the sentinels' bin, the padding lanes' bin)
MAX_BINS = 1024


@triton.jit
def _moe_routing_kernel(IDS, R, E, TOP_K, OFFSETS, COUNTS, ORDER, TOKEN, BLOCK: tl.constexpr, BINS: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < R
    ids = tl.load(IDS + i, mask=live, other=0)
    key = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    key = tl.where(live, key, BINS - 1)  # padding lanes: a bin above every real key, sorted last
    counts = tl.histogram(key, BINS)
    b = tl.arange(0, BINS)
    tl.store(COUNTS + b, counts.to(tl.int64), mask=b <= E)
    tl.store(OFFSETS + b, (tl.cumsum(counts, 0) - counts).to(tl.int64), mask=b <= E)
    order = (tl.sort(key * BLOCK + i) % BLOCK).to(tl.int64)  # composites unique: the sort is stable
    tl.store(ORDER + i, order, mask=live)
    tl.store(TOKEN + i, order // TOP_K, mask=live)


def routing_fits(num_rows: int, num_experts: int) -> bool:
    """Whether one program holds the problem."""
    return num_rows <= MAX_ROWS and num_experts + 2 <= MAX_BINS


def moe_routing(flat: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """``flat`` (R,) int64 expert ids -> ``(order, counts (E+1,), offsets (E+1,), token_of_row)``,
    all int64: the stable sort by expert (sentinels last), the rows per key (the last: the
    sentinels), the exclusive prefix sum of the counts, ``order // top_k``."""
    r = flat.numel()
    if not routing_fits(r, num_experts):
        raise ValueError(f"moe_routing: {r} rows over {num_experts} experts exceed one program "
                         f"({MAX_ROWS} rows, {MAX_BINS - 2} experts)")
    flat = flat.contiguous()
    e1 = num_experts + 1
    buf = torch.empty(2 * e1 + 2 * r, dtype=torch.int64, device=flat.device)  # one allocation
    offsets, counts, order, token = buf[:e1], buf[e1:2 * e1], buf[2 * e1:2 * e1 + r], buf[2 * e1 + r:]
    block = triton.next_power_of_2(max(r, 16))
    bins = max(32, triton.next_power_of_2(num_experts + 2))
    _moe_routing_kernel[(1,)](flat, r, num_experts, top_k, offsets, counts, order, token, BLOCK=block, BINS=bins,
                              num_warps=4 if block <= 1024 else 8)
    return order, counts, offsets, token
