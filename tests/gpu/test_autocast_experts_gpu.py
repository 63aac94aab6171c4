"""On CUDA: the ``bf16`` plan's trainer experts multiply in BF16 under autocast (torch's CUDA
grouped GEMM, sm_80+), the ``bf16-fp32-experts`` ablation in FP32, and the precision probe
tells them apart.

Marked ``gpu`` and skipped without CUDA: ``python -m pytest -m gpu tests/gpu/test_autocast_experts_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

import quads
from quads.diagnostics.precision_probe import compute_dtypes, precision_probe
from quads.policies import build_rollout_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("preset, dtype", [("bf16", torch.bfloat16), ("bf16-fp32-experts", torch.float32)])
def test_experts_dtype_under_cuda_autocast(preset, dtype):
    from tests.policies.test_autocast_experts import moe_masters

    trainer = quads.prepare_trainer_(moe_masters().cuda(), preset)
    ids = torch.arange(1, 9, device="cuda")[None]
    assert compute_dtypes(trainer, ids, torch.bfloat16)["model.layers.0.mlp.experts"] == {dtype}
    found = precision_probe(trainer, build_rollout_model(trainer, None))
    assert [m.module for m in found] == ([] if preset == "bf16" else
                                         ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])
