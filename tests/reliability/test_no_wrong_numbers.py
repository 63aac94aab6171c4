"""No wrong numbers: values that would overflow, nonsense scales and forwards quads would drop
are refused, naming the culprit, instead of giving Inf, NaN or another model."""

import re

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import quads
from quads.tensor import nvfp4_dequantize, nvfp4_quantize
from tests.model_state import assert_unchanged, snapshot
from tests.tiny_models import COMMON


def _llama(dtype=torch.bfloat16, seed=0, **kw):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 96, **kw})).to(dtype)


# -- 16-bit overflow on every path that writes weights ---------------------------------------------


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_load_state_dict_into_a_float16_rollout_refuses_overflow(name):
    """A float32 trainer state with one weight at 1e6 (packed or dense) into a float16 rollout."""
    rollout = _llama(torch.float16)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    state = _llama(torch.float32).state_dict()
    with torch.no_grad():
        state[name].view(-1)[3] = 1e6
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=r"load_state_dict \(nothing was loaded\).*" + re.escape(name)):
        rollout.load_state_dict(state)
    assert_unchanged(before, rollout)
    state[name].view(-1)[3] = 0.5  # the same state without the outlier loads
    rollout.load_state_dict(state)


def test_load_state_dict_refuses_nan_before_loading_anything():
    rollout = _llama()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    state = _llama(torch.float32, seed=1).state_dict()
    with torch.no_grad():
        state["model.layers.1.mlp.down_proj.weight"].view(-1)[0] = float("nan")  # the last packed weight
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=r"down_proj\.weight"):
        rollout.load_state_dict(state)
    assert_unchanged(before, rollout)  # not the earlier layers loaded and the rest refused


def test_export_float16_refuses_a_weight_that_overflows(tmp_path):
    from quads.integrations.modelopt import export_modelopt

    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        model = _llama(torch.float32)
        with torch.no_grad():
            model.get_parameter(name).view(-1)[5] = 1e6
        with pytest.raises(ValueError, match=r"nothing was written.*" + re.escape(name)):
            export_modelopt(model, tmp_path / "out", dtype="float16")
        assert not (tmp_path / "out").exists()
        export_modelopt(model, tmp_path / f"ok-{name}", dtype="bfloat16")  # fits bfloat16


def test_quads_export_dtype_float16_exits_2_naming_the_tensor(tmp_path, capsys):
    from quads.cli import main

    model = _llama(torch.float32)
    with torch.no_grad():
        model.model.norm.weight[0] = 1e6
    model.save_pretrained(tmp_path / "ck")
    rc = main(["export", "--model", str(tmp_path / "ck"), "--out", str(tmp_path / "out"), "--dtype", "float16"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(err) == 1 and "model.norm.weight" in err[0], err
    assert not (tmp_path / "out").exists()


# -- the low-level ops refuse nonsense -------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, float("nan"), -1.0, float("inf")])
def test_nvfp4_quantize_refuses_a_global_scale_that_is_not_finite_and_positive(bad):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="global_encode_scale must be finite and > 0"):
        nvfp4_quantize(x, "tensor", torch.tensor(bad))
    nvfp4_quantize(x, "tensor", torch.tensor(12.5))  # a real one is fine


def test_nvfp4_quantize_refuses_a_global_scale_of_another_shape():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="does not fit 'tensor' global scales"):
        nvfp4_quantize(x, "tensor", torch.full((4,), 10.0))  # would broadcast one per row
    with pytest.raises(ValueError, match="does not fit 'row' global scales"):
        nvfp4_quantize(x, "row", torch.full((3,), 10.0))


def test_nvfp4_dequantize_refuses_parts_that_do_not_fit():
    q, s, g = nvfp4_quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"scale has shape \(8, 1\).*needs \(8, 4\)"):
        nvfp4_dequantize(q, s[:, :1], g)  # refused, not one block scale broadcast over the row
    with pytest.raises(ValueError, match="global_encode_scale of shape"):
        nvfp4_dequantize(q, s, torch.ones(3))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4_dequantize(q, s.view(torch.uint8), g)
    assert torch.equal(nvfp4_dequantize(q, s, g), nvfp4_dequantize(q, s, g.reshape(())))


def test_calibrate_residual_channels_refuses_nan_activations():
    model = _llama()
    quads.quantize_(model, quads.QuadsPolicy(side="rollout", residual_fraction=0.5, residual_selection="static"))
    embeds = torch.randn(1, 8, COMMON["hidden_size"], dtype=torch.bfloat16)
    embeds[0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite calibration activations.*model.layers.0.self_attn.q_proj"):
        quads.calibrate_residual_channels(model, [{"inputs_embeds": embeds}])
    assert all(getattr(m, "quads_static_mask", None) is None for m in model.modules())


# -- a forward quads would drop --------------------------------------------------------------------


def test_instance_level_forward_is_refused_naming_the_module():
    model = _llama()
    layer = model.model.layers[0].mlp.down_proj
    layer.forward = lambda x: nn.functional.linear(x, layer.weight) * 2  # what the model computes now
    before = snapshot(model)
    for side in ("trainer", "rollout"):
        with pytest.raises(TypeError, match=r"model\.layers\.0\.mlp\.down_proj has an instance-level forward"):
            quads.quantize_(model, quads.QuadsPolicy(side=side))
        assert_unchanged(before, model)
    with pytest.raises(TypeError, match="instance-level forward"):
        quads.policies.build_rollout_model(model, quads.QuadsPolicy(side="rollout"))
    # skipped, it stays as it is and the rest converts
    quads.quantize_(model, quads.QuadsPolicy(side="trainer", extra_skip_patterns=(r"layers\.0\.mlp\.down_proj$",)))
    assert "forward" in vars(layer) and "model.layers.0.mlp.down_proj" not in quads.quantized_modules(model)
