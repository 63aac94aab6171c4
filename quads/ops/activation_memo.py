"""The last quantized activation, reused when the next reference linear gets the same input.

In a transformer block several linears read one tensor: ``q_proj``, ``k_proj`` and ``v_proj``
the attention input, ``gate_proj`` and ``up_proj`` the MLP input. The reference W4A4 linear
quantizes its input (and the residual) and expands it to float32 GEMM operands; done once per
linear that is 7 quantizations per layer where 4 distinct inputs exist. :func:`memo_last`
keeps one entry: the result for the most recent input, returned again while the next call has
the same input tensor (same storage, offset, shape, strides, dtype, unchanged version counter)
and the same configuration. The entry holds a detached alias of that input, so its storage
cannot be freed and reused by another tensor while the entry exists; any in-place write bumps
the version counter and misses. One entry only: memory is one activation and its operands.

Used by the torch reference only (the kernels fuse quantization into one launch anyway);
inference-mode tensors (no version counter) and traced code are never memoised.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

__all__ = ["memo_last", "clear_activation_memo"]

_slots: dict[str, list[Any]] = {}  # slot -> [key, alias of the input, value]


def _key(x: torch.Tensor, extra: Hashable) -> tuple:
    return (x.data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device,
            x._version, extra)


def memo_last(slot: str, x: torch.Tensor, extra: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()`` for input ``x`` and configuration ``extra`` (hashable, no tensors); the
    previous result of this ``slot`` if both match."""
    if torch.compiler.is_compiling() or x.is_inference() or type(x) is not torch.Tensor or x.device.type == "meta":
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
