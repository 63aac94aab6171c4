"""The NVFP4 recipe: the one implementation of the quantization math in quads.

Every other path (the trainer's fake quantizer, the rollout's weight packing, online
activation quantization, the residual compensation and the references the Triton kernels
are checked against) calls the functions in this module. The recipe is NVIDIA's, as
implemented by TransformerEngine / ModelOpt; ``docs/nvfp4_spec.md`` states it with the
tie table and the NaN/Inf behaviour. All arithmetic is float32.

Layout conventions
------------------
* Blocks of 16 elements run along the last dimension ``K`` (which must be a multiple of 16).
* ``qdata``: uint8, shape ``(..., K/2)``, two E2M1 codes per byte, **even element in the low
  nibble**. Bit 3 of a code is the sign, bits 0-2 the magnitude index into
  ``E2M1_VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``.
* ``scale``: float8_e4m3fn, shape ``(..., K/16)``, plain row-major (no swizzle).
* ``global_encode_scale``: float32 ``S_enc = 448*6/amax``; multiply to encode, divide to
  decode. Its shape is the "global-scale group" shape: ``()`` for one scale per tensor,
  ``(E,)`` for one per expert of a 3-D weight, ``x.shape[:-1]`` for one per row (token).

Block scaling (``block_scaling``)
---------------------------------
* ``"6"`` (default): every block's max maps to E2M1's 6, NVIDIA's recipe.
* ``"4over6"``: Four Over Six (Cook et al., arXiv 2512.02010): each block's max mapped to 6 and
  to 4, the candidate of smaller squared error kept (:func:`block_squared_error`), with
  ``S_enc = 256*6/amax``; standard NVFP4 (docs/nvfp4_spec.md states it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "E2M1_VALUES",
    "NVFP4Parts",
    "check_quantizable",
    "e2m1_codes_rne",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "global_encode_scale_from_amax",
    "global_amax",
    "shared_global_encode_scale",
    "default_granularity",
    "GLOBAL_SCALE_GRANULARITIES",
    "check_global_encode_scale",
    "BLOCK_SCALINGS",
    "check_block_scaling",
    "block_squared_error",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# float32(1/6), as the recipe multiplies by it (one rounding in block_amax * (S_enc * (1/6))).
_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()

_SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Global-scale granularity names accepted by `nvfp4_quantize`.
GLOBAL_SCALE_GRANULARITIES = ("tensor", "expert", "row")

#: Block-scale rules accepted by `nvfp4_quantize` (module doc): "6" (NVIDIA's) or "4over6".
BLOCK_SCALINGS = ("6", "4over6")
# S_enc = numerator / amax: the group's amax maps to E4M3 448 (x 6), or to 256 under 4over6,
# which leaves room for the max-to-4 candidate's 1.5x larger block scale (256 * 1.5 = 384).
_GLOBAL_SCALE_NUMERATORS = {"6": E4M3_MAX * E2M1_MAX, "4over6": 256.0 * E2M1_MAX}


class NVFP4Parts(NamedTuple):
    """The three stored pieces of an NVFP4-quantized tensor."""

    qdata: torch.Tensor  # uint8 (..., K/2)
    scale: torch.Tensor  # float8_e4m3fn (..., K/16)
    global_encode_scale: torch.Tensor  # float32, group shape (see module doc)


def check_quantizable(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise a clear error if ``x`` cannot be NVFP4-quantized (dtype, rank, K % 16)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT_DTYPES:
        raise TypeError(
            f"{what}: NVFP4 quantization takes float32/bfloat16/float16, got {x.dtype}"
        )
    if x.dim() < 1:
        raise ValueError(f"{what}: cannot quantize a 0-d tensor")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"{what}: the last dimension (K={x.shape[-1]}) must be a multiple of {BLOCK_SIZE} "
            f"for NVFP4 (shape {tuple(x.shape)})"
        )


def e2m1_codes_rne(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already clamped to [-6, 6]) to 4-bit E2M1 codes, ties to even.

    The sign bit is taken from the IEEE sign of ``v`` (so -0.0 and small negatives that
    round to zero give code 0x8, as hardware conversion does). NaN gives magnitude 0.
    Thresholds (ties go to the even code): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0,
    2.5->2.0, 3.5->4.0, 5.0->4.0.
    """
    a = v.abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    sign = torch.signbit(v).to(torch.uint8) << 3
    return mag | sign


_E2M1_SIGNED = (*E2M1_VALUES, *(-v for v in E2M1_VALUES))  # code 8 is -0.0, as the sign bit says


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (uint8 in 0..15) to float32 values (one lookup in a signed table)."""
    table = torch.tensor(_E2M1_SIGNED, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes (..., K) into bytes (..., K/2), even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(qdata: torch.Tensor) -> torch.Tensor:
    """Unpack bytes (..., K/2) into codes (..., K)."""
    low = qdata & 0x0F
    high = qdata >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def check_block_scaling(block_scaling: str) -> str:
    """``block_scaling`` if it is one of :data:`BLOCK_SCALINGS`, else a ValueError naming them."""
    if block_scaling not in BLOCK_SCALINGS:
        raise ValueError(f"unknown NVFP4 block scaling {block_scaling!r}; use one of {BLOCK_SCALINGS}")
    return block_scaling


def global_encode_scale_from_amax(amax: torch.Tensor, block_scaling: str = "6") -> torch.Tensor:
    """``S_enc = 448*6/amax`` (``256*6/amax`` under ``block_scaling="4over6"``), clamped to
    FLT_MAX; 1 where amax == 0 or S_enc == 0.

    amax = +inf gives S_enc = 0 and therefore 1 (the recipe's guard); amax = NaN gives NaN,
    which poisons every scale of that group (see the spec's NaN/Inf section).
    """
    numerator = _GLOBAL_SCALE_NUMERATORS[check_block_scaling(block_scaling)]
    amax = amax.to(torch.float32)
    # Tensor / tensor: `scalar / tensor` in torch is reciprocal-then-multiply (two roundings).
    s = torch.clamp(torch.full_like(amax, numerator) / amax, max=FLT_MAX)
    bad = (amax == 0) | (s == 0)
    return torch.where(bad, 1.0, s)  # a scalar 1 (float32 result): no ones_like kernel


def global_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max|x| over each global-scale group; NaN propagates (torch.amax semantics)."""
    if granularity == "tensor":
        return _max_abs(x)
    a = x.detach().abs().to(torch.float32)
    if granularity == "expert":
        if x.dim() != 3:
            raise ValueError(f"'expert' global scales need a 3-D (experts, N, K) tensor, got shape {tuple(x.shape)}")
        return a.amax(dim=(1, 2))
    if granularity == "row":
        return a.amax(dim=-1)
    raise ValueError(f"unknown global-scale granularity {granularity!r}; use one of {GLOBAL_SCALE_GRANULARITIES}")


def shared_global_encode_scale(tensors, block_scaling: str = "6") -> torch.Tensor:
    """One ``S_enc`` (shape ``()``) for weights quantized with one global scale: sibling
    projections that an engine fuses into one layer (q/k/v, gate/up). It comes from the largest
    amax of the group, as ModelOpt computes a fused layer's ``weight_scale_2``, so no member
    saturates; on the first tensor's device. NaN propagates (any member's NaN poisons the group)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("shared_global_encode_scale needs at least one tensor")
    device = tensors[0].device
    amax = torch.stack([_max_abs(t).to(device) for t in tensors]).amax()
    return global_encode_scale_from_amax(amax, block_scaling)


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    """max|t| in float32 (``global_amax(t, "tensor")``) from one min/max pass in the tensor's
    dtype, without a float32 (or any) copy of the tensor. NaN propagates. (The trainer's group
    scale on the kernel backends does not come here: its amax passes run in the fake-quant
    kernel, ``quads.kernels.fake_quantize_nvfp4.shared_amax_bits``.)"""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    lo, hi = torch.aminmax(t.detach())
    return torch.maximum(lo.abs(), hi.abs()).to(torch.float32)


def default_granularity(x: torch.Tensor) -> str:
    """One global scale per tensor for 1-D/2-D weights, one per expert for 3-D expert weights."""
    return "expert" if x.dim() == 3 else "tensor"


def _broadcast_group(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape a group-shaped scale so it broadcasts against (..., K/16, 1)-shaped blocks."""
    nlead = x.dim() - 1  # dims before K
    s = s.reshape(s.shape + (1,) * (nlead - s.dim()))  # pad trailing lead dims
    return s.unsqueeze(-1).unsqueeze(-1)  # (..., 1, 1) against (..., K/16, 16)


def _group_shape(x: torch.Tensor, granularity: str) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    if granularity == "expert":
        return tuple(x.shape[:1])
    return tuple(x.shape[:-1])


def check_global_encode_scale(x: torch.Tensor, granularity: str, global_encode_scale, check_values: bool) -> None:
    """Refuse a given ``S_enc`` that cannot quantize ``x``: not a floating tensor, a shape that
    does not broadcast (leading dims first) to the groups of ``granularity`` (a wrong shape
    would silently broadcast per row), and, with ``check_values``, a value that is not finite
    and > 0 (0, NaN, -1 or inf give garbage codes). The value check is one reduction and one
    host read, so callers on hot paths that pass scales they computed themselves skip it."""
    if not isinstance(global_encode_scale, torch.Tensor) or not global_encode_scale.is_floating_point():
        raise TypeError(f"nvfp4_quantize: global_encode_scale must be a floating-point tensor, got "
                        f"{getattr(global_encode_scale, 'dtype', type(global_encode_scale).__name__)}")
    groups, shape = _group_shape(x, granularity), tuple(global_encode_scale.shape)
    fits = (global_encode_scale.numel() == 1 if not groups
            else len(shape) <= len(groups) and all(s in (1, g) for s, g in zip(shape, groups)))
    if not fits:
        raise ValueError(f"nvfp4_quantize: global_encode_scale of shape {shape} does not fit {granularity!r} global "
                         f"scales of a {tuple(x.shape)} tensor (groups {groups})")
    if check_values and global_encode_scale.numel():
        lo, hi = torch.aminmax(global_encode_scale.detach().to(torch.float32).reshape(-1))
        lo, hi = float(lo), float(hi)
        if not (lo > 0 and hi < float("inf")):
            raise ValueError(f"nvfp4_quantize: global_encode_scale must be finite and > 0 (S_enc = 448*6/amax), "
                             f"got values in [{lo}, {hi}]")


def nvfp4_quantize(
    x: torch.Tensor,
    granularity: str | None = None,
    global_encode_scale: torch.Tensor | None = None,
    block_scaling: str = "6",
    *,
    check_values: bool = True,
) -> NVFP4Parts:
    """Quantize ``x`` (..., K) to NVFP4 per the recipe.

    Args:
        x: float32/bfloat16/float16 tensor, K a multiple of 16.
        granularity: global-scale groups: ``"tensor"`` (default for 1-D/2-D), ``"expert"``
            (default for 3-D: one scale per ``x[e]``) or ``"row"`` (one per row, i.e. per
            token, for activations: keeps a row's result independent of the other rows).
        global_encode_scale: use this ``S_enc`` instead of computing it from amax (shape of
            the groups, or broadcastable to it; finite and > 0, checked).
        block_scaling: ``"6"`` (NVIDIA's: every block's max maps to 6) or ``"4over6"`` (each
            block maps its max to 4 or 6, whichever quantizes it with less squared error; see
            the module doc). A given ``global_encode_scale`` is used as it is under either.
        check_values: check the given ``global_encode_scale``'s values (one host read);
            ``False`` for scales the caller just computed (quads' own hot paths).

    Returns:
        NVFP4Parts(qdata, scale, global_encode_scale).
    """
    check_quantizable(x)
    check_block_scaling(block_scaling)
    granularity = granularity or default_granularity(x)
    if global_encode_scale is None:
        global_encode_scale = global_encode_scale_from_amax(global_amax(x, granularity), block_scaling)
    else:
        check_global_encode_scale(x, granularity, global_encode_scale, check_values)
        global_encode_scale = global_encode_scale.to(device=x.device, dtype=torch.float32)

    xf = x.detach().to(torch.float32)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    s_enc = _broadcast_group(global_encode_scale, x)  # (..., 1, 1)

    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # (..., K/16, 1)
    scale_e4m3, codes = _encode_blocks(blocks, block_amax, s_enc, _ONE_SIXTH)
    if block_scaling == "4over6":
        scale_4, codes_4 = _encode_blocks(blocks, block_amax, s_enc, 0.25)
        target = blocks * s_enc  # x in the units of e2m1 * s
        error_6 = block_squared_error(_unscaled_values(codes, scale_e4m3), target)
        error_4 = block_squared_error(_unscaled_values(codes_4, scale_4), target)
        pick_4 = (error_4 < error_6).unsqueeze(-1)  # (..., K/16, 1); a tie (and NaN) keeps 6
        scale_e4m3 = torch.where(pick_4, scale_4, scale_e4m3)
        codes = torch.where(pick_4, codes_4, codes)

    return NVFP4Parts(
        qdata=pack_e2m1(codes.reshape(xf.shape)),
        scale=scale_e4m3.squeeze(-1),
        global_encode_scale=global_encode_scale,
    )


def _encode_blocks(blocks, block_amax, s_enc, inv_max):
    """The block scales (e4m3, (..., K/16, 1)) and E2M1 codes ((..., K/16, 16)) of ``blocks``
    with each block's max mapped to ``1 / inv_max`` (``inv_max`` is float32(1/6) or 1/4)."""
    scale_f32 = torch.clamp(block_amax * (s_enc * inv_max), max=E4M3_MAX)
    scale_e4m3 = scale_f32.to(torch.float8_e4m3fn)
    # enc = min(1 / (f32(s) * (1/S_enc)), FLT_MAX); a zero block scale gives FLT_MAX.
    one = torch.ones((), dtype=torch.float32, device=blocks.device)
    decode_scale = scale_e4m3.to(torch.float32) * (one / s_enc)
    enc = torch.clamp(one / decode_scale, max=FLT_MAX)
    scaled = torch.clamp(blocks * enc, min=-E2M1_MAX, max=E2M1_MAX)
    return scale_e4m3, e2m1_codes_rne(scaled)


def _unscaled_values(codes, scale_e4m3):
    """``e2m1(codes) * f32(s)`` on blocks (..., K/16, 16) (exact in float32)."""
    return e2m1_decode(codes) * scale_e4m3.to(torch.float32)


def _decode_blocks(codes, scale_e4m3, s_enc):
    """``(e2m1(codes) * f32(s)) / S_enc`` in float32 on blocks (..., K/16, 16): dequantization."""
    return _unscaled_values(codes, scale_e4m3) / s_enc


def block_squared_error(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per block (last dim 16), the float32 sum of ``(values - target)^2`` in a fixed pairwise
    order: elements (0, 1), (2, 3), ... first, then neighbouring pair sums, four levels in all.

    4over6 compares its candidates with it in the units of ``e2m1 * s`` (``values``, exact)
    against ``x * S_enc`` (``target``, one rounding): the dequantization error times ``S_enc``,
    the same factor for every block of a group, and of the order of 1 whatever the tensor's
    magnitude (no overflow or underflow of the squares). Each difference, square and sum is one
    float32 rounding, and the fixed order makes the choice reproducible bit for bit (the Triton
    kernels sum in this order)."""
    e = values - target
    e = e * e
    while e.shape[-1] > 1:
        e = e.reshape(*e.shape[:-1], e.shape[-1] // 2, 2)
        e = e[..., 0] + e[..., 1]
    return e.squeeze(-1)


def nvfp4_dequantize(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    global_encode_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x_hat = (e2m1(q) * f32(s)) / S_enc`` in float32, then cast to ``dtype``.

    The product ``e2m1(q) * f32(s)`` is exact in float32 (at most 6 significant bits), so
    the only float32 rounding is the division by ``S_enc``. This is the dequantization every
    path uses; the trainer's forward weight is this function's output in the weight dtype.
    The parts' dtypes and shapes are checked (metadata only): ``scale`` exactly ``(..., K/16)``
    for ``qdata`` ``(..., K/2)``, never broadcast.
    """
    _check_parts(qdata, scale, global_encode_scale)
    codes = unpack_e2m1(qdata)
    blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    s_enc = _broadcast_group(global_encode_scale.to(torch.float32), codes)
    out = _decode_blocks(blocks, scale.unsqueeze(-1), s_enc)
    return out.reshape(codes.shape).to(dtype)


def _check_parts(qdata: torch.Tensor, scale: torch.Tensor, global_encode_scale: torch.Tensor) -> None:
    """Dtypes and shapes of NVFP4 parts (metadata only: no device work)."""
    if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"nvfp4_dequantize: qdata must be uint8 and scale float8_e4m3fn, got {qdata.dtype} and "
                        f"{scale.dtype}")
    if qdata.dim() < 1 or (qdata.shape[-1] * 2) % BLOCK_SIZE:
        raise ValueError(f"nvfp4_dequantize: qdata of shape {tuple(qdata.shape)} is not (..., K/2) with K a multiple "
                         f"of {BLOCK_SIZE}")
    want = tuple(qdata.shape[:-1]) + (qdata.shape[-1] * 2 // BLOCK_SIZE,)
    if tuple(scale.shape) != want:
        raise ValueError(f"nvfp4_dequantize: scale has shape {tuple(scale.shape)}, qdata {tuple(qdata.shape)} needs "
                         f"{want} (one E4M3 scale per 16 elements)")
    lead, shape = tuple(qdata.shape[:-1]), tuple(global_encode_scale.shape)
    if not (len(shape) <= len(lead) and all(s in (1, g) for s, g in zip(shape, lead))):
        raise ValueError(f"nvfp4_dequantize: global_encode_scale of shape {shape} fits no global-scale groups of "
                         f"qdata {tuple(qdata.shape)}")


def nvfp4_max_abs(scale: torch.Tensor, global_encode_scale: torch.Tensor) -> torch.Tensor:
    """An upper bound of ``|nvfp4_dequantize(...)|`` from the scales alone (float32, 0-dim, no sync).

    The largest E2M1 magnitude is 6, so no element exceeds ``6 * f32(s) / S_enc`` of its block;
    one reduction over the block scales (1/16 of the codes' elements) instead of a dequantization.
    It is what decides whether the dequantized weight fits a dtype (float16 tops out at 65504).
    """
    s = scale.to(torch.float32).unsqueeze(-1)  # (..., K/16, 1): the shape blocks have, one column
    s_enc = _broadcast_group(global_encode_scale.to(torch.float32), scale)
    if s.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=scale.device)
    return (s * 6.0 / s_enc).amax()


def nvfp4_fake_quantize(
    x: torch.Tensor,
    granularity: str | None = None,
    dtype: torch.dtype | None = None,
    global_encode_scale: torch.Tensor | None = None,
    block_scaling: str = "6",
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """``DQ(Q(x))`` in ``dtype`` (default ``x.dtype``), with ``global_encode_scale`` if given (e.g.
    a sibling group's; ``check_values`` as in :func:`nvfp4_quantize`); no gradient logic (see
    policies.ste)."""
    parts = nvfp4_quantize(x, granularity, global_encode_scale, block_scaling, check_values=check_values)
    return nvfp4_dequantize(*parts, dtype=dtype or x.dtype)
