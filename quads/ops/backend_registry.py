"""The backend interface, the kernel objects' base, the registry of backends and the choice of one.

A :class:`Backend` implements every rollout op for one kind of hardware: weight and activation
quantization, the linear and experts kernels (:class:`LinearKernel`, one per quantized module, over
one :class:`LinearArgs`), the stacked linear of sibling projections. ``quantize_`` (and the vLLM
method's ``process_weights_after_loading``) picks one with :func:`select_backend` for the device
and shapes of the module's weights and stores it (``quads_backend``); moving a module picks again.

Built in (:mod:`quads.ops.backends`, one module each, registered when :mod:`quads.ops` is
imported): ``torch`` (the references: any device, the spec), ``hopper`` (the exact-emulation Triton
kernels: sm_90; any device under ``TRITON_INTERPRET=1``), ``blackwell`` (native FP4 on sm_100+, NOT
RUN: selectable, never ``auto``), and ``humming`` (:mod:`quads.ops.backends.humming.backend`, vLLM's
humming GEMMs on sm_90, the fast non-exact path; registered on first use).

``auto`` (default) = ``hopper`` on CUDA sm_90 with Triton, ``torch`` anywhere else; with the
kernel preference ``"fast"`` (``QuadsPolicy.kernel``) ``humming`` where it would pick ``hopper``,
except for a module with a weight shape humming cannot serve (:meth:`Backend.shape_problem`):
that module gets the exact kernels. Force a backend with ``QUADS_BACKEND=<name>|auto`` or
``with quads.use_backend(name):`` (a forced kernel backend on a device that cannot run it raises).

Adding a backend: subclass :class:`Backend` (or an existing one), give it a ``name``, its kernel
classes (``linear_kernel_class``, ``experts_kernel_class``, ``sibling_kernel_class``) and entries with the references' bits (or a documented bound), :func:`register_backend`
an instance; add its device rule to :func:`select_backend` only once it is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from typing import Any, Sequence

import torch

from quads.tensor.nvfp4_math import NVFP4Parts, shared_global_encode_scale

__all__ = ["BACKEND_NAMES", "KERNEL_OPS", "KERNEL_PREFERENCES", "Backend", "KernelHandle", "KernelObject", "LinearArgs",
           "LinearKernel", "backend_names", "gemm_shape", "get_backend", "register_backend", "select_backend",
           "use_backend"]

try:  # torch's opaque objects: a custom op may take a Python object (torch.compile)
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # an older torch: compiled code passes a kernel's plain fields instead
    OpaqueBase, register_opaque_type = object, None


class KernelHandle(OpaqueBase):
    """A kernel object as a custom op's argument (``quads::linear_kernel``, ``quads::experts_gemm``):
    opaque to ``torch.compile`` (a reference: a graph input, never copied or guarded on), so the
    compiled call runs the module's own kernel. Pickles as its kernel's class name (what
    inductor's cache key hashes of it: never the weights); copies are the handle itself (a
    reference: torch's fake script objects deep-copy the objects they wrap in some versions)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __reduce__(self):
        return str, (f"quads kernel {type(self.kernel).__qualname__}",)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


#: whether compiled code hands kernel objects to the quads custom ops (``quads::linear_kernel``,
#: ``quads::experts_gemm``) rather than their fields (``quads::linear``, ``quads::grouped_linear``)
KERNEL_OPS = register_opaque_type is not None
if KERNEL_OPS:
    try:
        register_opaque_type(KernelHandle, typ="reference")
    except (TypeError, ValueError, RuntimeError):  # a torch whose opaque-object API differs: the plain fields
        KERNEL_OPS = False


class KernelObject:
    """What every kernel (linear, experts) shares: its :class:`KernelHandle` (``op_handle``), made
    with it and again when it is unpickled or deep-copied."""

    def _init_handle(self) -> None:
        self.op_handle = KernelHandle(self) if KERNEL_OPS else None

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_handle()


@dataclasses.dataclass
class LinearArgs:
    """What a quantized linear's GEMMs read besides the input, fixed when its weight is set.

    ``weight``: the packed weight (an ``NVFP4Tensor``, read through ``stored_parts()`` per call so a
    write in place is seen, or its ``NVFP4Parts``); ``act``: the ``ActivationQuant`` (None:
    weight-only W4A16); ``static_mask``: the calibrated residual channels; ``prepared``: what the
    backend derived from the weight (``Backend.prepare_weight``: the Hopper layout, a humming layout)."""

    weight: Any
    act: Any = None
    static_mask: torch.Tensor | None = None
    prepared: Any = None

    def parts(self) -> NVFP4Parts:
        w = self.weight
        return w if isinstance(w, NVFP4Parts) else w.stored_parts()


def _weight_k(weight) -> int | None:
    """K of a linear's weight (None: no weight, a kernel over a prepared layer alone); raises unless
    it is a 2-D untransposed NVFP4 weight (an ``NVFP4Tensor`` or its parts)."""
    if weight is None:
        return None
    if isinstance(weight, NVFP4Parts):
        if weight.qdata.dim() != 2:
            raise TypeError(f"a linear kernel expects 2-D NVFP4 parts (N, K/2), got qdata of shape {tuple(weight.qdata.shape)}")
        return weight.qdata.shape[-1] * 2
    if getattr(weight, "transposed", False) or weight.dim() != 2:
        raise TypeError("a linear kernel expects a 2-D, untransposed NVFP4Tensor weight (N, K)")
    return weight.shape[-1]


class LinearKernel(KernelObject):
    """One quantized linear's kernel: a backend's GEMMs over one weight (:class:`LinearArgs`).

    Made once when the weight is set (:meth:`Backend.linear_kernel`; a rollout module remakes it
    only in ``quads_weights_changed``, never in a forward), applied per forward:
    ``apply(x (..., K), bias, operands) -> (..., N)`` calls the launchers itself (inside
    ``torch.compile``: the ``quads::linear`` custom op). ``operands``: the input's GEMM operands
    computed once for sibling linears (:meth:`Backend.activation_operands`).

    What ``apply`` reads is resolved here, once: ``parts`` (the packed parts' tensors, which
    every write through the product API rewrites in place; meta placeholders where the prepared
    layout holds them), ``act``, ``static_mask``, ``prepared``, ``k``."""

    def __init__(self, backend: "Backend", args: LinearArgs):
        self.backend, self.args = backend, args
        self.k = _weight_k(args.weight)
        self.parts = None if args.weight is None else args.parts()
        self.n = None if self.parts is None else self.parts.qdata.shape[0]
        self.act, self.static_mask, self.prepared = args.act, args.static_mask, args.prepared
        self._init_handle()

    def check_input(self, x: torch.Tensor) -> None:
        """Raise unless ``x``'s last dim is the weight's K (some GEMMs read only the first K columns)."""
        if self.k is not None and x.shape[-1] != self.k:
            raise ValueError(f"quads linear: x of shape {tuple(x.shape)} has K={x.shape[-1]}, the weight has K={self.k}")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None, operands=None) -> torch.Tensor:
        raise NotImplementedError

#: ``QuadsPolicy.kernel``: the exact Triton kernels (bit-exact, deterministic, batch invariant) or
#: the fast path (humming: within a stated bound of the exact path, see docs/humming.md)
KERNEL_PREFERENCES = ("exact", "fast")
#: backends registered on first use (their modules import this one)
_LAZY = {"humming": "quads.ops.backends.humming.backend"}


class Backend:
    """What a backend implements (one entry per rollout op). Arguments are plain tensors and
    :class:`~quads.tensor.nvfp4_math.NVFP4Parts`; activations are 2-D ``(M, K)``.

    * ``prepare_weight(parts, out=None)``: what the backend's GEMMs read from a packed weight
      (e.g. the Hopper kernel layout; None when they read the parts). Called whenever a weight is
      written, never per forward; ``out``, an earlier result, is rewritten in place when it fits.
      ``op_prepared(prepared)`` / ``prepared_from_op(...)``: that result as ``quads::linear``'s
      tensors and static description, and back (compiled code).
    * ``quantize_weight(x, granularity, global_encode_scale, block_scaling="6")`` -> ``NVFP4Parts``
      (the sync's op; ``block_scaling``: ``"6"`` or ``"4over6"``, ``QuadsPolicy.weight_block_scaling``).
    * ``quantize_activation(x2d, act, static_mask)`` -> ``QuantizedActivation`` (packed parts).
    * ``activation_operands(x2d, act, static_mask)``: the input in the form this backend's GEMMs
      read (computed once for several linear kernels by a sibling set's kernel); ``act=None``:
      the weight-only operand.
    * ``linear_kernel(args)`` -> the :class:`LinearKernel` of one weight (the module's, made once);
      ``linear(x2d, weight, bias, act, static_mask, prepared, operands)`` -> ``(M, N)``: one call
      through it (W4A4 + residual with an ``ActivationQuant``, W4A16 with ``act=None``).
    * ``stack_prepared(prepared, shared_scale, weight_only)`` -> the stacked layout of sibling weights
      and one view of it per member (written through the views from then on, or the members' own
      layouts where the stacked one is a copy with ``write_member_(i)``), or None when the backend
      has no stacked GEMM for them (``shared_scale``: the weights share one global scale;
      ``weight_only``: the set multiplies unquantized activations, W4A16);
      ``sibling_kernel_class``: the kernel of a :class:`~quads.ops.sibling_linear.SiblingSet` (the
      operands once, one GEMM over that layout where there is one).
    * ``experts_kernel(gate_up, down)`` -> the experts module's kernel (``experts_kernel_class``);
      ``grouped_linear(x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared)``: one
      projection over rows routed already (the ``quads::grouped_linear`` op's body; the built-in
      backends run it through a one-projection experts kernel, :func:`quads.ops.experts_op.grouped_linear`).

    Trainer side: ``group_scale(masters, block_scaling="6")``, a sibling group's shared global
    scale in the form this backend's weight fake quantizer (:func:`~quads.policies.ste.fake_quantizer`)
    takes as its ``global_encode_scale``.
    """

    name = "abstract"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "linear" in cls.__dict__ and not {"linear_kernel_class", "linear_kernel"} & cls.__dict__.keys():
            raise TypeError(f"{cls.__name__} defines linear(), which module forwards never call: put its GEMMs in "
                            f"a LinearKernel subclass's apply() and set {cls.__name__}.linear_kernel_class to it")

    def prepare_weight(self, weight, out=None):
        raise NotImplementedError

    def op_prepared(self, prepared) -> tuple[list, str]:
        """A ``prepare_weight`` result as ``quads::linear``'s arguments: its tensors and a static
        description of them (``""``: none); :meth:`prepared_from_op` makes it back inside the op."""
        return [], ""

    def prepared_from_op(self, tensors: list, config: str, weight: NVFP4Parts | None, global_encode_scale):
        """The prepared weight of :meth:`op_prepared`'s ``tensors`` and ``config``; ``weight``: the
        packed parts, None where the prepared layout holds them."""
        return None

    def refresh_prepared(self, held: tuple, weights: Sequence) -> tuple:
        """``prepare_weight`` of each of ``weights``, written **into** its predecessor in ``held``
        where that fits, else new. In place matters: CUDA graphs (ours, vLLM's) and compiled graphs
        captured over a rollout hold the prepared tensors' addresses, so a weight sync must update
        them, not replace them."""
        if len(held) != len(weights):
            held = (None,) * len(weights)
        return tuple(self.prepare_weight(w, out) for w, out in zip(weights, held))

    def quantize_weight(self, x, granularity=None, global_encode_scale=None, block_scaling="6"):
        raise NotImplementedError

    def quantize_activation(self, x2d, act, static_mask=None):
        raise NotImplementedError

    def activation_operands(self, x2d, act, static_mask=None):
        raise NotImplementedError

    #: the class of this backend's linear kernels
    linear_kernel_class: type[LinearKernel] = LinearKernel

    def linear_kernel(self, args: LinearArgs) -> LinearKernel:
        """The kernel that serves one weight (chosen once, when the weight is set)."""
        return self.linear_kernel_class(self, args)

    #: the class of this backend's experts kernels: :class:`quads.ops.experts_op.ExpertsKernel` (it
    #: runs the backend's ``grouped_linear``) or a subclass; None: the backend has none
    experts_kernel_class: type | None = None

    def experts_kernel(self, gate_up: LinearArgs, down: LinearArgs | None = None):
        """The kernel that serves one experts module's two 3-D weights (chosen once, when they are
        set); ``down`` None: a kernel of one projection over rows routed already."""
        if self.experts_kernel_class is None:
            raise NotImplementedError(f"backend {self.name!r} names no experts_kernel_class")
        return self.experts_kernel_class(self, gate_up, down)

    def linear(self, x2d, weight, bias, act, static_mask=None, prepared=None, operands=None):
        """One linear call through :meth:`linear_kernel` (callers that keep no kernel)."""
        return self.linear_kernel(LinearArgs(weight, act, static_mask, prepared)).apply(x2d, bias, operands)

    def stack_prepared(self, prepared: Sequence, shared_scale: bool = False, weight_only: bool = False):
        return None

    #: the class of this backend's sibling-set kernels: :class:`quads.ops.sibling_linear.SiblingKernel`
    #: (the operands once) or a subclass with a stacked GEMM; None: the backend serves no sibling set
    sibling_kernel_class: type | None = None

    def grouped_linear(self, x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared=None):
        raise NotImplementedError

    #: the backend a weight this one cannot serve (:meth:`shape_problem`) gets instead, or None
    fallback: str | None = None

    def shape_problem(self, n: int, k: int) -> str | None:
        """Why this backend's GEMMs cannot serve a weight of ``n`` outputs by ``k`` inputs (one
        line), or None: :func:`select_backend` gives such a weight :attr:`fallback` instead."""
        return None

    def group_scale(self, masters: Sequence[torch.Tensor], block_scaling: str = "6"):
        """The shared global scale of a sibling group's whole 2-D ``masters`` (trainer group
        mode, once per forward of their parent), as this backend's fake quantizer takes it: here
        ``S_enc`` itself (shape ``()``, :func:`~quads.tensor.nvfp4_math.shared_global_encode_scale`,
        which every fake quantizer accepts); the kernel backends return the group's amax bits
        instead (:class:`~quads.ops.weight_quant.GroupAmaxBits`: the same ``S_enc`` derived in
        their fused pass, without the torch reduction and elementwise ops on the host)."""
        return shared_global_encode_scale(masters, block_scaling)

    def __repr__(self) -> str:
        return f"quads.Backend({self.name!r})"

    def __reduce__(self):  # a backend pickles (deepcopy, torch.save of modules) as its name
        return get_backend, (self.name,)


_BACKENDS: dict[str, Backend] = {}
_forced: list[str] = []


def register_backend(backend: Backend) -> Backend:
    """Make ``backend`` selectable by its name (``QUADS_BACKEND``, :func:`use_backend`)."""
    if not backend.name or backend.name == "auto":
        raise ValueError(f"a backend needs a name other than 'auto', got {backend.name!r}")
    _BACKENDS[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    """``auto``, the registered backends' names and those registered on first use."""
    return ("auto", *_BACKENDS, *(n for n in _LAZY if n not in _BACKENDS))


BACKEND_NAMES = ("auto", "torch", "hopper", "humming", "blackwell")  # the built-in ones (see backend_names())


def get_backend(name: str) -> Backend:
    """The backend object of a name (``torch``, ``hopper``, ``humming``, ``blackwell``, or a registered one)."""
    if name in _LAZY and name not in _BACKENDS:
        importlib.import_module(_LAZY[name])  # registers it
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown quads backend {name!r}; use one of {tuple(_BACKENDS)}") from None


def _requested() -> str:
    name = _forced[-1] if _forced else os.environ.get("QUADS_BACKEND", "auto")
    if name not in backend_names():
        raise ValueError(f"QUADS_BACKEND must be one of {backend_names()}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Force the backend that :func:`select_backend` returns inside a ``with`` block.

    Modules store their backend when they are converted (or moved): use this around
    ``quantize_`` (or around direct calls of the ops' front functions, e.g. ``rollout_linear``).
    """
    if name not in backend_names():
        raise ValueError(f"backend must be one of {backend_names()}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _kernel_backend_for(device: torch.device) -> str | None:
    """'hopper' where the measured kernels run (sm_90 + Triton), else None."""
    if device.type != "cuda" or not _triton_available():
        return None
    return "hopper" if torch.cuda.get_device_capability(device)[0] == 9 else None


def gemm_shape(weight: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of a linear or experts weight as the GEMMs see it: the last two dims, swapped
    for an ``NVFP4Tensor`` stored transposed (its parts hold K last)."""
    n, k = weight.shape[-2], weight.shape[-1]
    return (k, n) if getattr(weight, "transposed", False) else (n, k)


def select_backend(device: torch.device | str, kernel: str = "exact",
                   gemm_shapes: Sequence[tuple[int, int]] = ()) -> Backend:
    """The backend for tensors on ``device`` (see the module doc); ``kernel``: ``"exact"`` or
    ``"fast"`` (the policy's preference: only ``auto`` reads it). ``gemm_shapes``: the ``(N, K)``
    of the weights it will run; one the backend cannot serve (:meth:`Backend.shape_problem`)
    gets its :attr:`~Backend.fallback` (humming -> hopper, the exact kernels)."""
    backend = _select(device, kernel)
    if backend.fallback is not None and any(backend.shape_problem(n, k) for n, k in gemm_shapes):
        return get_backend(backend.fallback)
    return backend


def _select(device: torch.device | str, kernel: str) -> Backend:
    if kernel not in KERNEL_PREFERENCES:
        raise ValueError(f"kernel preference must be one of {KERNEL_PREFERENCES}, got {kernel!r}")
    device = torch.device(device)
    requested = _requested()
    if requested == "torch" or device.type == "meta":
        return _BACKENDS["torch"]
    if requested == "auto":
        name = _kernel_backend_for(device) or "torch"
        if name == "hopper" and kernel == "fast":
            from quads.ops.backends.humming.library import import_humming

            import_humming()  # missing: the error names the pip requirement
            name = "humming"
        return get_backend(name)
    if requested == "humming" and not _interpreting():
        from quads.ops.backends.humming.library import check_humming_device, import_humming

        check_humming_device(device)
        import_humming()
        return get_backend(requested)
    if _interpreting():
        return get_backend(requested)  # the interpreter runs kernels on CPU tensors (tests)
    if device.type != "cuda" or not _triton_available():
        raise RuntimeError(f"QUADS backend {requested!r} was forced but {device} cannot run Triton kernels")
    major = torch.cuda.get_device_capability(device)[0]
    if requested == "blackwell" and major < 10:
        raise RuntimeError(f"QUADS backend 'blackwell' was forced but {device} is sm_{major}0, not sm_100+")
    return get_backend(requested)
