"""Compiled graphs holding quads ops keep eager's BF16 roundings (so eager's bits).

A compiled rollout is exact only if every tensor reaching a quads op has eager's bits. inductor
fuses the BF16 ops around them (norms, router softmax, residual sums) and keeps the
intermediates in float32, dropping the BF16 roundings eager does between ops; an activation
one BF16 ulp off can move an NVFP4 code, and with it the logits. inductor's
``emulate_precision_casts`` keeps those roundings. The trace-time (fake) kernel of every quads
op calls :func:`align_this_compile`, which turns it on for the rest of the ``torch.compile``
it runs in (dynamo's tracing, inductor's lowering and code generation) and restores the
previous value when that compile ends (dynamo's end-of-compile callback). Graphs without quads
ops compile as configured.

The switch is one process-wide setting, read from ``QUADS_EAGER_CASTS`` once, at import
(``QUADS_EAGER_CASTS=0``: off, leaving inductor's setting alone: faster fused BF16 math, a bounded
drift from eager); :func:`set_eager_casts` / :func:`eager_casts` change it for the compiles that
start afterwards (a graph already compiled keeps what it was compiled with). Compiles read the
stored value, never the environment.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

__all__ = ["align_this_compile", "eager_casts", "enabled", "set_eager_casts"]

_state = threading.local()
_eager_casts = os.environ.get("QUADS_EAGER_CASTS", "1") != "0"  # read once, here


def enabled() -> bool:
    """Whether compiles of graphs holding quads ops keep eager's roundings (the stored setting:
    ``QUADS_EAGER_CASTS`` at import, else :func:`set_eager_casts`'s last value)."""
    return _eager_casts


def set_eager_casts(on: bool) -> None:
    """Turn the alignment on or off for the compiles that start from now on, process-wide
    (what ``QUADS_EAGER_CASTS=0`` does at import)."""
    global _eager_casts
    if not isinstance(on, bool):
        raise TypeError(f"set_eager_casts takes a bool, got {on!r}")
    _eager_casts = on


@contextlib.contextmanager
def eager_casts(on: bool):
    """:func:`set_eager_casts` inside a ``with`` block, the previous setting restored after it."""
    previous = _eager_casts
    set_eager_casts(on)
    try:
        yield
    finally:
        set_eager_casts(previous)


def align_this_compile() -> None:
    """Inside a ``torch.compile``: inductor's ``emulate_precision_casts`` on until this compile ends
    (once per compile); a no-op outside one, when already on, or when disabled."""
    if not torch.compiler.is_compiling() or getattr(_state, "patch", None) is not None or not enabled():
        return
    from torch._guards import CompileContext
    import torch._inductor.config as inductor_config

    if CompileContext.current_compile_id() is None or inductor_config.emulate_precision_casts:
        return  # not dynamo's compile (no end-of-compile callback to restore it), or on already
    patch = inductor_config.patch(emulate_precision_casts=True)
    patch.__enter__()
    _state.patch = patch
    handler = torch._dynamo.callback_handler
    if _restore not in handler.end_callbacks:  # torch._dynamo.reset() clears callbacks
        handler.register_end_callback(_restore)


def _restore(_args=None) -> None:
    patch = getattr(_state, "patch", None)
    if patch is not None:
        _state.patch = None
        patch.__exit__(None, None, None)
