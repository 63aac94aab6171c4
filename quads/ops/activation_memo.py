"""The last quantized activation, reused when the next linear gets the same input.

In a transformer block several linears read one tensor: ``q_proj``, ``k_proj`` and ``v_proj``
the attention input, ``gate_proj`` and ``up_proj`` the MLP input. Quantized once per linear
that is 7 quantizations per layer where 4 distinct inputs exist. Two memos keep one entry
each: the result for the most recent input, returned again while the next call has the same
input tensor (same storage object, offset, shape, strides, dtype, unchanged version counter)
and the same configuration. An entry holds a detached alias of its input, so the storage
cannot be freed and its address reused by another tensor while the entry exists; any in-place
write through the dispatcher bumps the version counter and misses.

* :func:`memo_last` (torch reference; always on): the quantized activation and its float32
  expansion.
* :func:`shared_operands` (kernel path): the fused quantization's GEMM operands, reused only
  inside a :func:`share_activation_quantization` block (the graphed decoder opens one around
  every model forward) and dropped when the outermost block exits, so no entry outlives a
  forward (no graph-pool tensor kept alive, no activation kept resident). Inside a CUDA-graph
  capture the hit is decided at capture time from tensor identity: the graph then holds one
  quantization whose output buffers the sibling GEMMs read, and every replay recomputes them
  from the new values written into the same input buffer.

Never memoised: inference-mode tensors (no version counter: an in-place write between two
linears could not be seen), tensor subclasses, meta tensors, code being traced by
``torch.compile``, and the bodies of the ``quads::`` custom ops (:func:`sharing_suspended`):
compiled code runs them with ``is_compiling()`` False, and inductor reuses buffers (and
cudagraph trees overwrite outputs) by writing through raw pointers that bump no version
counter, so identity there says nothing about values. Writes that bypass the dispatcher (a raw
Triton kernel writing into an existing tensor) are invisible to the check in eager code too;
transformers' decoder layers have none between sibling projections.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable

import torch

__all__ = ["memo_last", "clear_activation_memo", "share_activation_quantization", "sharing_suspended",
           "shared_operands", "sharing_active"]

_slots: dict[str, list[Any]] = {}  # slot -> [key, alias of the input, value]
_scope = threading.local()  # .depth (open sharing blocks), .suspended, .entry: [key, alias, value] | None


def _key(x: torch.Tensor, extra: Hashable) -> tuple:
    return (x.untyped_storage()._cdata, x.data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()),
            x.dtype, x.device, x._version, extra)


def _memoisable(x: torch.Tensor) -> bool:
    return not (torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_inference()
                or x.device.type == "meta")


def memo_last(slot: str, x: torch.Tensor, extra: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()`` for input ``x`` and configuration ``extra`` (hashable, no tensors); the
    previous result of this ``slot`` if both match."""
    if not _memoisable(x):
        return compute()
    key = _key(x, extra)
    last = _slots.get(slot)
    if last is not None and last[0] == key:
        return last[2]
    value = compute()
    _slots[slot] = [key, x.detach(), value]
    return value


def clear_activation_memo() -> None:
    """Drop the remembered activations (frees their memory)."""
    _slots.clear()
    _scope.entry = None


def sharing_active() -> bool:
    """True inside :func:`share_activation_quantization` and outside :func:`sharing_suspended`."""
    return getattr(_scope, "depth", 0) > 0 and not getattr(_scope, "suspended", False)


@contextlib.contextmanager
def share_activation_quantization(enabled: bool = True):
    """Inside the block, kernel-path linears that read the same input tensor with the same
    activation configuration quantize it once (:func:`shared_operands`). ``enabled=False``: a
    no-op block (callers that make sharing optional)."""
    if not enabled:
        yield
        return
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1
        if _scope.depth == 0:
            _scope.entry = None


@contextlib.contextmanager
def sharing_suspended():
    """No sharing inside the block (the custom ops' bodies, see the module doc)."""
    was = getattr(_scope, "suspended", False)
    _scope.suspended = True
    try:
        yield
    finally:
        _scope.suspended = was


def shared_operands(x: torch.Tensor, extra: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()`` for input ``x`` and configuration ``extra``, or the value of the previous
    call inside the current sharing block if both match. A miss drops the previous entry
    before computing (its memory is free again for the new operands)."""
    if torch.compiler.is_compiling() or not sharing_active() or not _memoisable(x):
        return compute()
    key = _key(x, extra)
    last = getattr(_scope, "entry", None)
    if last is not None and last[0] == key:
        return last[2]
    _scope.entry = None
    value = compute()
    _scope.entry = [key, x.detach(), value]
    return value
