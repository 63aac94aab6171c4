"""Triton interpreter (``TRITON_INTERPRET=1``: kernels run on CPU tensors, the test suite's mode).

Two interpreter defects the launchers work around (Triton 3.9, measured, docs/kernels.md):
bf16 subnormals are converted to fp32 wrongly (so bf16 inputs are handed over as exact fp32
copies) and fp32 -> bf16 stores truncate instead of rounding (so bf16 outputs are written as
fp32 and cast on the host). On a GPU both helpers are no-ops.
"""

from __future__ import annotations

import os

import torch

__all__ = ["interpreting", "interpreter_safe_input"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_safe_input(x: torch.Tensor) -> torch.Tensor:
    """An exact fp32 copy of a bf16 input under the interpreter; ``x`` itself otherwise."""
    return x.float() if interpreting() and x.dtype == torch.bfloat16 else x
