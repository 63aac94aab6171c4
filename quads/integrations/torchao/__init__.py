"""QUADS inside torchao: ``torchao.quantization.quantize_(model, quads.QuadsPolicy(...))``, and
conversions between ``quads.NVFP4Tensor`` and torchao's NVFP4 tensor.

    import torchao, quads
    import quads.integrations.torchao            # registers QuadsPolicy with torchao (once)

    torchao.quantization.quantize_(llama, quads.QuadsPolicy(side="trainer"))
    # fused MoE experts are not nn.Linear: select them with a filter, as for any torchao config
    from quads.integrations.torchao import linear_or_experts
    torchao.quantization.quantize_(moe, quads.QuadsPolicy(side="rollout"), filter_fn=linear_or_experts)

Tested with ``torchao==0.18.0`` (the ``torchao`` extra). Importing this package imports torchao;
``import quads`` never does. :func:`register` (run on import, idempotent) makes ``QuadsPolicy`` a
torchao ``AOBaseConfig`` (an ABC virtual subclass: ``quads.policies`` does not depend on torchao)
and registers its module handler; see :mod:`.config` for what the handler does and
:mod:`.tensor` for the tensor conversions and where the two NVFP4 recipes differ.
"""

from __future__ import annotations

from quads.extras import require

require("quads.integrations.torchao", "torchao")

from quads.integrations.torchao.config import linear_or_experts, register
from quads.integrations.torchao.tensor import from_torchao_nvfp4, to_torchao_nvfp4

__all__ = ["from_torchao_nvfp4", "linear_or_experts", "register", "to_torchao_nvfp4"]

register()
