"""Arrival counters of the split-K GEMMs: int32 zeros a kernel's last program per tile resets.

The split-K kernels (decode and prefill) count arriving programs per output tile; the last
one adds the partial sums in segment order and resets its counter to zero, so a buffer is
zero again after every launch and can be reused by the next launch on the same stream.

Eager launches share one cached buffer per (device, stream). Inside a CUDA-graph capture a
cached buffer would be wrong twice over: allocated during the capture it lives in the graph's
private memory pool (freed with the graph, while the cache still points at it), and a buffer
from outside would tie the graph to memory the cache may later replace. So a capture gets a
fresh buffer (its zeroing is captured too: a ~1 us memset per call), owned by the graph's pool
for the graph's lifetime.
"""

from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

_CACHE: dict = {}


def arrival_counters(device: torch.device, n: int, minimum: int = 1024) -> torch.Tensor:
    """An int32 buffer of at least ``n`` zeros for one split-K launch on the current stream."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(n, minimum), dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _CACHE.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, minimum), dtype=torch.int32, device=device)
        _CACHE[key] = buf
    return buf
