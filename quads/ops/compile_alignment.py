"""Compiled graphs holding quads ops keep eager's BF16 roundings (so eager's bits).

A compiled rollout is exact only if every tensor reaching a quads op has eager's bits. inductor
fuses the BF16 ops around them (norms, router softmax, residual sums) and keeps the
intermediates in float32, dropping the BF16 roundings eager does between ops; an activation
one BF16 ulp off can move an NVFP4 code, and with it the logits. inductor's
``emulate_precision_casts`` keeps those roundings. The trace-time (fake) kernel of every quads
op calls :func:`align_this_compile`, which turns it on for the rest of the ``torch.compile``
it runs in (dynamo's tracing, inductor's lowering and code generation) and restores the
previous value when that compile ends (dynamo's end-of-compile callback). Graphs without quads
ops compile as configured. ``QUADS_EAGER_CASTS=0`` leaves inductor's setting alone (faster fused
BF16 math, a bounded drift from eager).
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["align_this_compile", "enabled"]

_state = threading.local()


def enabled() -> bool:
    """False when ``QUADS_EAGER_CASTS=0``: compiled quads graphs then use inductor's setting as is."""
    return os.environ.get("QUADS_EAGER_CASTS", "1") != "0"


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
