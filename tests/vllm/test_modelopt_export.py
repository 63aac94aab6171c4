"""``quads export`` checkpoints in vLLM's own ``modelopt_fp4`` loader (CPU build, see _nvfp4_cpu)."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from _nvfp4_cpu import REFUSALS, emulated_nvfp4_linear, emulated_nvfp4_moe_backend, load_only  # noqa: E402
from _support import agreement, build, make_llm, release, reset_parallel_state  # noqa: E402

import quads  # noqa: E402
from quads.integrations.modelopt import export_modelopt  # noqa: E402
from quads.integrations.vllm.weight_push import engine_model  # noqa: E402
from quads.tasks.arithmetic import make_tokenizer  # noqa: E402
from quads.tensor.modelopt_format import decode_scale, read_modelopt_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm

CALIB = ["12+34=", "7+8=", "999+1=", "45+67=", "3+3=", "120+5="]


def _export(tmp_path, kind, fmt):
    tok = make_tokenizer()
    calib = [tok(p, return_tensors="pt")["input_ids"] for p in CALIB] if fmt == "nvfp4" else None
    out = tmp_path / f"{kind}-{fmt}"
    report = export_modelopt(build(kind), out, fmt, calibration=calib, tokenizer=tok)
    return out, report


def _served(path, kind):
    """The transformers model computing with the checkpoint's weights as quads reads them
    (dequantized to BF16, BF16 activations: the W4A16 numerics)."""
    model = build(kind, seed=1)
    back = read_modelopt_checkpoint(path)
    weights = {k: v for k, v in back.items() if not k.endswith(".input_scale")}
    model.load_state_dict({k: v.dequantize(torch.bfloat16) if isinstance(v, quads.NVFP4Tensor) else v for k, v in weights.items()})
    return model.eval(), back


def _parts_equal(layer_weight, layer_scale, pieces):
    return torch.equal(layer_weight, torch.cat([p.qdata for p in pieces])) and torch.equal(
        layer_scale.view(torch.uint8), torch.cat([p.scale for p in pieces]).view(torch.uint8)
    )


def test_vllm_reads_the_quantization_config(tmp_path):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    out, report = _export(tmp_path, "qwen3_moe", "w4a16")
    in_config = json.loads((out / "config.json").read_text())["quantization_config"]
    legacy = json.loads((out / "hf_quant_config.json").read_text())
    assert ModelOptNvFp4Config.override_quantization_method(in_config, None) == "modelopt_fp4"
    for raw in (in_config, legacy):
        cfg = ModelOptNvFp4Config.from_config(raw)
        assert cfg.quant_method == "W4A16_NVFP4" and cfg.group_size == 16 and cfg.is_checkpoint_nvfp4_serialized
        assert cfg.exclude_modules == report.exclude_modules
        assert cfg.is_layer_excluded("lm_head") and cfg.is_layer_excluded("model.layers.1.mlp.gate")
        assert not cfg.is_layer_excluded("model.layers.0.self_attn.qkv_proj")
        assert not cfg.is_layer_excluded("model.layers.0.mlp.experts")
    assert ModelOptNvFp4Config.from_config(json.loads((_export(tmp_path, "llama", "nvfp4")[0] / "config.json").read_text())["quantization_config"]).quant_method == "NVFP4"


@pytest.mark.parametrize("kind, fmt, refusal", [("llama", "w4a16", "w4a16"), ("llama", "nvfp4", "nvfp4"), ("qwen3_moe", "nvfp4", "moe")])
def test_cpu_build_refuses_nvfp4_kernels(tmp_path, monkeypatch, kind, fmt, refusal):
    """What vLLM's CPU build says about the checkpoints as they are (what the helpers work around)."""
    out, _ = _export(tmp_path, kind, fmt)
    if refusal == "moe":
        emulated_nvfp4_linear(monkeypatch)  # past the attention layers, to the experts
    with pytest.raises(Exception, match=REFUSALS[refusal]):
        make_llm(out)
    reset_parallel_state()


@torch.no_grad()
def test_dense_w4a16_in_vllm_computes_with_the_exported_weights(tmp_path, monkeypatch):
    emulated_nvfp4_linear(monkeypatch)
    out, report = _export(tmp_path, "llama", "w4a16")
    served, back = _served(out, "llama")
    llm = make_llm(out)
    try:
        vm = engine_model(llm)
        for i in range(2):
            attn, mlp = vm.model.layers[i].self_attn, vm.model.layers[i].mlp
            pre = f"model.layers.{i}"
            q, k, v = (back[f"{pre}.self_attn.{p}_proj.weight"] for p in "qkv")
            assert _parts_equal(attn.qkv_proj.weight, attn.qkv_proj.weight_scale, [q, k, v])
            # one global scale per fused layer, the shards' own (fused_scales="shared")
            assert torch.equal(attn.qkv_proj.weight_global_scale, decode_scale(q.global_encode_scale))
            gate, up = (back[f"{pre}.mlp.{p}_proj.weight"] for p in ("gate", "up"))
            assert _parts_equal(mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale, [gate, up])
            assert torch.equal(mlp.gate_up_proj.weight_global_scale, decode_scale(gate.global_encode_scale))
            down = back[f"{pre}.mlp.down_proj.weight"]
            assert torch.equal(mlp.down_proj.weight_global_scale, decode_scale(down.global_encode_scale))
        # vLLM's dequantized weights vs quads' reading of the same checkpoint: identical up to
        # vLLM multiplying by 1/S_enc where quads divides by S_enc (float32 rounding)
        x = torch.randn(7, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
        r_attn = served.model.layers[0].self_attn
        ref = torch.cat([r_attn.q_proj(x), r_attn.k_proj(x), r_attn.v_proj(x)], dim=-1)
        got = vm.model.layers[0].self_attn.qkv_proj(x)[0]
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3)
        stats = agreement(llm, served)
        assert stats["near"] == 1.0 and stats["exact"] >= 0.9 and stats["max"] <= 0.75, stats
    finally:
        release(llm)


@torch.no_grad()
def test_dense_w4a4_runs_through_vllms_emulation(tmp_path, monkeypatch):
    """vLLM's W4A4 emulation on the exported checkpoint: activations quantized with the static
    input scale, the layer output equals quads' recipe with that scale (float32 rounding aside)."""
    from quads.tensor import nvfp4_dequantize, nvfp4_quantize

    emulated_nvfp4_linear(monkeypatch)
    out, _ = _export(tmp_path, "llama", "nvfp4")
    served, back = _served(out, "llama")
    llm = make_llm(out)
    try:
        attn = engine_model(llm).model.layers[0].self_attn
        scale = back["model.layers.0.self_attn.q_proj.input_scale"]
        assert all(torch.equal(back[f"model.layers.0.self_attn.{p}_proj.input_scale"], scale) for p in "kv")
        assert torch.equal(attn.qkv_proj.input_global_scale, scale)  # the static decode scale, as stored
        amax = scale.item() * 2688
        x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).bfloat16() * (amax / 5)
        x_hat = nvfp4_dequantize(*nvfp4_quantize(x, global_encode_scale=torch.ones(()) / scale), dtype=torch.bfloat16)
        r_attn = served.model.layers[0].self_attn
        ref = torch.cat([r_attn.q_proj(x_hat), r_attn.k_proj(x_hat), r_attn.v_proj(x_hat)], dim=-1)
        torch.testing.assert_close(attn.qkv_proj(x)[0], ref, rtol=2**-7, atol=1e-3)
        stats = agreement(llm, served)  # W4A4 (static scales) vs the same weights in W4A16
        print("vLLM W4A4 emulation vs W4A16 on the same weights:", stats)
        assert stats["tokens"] == 72 and torch.isfinite(torch.tensor(stats["max"])), stats
    finally:
        release(llm)


@pytest.mark.parametrize("fmt", ["w4a16", "nvfp4"])
def test_moe_checkpoint_loads_into_vllms_fused_moe_layers(tmp_path, monkeypatch, fmt):
    emulated_nvfp4_linear(monkeypatch)
    emulated_nvfp4_moe_backend(monkeypatch)
    out, _ = _export(tmp_path, "qwen3_moe", fmt)
    back = read_modelopt_checkpoint(out)
    vm = load_only(monkeypatch, out)
    for i in range(2):
        experts = vm.model.layers[i].mlp.experts.routed_experts
        pre = f"model.layers.{i}.mlp.experts"
        for e in range(4):
            gate, up, down = (back[f"{pre}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            assert _parts_equal(experts.w13_weight[e], experts.w13_weight_scale[e], [gate, up])
            assert _parts_equal(experts.w2_weight[e], experts.w2_weight_scale[e], [down])
            # vLLM keeps the gate shard's scale for w13: quads' experts share one per expert
            assert gate.global_encode_scale.item() == up.global_encode_scale.item()
            assert torch.equal(experts.w13_weight_scale_2[e], decode_scale(gate.global_encode_scale))
            assert torch.equal(experts.w2_weight_scale_2[e], decode_scale(down.global_encode_scale))
        if fmt == "nvfp4":  # the emulation backend keeps the largest per-expert input scale
            a13 = max(back[f"{pre}.{e}.gate_proj.input_scale"].item() for e in range(4))
            assert experts.w13_input_scale.item() == pytest.approx(1 / a13, rel=1e-6)
        assert type(vm.model.layers[i].mlp.gate.quant_method).__name__ == "UnquantizedLinearMethod"
