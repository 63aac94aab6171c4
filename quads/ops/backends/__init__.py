"""The built-in backends, one module each: its kernel classes (linear, experts, sibling set) and
its :class:`~quads.ops.backend_registry.Backend` subclass, which names them and is registered
at the end of the module.

:mod:`.reference` (``torch``, the spec), :mod:`.hopper` (the exact Triton kernels),
:mod:`.blackwell` (native FP4, NOT RUN) are registered when :mod:`quads.ops` is imported;
:mod:`.humming` (the fast path on vLLM's humming GEMMs) on first use.
"""

from quads.ops.backends.reference import TorchBackend
from quads.ops.backends.hopper import HopperBackend
from quads.ops.backends.blackwell import BlackwellBackend

__all__ = ["BlackwellBackend", "HopperBackend", "TorchBackend"]
