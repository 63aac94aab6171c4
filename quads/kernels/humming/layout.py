"""humming's weight layout for NVFP4 weights and 16-bit activations, restated in torch (no humming import).

humming 0.1.19 repacks a packed 4-bit weight for 16-bit activations with one CUDA kernel
(``weight_repack_nk`` in ``humming/include/humming/kernel/process.cuh``, launched by
``humming.ops.repack_weight``; here: float e2m1 weight, no zero point, ``interleave_mode`` 3, no
packed-K layout, no native dequant, K a multiple of 64). Read off that kernel it is a pure
permutation of the 4-bit codes, separable into digit permutations:

* source code ``W[e, n, k]`` with ``n = 64 bx + 8 (2 kk + i4) + tb`` and
  ``k = 64 by + 8 (2 i + i5) + 2 td + i6``;
* output int32 ``L[e, 4 by + i, 128 bx + 16 tb + 4 td + kk]`` (shape ``(E, K/16, 2N)``), nibble
  ``m = 4 i6 + 2 i4 + i5`` (nibble ``m`` = bits ``4m..4m+3``).

The block scales go through ``transform_humming_weight_scale`` (transpose to ``(G, N)``, then a
permutation of each run of 32 or 64 values: :func:`scale_permutation`).

:func:`repack_reference` and :func:`unrepack_reference` are this permutation and its inverse:
the CPU stand-in for humming's kernel in the tests, and the packed parts derived on demand from
humming's layout (:meth:`quads.ops.backends.humming.library.HummingNVFP4.packed_parts`; the GPU run
checks both bit-exact against humming's own kernel before anything relies on them).

**Padding.** Other shapes than humming's tile multiples are held in the layout of their padded
shape (:func:`humming_padded_shape`): :func:`pad_parts` appends zero codes and zero block scales
(padded outputs exactly 0, padded K adds exactly 0); :func:`humming_padding_cost` is its memory.
"""

from __future__ import annotations

import functools

import torch

from quads.tensor.nvfp4_math import pack_e2m1, unpack_e2m1

__all__ = ["HUMMING_K_MULTIPLE", "HUMMING_N_MULTIPLE", "humming_padded_shape", "humming_padding_cost", "pad_parts",
           "repack_reference", "scale_layout", "scale_permutation", "scale_unlayout", "unpad_parts",
           "unrepack_reference"]

#: humming 0.1.19's sm_90 tile multiples (read off its heuristics and ``check_shape``: the rule's
#: reasons are in :func:`quads.ops.backends.humming.backend.humming_shape_problem`)
HUMMING_N_MULTIPLE, HUMMING_K_MULTIPLE = 128, 64


def humming_padded_shape(n: int, k: int) -> tuple[int, int]:
    """``(N, K)`` of the humming layout that holds a weight of ``n`` outputs by ``k`` inputs: each
    rounded up to humming's tile multiple (the shape itself where it is one)."""
    return -(-n // HUMMING_N_MULTIPLE) * HUMMING_N_MULTIPLE, -(-k // HUMMING_K_MULTIPLE) * HUMMING_K_MULTIPLE


def humming_padding_cost(n: int, k: int) -> float:
    """Bytes of the padded layout / bytes of the unpadded one (codes and block scales both grow with
    ``N x K``; per expert the same): 1.0 for a shape humming tiles as it is."""
    n_pad, k_pad = humming_padded_shape(n, k)
    return (n_pad * k_pad) / (n * k)


def pad_parts(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``qdata`` (.., N, K/2) and ``scale`` (.., N, K/16) in the padded shape
    (:func:`humming_padded_shape`): zero codes and zero scales appended (the parts themselves
    where no padding is needed)."""
    n, k = qdata.shape[-2], qdata.shape[-1] * 2
    n_pad, k_pad = humming_padded_shape(n, k)
    if (n_pad, k_pad) == (n, k):
        return qdata, scale
    q = qdata.new_zeros((*qdata.shape[:-2], n_pad, k_pad // 2))
    s = torch.zeros((*scale.shape[:-2], n_pad, k_pad // 16), dtype=torch.uint8, device=scale.device)
    q[..., :n, : k // 2] = qdata
    s[..., :n, : k // 16] = scale.view(torch.uint8)
    return q, s.view(scale.dtype)


def unpad_parts(qdata: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed parts of an ``n x k`` weight held padded (:func:`pad_parts`' inverse; new tensors
    where padded)."""
    if tuple(qdata.shape[-2:]) == (n, k // 2):
        return qdata, scale
    return qdata[..., :n, : k // 2].contiguous(), scale[..., :n, : k // 16].contiguous()


# source axes after reshaping (E, N, K) codes to (E, bx, kk, i4, tb, by, i, i5, td, i6)
_SRC = ("bx", "kk", "i4", "tb", "by", "i", "i5", "td", "i6")
# output axes: row (by, i), column (bx, tb, td, kk), nibble (i6, i4, i5)
_OUT = ("by", "i", "bx", "tb", "td", "kk", "i6", "i4", "i5")


def _check(n: int, k: int) -> None:
    if n % 64 or k % 64:
        raise ValueError(f"the humming layout restated here needs N and K multiples of 64, got N={n}, K={k}")


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 8) uint8 codes -> (...,) int32, code m in bits 4m..4m+3 (little-endian bytes)."""
    b = pack_e2m1(codes)  # (..., 4) bytes: code 2p low nibble, 2p+1 high
    return b.contiguous().view(torch.int32).squeeze(-1)


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    return unpack_e2m1(words.contiguous().unsqueeze(-1).view(torch.uint8))  # (..., 8)


def repack_reference(qdata: torch.Tensor) -> torch.Tensor:
    """humming's repacked weight (int32, ``(E, K/16, 2N)`` or ``(K/16, 2N)``) of packed NVFP4
    ``qdata`` (uint8 ``(E, N, K/2)`` or ``(N, K/2)``): the module doc's permutation."""
    dense = qdata.dim() == 2
    q = qdata.unsqueeze(0) if dense else qdata
    e, n, k = q.shape[0], q.shape[1], q.shape[2] * 2
    _check(n, k)
    codes = unpack_e2m1(q).reshape(e, n // 64, 4, 2, 8, k // 64, 4, 2, 4, 2)
    order = [0] + [1 + _SRC.index(a) for a in _OUT]
    out = _pack_nibbles(codes.permute(order).reshape(e, k // 16, 2 * n, 8))
    return out.squeeze(0) if dense else out


def unrepack_reference(layout: torch.Tensor) -> torch.Tensor:
    """The packed NVFP4 ``qdata`` (uint8) a humming layout (:func:`repack_reference`) holds: its inverse."""
    dense = layout.dim() == 2
    lay = layout.unsqueeze(0) if dense else layout
    e, k, n = lay.shape[0], lay.shape[1] * 16, lay.shape[2] // 2
    _check(n, k)
    codes = _unpack_nibbles(lay).reshape(e, k // 64, 4, n // 64, 8, 4, 4, 2, 2, 2)
    order = [0] + [1 + _OUT.index(a) for a in _SRC]
    q = pack_e2m1(codes.permute(order).reshape(e, n, k))
    return q.squeeze(0) if dense else q


def scale_permutation(apply_on_c: bool, device=None) -> torch.Tensor:
    """The index permutation humming's ``transform_humming_weight_scale`` applies to each run of
    transposed block scales (its ``perm_new``); one tensor per device, made once, so a weight
    write captured in a CUDA graph copies nothing from the host."""
    return _scale_permutation(apply_on_c, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=None)
def _scale_permutation(apply_on_c: bool, device: torch.device) -> torch.Tensor:
    perm = [0, 1, 8, 9, 16, 17, 24, 25] if apply_on_c else [0, 8, 16, 24, 32, 40, 48, 56]
    count = sum(x < 8 for x in perm)
    full = [x + count * i for i in range(8 // count) for x in perm]
    return torch.tensor(full, dtype=torch.long, device=device)


def scale_layout(scale: torch.Tensor, apply_on_c: bool) -> torch.Tensor:
    """humming's block-scale layout of ``scale`` (.., N, G) (restates ``transform_humming_weight_scale``
    on a non-PPU device, no block-scaled MMA): (.., G, N)."""
    perm = scale_permutation(apply_on_c, scale.device)
    t = scale.transpose(-1, -2).contiguous()
    return t.view(torch.uint8).view(-1, perm.numel())[:, perm].contiguous().view(t.dtype).view(t.shape)


def scale_unlayout(ws: torch.Tensor, apply_on_c: bool) -> torch.Tensor:
    """The block scales (.., N, G) a humming block-scale layout (.., G, N) holds: :func:`scale_layout`'s inverse."""
    inv = torch.argsort(scale_permutation(apply_on_c, ws.device))
    t = ws.contiguous().view(torch.uint8).view(-1, inv.numel())[:, inv].contiguous().view(ws.dtype).view(ws.shape)
    return t.transpose(-1, -2).contiguous()
