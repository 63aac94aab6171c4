"""Tests for quads.tasks: the arithmetic task, its tokenizer and reward, and the shipped default model."""

from __future__ import annotations

import json

import pytest
import torch

from quads.tasks import arithmetic as ar
from quads.tasks.default_model import DEFAULT_MODEL_DIR, default_model_config, load_default_model


@pytest.fixture(scope="module")
def tok():
    return ar.make_tokenizer()


@pytest.fixture(scope="module")
def default_model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_default_model()


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_specials(tok):
    assert len(tok) == 32
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"


def test_tokenizer_round_trip(tok):
    for text in ["37+485=522", "0+0=0", "999+999=1998", "1 2\n3"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert len(ids) == len(text) + 1  # one token per character, plus <bos>
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == "<bos>" + text
    # <eos> in text is one special token, dropped by skip_special_tokens (as TRL decodes)
    ids = tok("522<eos>")["input_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "522"


def test_tokenizer_batch_left_padding(tok):
    enc = tok(["37+485=", "1+2="], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert ids.shape == (2, 8)
    assert ids[1, :3].tolist() == [tok.pad_token_id] * 3 and mask[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert ids[:, -1].tolist() == [tok.convert_tokens_to_ids("=")] * 2
    assert tok.batch_decode(ids, skip_special_tokens=True) == ["37+485=", "1+2="]


def test_tokenizer_save_load(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tok2.padding_side == "left"
    assert tok2("37+485=")["input_ids"] == tok("37+485=")["input_ids"]
    assert tok2.get_vocab() == tok.get_vocab()


# --- reward --------------------------------------------------------------------------------------


def test_reward_exact_match():
    comps = ["522", "523", " 522 ", "522<eos>", "522<eos>999", "522\n17", "5220", "", "52", "522<pad><pad>"]
    ans = ["522"] * len(comps)
    assert ar.reward_exact_match(comps, ans) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    # extra dataset columns arrive as kwargs (TRL); answers may be ints
    assert ar.reward_exact_match(["7", "8"], answer=[7, 7], prompts=["3+4=", "3+4="]) == [1.0, 0.0]
    # conversational completions are tolerated
    assert ar.reward_exact_match([[{"role": "assistant", "content": "10"}]], ["10"]) == [1.0]


# --- problems and splits -------------------------------------------------------------------------


def _pairs(items):
    out = set()
    for it in items:
        a, b = it["prompt"].rstrip("=").split("+")
        assert int(a) + int(b) == int(it["answer"])
        out.add(frozenset((int(a), int(b))))
    return out


def test_make_prompts_deterministic_and_disjoint():
    tr = ar.make_prompts(2000, seed=0, split="train")
    assert tr == ar.make_prompts(2000, seed=0, split="train")
    assert tr != ar.make_prompts(2000, seed=1, split="train")
    ho = ar.make_prompts(500, seed=0, split="heldout")
    assert ho == ar.make_prompts(500, seed=0, split="heldout")
    assert len({p["prompt"] for p in tr}) == 2000 and len({p["prompt"] for p in ho}) == 500
    assert not (_pairs(tr) & _pairs(ho))  # disjoint, also up to commutation
    assert all(not ar.is_heldout(*map(int, p["prompt"][:-1].split("+"))) for p in tr)
    assert all(ar.is_heldout(*map(int, p["prompt"][:-1].split("+"))) for p in ho)
    assert all(len(p["answer"]) <= ar.MAX_DIGITS + 1 for p in tr + ho)
    with pytest.raises(ValueError):
        ar.make_prompts(1, split="test")


# --- the shipped default model -------------------------------------------------------------------


def test_default_config_nvfp4_friendly():
    cfg = default_model_config()
    dims = [cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.moe_intermediate_size, cfg.intermediate_size]
    assert all(d % 16 == 0 for d in dims)
    assert cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1
    assert not cfg.tie_word_embeddings and not cfg.output_router_logits


def test_default_model_loads(default_model):
    from transformers import Qwen3MoeForCausalLM

    model, tok = default_model
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert model.config.model_type == "qwen3_moe"
    assert model.config.vocab_size == len(tok) == 32
    assert model.config._experts_implementation == "eager"
    assert not model.config.output_router_logits and not model.config.tie_word_embeddings
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    E, I, H = model.config.num_experts, model.config.moe_intermediate_size, model.config.hidden_size
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up_proj.shape == (E, 2 * I, H)
        assert experts.down_proj.shape == (E, H, I)
    files = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) < 8e6


def test_default_model_accuracy_in_band(default_model):
    model, tok = default_model
    acc = ar.held_out_accuracy(model, tok, n=64, greedy=True, seed=123)
    assert 0.2 < acc < 0.95, acc


def test_default_model_is_peaked_and_rewards_vary(default_model):
    """Output distributions are far from uniform, and sampled rewards are neither all 0 nor all 1."""
    model, tok = default_model
    probs = ar.make_prompts(32, seed=7, split="heldout")
    enc = tok([p["prompt"] for p in probs], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float()  # first answer token
    lp = torch.log_softmax(logits, -1)
    entropy = -(lp.exp() * lp).sum(-1).mean().item()
    assert entropy < 0.5 * torch.log(torch.tensor(32.0)).item(), entropy
    comps = ar.generate_completions(model, tok, [p["prompt"] for p in probs] * 4, greedy=False, seed=0)
    r = ar.reward_exact_match(comps, [p["answer"] for p in probs] * 4)
    assert 0.0 < sum(r) / len(r) < 1.0


def test_build_info_matches():
    info = json.loads((DEFAULT_MODEL_DIR / "build_info.json").read_text())
    assert 0.4 <= info["greedy_acc_bf16"] <= 0.8
    assert 0.0 < info["sampled_acc_T1_bf16"] < info["greedy_acc_bf16"]
