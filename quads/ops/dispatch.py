"""Which implementation of a rollout op runs: the torch reference or a Triton kernel.

``auto`` (default) picks by the input's device: CUDA sm_90 (Hopper) -> the exact-emulation
Triton kernels, CUDA sm_100+ (Blackwell) -> the native FP4 path, anything else (CPU...) ->
the torch reference. Force a path for debugging with the environment variable
``QUADS_BACKEND=torch|hopper|blackwell|auto`` or, in code, ``with quads.ops.use_backend("torch"):``.
A forced kernel backend on a device that cannot run it raises instead of falling back.
"""

from __future__ import annotations

import contextlib
import os

import torch

BACKENDS = ("auto", "torch", "hopper", "blackwell")
_forced: list[str] = []


def _requested() -> str:
    name = _forced[-1] if _forced else os.environ.get("QUADS_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"QUADS_BACKEND must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Force the rollout-op backend inside a ``with`` block."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def device_backend(device: torch.device) -> str:
    """The kernel backend a device supports: 'hopper', 'blackwell' or 'torch'."""
    if device.type != "cuda" or not _triton_available():
        return "torch"
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    return "torch"


def select_backend(device: torch.device) -> str:
    """Resolve the backend for tensors on ``device`` (see module doc)."""
    requested = _requested()
    if requested == "auto":
        return device_backend(device)
    if requested == "torch":
        return "torch"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return requested  # the interpreter runs kernels on CPU tensors (tests)
    supported = device_backend(device)
    if supported != requested:
        raise RuntimeError(
            f"QUADS backend {requested!r} was forced but the device {device} supports {supported!r}"
        )
    return requested
