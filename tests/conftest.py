"""Test session set-up: without a GPU, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before ``quads.kernels`` is imported (Triton reads it when the
kernels are decorated), so it is set here, once, for the whole session.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
