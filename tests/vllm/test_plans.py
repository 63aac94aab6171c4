"""Precision plans in vLLM: the ``quads`` method's scope and boundary layers (those layers run
unquantized, the rest bit for bit as the transformers rollout of the same plan), and a scoped
``quads export`` in vLLM's own ``modelopt_fp4`` loader."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from _nvfp4_cpu import emulated_nvfp4_linear, emulated_nvfp4_moe_backend, load_only  # noqa: E402
from _support import agreement, build, make_llm, release  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import quads  # noqa: E402
from quads.integrations.modelopt import export_modelopt  # noqa: E402
from quads.integrations.vllm.quant_method import (  # noqa: E402
    QuadsConfig,
    QuadsFusedMoEMethod,
    QuadsLinearMethod,
    dequantize_moe_weights,
    quads_quantization_config,
)
from quads.integrations.vllm.weight_push import engine_model  # noqa: E402
from quads.tasks.arithmetic import make_tokenizer  # noqa: E402
from quads.tensor.modelopt_format import read_modelopt_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm


def test_plan_keys_parse_and_round_trip():
    cfg = QuadsConfig.from_config(quads_quantization_config(scope="routed_experts", skip_first_layers=2,
                                                            skip_last_layers=4))
    p = cfg.policy
    assert (p.scope, p.skip_first_layers, p.skip_last_layers) == ("routed_experts", 2, 4)
    assert QuadsConfig.from_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    for key, value in (("scope", "experts"), ("skip_first_layers", -1), ("skip_last_layers", "2")):
        with pytest.raises(ValueError, match=f"QuadsPolicy.{key}"):
            quads_quantization_config(**{key: value})


@torch.no_grad()
def test_routed_experts_plan_with_a_bf16_first_layer(checkpoint):
    plan = dict(scope="routed_experts", skip_first_layers=1)
    path = checkpoint("qwen3_moe")
    llm = make_llm(path, quantization="quads", hf_overrides={"quantization_config": quads_quantization_config(**plan)})
    try:
        vm = engine_model(llm)
        quantized = {p for p, layer in vm.named_modules()
                     if isinstance(getattr(layer, "quant_method", None), (QuadsLinearMethod, QuadsFusedMoEMethod))}
        assert quantized == {"model.layers.1.mlp.experts.routed_experts"}, quantized
        rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", **plan))
        assert set(quads.quantized_modules(rollout)) == {"model.layers.1.mlp.experts"}
        experts = vm.model.layers[1].mlp.experts.routed_experts
        packed = dict(rollout.named_parameters())
        assert torch.equal(experts.w13_weight, packed["model.layers.1.mlp.experts.gate_up_proj"].qdata)
        w13, _ = dequantize_moe_weights(experts)
        assert torch.equal(w13, packed["model.layers.1.mlp.experts.gate_up_proj"].dequantize(torch.bfloat16))
        # the BF16 layer runs vLLM's unquantized MoE method on BF16 weights (its CPU build repacks them)
        kept = vm.model.layers[0].mlp.experts.routed_experts
        assert kept.w13_weight.dtype == torch.bfloat16 and "Quads" not in type(kept.quant_method).__name__
        stats = agreement(llm, rollout)
        assert stats["near"] == 1.0 and stats["max"] <= 0.75, stats
    finally:
        release(llm)


def test_dense_boundary_layer_runs_unquantized(checkpoint):
    llm = make_llm(checkpoint("llama"), quantization="quads",
                   hf_overrides={"quantization_config": quads_quantization_config(skip_last_layers=1)})
    try:
        vm = engine_model(llm)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            first, last = (vm.model.layers[i].get_submodule(name).quant_method for i in (0, 1))
            assert isinstance(first, QuadsLinearMethod) and type(last).__name__ == "UnquantizedLinearMethod", name
    finally:
        release(llm)


def test_scoped_export_loads_in_modelopt_fp4(tmp_path, monkeypatch):
    """The exclude list keeps vLLM's fused layers of the BF16 parts unquantized (the BF16 experts
    module by its prefix); the quantized experts carry the exported parts."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    trainer = build("qwen3_moe")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", scope="routed_experts", skip_first_layers=1))
    out = tmp_path / "ck"
    report = export_modelopt(trainer, out, "w4a16", tokenizer=make_tokenizer())
    cfg = ModelOptNvFp4Config.from_config(json.loads((out / "hf_quant_config.json").read_text()))
    assert cfg.exclude_modules == report.exclude_modules
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for prefix in ("model.layers.0.mlp.experts", "model.layers.0.self_attn.qkv_proj",
                   "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj", "lm_head"):
        assert cfg.is_layer_excluded(prefix), prefix
    assert not cfg.is_layer_excluded("model.layers.1.mlp.experts")
    emulated_nvfp4_linear(monkeypatch)
    emulated_nvfp4_moe_backend(monkeypatch)
    vm = load_only(monkeypatch, out)
    back = read_modelopt_checkpoint(out)
    served = vm.model.layers[1].mlp.experts.routed_experts
    gate, up = (back[f"model.layers.1.mlp.experts.0.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(served.w13_weight[0], torch.cat([gate.qdata, up.qdata]))
    kept = vm.model.layers[0].mlp.experts.routed_experts
    assert kept.w13_weight.dtype == torch.bfloat16  # the unquantized MoE method: BF16 weights
    assert "ModelOpt" not in type(kept.quant_method).__name__
    assert vm.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
