"""quads: NVFP4 precision policies for stable RL of LLMs (QUADS).

Trainer side: asymmetric W4A16 QAT (NVFP4 fake-quant weights, BF16 activations).
Rollout side: packed NVFP4 weights, W4A4 with residual activation compensation.
Both sides share one quantizer, so the rollout's weights equal the trainer's bit for bit.

    import quads
    quads.quantize_(trainer_model, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout_model, quads.QuadsPolicy(side="rollout", residual_fraction=0.5))
    quads.sync_weights_(rollout_model, trainer_model)   # after every optimizer step
    quads.fuse_projections_(rollout_model)  # GPU: q/k/v and gate/up as one decode GEMM each
"""

from quads.ops import ActivationQuant, Backend, select_backend, use_backend
from quads.policies import (
    POLICY_PRESETS,
    QuadsPolicy,
    autocast_experts_,
    calibrate_residual_channels,
    fuse_projections_,
    prepare_trainer_,
    quantize_,
    quantized_modules,
    sync_weights_,
)
from quads.tensor import NVFP4Tensor, nvfp4_dequantize, nvfp4_fake_quantize, nvfp4_quantize
from quads.integration_hooks import install as _install_integration_hooks
from quads.tensor.load_guard import install as _install_load_guard

_install_integration_hooks()  # QuadsPolicy works in torchao's quantize_ once torchao is imported
_install_load_guard()  # load_state_dict never dequantizes packed NVFP4 weights into dense tensors silently

__version__ = "0.1.0"

__all__ = [
    "POLICY_PRESETS",
    "ActivationQuant",
    "Backend",
    "NVFP4Tensor",
    "QuadsPolicy",
    "autocast_experts_",
    "calibrate_residual_channels",
    "fuse_projections_",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "nvfp4_quantize",
    "prepare_trainer_",
    "quantize_",
    "quantized_modules",
    "select_backend",
    "sync_weights_",
    "use_backend",
]
