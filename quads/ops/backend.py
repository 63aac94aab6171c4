"""Backends: which implementation of every rollout op runs, chosen once and stored.

A :class:`Backend` has one method per op (weight quantization, activation quantization, the
W4A4/W4A16 linear, the grouped expert linear). ``quantize_`` (and the vLLM method's
``process_weights_after_loading``) picks one with :func:`select_backend` for the device the
weights live on and stores it on the module, so a forward never re-resolves it; moving a
module to another device picks again.

* ``torch``: the references (any device; the spec the kernels are tested against);
* ``hopper``: the exact-emulation Triton kernels (sm_90; any device under ``TRITON_INTERPRET=1``);
* ``humming``: rollout linears through vLLM's humming GEMMs (sm_90, :mod:`quads.ops.humming_backend`;
  humming imported lazily, ``pip install humming-kernels==0.1.19``): the fast, non-exact path;
* ``blackwell``: the native FP4 linear of :mod:`quads.kernels.blackwell` on sm_100+, the Hopper
  kernels for everything else. **Never run** (no Blackwell GPU here): selectable, never ``auto``.

``auto`` (default) = ``hopper`` on CUDA sm_90 with Triton installed, ``torch`` anywhere else
(the emulation kernels are only measured on sm_90); with the kernel preference ``"fast"``
(``QuadsPolicy.kernel``) ``auto`` picks ``humming`` where ``hopper`` would be picked. Force a backend for new modules and for
tests with ``QUADS_BACKEND=torch|hopper|blackwell|auto`` or ``with quads.use_backend(name):``.
A forced kernel backend on a device that cannot run it raises instead of falling back.
"""

from __future__ import annotations

import contextlib
import os

import torch

from quads.ops.activation_quant import (
    ActivationQuant,
    QuantizedActivation,
    quantize_activation_reference,
    quantize_activation_triton,
)
from quads.ops.grouped_linear import grouped_linear_hopper, grouped_linear_reference
from quads.ops.linear import (
    prepare_weight_hopper,
    w4a4_linear_blackwell,
    w4a4_linear_hopper,
    w4a4_linear_reference,
    w4a16_linear,
    w4a16_linear_hopper,
)
from quads.ops.weight_quant import quantize_weight_reference, quantize_weight_triton
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["BACKEND_NAMES", "Backend", "get_backend", "select_backend", "use_backend"]

BACKEND_NAMES = ("auto", "torch", "hopper", "humming", "blackwell")
KERNEL_PREFERENCES = ("exact", "fast")


class Backend:
    """The torch reference backend; kernel backends override the methods they accelerate.

    ``prepare_weight(parts)`` derives what the backend's GEMMs read from a packed weight (the
    Hopper kernel layout; nothing for the reference); the rollout modules call it whenever their
    weights are written and pass the result back as ``prepared`` (optional for direct callers).
    """

    name = "torch"

    def prepare_weight(self, weight: NVFP4Parts, out=None):
        """What this backend's GEMMs read from ``weight`` (None here). ``out``: an earlier result,
        rewritten in place and returned when it fits ``weight`` (same shapes, dtypes, device)."""
        return None

    def refresh_prepared(self, held: tuple, weights) -> tuple:
        """``prepare_weight`` of each of ``weights``, written **into** its predecessor in ``held``
        where that fits, else new. In place matters: CUDA graphs (ours, vLLM's) and compiled graphs
        captured over a rollout hold the prepared tensors' addresses, so a weight sync must update
        them, not replace them (on CUDA the Hopper layout kernel writes them directly)."""
        if len(held) != len(weights):
            held = (None,) * len(weights)
        return tuple(self.prepare_weight(w, out) for w, out in zip(weights, held))

    def quantize_weight(
        self, x: torch.Tensor, granularity: str | None = None, global_encode_scale: torch.Tensor | None = None
    ) -> NVFP4Parts:
        return quantize_weight_reference(x, granularity, global_encode_scale)

    def quantize_activation(self, x2d: torch.Tensor, act: ActivationQuant, static_mask=None) -> QuantizedActivation:
        return quantize_activation_reference(x2d, act, static_mask)

    def linear(self, x2d, weight: NVFP4Parts, bias, act: ActivationQuant | None, static_mask=None,
               prepared=None) -> torch.Tensor:
        if act is None:
            return w4a16_linear(x2d, weight, bias)
        return w4a4_linear_reference(x2d, weight, bias, act, static_mask)

    def grouped_linear(self, x, rows, offsets, weight: NVFP4Parts, bias, act, static_mask, num_rows,
                       prepared=None) -> torch.Tensor:
        return grouped_linear_reference(x, rows, offsets, weight, bias, act, static_mask, num_rows)

    def __repr__(self) -> str:
        return f"quads.Backend({self.name!r})"

    def __reduce__(self):  # a backend pickles (deepcopy, torch.save of modules) as its name
        return get_backend, (self.name,)


class HopperBackend(Backend):
    name = "hopper"

    def prepare_weight(self, weight, out=None):
        return prepare_weight_hopper(weight, out)

    def quantize_weight(self, x, granularity=None, global_encode_scale=None):
        return quantize_weight_triton(x, granularity, global_encode_scale)

    def quantize_activation(self, x2d, act, static_mask=None):
        return quantize_activation_triton(x2d, act, static_mask)

    def linear(self, x2d, weight, bias, act, static_mask=None, prepared=None):
        if act is None:
            return w4a16_linear_hopper(x2d, weight, bias, prepared)
        return w4a4_linear_hopper(x2d, weight, bias, act, static_mask, prepared)

    def grouped_linear(self, x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared=None):
        return grouped_linear_hopper(x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared)


class BlackwellBackend(HopperBackend):
    """NOT RUN (see the module doc)."""

    name = "blackwell"

    def linear(self, x2d, weight, bias, act, static_mask=None, prepared=None):
        if act is None or not x2d.is_cuda:  # CPU tensors under the interpreter: the emulation
            return super().linear(x2d, weight, bias, act, static_mask, prepared)
        return w4a4_linear_blackwell(x2d, weight, bias, act, static_mask)


_BACKENDS = {b.name: b for b in (Backend(), HopperBackend(), BlackwellBackend())}
_forced: list[str] = []


def get_backend(name: str) -> Backend:
    """The backend object of a name (``torch``, ``hopper``, ``humming``, ``blackwell``)."""
    if name == "humming" and name not in _BACKENDS:  # created on first use: its module imports this one
        from quads.ops.humming_backend import HummingBackend

        _BACKENDS[name] = HummingBackend()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown quads backend {name!r}; use one of {BACKEND_NAMES[1:]}") from None


def _requested() -> str:
    name = _forced[-1] if _forced else os.environ.get("QUADS_BACKEND", "auto")
    if name not in BACKEND_NAMES:
        raise ValueError(f"QUADS_BACKEND must be one of {BACKEND_NAMES}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Force the backend that :func:`select_backend` returns inside a ``with`` block.

    Modules store their backend when they are converted (or moved): use this around
    ``quantize_`` (or around calls of the functional ops in :mod:`quads.ops.functional`).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel_backend_for(device: torch.device) -> str | None:
    """'hopper' where the measured kernels run (sm_90 + Triton), else None."""
    if device.type != "cuda" or not _triton_available():
        return None
    return "hopper" if torch.cuda.get_device_capability(device)[0] == 9 else None


def select_backend(device: torch.device | str, kernel: str = "exact") -> Backend:
    """The backend for tensors on ``device`` (see the module doc); ``kernel``: ``"exact"`` or
    ``"fast"`` (the policy's preference: only ``auto`` reads it)."""
    if kernel not in KERNEL_PREFERENCES:
        raise ValueError(f"kernel preference must be one of {KERNEL_PREFERENCES}, got {kernel!r}")
    device = torch.device(device)
    requested = _requested()
    if requested == "torch" or device.type == "meta":
        return _BACKENDS["torch"]
    if requested == "auto":
        name = _kernel_backend_for(device) or "torch"
        if name == "hopper" and kernel == "fast":
            from quads.kernels.humming_gemm import import_humming

            import_humming()  # missing: the error names the pip requirement
            name = "humming"
        return get_backend(name)
    if requested == "humming" and not _interpreting():
        from quads.kernels.humming_gemm import check_humming_device, import_humming

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
    return _BACKENDS[requested]
