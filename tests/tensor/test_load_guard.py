"""``load_state_dict`` and packed NVFP4 weights (quads.tensor.load_guard): the loads that keep the
packed bits or dequantize on request pass; the ones that would dequantize into a dense tensor, or
drop a packed weight's parts, are refused (tests/reliability/test_misuse.py: the refusals)."""

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import quads
from quads.tensor import NVFP4Tensor, load_safetensors, save_safetensors
from quads.tensor.load_guard import check_no_dequantizing_load
from tests.model_state import assert_unchanged, snapshot
from tests.tiny_models import build


def _rollout(seed=0, kind="llama", **kw):
    model = build(kind, seed)
    quads.quantize_(model, quads.QuadsPolicy(side="rollout", **kw))
    return model


def _bytes(model):
    return {k: [p.clone() for p in v.parts] if isinstance(v, NVFP4Tensor) else v.clone()
            for k, v in model.state_dict().items()}


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert all(torch.equal(p, q) for p, q in zip(x, y)) if isinstance(x, list) else torch.equal(x, y), k


def test_the_guard_is_installed_on_every_module():
    assert getattr(nn.Module.load_state_dict, "_quads_load_guard", False)
    layer = nn.Linear(32, 16).bfloat16()
    state = {"weight": NVFP4Tensor.from_float(torch.randn(16, 32, dtype=torch.bfloat16)), "bias": torch.zeros(16)}
    with pytest.raises(ValueError, match=r"^load_state_dict \(nothing was loaded\): weight is a packed NVFP4 weight"):
        layer.load_state_dict(state)


def test_rollout_to_rollout_keeps_every_bit(tmp_path):
    source, target = _rollout(seed=3), _rollout(seed=4)
    save_safetensors(source.state_dict(), str(tmp_path / "r.safetensors"))
    target.load_state_dict(load_safetensors(str(tmp_path / "r.safetensors")))
    _equal(_bytes(target), _bytes(source))
    other = _rollout(seed=5)
    other.load_state_dict(source.state_dict())  # in memory too
    _equal(_bytes(other), _bytes(source))


def test_explicit_dequantization_loads_into_a_plain_model():
    rollout, plain = _rollout(seed=3), build("llama")
    dense = {k: v.dequantize(v.dtype) if isinstance(v, NVFP4Tensor) else v for k, v in rollout.state_dict().items()}
    plain.load_state_dict(dense)
    q = rollout.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(plain.model.layers[0].self_attn.q_proj.weight, q.dequantize(torch.bfloat16))


def test_assign_keeps_the_packed_tensor():
    """``assign=True`` makes the packed tensor the parameter: nothing is dequantized."""
    rollout, plain = _rollout(seed=3), build("llama")
    plain.load_state_dict(rollout.state_dict(), assign=True)
    assert isinstance(plain.model.layers[0].self_attn.q_proj.weight, NVFP4Tensor)


def test_plain_state_dicts_pass_through_with_torchs_result():
    model = build("llama")
    state = build("llama", seed=1).state_dict()
    del state["lm_head.weight"]
    state["extra"] = torch.zeros(1)
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(state)


def test_a_rollout_file_read_with_safetensors_into_a_plain_model_strict_false(tmp_path):
    """The packed parts under ``K.qdata``... are keys a plain model lacks: ``strict=False`` would
    drop them and keep the model's own ``K``."""
    path = str(tmp_path / "r.safetensors")
    save_safetensors(_rollout(seed=3).state_dict(), path)
    raw = load_file(path)
    assert "model.layers.0.self_attn.q_proj.weight.qdata" in raw and "model.layers.0.self_attn.q_proj.weight" not in raw
    plain = build("llama")
    before = snapshot(plain)
    with pytest.raises(ValueError, match=r"weight\.qdata is a part of the packed NVFP4 weight .*load_safetensors"):
        plain.load_state_dict(raw, strict=False)
    assert_unchanged(before, plain)


def test_parts_named_like_a_packed_weight_without_its_dense_destination_pass():
    """Names ending in ``.qdata`` are refused only for a dense ``K`` the model holds and the state
    dict lacks, with all three parts present."""
    model = nn.Linear(16, 16)
    check_no_dequantizing_load(model, {"weight": torch.zeros(16, 16), "weight.qdata": torch.zeros(1),
                                       "weight.scale": torch.zeros(1), "weight.global_encode_scale": torch.zeros(1)})
    check_no_dequantizing_load(model, {"other.qdata": torch.zeros(1), "other.scale": torch.zeros(1),
                                       "other.global_encode_scale": torch.zeros(1)})
    check_no_dequantizing_load(model, {"weight.qdata": torch.zeros(1)})
