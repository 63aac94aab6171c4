"""Weight quantization front: the recipe's reference on CPU, a bit-exact Triton kernel on GPU.

Used by :class:`NVFP4Tensor` construction and by in-place weight sync (``copy_`` from the
trainer's BF16 masters), which runs every RL step and so must be fast on the GPU.
"""

from __future__ import annotations

import torch

from quads.ops.dispatch import select_backend
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_quantize


def quantize_weight(x: torch.Tensor, granularity: str | None = None) -> NVFP4Parts:
    """NVFP4 parts of a weight; identical bits whichever backend runs."""
    if select_backend(x.device) == "torch":
        return nvfp4_quantize(x, granularity)
    from quads.kernels import quantize_weight_kernel

    return quantize_weight_kernel(x, granularity)
