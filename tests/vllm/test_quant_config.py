"""The ``quads`` method's registration and configuration: plugin entry point, config parsing,
selection through config.json's ``quantization_config`` and through ``hf_overrides``."""

from __future__ import annotations

import json
import shutil

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from _support import agreement, make_llm, release  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import quads  # noqa: E402
from quads.integrations.vllm.quant_method import QuadsConfig, QuadsLinearMethod, quads_quantization_config  # noqa: E402
from quads.integrations.vllm.weight_push import engine_model  # noqa: E402

pytestmark = pytest.mark.vllm


def test_registered():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from quads.integrations.vllm import register

    register()
    register()  # idempotent
    assert "quads" in QUANTIZATION_METHODS
    assert get_quantization_config("quads") is QuadsConfig


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("quads.")]
    if not eps:
        pytest.skip("quads is not installed with its vllm.general_plugins entry point (pip install -e .)")
    assert [ep.value for ep in eps] == ["quads.integrations.vllm:register"]
    eps[0].load()()


def test_config_parsing():
    cfg = QuadsConfig.from_config({"quant_method": "quads", "residual_fraction": 0.25})
    assert cfg.activation_quant == quads.ActivationQuant(0.25, "per_token", "row")
    assert QuadsConfig.from_config({"quant_method": "quads", "activations": "bf16"}).activation_quant is None
    assert QuadsConfig.from_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert cfg.policy.kernel == "exact"
    fast = QuadsConfig.from_config({"quant_method": "quads", "kernel": "fast"})  # humming on sm_90
    assert fast.policy.kernel == "fast" and fast.to_dict()["kernel"] == "fast"
    with pytest.raises(ValueError, match="kernel"):
        QuadsConfig.from_config({"quant_method": "quads", "kernel": "fastest"})
    d = quads_quantization_config(residual_fraction=0.0)
    assert d["quant_method"] == "quads" and d["residual_fraction"] == 0.0
    assert d["weight_global_scale"] == "group"  # merged layers: one global scale for their shards
    tensor = QuadsConfig.from_config({"quant_method": "quads", "weight_global_scale": "tensor"})
    assert tensor.policy.weight_global_scale == "tensor" and tensor.to_dict()["weight_global_scale"] == "tensor"
    with pytest.raises(ValueError, match="weight_global_scale"):
        quads_quantization_config(weight_global_scale="fused")
    with pytest.raises(ValueError, match="unknown"):
        QuadsConfig.from_config({"quant_method": "quads", "residual": 0.5})
    with pytest.raises(NotImplementedError, match="per_token"):
        QuadsConfig.from_config({"quant_method": "quads", "residual_selection": "static"})
    with pytest.raises(ValueError):
        quads_quantization_config(residual_fraction=2.0)


def test_quantization_config_in_config_json(checkpoint, tmp_path):
    """A checkpoint whose config.json names quant_method "quads" loads with those settings and
    no ``quantization=`` argument; W4A16 (activations "bf16") agrees with the transformers W4A16
    rollout model at the BF16 engine-drift level."""
    src = checkpoint("qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quads_quantization_config(activations="bf16")
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = make_llm(dst)
    vm = engine_model(llm)
    method = vm.model.layers[0].self_attn.qkv_proj.quant_method
    assert isinstance(method, QuadsLinearMethod) and method.config.activation_quant is None
    rollout = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations="bf16"))
    stats = agreement(llm, rollout)
    print(f"\nqwen3_moe: vLLM-quads vs transformers rollout (W4A16): {stats}")
    release(llm)
    assert stats["near"] == 1.0 and stats["max"] <= 0.15, stats


def test_hf_overrides_select_residual_fraction(checkpoint):
    llm = make_llm(
        checkpoint("llama"),
        quantization="quads",
        hf_overrides={"quantization_config": quads_quantization_config(residual_fraction=0.25)},
    )
    method = engine_model(llm).model.layers[0].mlp.down_proj.quant_method
    release(llm)
    assert method.config.activation_quant == quads.ActivationQuant(0.25)
