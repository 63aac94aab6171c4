"""Saving quantized models: what round-trips, and a clear error naming the way that works where
transformers' or torchao's writer cannot store packed NVFP4 weights."""

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
    """A trainer keeps its masters as plain parameters under their names: save_pretrained works."""
    trainer = build("qwen3_moe")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    trainer.save_pretrained(tmp_path / "t")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.bfloat16)
    quads.quantize_(back, quads.QuadsPolicy(side="trainer"))
    for (n, a), (m, b) in zip(trainer.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_rollout_save_pretrained_names_the_way_that_works_and_that_way_round_trips(kind, tmp_path):
    rollout = build(kind)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    with pytest.raises(TypeError, match=r"quads\.tensor\.save_safetensors.*load_safetensors"):
        rollout.save_pretrained(tmp_path / "r")
    assert not (tmp_path / "r").exists()

    save_safetensors(rollout.state_dict(), tmp_path / "r.safetensors")  # the way the error names
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


def test_torchao_rollout_save_pretrained_names_the_way_that_works(tmp_path):
    """A rollout loaded through TorchAoConfig: save_pretrained refuses before writing anything
    (transformers' torchao writer cannot store quads' packed tensors, and a checkpoint read back
    as torchao-pre-quantized would never become a quads rollout again), naming the ways that work."""
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
    with pytest.raises(TypeError, match=r"save_pretrained cannot write .*quads\.tensor\.save_safetensors"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(AttributeError, match=r"not a torchao tensor.*quads\.tensor\.save_safetensors"):
        next(iter(_packed(model).values())).tensor_data_names  # torchao's own writer gets the same hint
    save_safetensors(model.state_dict(), tmp_path / "m.safetensors")  # the named way works here too
    back = load_safetensors(tmp_path / "m.safetensors")
    for n, p in _packed(model).items():
        assert torch.equal(back[n].qdata, p.qdata), n
    assert not hasattr(next(iter(_packed(model).values())), "tensor_data_names")  # probes still get False


def test_torchao_trainer_save_pretrained_round_trips(tmp_path):
    """A trainer loaded through TorchAoConfig saves its BF16 masters (a plain checkpoint: no
    torchao quantization_config, which a later load would take as pre-quantized and never turn
    back into a trainer); loading it with the same TorchAoConfig gives the same trainer: the
    same masters, group scales and logits, bit for bit."""
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
    assert "quantization_config" not in json.loads((tmp_path / "t" / "config.json").read_text())
    assert model.config.quantization_config is not None and model.hf_quantizer is not None  # restored
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.bfloat16,
                                                quantization_config=TorchAoConfig(policy))
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    with torch.no_grad():
        logits = model(IDS).logits
        assert torch.equal(back(IDS).logits, logits)
        assert torch.equal(ours(IDS).logits, logits)  # = quads.quantize_ on the same checkpoint
