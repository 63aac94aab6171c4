"""Saving quantized models: what round-trips (save_pretrained through quads' writer, and the
low-level save_safetensors / load_state_dict), and a clear error naming the ways that work where
no writer can store packed NVFP4 weights."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import quads
from quads.tensor import load_safetensors, save_safetensors
from tests.tiny_models import build

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))


def _packed(model):
    return {n: p for n, p in model.named_parameters() if isinstance(p, quads.NVFP4Tensor)}


def test_trainer_save_pretrained_round_trips(tmp_path):
    """A trainer keeps its masters as plain parameters under their names; save_pretrained records
    its policy, so from_pretrained gives the quads trainer back."""
    trainer = build("qwen3_moe")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    trainer.save_pretrained(tmp_path / "t")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.bfloat16)
    assert quads.quantized_modules(back).keys() == quads.quantized_modules(trainer).keys()
    for (n, a), (m, b) in zip(trainer.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_rollout_save_pretrained_without_the_transformers_integration_names_the_ways(tmp_path, monkeypatch):
    import quads.policies.quantize as quantize

    rollout = build("llama")
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    monkeypatch.setattr(quantize, "_SAVE_PRETRAINED_HANDLER", [])
    with pytest.raises(TypeError, match=r"import quads\.integrations\.transformers.*quads\.tensor\.save_safetensors"):
        rollout.save_pretrained(tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_rollout_save_safetensors_load_state_dict_round_trips(kind, tmp_path):
    rollout = build(kind)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    save_safetensors(rollout.state_dict(), tmp_path / "r.safetensors")  # the low-level way
    fresh = build(kind, seed=7)
    quads.quantize_(fresh, quads.QuadsPolicy(side="rollout"))
    fresh.load_state_dict(load_safetensors(tmp_path / "r.safetensors"))
    mine, theirs = _packed(rollout), _packed(fresh)
    assert mine.keys() == theirs.keys() and mine
    for n in mine:
        assert torch.equal(mine[n].qdata, theirs[n].qdata), n
        assert torch.equal(mine[n].global_encode_scale, theirs[n].global_encode_scale), n
    with torch.no_grad():
        assert torch.equal(fresh(IDS).logits, rollout(IDS).logits)


def test_torchao_rollout_config_serializes_and_save_pretrained_writes_a_quads_checkpoint(tmp_path):
    """A rollout loaded through TorchAoConfig: its config serializes; save_pretrained goes through
    quads' writer (transformers' torchao writer cannot store quads' packed tensors), so a plain
    from_pretrained gives it back; torchao's own writer gets a hint naming the ways that work."""
    pytest.importorskip("torchao")
    from transformers import TorchAoConfig

    import quads.integrations.torchao  # noqa: F401

    build("llama").save_pretrained(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", dtype=torch.bfloat16,
        quantization_config=TorchAoConfig(quads.QuadsPolicy(side="rollout")))
    assert _packed(model)
    policy = model.config.quantization_config.quant_type  # serializable by torchao's encoder
    written = json.loads(model.config.to_json_string())["quantization_config"]["quant_type"]["default"]
    assert written["_type"] == "QuadsPolicy" and written["_data"]["side"] == "rollout"
    assert written["_data"]["skip_patterns"]["_data"]["patterns"] == list(policy.skip_patterns)
    assert "QuadsPolicy" in repr(model.config)
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "quads"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for n, p in _packed(model).items():
        assert torch.equal(_packed(back)[n].qdata, p.qdata), n
    with pytest.raises(AttributeError, match=r"not a torchao tensor.*quads\.tensor\.save_safetensors"):
        next(iter(_packed(model).values())).tensor_data_names  # torchao's own writer gets the same hint
    save_safetensors(model.state_dict(), tmp_path / "m.safetensors")  # the named way works here too
    back = load_safetensors(tmp_path / "m.safetensors")
    for n, p in _packed(model).items():
        assert torch.equal(back[n].qdata, p.qdata), n
    assert not hasattr(next(iter(_packed(model).values())), "tensor_data_names")  # probes still get False


def test_torchao_trainer_save_pretrained_round_trips(tmp_path):
    """A trainer loaded through TorchAoConfig saves its BF16 masters with the policy as a quads
    quantization_config (a torchao one would be taken as pre-quantized by a later load and never
    turn back into a trainer); a plain from_pretrained gives the same trainer: the same masters,
    group scales and logits, bit for bit."""
    pytest.importorskip("torchao")
    from transformers import TorchAoConfig

    import quads.integrations.torchao  # noqa: F401

    policy = quads.QuadsPolicy(side="trainer")
    build("llama").save_pretrained(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16,
                                                 quantization_config=TorchAoConfig(policy))
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16)
    quads.quantize_(ours, policy)
    q = model.model.layers[0].self_attn.q_proj
    assert q.quads_scale_group is not None and len(q.quads_scale_group.members) == 3
    model.save_pretrained(tmp_path / "t")
    assert json.loads((tmp_path / "t" / "config.json").read_text())["quantization_config"]["quant_method"] == "quads"
    assert isinstance(model.config.quantization_config, TorchAoConfig) and model.hf_quantizer is not None  # restored
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.bfloat16)
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    with torch.no_grad():
        logits = model(IDS).logits
        assert torch.equal(back(IDS).logits, logits)
        assert torch.equal(ours(IDS).logits, logits)  # = quads.quantize_ on the same checkpoint
