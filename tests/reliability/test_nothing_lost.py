"""Nothing lost: what a user saves loads back, concurrent or interrupted operations leave whole
models and folders, and a damaged export is refused instead of loaded."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quads
from quads.tensor import NVFP4Tensor, load_safetensors, save_safetensors
from tests.tiny_models import COMMON


def _tied_llama(seed=0):
    """SmolLM2's layout: ``lm_head.weight`` is ``model.embed_tokens.weight``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**COMMON, "tie_word_embeddings": True, "intermediate_size": 96})
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


# -- tied embeddings save and load -------------------------------------------------------------


def test_tied_embeddings_save_once_and_load_tied(tmp_path):
    model = _tied_llama()
    path = tmp_path / "model.safetensors"
    save_safetensors(model.state_dict(), path)
    state = load_safetensors(path)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    fresh = _tied_llama(seed=1)
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_tied_rollout_round_trips(tmp_path):
    rollout = _tied_llama()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    path = tmp_path / "rollout.safetensors"
    save_safetensors(rollout.state_dict(), path)
    other = _tied_llama(seed=1)
    quads.quantize_(other, quads.QuadsPolicy(side="rollout"))
    other.load_state_dict(load_safetensors(path))
    assert other.lm_head.weight is other.model.embed_tokens.weight
    for name, p in rollout.named_parameters():
        q = dict(other.named_parameters())[name]
        if isinstance(p, NVFP4Tensor):
            assert all(torch.equal(a, b) for a, b in zip(p.parts, q.parts)), name
        else:
            assert torch.equal(p, q), name


def test_overlapping_views_of_one_buffer_are_stored_as_copies(tmp_path):
    buf = torch.arange(32, dtype=torch.float32)
    state = {"a": buf[:20], "b": buf[10:]}
    save_safetensors(state, tmp_path / "v.safetensors")
    back = load_safetensors(tmp_path / "v.safetensors")
    assert torch.equal(back["a"], buf[:20]) and torch.equal(back["b"], buf[10:])
    assert back["a"] is not back["b"]
