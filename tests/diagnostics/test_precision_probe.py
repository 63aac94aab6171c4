"""The precision probe names the modules a plan runs in another dtype in the trainer than in the rollout."""

import pytest
import torch

import quads
from quads.diagnostics.precision_probe import compute_dtypes, precision_probe, probe_warning
from quads.policies import POLICY_PRESETS, build_rollout_model
from quads.policies.presets import preset_problem
from tests.policies.test_autocast_experts import moe_masters


def _probe(preset: str):
    trainer = quads.prepare_trainer_(moe_masters(), preset)
    return precision_probe(trainer, build_rollout_model(trainer, POLICY_PRESETS[preset].rollout))


def test_the_fp32_experts_ablation_is_caught_naming_the_experts():
    found = _probe("bf16-fp32-experts")
    assert [m.module for m in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    line = probe_warning(found)
    assert "\n" not in line
    assert "2 module(s)" in line and "model.layers.0.mlp.experts: trainer float32, rollout bfloat16" in line
    assert "quads_policy='bf16'" in line


@pytest.mark.parametrize("preset", sorted(set(POLICY_PRESETS) - {"bf16-fp32-experts"}))
def test_every_other_plan_is_bf16_on_both_sides(preset):
    if preset_problem(preset, moe_masters()):
        pytest.skip(preset_problem(preset, moe_masters()))
    assert _probe(preset) == []
    assert probe_warning([]) is None


def test_ops_are_attributed_to_the_innermost_module():
    model = moe_masters()
    seen = compute_dtypes(model, torch.arange(1, 5)[None], torch.bfloat16)
    assert seen["model.layers.0.self_attn.q_proj"] == {torch.bfloat16}  # F.linear under autocast
    assert seen["model.layers.0.mlp.experts"] == {torch.float32}  # transformers' grouped_mm: not cast
    assert "model.layers.0" not in seen  # its ops belong to its children


def test_boundary_layers_experts_compute_in_bf16_too():
    """``quads-boundary`` keeps whole decoder layers in BF16: their transformers experts get the
    autocast implementation, the quantized ones keep quads' forward."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.tiny_models import COMMON

    torch.manual_seed(0)
    cfg = MixtralConfig(**{**COMMON, "num_hidden_layers": 7}, intermediate_size=48, num_local_experts=4,
                        num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    trainer = quads.prepare_trainer_(MixtralForCausalLM(cfg).float(), "quads-boundary")
    seen = compute_dtypes(trainer, torch.arange(1, 9)[None], torch.bfloat16)
    assert seen["model.layers.0.mlp.experts"] == seen["model.layers.6.mlp.experts"] == {torch.bfloat16}
    assert precision_probe(trainer, build_rollout_model(trainer, POLICY_PRESETS["quads-boundary"].rollout)) == []
