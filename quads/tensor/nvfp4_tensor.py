"""`NVFP4Tensor`: a torch tensor subclass holding a packed NVFP4 weight.

The tensor's *logical* shape and dtype are those of the high-precision weight it stands for
(e.g. ``(N, K)`` bfloat16, or ``(E, N, K)`` for fused MoE experts); its storage is the three
NVFP4 parts produced by :func:`quads.tensor.nvfp4_math.nvfp4_quantize`:

* ``qdata``  uint8 ``(..., K/2)``, even element in the low nibble;
* ``scale``  float8_e4m3fn ``(..., K/16)``, plain layout;
* ``global_encode_scale`` float32, ``()`` for 2-D weights, ``(E,)`` for 3-D expert weights.

Ops on it are implemented in ``__torch_dispatch__`` by a small table of handlers: layout ops
(detach, clone, to, copy_, transpose, expert select/slice/index_select, views that keep K) act
on the parts; matrix ops (mm, addmm, bmm, ``_grouped_mm``) dequantize the weight to the other
operand's dtype and run the high-precision op (the weight-only W4A16 path). The fast W4A4
rollout path does not go through here: it calls ``quads.ops`` with the parts directly.
This module computes with the recipe of :mod:`quads.tensor.nvfp4_math` only (the tensor layer
imports nothing above it).
Anything else raises ``NotImplementedError`` naming the op.

A transpose of the last two dims is recorded as a flag (``transposed``); the parts always
keep K last, which is what every kernel wants.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from quads.tensor.nvfp4_math import (
    BLOCK_SIZE,
    NVFP4Parts,
    check_quantizable,
    nvfp4_dequantize,
    nvfp4_quantize,
)

aten = torch.ops.aten

__all__ = ["NVFP4Tensor"]


def _granularity_of(t: "NVFP4Tensor") -> str:
    """The global-scale granularity of a packed tensor, read off its global-scale shape."""
    gs = t.global_encode_scale
    if gs.dim() == 0:
        return "tensor"
    if t.qdata.dim() == 3 and tuple(gs.shape) == tuple(t.qdata.shape[:1]):
        return "expert"
    return "row"


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise ValueError if ``x`` holds NaN or Inf (weights must be finite to quantize)."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"{what}: {bad} non-finite value(s) (NaN/Inf) in a weight; NVFP4 quantization of "
            "non-finite weights would silently poison or saturate whole blocks, refusing"
        )


class NVFP4Tensor(torch.Tensor):
    """A packed NVFP4 weight that behaves like its high-precision original where meaningful."""

    qdata: torch.Tensor
    scale: torch.Tensor
    global_encode_scale: torch.Tensor

    @staticmethod
    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        global_encode_scale: torch.Tensor,
        orig_dtype: torch.dtype = torch.bfloat16,
        transposed: bool = False,
    ):
        shape = list(qdata.shape[:-1]) + [qdata.shape[-1] * 2]
        if transposed:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=orig_dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata, scale, global_encode_scale, orig_dtype=torch.bfloat16, transposed=False):
        if qdata.dtype != torch.uint8:
            raise TypeError(f"NVFP4Tensor.qdata must be uint8, got {qdata.dtype}")
        if scale.dtype != torch.float8_e4m3fn:
            raise TypeError(f"NVFP4Tensor.scale must be float8_e4m3fn, got {scale.dtype}")
        if scale.shape[-1] * BLOCK_SIZE != qdata.shape[-1] * 2:
            raise ValueError(f"scale {tuple(scale.shape)} does not match qdata {tuple(qdata.shape)}")
        self.qdata = qdata
        self.scale = scale
        self.global_encode_scale = global_encode_scale
        self.orig_dtype = orig_dtype
        self.transposed = transposed

    # -- construction / conversion -------------------------------------------------------

    @classmethod
    def from_float(cls, x: torch.Tensor, granularity: str | None = None) -> "NVFP4Tensor":
        """Quantize a 2-D (one global scale) or 3-D (one per expert) weight with the recipe.

        (The rollout side quantizes through its backend, whose kernels give the same bits, and
        wraps the parts: ``NVFP4Tensor(*parts, orig_dtype=...)``.)
        """
        check_quantizable(x, "NVFP4Tensor.from_float")
        if x.dim() not in (2, 3):
            raise ValueError(f"NVFP4Tensor holds 2-D or 3-D weights, got shape {tuple(x.shape)}")
        check_finite(x, "NVFP4Tensor.from_float")
        return cls(*nvfp4_quantize(x, granularity), orig_dtype=x.dtype)

    @property
    def parts(self) -> NVFP4Parts:
        """The stored parts (K last, untransposed)."""
        return NVFP4Parts(self.qdata, self.scale, self.global_encode_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight in its logical orientation (the trainer's forward weight)."""
        out = nvfp4_dequantize(self.qdata, self.scale, self.global_encode_scale, dtype)
        return out.transpose(-2, -1) if self.transposed else out

    def _with_parts(self, qdata, scale, gs, *, orig_dtype=None, transposed=None) -> "NVFP4Tensor":
        return NVFP4Tensor(
            qdata,
            scale,
            gs,
            self.orig_dtype if orig_dtype is None else orig_dtype,
            self.transposed if transposed is None else transposed,
        )

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.orig_dtype}, "
            f"device={self.device}, transposed={self.transposed}, "
            f"global_scales={tuple(self.global_encode_scale.shape) or 'scalar'})"
        )

    # -- subclass protocol (torch.compile, serialization) --------------------------------

    def __tensor_flatten__(self):
        return ["qdata", "scale", "global_encode_scale"], (self.orig_dtype, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        orig_dtype, transposed = meta
        return NVFP4Tensor(
            inner_tensors["qdata"],
            inner_tensors["scale"],
            inner_tensors["global_encode_scale"],
            orig_dtype,
            transposed,
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"NVFP4Tensor does not support the op {func}; dequantize() first if a "
                "high-precision copy is what you need"
            )
        return handler(func, args, kwargs)


# ---------------------------------------------------------------------------------------
# Op handlers: one table, one function per op family.
# ---------------------------------------------------------------------------------------

_HANDLERS: dict = {}


def _implements(ops) -> Callable:
    def register(fn):
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return register


def _dense(t, dtype: torch.dtype | None = None):
    """Dequantize an NVFP4Tensor operand (to ``dtype``), pass anything else through."""
    if isinstance(t, NVFP4Tensor):
        return t.dequantize(dtype or t.orig_dtype)
    return t


def _peer_dtype(args) -> torch.dtype:
    """dtype of the first dense tensor operand (the activation), else the weight's."""
    for a in args:
        if isinstance(a, torch.Tensor) and not isinstance(a, NVFP4Tensor):
            return a.dtype
    for a in args:
        if isinstance(a, NVFP4Tensor):
            return a.orig_dtype
    raise AssertionError("no tensor operand")


@_implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    t = args[0]
    return return_and_correct_aliasing(func, args, kwargs, t._with_parts(t.qdata, t.scale, t.global_encode_scale))


@_implements([aten.clone.default])
def _clone(func, args, kwargs):
    t = args[0]
    return t._with_parts(t.qdata.clone(), t.scale.clone(), t.global_encode_scale.clone())


@_implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    """``.to(device)`` moves the parts; ``.to(dtype)`` changes the logical (dequant) dtype."""
    t = args[0]
    device = kwargs.get("device") or t.device
    dtype = kwargs.get("dtype") or t.orig_dtype
    if not dtype.is_floating_point:
        raise NotImplementedError(f"NVFP4Tensor cannot be converted to {dtype}")
    return t._with_parts(
        t.qdata.to(device), t.scale.to(device), t.global_encode_scale.to(device), orig_dtype=dtype
    )


@_implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    """In-place copy. From an NVFP4Tensor: copy the parts. From a dense tensor: quantize it
    with the same recipe and granularity (this is how trainer weights are synced in place)."""
    dst, src = args[0], args[1]
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy_: shape mismatch {tuple(src.shape)} -> {tuple(dst.shape)}")
    if isinstance(src, NVFP4Tensor):
        if src.transposed != dst.transposed:
            raise NotImplementedError("copy_ between NVFP4Tensors of different orientation")
        parts = src.parts
    else:
        dense = src.transpose(-2, -1) if dst.transposed else src
        check_finite(dense, "NVFP4Tensor.copy_")
        parts = nvfp4_quantize(dense, _granularity_of(dst))
    dst.qdata.copy_(parts.qdata)
    dst.scale.copy_(parts.scale)
    dst.global_encode_scale.copy_(parts.global_encode_scale)
    # Inside __torch_dispatch__ in-place writes do not bump the parts' version counters (that
    # happens above this dispatch level); bump them so version-keyed caches see the write.
    torch.autograd.graph.increment_version((dst.qdata, dst.scale, dst.global_encode_scale))
    return dst


@_implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    t = args[0]
    if func is aten.transpose.int:
        d0, d1 = (d % t.dim() for d in args[1:3])
        if {d0, d1} != {t.dim() - 2, t.dim() - 1}:
            raise NotImplementedError(
                f"NVFP4Tensor only transposes its last two dims, got transpose({args[1]}, {args[2]})"
            )
    elif t.dim() != 2:
        raise NotImplementedError("t() needs a 2-D NVFP4Tensor")
    return t._with_parts(t.qdata, t.scale, t.global_encode_scale, transposed=not t.transposed)


def _check_expert_dim(t, dim: int, op: str) -> None:
    if t.dim() != 3 or dim % 3 != 0:
        raise NotImplementedError(f"NVFP4Tensor supports {op} only along the expert dim 0 of a 3-D weight")


@_implements([aten.select.int])
def _select(func, args, kwargs):
    t, dim, index = args
    _check_expert_dim(t, dim, "select")
    return t._with_parts(t.qdata[index], t.scale[index], t.global_encode_scale[index])


@_implements([aten.index_select.default])
def _index_select(func, args, kwargs):
    t, dim, index = args
    _check_expert_dim(t, dim, "index_select")
    return t._with_parts(
        t.qdata.index_select(0, index), t.scale.index_select(0, index), t.global_encode_scale.index_select(0, index)
    )


@_implements([aten.index.Tensor])
def _index(func, args, kwargs):
    t, indices = args
    if t.dim() != 3 or len(indices) != 1 or indices[0] is None:
        raise NotImplementedError("NVFP4Tensor supports advanced indexing only by expert ids (w[ids])")
    ids = indices[0]
    return t._with_parts(t.qdata[ids], t.scale[ids], t.global_encode_scale[ids])


@_implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    t, dim = args[0], args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    _check_expert_dim(t, dim, "slicing")
    sl = slice(start, end, step)
    return t._with_parts(t.qdata[sl], t.scale[sl], t.global_encode_scale[sl])


@_implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    """Views that keep the stored K last: identity, or leading-dim reshapes of a tensor with
    one global scale (per-expert scales cannot be split or merged)."""
    t, size = args[0], list(args[1])
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        size[size.index(-1)] = t.numel() // known
    if tuple(size) == tuple(t.shape):
        return t._with_parts(t.qdata, t.scale, t.global_encode_scale)
    if t.transposed or t.global_encode_scale.dim() != 0 or size[-1] != t.shape[-1]:
        raise NotImplementedError(
            f"NVFP4Tensor cannot be viewed as {tuple(size)} from {tuple(t.shape)}: only views "
            "that keep K last and a single global scale are meaningful"
        )
    lead = size[:-1]
    return t._with_parts(
        t.qdata.reshape(*lead, t.qdata.shape[-1]),
        t.scale.reshape(*lead, t.scale.shape[-1]),
        t.global_encode_scale,
    )


@_implements([aten.mm.default, aten.bmm.default])
def _mm(func, args, kwargs):
    dtype = _peer_dtype(args[:2])
    return func(_dense(args[0], dtype), _dense(args[1], dtype), **kwargs)


@_implements([aten.addmm.default, aten.baddbmm.default])
def _addmm(func, args, kwargs):
    dtype = _peer_dtype(args[1:3])
    return func(args[0], _dense(args[1], dtype), _dense(args[2], dtype), *args[3:], **kwargs)


if hasattr(aten, "_grouped_mm"):

    @_implements([aten._grouped_mm.default])
    def _grouped_mm(func, args, kwargs):
        dtype = _peer_dtype(args[:2])
        return func(_dense(args[0], dtype), _dense(args[1], dtype), *args[2:], **kwargs)


@_implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


# torch.load(weights_only=True) may rebuild this class.
torch.serialization.add_safe_globals([NVFP4Tensor])
