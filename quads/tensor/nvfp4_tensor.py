"""`NVFP4Tensor`: a torch tensor subclass holding a packed NVFP4 weight.

The tensor's *logical* shape and dtype are those of the high-precision weight it stands for
(e.g. ``(N, K)`` bfloat16, or ``(E, N, K)`` for fused MoE experts); its storage is the three
NVFP4 parts produced by :func:`quads.tensor.nvfp4_math.nvfp4_quantize`:

* ``qdata``  uint8 ``(..., K/2)``, even element in the low nibble;
* ``scale``  float8_e4m3fn ``(..., K/16)``, plain layout;
* ``global_encode_scale`` float32, ``()`` for 2-D weights, ``(E,)`` for 3-D expert weights
  (``qdata.shape[:-1]`` for one scale per row).

Construction checks these invariants (see :class:`NVFP4Tensor`): a corrupt or hand-made state
dict fails loudly instead of broadcasting one row's scales or decoding NaN scales.

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

from quads.tensor.finite import check_finite
from quads.tensor.nvfp4_math import (
    BLOCK_SIZE,
    NVFP4Parts,
    check_block_scaling,
    check_quantizable,
    nvfp4_dequantize,
    nvfp4_quantize,
)

aten = torch.ops.aten

__all__ = ["NVFP4Tensor", "LOGICAL_DTYPES", "SAVE_HINT", "check_nvfp4_layout", "check_nvfp4_values", "check_finite"]

#: How models holding NVFP4Tensors are saved and loaded (transformers' and torchao's own tensor
#: writers cannot store them: the parts are no storage of the tensor itself).
SAVE_HINT = (
    "save a quads model with model.save_pretrained(path) (quads.integrations.transformers: the packed parts and "
    "the policy) and load it with from_pretrained(path); or save the state dict with "
    "quads.tensor.save_safetensors(model.state_dict(), path) and load it into a model quantized the same way with "
    "model.load_state_dict(quads.tensor.load_safetensors(path)); or export a serving checkpoint (quads export / "
    "quads.integrations.modelopt.export_modelopt) and read it back with "
    "quads.integrations.modelopt.load_exported(path, side='rollout')"
)


#: logical dtypes an NVFP4Tensor may stand for (what ``dequantize()`` returns by default)
LOGICAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _group_shapes(qdata: torch.Tensor) -> dict[tuple[int, ...], str]:
    """The global-scale shapes valid for ``qdata``, with their granularity names."""
    shapes = {(): "tensor"}
    shapes.setdefault(tuple(qdata.shape[:-1]), "row")
    if qdata.dim() == 3:
        shapes[tuple(qdata.shape[:1])] = "expert"
    return shapes


def _logical_shape(qdata: torch.Tensor, transposed: bool) -> list[int]:
    shape = list(qdata.shape[:-1]) + [qdata.shape[-1] * 2]
    if transposed:
        shape[-2], shape[-1] = shape[-1], shape[-2]
    return shape


def check_nvfp4_layout(qdata, scale, global_encode_scale, orig_dtype, transposed, what: str = "NVFP4Tensor") -> None:
    """Raise if the parts cannot form an NVFP4Tensor: types, dtypes, shapes, devices, metadata.

    Reads only tensor metadata (no device work), so it runs on every construction.
    """
    for part, value in (("qdata", qdata), ("scale", scale), ("global_encode_scale", global_encode_scale)):
        if not isinstance(value, torch.Tensor) or isinstance(value, NVFP4Tensor):
            raise TypeError(f"{what}: {part} must be a plain torch.Tensor, got {type(value).__name__}")
    if qdata.dtype != torch.uint8:
        raise TypeError(f"{what}: qdata must be uint8 (two E2M1 codes per byte), got {qdata.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{what}: scale must be float8_e4m3fn, got {scale.dtype}")
    if global_encode_scale.dtype != torch.float32:
        raise TypeError(f"{what}: global_encode_scale must be float32, got {global_encode_scale.dtype}")
    if qdata.dim() < 1 or qdata.shape[-1] % (BLOCK_SIZE // 2):
        raise ValueError(
            f"{what}: qdata {tuple(qdata.shape)} must have a last dim of K/2 bytes with K a multiple of {BLOCK_SIZE}"
        )
    want_scale = tuple(qdata.shape[:-1]) + (qdata.shape[-1] * 2 // BLOCK_SIZE,)
    if tuple(scale.shape) != want_scale:
        raise ValueError(
            f"{what}: scale has shape {tuple(scale.shape)} but qdata {tuple(qdata.shape)} needs {want_scale} "
            f"(one E4M3 scale per {BLOCK_SIZE} elements of every row)"
        )
    groups = _group_shapes(qdata)
    if tuple(global_encode_scale.shape) not in groups:
        allowed = ", ".join(f"{shape} ({name})" for shape, name in groups.items())
        raise ValueError(
            f"{what}: global_encode_scale has shape {tuple(global_encode_scale.shape)}; for qdata "
            f"{tuple(qdata.shape)} it must be one of {allowed}"
        )
    if not (qdata.device == scale.device == global_encode_scale.device):
        raise ValueError(
            f"{what}: parts on different devices (qdata {qdata.device}, scale {scale.device}, "
            f"global_encode_scale {global_encode_scale.device})"
        )
    if orig_dtype not in LOGICAL_DTYPES:
        raise TypeError(f"{what}: orig_dtype must be one of {LOGICAL_DTYPES}, got {orig_dtype!r}")
    if type(transposed) is not bool:
        raise TypeError(f"{what}: transposed must be a bool, got {transposed!r}")
    if transposed and qdata.dim() < 2:
        raise ValueError(f"{what}: a transposed NVFP4Tensor needs at least 2 dims, got qdata {tuple(qdata.shape)}")


def check_nvfp4_values(scale: torch.Tensor, global_encode_scale: torch.Tensor, what: str = "NVFP4Tensor") -> None:
    """Raise ValueError unless every block scale is finite and >= 0 and every global scale finite and > 0.

    The quantizer only ever produces such values. E4M3 bytes 0x7F / 0xFF are NaN (E4M3 has no
    Inf); a sign bit on a non-zero scale means a negative scale. One device reduction per part
    and one host sync; meta tensors (no values) are skipped.
    """
    if scale.device.type == "meta":
        return
    scale_ok = (scale.to(torch.float32) >= 0).all()  # NaN >= 0 is False
    gs_ok = ((global_encode_scale > 0) & (global_encode_scale < float("inf"))).all()
    ok_scale, ok_gs = torch.stack([scale_ok, gs_ok]).tolist()
    if not ok_scale:
        bits = scale.view(torch.uint8)
        nan = int(((bits & 0x7F) == 0x7F).sum())
        negative = int((scale.to(torch.float32) < 0).sum())
        first = tuple(int(i) for i in (~(scale.to(torch.float32) >= 0)).nonzero()[0].tolist())
        raise ValueError(
            f"{what}: {nan} NaN block scale(s) (E4M3 bytes 0x7F/0xFF) and {negative} negative one(s), "
            f"first at index {first}; the packed parts are corrupt"
        )
    if not ok_gs:
        bad = global_encode_scale[~((global_encode_scale > 0) & (global_encode_scale < float("inf")))]
        raise ValueError(
            f"{what}: global_encode_scale must be finite and > 0 (S_enc = 448*6/amax), got "
            f"{bad.flatten()[:4].tolist()}; the packed parts are corrupt"
        )


class NVFP4Tensor(torch.Tensor):
    """A packed NVFP4 weight that behaves like its high-precision original where meaningful.

    ``NVFP4Tensor(qdata, scale, global_encode_scale, orig_dtype=torch.bfloat16, transposed=False)``
    wraps parts (user data: a hand-made or loaded state dict) and checks them: the layout
    always (:func:`check_nvfp4_layout`: dtypes, ``scale`` of shape ``(..., K/16)`` for
    ``qdata`` ``(..., K/2)``, a global-scale shape of one granularity, one device, ``orig_dtype``
    a float dtype, ``transposed`` a bool), and the values unless ``check_values=False``
    (:func:`check_nvfp4_values`: finite non-negative block scales, finite positive global
    scales; one device reduction and host sync). ``check_values=False`` is for parts quads'
    own quantizer just produced from finite weights and for views of a checked tensor (every
    layout op below), so hot paths never synchronise. ``torch.load`` checks both as well.

    What the checks cannot see: a flipped bit in ``qdata`` changes one E2M1 code, i.e. one
    element, silently (every byte is a valid pair of codes); a flipped scale bit that gives
    another finite positive E4M3 value rescales its 16-element block silently. Files written
    by :func:`quads.tensor.save_safetensors` carry CRC32 checksums that catch both on load.
    """

    global_encode_scale: torch.Tensor
    orig_dtype: torch.dtype
    transposed: bool
    #: the block-scale rule of the recipe its parts come from (``"6"`` or ``"4over6"``,
    #: ``nvfp4_quantize``'s ``block_scaling``): what a dense ``copy_`` into it quantizes with
    block_scaling: str = "6"

    # -- where the packed parts live ---------------------------------------------------------
    #
    # Here (``qdata``/``scale`` tensors), or in a kernel layout that converts to and from them bit
    # for bit (the humming backend's: :meth:`to_layout_`, one explicit conversion when a module's
    # weights are set). In a layout, the layout is this tensor's only storage: ``qdata``/``scale``
    # are derived on each read (new tensors: a read changes nothing), and every write goes through
    # :meth:`write_parts_` (a sync, ``load_state_dict``'s ``copy_``), which writes the layout in place.

    @property
    def kernel_layout(self):
        """The kernel layout holding the packed parts (``packed_parts()``, ``write_parts_(parts)``,
        ``shape_parts``), or None when they are stored here."""
        return self.__dict__.get("_layout")

    @property
    def qdata(self) -> torch.Tensor:
        layout = self.__dict__.get("_layout")
        return self.__dict__["_qdata"] if layout is None else layout.packed_parts()[0]

    @qdata.setter
    def qdata(self, value: torch.Tensor) -> None:
        self.__dict__["_qdata"] = value

    @property
    def scale(self) -> torch.Tensor:
        layout = self.__dict__.get("_layout")
        return self.__dict__["_scale"] if layout is None else layout.packed_parts()[1]

    @scale.setter
    def scale(self, value: torch.Tensor) -> None:
        self.__dict__["_scale"] = value

    def to_layout_(self, layout) -> None:
        """Make ``layout`` (just built from these parts, bit for bit) the parts' storage: the stored
        ``qdata``/``scale`` are dropped."""
        self.__dict__["_layout"] = layout
        self.__dict__.pop("_qdata", None)
        self.__dict__.pop("_scale", None)
        self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1

    def to_parts_(self) -> None:
        """Store the parts here again (derived from the layout), the layout no longer their storage."""
        layout = self.__dict__.pop("_layout", None)
        if layout is not None:
            self.qdata, self.scale = layout.packed_parts()
            self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1

    def write_parts_(self, parts: NVFP4Parts) -> None:
        """Write new parts of the same shapes in place (the one write: a sync, ``copy_``): into the
        layout when it holds them, else into the stored tensors (their version counters bumped)."""
        layout = self.__dict__.get("_layout")
        if layout is not None:
            self.global_encode_scale.copy_(parts.global_encode_scale)
            layout.write_parts_(NVFP4Parts(parts.qdata, parts.scale, self.global_encode_scale))
            self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1
            return
        q, s = self.__dict__["_qdata"], self.__dict__["_scale"]
        q.copy_(parts.qdata)
        s.copy_(parts.scale)
        self.global_encode_scale.copy_(parts.global_encode_scale)
        self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1
        # Inside __torch_dispatch__ in-place writes do not bump the version counters (that happens
        # above this dispatch level); bump them so version-keyed caches see the write.
        torch.autograd.graph.increment_version((q, s, self.global_encode_scale))

    def written_storage(self) -> list[torch.Tensor]:
        """Every tensor :meth:`write_parts_` overwrites: the layout's own tensors when it holds the
        parts, else the stored parts; the global scale last."""
        layout = self.__dict__.get("_layout")
        held = layout.written_tensors() if layout is not None else [self.__dict__["_qdata"], self.__dict__["_scale"]]
        return [*held, self.global_encode_scale]

    def storage_snapshot(self) -> tuple:
        """A copy of what :meth:`write_parts_` overwrites, for :meth:`restore_storage_` (undoing a
        sync's write): the layout's own tensors when it holds the parts (nothing derived from it:
        a derivation costs several passes over the weight), else the stored parts."""
        return self.__dict__.get("_layout"), [(t, t.clone()) for t in self.written_storage()]

    def mark_written_(self) -> None:
        """Count a write that bypassed :meth:`write_parts_` (a replayed CUDA graph of one) as it counts
        its own: :meth:`parts_version` and the written tensors' version counters move, so
        version-keyed caches of the parts see it."""
        self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1
        torch.autograd.graph.increment_version(tuple(self.written_storage()))

    def restore_storage_(self, snapshot: tuple) -> None:
        """Put back, in place, what :meth:`storage_snapshot` copied; its storage is this tensor's again."""
        layout, saved = snapshot
        for t, old in saved:
            t.copy_(old)
        if layout is not None:
            self.__dict__.pop("_qdata", None)
            self.__dict__.pop("_scale", None)
            self.__dict__["_layout"] = layout
        else:
            self.__dict__.pop("_layout", None)
            self.__dict__["_qdata"], self.__dict__["_scale"] = saved[0][0], saved[1][0]
        self.__dict__["_writes"] = self.__dict__.get("_writes", 0) + 1

    def storage_objects(self) -> tuple:
        """``(layout, qdata, scale, global_encode_scale)`` as held (``qdata``/``scale`` None while a
        layout holds the parts): the objects a kernel reads, compared by identity when a module
        refreshes its kernel (every write lands in them in place; a storage change replaces one)."""
        d = self.__dict__
        return d.get("_layout"), d.get("_qdata"), d.get("_scale"), self.global_encode_scale

    def parts_version(self) -> tuple:
        """A key that changes whenever the parts may have been written (a module then re-derives its
        kernel layout): the stored parts' version counters, or the layout's write count."""
        writes = self.__dict__.get("_writes", 0)
        if self.__dict__.get("_layout") is not None:
            return ("layout", writes)
        q, s = self.__dict__["_qdata"], self.__dict__["_scale"]
        if q.is_inference() or s.is_inference():  # no counters: only writes through write_parts_ count
            return (writes, None)
        return (writes, q._version, s._version)

    def stored_parts(self) -> NVFP4Parts:
        """The parts without deriving them: the stored ones, or meta placeholders of their shapes
        when a layout holds them (the backend reads its layout; a fallback that needs the parts
        asks the layout)."""
        layout = self.__dict__.get("_layout")
        if layout is None:
            return NVFP4Parts(self.__dict__["_qdata"], self.__dict__["_scale"], self.global_encode_scale)
        shapes = layout.shape_parts
        return NVFP4Parts(shapes.qdata, shapes.scale, self.global_encode_scale)

    def __getstate__(self):
        """Pickled (torch.save, deepcopy) with its parts, never with the layout holding them."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_qdata", "_scale", "_layout", "_writes", "_traced_shapes")}
        state["qdata"], state["scale"] = self.qdata, self.scale
        return state

    @staticmethod
    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        global_encode_scale: torch.Tensor,
        orig_dtype: torch.dtype = torch.bfloat16,
        transposed: bool = False,
        *,
        check_values: bool = True,
        block_scaling: str = "6",
    ):
        check_nvfp4_layout(qdata, scale, global_encode_scale, orig_dtype, transposed)
        return torch.Tensor._make_wrapper_subclass(
            cls, _logical_shape(qdata, transposed), dtype=orig_dtype, device=qdata.device, requires_grad=False
        )

    def __init__(
        self, qdata, scale, global_encode_scale, orig_dtype=torch.bfloat16, transposed=False, *, check_values=True,
        block_scaling="6",
    ):
        if check_values:
            check_nvfp4_values(scale, global_encode_scale)
        if block_scaling != "6":
            self.block_scaling = check_block_scaling(block_scaling)
        self.qdata = qdata
        self.scale = scale
        self.global_encode_scale = global_encode_scale
        self.orig_dtype = orig_dtype
        self.transposed = transposed

    # -- construction / conversion -------------------------------------------------------

    @classmethod
    def from_float(cls, x: torch.Tensor, granularity: str | None = None, block_scaling: str = "6") -> "NVFP4Tensor":
        """Quantize a 2-D (one global scale) or 3-D (one per expert) weight with the recipe
        (``block_scaling``: ``"6"`` or ``"4over6"``).

        (The rollout side quantizes through its backend, whose kernels give the same bits, and
        wraps the parts: ``NVFP4Tensor(*parts, orig_dtype=...)``.)
        """
        check_quantizable(x, "NVFP4Tensor.from_float")
        if x.dim() not in (2, 3):
            raise ValueError(f"NVFP4Tensor holds 2-D or 3-D weights, got shape {tuple(x.shape)}")
        check_finite(x, "NVFP4Tensor.from_float")
        return cls(*nvfp4_quantize(x, granularity, None, block_scaling), orig_dtype=x.dtype, check_values=False,
                   block_scaling=block_scaling)

    @property
    def granularity(self) -> str:
        """Global-scale groups: ``"tensor"`` (one S_enc), ``"expert"`` (one per ``w[e]`` of a 3-D
        weight) or ``"row"`` (one per row), read off the global-scale shape."""
        return _group_shapes(self.stored_parts().qdata)[tuple(self.global_encode_scale.shape)]

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
            check_values=False,  # views and copies of parts that were checked
            block_scaling=self.block_scaling,
        )

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.orig_dtype}, "
            f"device={self.device}, transposed={self.transposed}, "
            f"global_scales={tuple(self.global_encode_scale.shape) or 'scalar'})"
        )

    # -- subclass protocol (torch.compile, serialization) --------------------------------

    @property
    def tensor_data_names(self):
        """Not a torchao tensor: torchao's safetensors writer (reached only by bypassing quads'
        ``save_pretrained``) asks for this and gets the ways that work (an ``AttributeError``, so
        ``hasattr`` probes still answer False)."""
        raise AttributeError(f"quads.NVFP4Tensor is not a torchao tensor; torchao/transformers cannot save it: {SAVE_HINT}")

    def __tensor_flatten__(self):
        """The parts; held in a kernel layout, only the global scale and the parts' shapes (nothing
        is derived for a trace: the compiled op reads the layout, never these parts)."""
        if self.kernel_layout is not None or self.__dict__.get("_traced_shapes"):
            shapes = self.stored_parts()
            return ["global_encode_scale"], (self.orig_dtype, self.transposed,
                                             (tuple(shapes.qdata.shape), tuple(shapes.scale.shape)))
        return ["qdata", "scale", "global_encode_scale"], (self.orig_dtype, self.transposed, None)

    def _stable_hash_for_caching(self) -> str:
        """The key torch.compile's AOT autograd cache gives this weight: its subclass metadata and
        its parts' metadata (shapes, dtypes, strides, device), never their values, as the graph
        depends on them (torch's default for wrapper subclasses, stated here so that it does not
        warn; a kernel-held weight flattens to other parts and so hashes differently)."""
        import hashlib
        import pickle

        from torch._inductor.codecache import extract_tensor_metadata_for_cache_key

        names, meta = self.__tensor_flatten__()
        parts = {name: extract_tensor_metadata_for_cache_key(getattr(self, name)) for name in names}
        payload = (type(self).__qualname__, tuple(self.shape), self.requires_grad, meta, parts)
        return hashlib.blake2b(pickle.dumps(payload), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        orig_dtype, transposed, shapes = meta
        if shapes is not None:  # a layout-held weight inside a trace: its shapes only
            out = torch.Tensor._make_wrapper_subclass(NVFP4Tensor, outer_size, dtype=orig_dtype,
                                                      device=inner_tensors["global_encode_scale"].device,
                                                      requires_grad=False)
            out.__dict__.update(global_encode_scale=inner_tensors["global_encode_scale"], orig_dtype=orig_dtype,
                                transposed=transposed,
                                _qdata=torch.empty(shapes[0], dtype=torch.uint8, device="meta"),
                                _scale=torch.empty(shapes[1], dtype=torch.float8_e4m3fn, device="meta"),
                                _traced_shapes=True)
            return out
        return NVFP4Tensor(
            inner_tensors["qdata"],
            inner_tensors["scale"],
            inner_tensors["global_encode_scale"],
            orig_dtype,
            transposed,
            check_values=False,  # rebuilt from a flattened NVFP4Tensor (torch.compile)
        )

    def __setstate__(self, state):
        """``torch.load`` (also ``weights_only=True``) restores the parts here, without
        ``__init__``: check them like a constructor does, and against the saved logical shape."""
        torch._utils._set_obj_state(self, state)
        what = "NVFP4Tensor (torch.load)"
        parts = [getattr(self, n, None) for n in ("qdata", "scale", "global_encode_scale")]
        check_nvfp4_layout(*parts, getattr(self, "orig_dtype", None), getattr(self, "transposed", None), what)
        if list(self.shape) != _logical_shape(self.qdata, self.transposed) or self.dtype != self.orig_dtype:
            raise ValueError(
                f"{what}: saved shape {tuple(self.shape)} / dtype {self.dtype} do not match its parts "
                f"({tuple(_logical_shape(self.qdata, self.transposed))}, {self.orig_dtype})"
            )
        check_nvfp4_values(self.scale, self.global_encode_scale, what)

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
    return return_and_correct_aliasing(func, args, kwargs, _alias(t, t.transposed))


def _alias(t: NVFP4Tensor, transposed: bool) -> NVFP4Tensor:
    """Another wrapper of ``t``'s storage (its parts, or the layout holding them: state_dict's
    detach derives nothing)."""
    if t.kernel_layout is None:
        return t._with_parts(t.qdata, t.scale, t.global_encode_scale, transposed=transposed)
    return _over_layout(t.kernel_layout, t.global_encode_scale, t.orig_dtype, transposed, t.block_scaling)


def _over_layout(layout, global_encode_scale, orig_dtype, transposed, block_scaling="6") -> NVFP4Tensor:
    """An ``NVFP4Tensor`` whose parts' storage is ``layout`` (see :meth:`NVFP4Tensor.to_layout_`)."""
    q = layout.shape_parts.qdata
    out = torch.Tensor._make_wrapper_subclass(NVFP4Tensor, _logical_shape(q, transposed), dtype=orig_dtype,
                                              device=global_encode_scale.device, requires_grad=False)
    out.__dict__.update(global_encode_scale=global_encode_scale, orig_dtype=orig_dtype, transposed=transposed,
                        _layout=layout)
    if block_scaling != "6":
        out.block_scaling = block_scaling
    return out


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
    if dtype not in LOGICAL_DTYPES:
        raise NotImplementedError(f"NVFP4Tensor cannot be converted to {dtype}; its logical dtype is one of {LOGICAL_DTYPES}")
    return t._with_parts(
        t.qdata.to(device), t.scale.to(device), t.global_encode_scale.to(device), orig_dtype=dtype
    )


@_implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    """In-place copy (what ``load_state_dict`` calls).

    * NVFP4Tensor -> NVFP4Tensor: the parts are copied once the source's values are checked
      (a loaded state dict is user data); both need the same orientation and part shapes (the
      same global-scale granularity), so nothing is broadcast.
    * dense -> NVFP4Tensor: the dense tensor (finite) is quantized with the recipe at the
      destination's granularity and block scaling.
    * NVFP4Tensor -> dense: the destination receives the dequantized weight.
    """
    dst, src = args[0], args[1]
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy_: shape mismatch {tuple(src.shape)} -> {tuple(dst.shape)}")
    if not isinstance(dst, NVFP4Tensor):
        return dst.copy_(src.dequantize(dst.dtype))
    if isinstance(src, NVFP4Tensor):
        if src.transposed != dst.transposed:
            raise NotImplementedError("copy_ between NVFP4Tensors of different orientation")
        for part, have, want in zip(NVFP4Parts._fields, src.parts, dst.parts):
            if have.shape != want.shape:
                raise ValueError(
                    f"copy_: source {part} {tuple(have.shape)} does not fit the destination's "
                    f"{tuple(want.shape)} (global scales per {src.granularity} -> per {dst.granularity})"
                )
        check_nvfp4_values(src.scale, src.global_encode_scale, "NVFP4Tensor.copy_ source")
        parts = src.parts
    else:
        dense = src.transpose(-2, -1) if dst.transposed else src
        check_finite(dense, "NVFP4Tensor.copy_")
        parts = nvfp4_quantize(dense, dst.granularity, None, dst.block_scaling)
    dst.write_parts_(parts)
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
    return _alias(t, not t.transposed)


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
