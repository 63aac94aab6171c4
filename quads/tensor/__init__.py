"""NVFP4 format: the recipe (`nvfp4_math`) and the packed tensor subclass (`NVFP4Tensor`)."""

from quads.tensor.nvfp4_math import (
    BLOCK_SIZE,
    NVFP4Parts,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
)
from quads.tensor.nvfp4_tensor import NVFP4Tensor
from quads.tensor.serialization import load_safetensors, save_safetensors

__all__ = [
    "BLOCK_SIZE",
    "NVFP4Parts",
    "NVFP4Tensor",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "nvfp4_quantize",
    "load_safetensors",
    "save_safetensors",
]
