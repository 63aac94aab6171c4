"""What the export tests add so that vLLM's own ``modelopt_fp4`` path runs on its CPU build.

vLLM 0.32's CPU build loads a ModelOpt NVFP4 checkpoint's config but has no NVFP4 kernel for
the CPU platform (measured; :data:`REFUSALS` holds its exact messages):

* NVFP4 linear, W4A16: the auto choice is forced to FP4 Marlin, which needs CUDA;
* NVFP4 linear, W4A4: ``_POSSIBLE_NVFP4_KERNELS`` has no CPU entry (vLLM's torch emulation
  kernel, ``EmulationNvFp4LinearKernel``, is registered for CUDA and ROCm only);
* NVFP4 fused MoE: every backend is CUDA (the emulation backend runs Triton's fused-MoE kernel).

So the tests register vLLM's *own* emulation kernel for the CPU platform (W4A4; its CPU path is
plain torch), give the W4A16 layers a kernel that computes ``F.linear(x, w)`` with ``w`` from
vLLM's own ``dequantize_to_dtype`` (vLLM's reading of the checkpoint, BF16 activations), and,
for MoE, stop the engine right after vLLM has built the model and loaded the checkpoint into it
(``create_weights``, the weight loaders, ``process_weights_after_loading`` all run), to inspect
the loaded layers. Everything else is vLLM's unmodified code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: vLLM 0.32 CPU's errors on an NVFP4 checkpoint without the helpers below
REFUSALS = {
    "w4a16": "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available",
    "nvfp4": "Failed to find a kernel that can implement the NVFP4 linear layer",
    "moe": "No NvFp4 MoE backend supports the deployment configuration.",
}


def emulated_nvfp4_linear(monkeypatch) -> None:
    """W4A4 and W4A16 NVFP4 linear layers on CPU through vLLM's emulation code (module doc)."""
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    class DequantW4A16(kernels.EmulationNvFp4LinearKernel):
        """BF16 activations times vLLM's own dequantization of the loaded NVFP4 weight."""

        def apply_weights(self, layer, x, bias=None):
            w = dequantize_to_dtype(layer.weight, layer.weight_scale, layer.weight_global_scale, x.dtype, swizzle=False)
            return F.linear(x, w, bias)

    def init_kernel(use_a16: bool = False):
        cls = DequantW4A16 if use_a16 else kernels.EmulationNvFp4LinearKernel
        return cls(NvFp4LinearLayerConfig())

    monkeypatch.setattr(modelopt, "init_nvfp4_linear_kernel", init_kernel)


def emulated_nvfp4_moe_backend(monkeypatch) -> None:
    """vLLM's own EMULATION NVFP4 MoE backend (weights loaded as on a GPU; forward needs Triton)."""
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    monkeypatch.setattr(
        modelopt, "select_nvfp4_moe_backend",
        lambda **kwargs: (NvFp4MoeBackend.EMULATION, Nvfp4QuantizationEmulationTritonExperts),
    )


class _Loaded(Exception):
    pass


def load_only(monkeypatch, path, **kwargs) -> torch.nn.Module:
    """The vLLM model built for ``path`` with the checkpoint loaded, before its first forward."""
    import vllm.v1.worker.cpu_model_runner as runner

    from _support import make_llm, reset_parallel_state

    captured = {}
    real_get_model = runner.get_model

    def get_model(**kw):
        captured["model"] = real_get_model(**kw)
        raise _Loaded

    monkeypatch.setattr(runner, "get_model", get_model)
    try:
        make_llm(path, **kwargs)
    except _Loaded:
        pass
    except Exception as exc:  # vLLM may wrap the sentinel
        if "model" not in captured:
            raise
        del exc
    finally:
        reset_parallel_state()
    return captured["model"]
