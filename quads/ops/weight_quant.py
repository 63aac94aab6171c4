"""Weight quantization (the op every trainer -> rollout sync runs): reference and kernel glue.

The reference is the recipe itself (:func:`quads.tensor.nvfp4_math.nvfp4_quantize`); the Triton
path (an amax pass, then a tile quantizer with the given global scales) returns the same bits
and is what makes a sync cheap on the GPU. Triton is optional: its glue imports it on first use.

Both take an optional ``global_encode_scale``: the sharded sync quantizes each rank's rows of a
weight with the scale of the *whole* weight (from an all-reduced amax), which gives the rows
the bits a quantization of the whole weight gives them.
"""

from __future__ import annotations

import torch

from quads.tensor.nvfp4_math import (
    GLOBAL_SCALE_GRANULARITIES,
    NVFP4Parts,
    check_block_scaling,
    check_quantizable,
    default_granularity,
    global_encode_scale_from_amax,
    nvfp4_dequantize,
    nvfp4_quantize,
)

from quads.ops.backend_registry import Backend, get_backend, select_backend
from quads.ops.compile_alignment import align_this_compile

__all__ = ["quantize_weight", "quantize_weight_op", "quantize_weight_reference", "quantize_weight_triton",
           "fake_quantize_weight_reference", "fake_quantize_weight_triton", "GroupAmaxBits", "group_amax_bits_triton"]


def quantize_weight_reference(
    x: torch.Tensor, granularity: str | None = None, global_encode_scale: torch.Tensor | None = None,
    block_scaling: str = "6",
) -> NVFP4Parts:
    """The NVFP4 parts of a weight (the recipe); ``global_encode_scale`` (group-shaped) skips the
    amax; ``block_scaling``: ``"6"`` or ``"4over6"`` (:func:`~quads.tensor.nvfp4_math.nvfp4_quantize`)."""
    return nvfp4_quantize(x, granularity, global_encode_scale, block_scaling, check_values=False)  # quads' own scales


def quantize_weight_triton(
    x: torch.Tensor, granularity: str | None = None, global_encode_scale: torch.Tensor | None = None,
    block_scaling: str = "6",
) -> NVFP4Parts:
    """Kernel twin of :func:`quantize_weight_reference` (same bits): amax pass + quantization pass
    (the amax pass is skipped when ``global_encode_scale`` is given)."""
    from quads.kernels.amax import amax_rows
    from quads.kernels.quantize_weights import quantize_given_scale

    check_quantizable(x, "weight")
    check_block_scaling(block_scaling)
    gran = granularity or default_granularity(x)
    if gran not in GLOBAL_SCALE_GRANULARITIES:
        raise ValueError(f"unknown global-scale granularity {gran!r}; use one of {GLOBAL_SCALE_GRANULARITIES}")
    if gran == "expert" and x.dim() != 3:
        raise ValueError(f"'expert' global scales need a 3-D (experts, N, K) tensor, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    x2 = x.detach().reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != k):
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if gran == "tensor":
        per_group, groups = max(rows, 1), ()
    elif gran == "expert":
        per_group, groups = max(rows // max(x.shape[0], 1), 1), tuple(x.shape[:1])
    else:  # row
        per_group, groups = 1, lead
    if global_encode_scale is None:
        amax = amax_rows(x2).reshape(groups + (-1,)).amax(dim=-1) if rows else x2.new_zeros(groups, dtype=torch.float32)
        gs = global_encode_scale_from_amax(amax, block_scaling)
    else:
        gs = global_encode_scale.to(dtype=torch.float32, device=x.device).expand(groups).contiguous()
    if rows == 0:
        q = torch.empty(lead + (k // 2,), dtype=torch.uint8, device=x.device)
        s = torch.empty(lead + (k // 16,), dtype=torch.float8_e4m3fn, device=x.device)
        return NVFP4Parts(q, s, gs)
    q, s, _ = quantize_given_scale(x2, gs.reshape(-1), per_group, block_scaling=block_scaling)
    return NVFP4Parts(q.view(lead + (k // 2,)), s.view(torch.float8_e4m3fn).view(lead + (k // 16,)), gs)


class GroupAmaxBits:
    """A sibling group's shared global scale as the kernel fake quantizer takes it: the ``|w|``
    bit-pattern max over every member's master (``bits``, (1,) int32), not yet ``S_enc``.

    :func:`fake_quantize_weight_triton` given this instead of a scale runs its fused pass from
    these bits (no amax pass of its own): the pass derives ``S_enc`` as it does from a weight's
    own amax (``global_encode_scale_from_amax``, bit for bit) and returns it, so each member gets
    the group's ``S_enc`` and the backward's recomputation reuses it. Made by
    :func:`group_amax_bits_triton` (the kernel backends' ``group_scale``)."""

    __slots__ = ("bits",)

    def __init__(self, bits: torch.Tensor):
        self.bits = bits


def group_amax_bits_triton(masters) -> GroupAmaxBits:
    """The group's amax bits of the whole weights ``masters``: one zeroed int32 buffer and one
    amax kernel pass per master into it (:func:`quads.kernels.fake_quantize_nvfp4.shared_amax_bits`)."""
    from quads.kernels.fake_quantize_nvfp4 import shared_amax_bits

    return GroupAmaxBits(shared_amax_bits(masters))


def _fake_quant_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    dtype = dtype or x.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"fake quantization writes float32/bfloat16/float16, got {dtype}")
    return dtype


def fake_quantize_weight_reference(
    x: torch.Tensor, dtype: torch.dtype | None = None, global_encode_scale: torch.Tensor | None = None,
    block_scaling: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(DQ(Q(x)) in dtype, S_enc)`` of a weight (``dtype`` default ``x.dtype``): the recipe
    (:func:`~quads.tensor.nvfp4_math.nvfp4_fake_quantize`; one global scale per 2-D weight, one
    per expert of a 3-D one); the float32 result is cast to ``dtype`` once. Passing back the
    returned ``global_encode_scale`` skips the amax (the backward's recomputation does).
    ``block_scaling``: ``"6"`` or ``"4over6"``."""
    check_quantizable(x, "weight")
    dtype = _fake_quant_dtype(x, dtype)
    parts = nvfp4_quantize(x.detach(), None, global_encode_scale, block_scaling, check_values=False)  # quads' own scales
    return nvfp4_dequantize(*parts, dtype=dtype), parts.global_encode_scale


def fake_quantize_weight_triton(
    x: torch.Tensor, dtype: torch.dtype | None = None,
    global_encode_scale: torch.Tensor | GroupAmaxBits | None = None,
    block_scaling: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel twin of :func:`fake_quantize_weight_reference` (same bits): an amax pass (skipped
    when ``global_encode_scale`` is given), then one fused pass that reads the master once and
    writes ``DQ(Q(x))`` in ``dtype`` (:mod:`quads.kernels.fake_quantize_nvfp4`).
    ``global_encode_scale`` may also be a 2-D weight's sibling group's :class:`GroupAmaxBits`:
    the fused pass then derives the group's ``S_enc`` from those bits (and returns it)."""
    check_quantizable(x, "weight")
    dtype = _fake_quant_dtype(x, dtype)
    nd = x.dim()
    if nd > 3:
        raise ValueError(f"weight fake quantization takes 1-D/2-D weights or 3-D experts, got shape {tuple(x.shape)}")
    shape = x.shape
    x2 = x.detach()
    if nd != 2:
        x2 = x2.reshape(-1, shape[-1])
    per_group = shape[1] if nd == 3 else x2.shape[0]  # "expert" for 3-D, "tensor" otherwise
    groups = shape[:1] if nd == 3 else ()
    if per_group == 0:
        gs = torch.ones(groups, dtype=torch.float32, device=x.device)
        return torch.empty(shape, dtype=dtype, device=x.device), gs
    if type(global_encode_scale) is GroupAmaxBits:
        out, gs = _fake_quantize_rows()(x2, per_group, dtype, None, shape, global_encode_scale.bits, block_scaling)
    else:
        out, gs = _fake_quantize_rows()(x2, per_group, dtype, global_encode_scale, shape, None, block_scaling)
    return out, (gs if nd == 3 else gs.view(()))  # (E,) per expert, () per tensor


_FAKE_QUANTIZE_ROWS = []


def _fake_quantize_rows():
    """:func:`quads.kernels.fake_quantize_nvfp4.fake_quantize_rows`, imported on first use (Triton
    is optional) and then held here: an ``import`` statement in the function costs a microsecond
    or two of host time per call."""
    if not _FAKE_QUANTIZE_ROWS:
        from quads.kernels.fake_quantize_nvfp4 import fake_quantize_rows

        _FAKE_QUANTIZE_ROWS.append(fake_quantize_rows)
    return _FAKE_QUANTIZE_ROWS[0]


@torch.library.custom_op("quads::quantize_weight", mutates_args=())
def quantize_weight_op(x: torch.Tensor, granularity: str, backend: str,
                       block_scaling: str = "6") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight's NVFP4 parts (the sync op) through the backend, as an op opaque to ``torch.compile``."""
    return tuple(get_backend(backend).quantize_weight(x, granularity, None, block_scaling))


@quantize_weight_op.register_fake
def _(x, granularity, backend, block_scaling="6"):
    align_this_compile()
    lead, k = x.shape[:-1], x.shape[-1]
    gs_shape = {"tensor": (), "expert": x.shape[:1], "row": lead}[granularity]
    return (x.new_empty(*lead, k // 2, dtype=torch.uint8), x.new_empty(*lead, k // 16, dtype=torch.float8_e4m3fn),
            x.new_empty(gs_shape, dtype=torch.float32))


def quantize_weight(x: torch.Tensor, granularity: str | None = None, backend: Backend | None = None,
                    block_scaling: str = "6") -> NVFP4Parts:
    """NVFP4 parts of a weight; identical bits whichever backend runs (None: picked for ``x``'s device)."""
    return (backend or select_backend(x.device)).quantize_weight(x, granularity, None, block_scaling)
