"""Saving and loading quads models with transformers' own ``save_pretrained`` / ``from_pretrained``.

    import quads
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    model.save_pretrained(path)                                  # packed parts + the policy
    back = AutoModelForCausalLM.from_pretrained(path)            # the same rollout, bit for bit

    from quads.integrations.transformers import QuadsConfig
    AutoModelForCausalLM.from_pretrained(bf16_path, quantization_config=QuadsConfig(policy))  # quantize at load

:func:`register` (run on import, idempotent) registers :class:`QuadsConfig` and
:class:`QuadsHfQuantizer` under ``quant_method="quads"`` with transformers' quantizer registries
and makes it the writer behind every quads model's ``save_pretrained``. ``import quads`` never
imports transformers: :mod:`quads.integration_hooks` imports this package right after
transformers' ``quantizers.auto`` (which ``from_pretrained`` needs) has loaded. What is stored
and checked: docs/ecosystem.md, "Saving and loading with transformers".
"""

from __future__ import annotations

from quads.extras import require

require("quads.integrations.transformers", "transformers")

from quads.integrations.transformers.config import FORMAT_VERSION, QUANT_METHOD, QuadsConfig
from quads.integrations.transformers.quantizer import QuadsHfQuantizer
from quads.integrations.transformers.save import save_pretrained

__all__ = ["FORMAT_VERSION", "QuadsConfig", "QuadsHfQuantizer", "register"]


def register() -> None:
    """Register ``quant_method="quads"`` with transformers and quads' ``save_pretrained`` writer (idempotent)."""
    from transformers.quantizers import auto

    from quads.policies.quantize import set_save_pretrained_handler

    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not QuadsConfig:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a reloaded quads' classes
        auto.register_quantization_config(QUANT_METHOD)(QuadsConfig)
    if auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not QuadsHfQuantizer:
        auto.AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        auto.register_quantizer(QUANT_METHOD)(QuadsHfQuantizer)
    set_save_pretrained_handler(save_pretrained)


register()
