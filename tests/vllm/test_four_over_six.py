"""The vLLM ``quads`` method with ``weight_block_scaling="4over6"`` (the trainer's Four Over Six
weights): its packed weights are the 4over6 trainer's forward weights, bit for bit, dense and MoE."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from _support import make_llm, release  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from quads.integrations.vllm.quant_method import (  # noqa: E402
    QuadsConfig,
    QuadsFusedMoEMethod,
    QuadsLinearMethod,
    dequantize_linear_weight,
    dequantize_moe_weights,
    quads_quantization_config,
)
from quads.integrations.vllm.weight_push import engine_model  # noqa: E402
from quads.tensor import nvfp4_fake_quantize  # noqa: E402
from tests.scale_reference import reference_forward_weight  # noqa: E402

pytestmark = pytest.mark.vllm
FOS = "4over6"


def test_config_key_round_trips_and_is_validated():
    cfg = QuadsConfig.from_config({"quant_method": "quads", "weight_block_scaling": FOS})
    assert cfg.policy.weight_block_scaling == FOS and cfg.to_dict()["weight_block_scaling"] == FOS
    assert quads_quantization_config()["weight_block_scaling"] == "6"
    act = QuadsConfig.from_config({"quant_method": "quads", "activation_block_scaling": FOS})
    assert act.activation_quant.block_scaling == FOS and act.to_dict()["activation_block_scaling"] == FOS
    with pytest.raises(ValueError, match="weight_block_scaling"):
        quads_quantization_config(weight_block_scaling="4/6")


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_packed_weights_are_the_4over6_trainer_forward_weights(kind, checkpoint):
    path = checkpoint(kind)
    llm = make_llm(path, quantization="quads",
                   hf_overrides={"quantization_config": quads_quantization_config(weight_block_scaling=FOS)})
    vm = engine_model(llm)
    masters = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).named_parameters())
    seen = 0
    for prefix, layer in vm.named_modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, QuadsLinearMethod):
            head, _, last = prefix.rpartition(".")
            names = [f"{head}.{s}" for s in method.config.packed_modules_mapping.get(last, [last])]
            for name, deq in zip(names, dequantize_linear_weight(layer), strict=True):
                want = reference_forward_weight(masters, f"{name}.weight", block_scaling=FOS)
                assert torch.equal(deq, want), name
                assert not torch.equal(deq, reference_forward_weight(masters, f"{name}.weight")), name
            seen += 1
        elif isinstance(method, QuadsFusedMoEMethod):
            hf = prefix.replace(".routed_experts", "")
            w13, w2 = dequantize_moe_weights(layer)
            assert torch.equal(w13, nvfp4_fake_quantize(masters[f"{hf}.gate_up_proj"], block_scaling=FOS)), prefix
            assert torch.equal(w2, nvfp4_fake_quantize(masters[f"{hf}.down_proj"], block_scaling=FOS)), prefix
            seen += 1
    release(llm)
    assert seen > 0
