"""Trainer -> vLLM weight push (``quads.integrations.vllm.weight_push``)."""

from __future__ import annotations

import pytest
import torch
from _support import build, save
from safetensors.torch import load_file

import quads
from quads.integrations.vllm.weight_push import checkpoint_weights, push_weights


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
def test_checkpoint_names_are_save_pretrained_names(kind, tmp_path):
    """Fused 3-D experts are split into vLLM's per-expert checkpoint names; values are the
    saved checkpoint's, bit for bit; a quads trainer model has the same names."""
    model = build(kind)
    saved = load_file(str(save(model, tmp_path) / "model.safetensors"))
    pushed = dict(checkpoint_weights(model))
    assert sorted(pushed) == sorted(saved)
    for name, tensor in pushed.items():
        assert torch.equal(tensor, saved[name]), name
    if kind == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in pushed
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in pushed)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    assert sorted(n for n, _ in checkpoint_weights(model)) == sorted(saved)


def test_partial_push_needs_opt_in():
    with pytest.raises(ValueError, match="allow_partial"):
        push_weights(object(), None, weights=[("lm_head.weight", torch.zeros(1))])


# ---------------------------------------------------------------------------------------------
# With a running engine
# ---------------------------------------------------------------------------------------------


def _engine_state(llm) -> dict[str, torch.Tensor]:
    from quads.integrations.vllm.weight_push import engine_model

    return {n: p.detach().clone() for n, p in engine_model(llm).named_parameters()}


@pytest.mark.vllm
@pytest.mark.parametrize("kind,quantization", [("qwen3_moe", "quads"), ("llama", "quads"), ("qwen3_moe", None)])
def test_push_changes_outputs_and_matches_fresh_load(kind, quantization, checkpoint):
    """Engine on checkpoint A, push the masters of model B (a quads trainer model): the engine's
    parameters equal those of a fresh engine on B bit for bit, and so do greedy tokens and
    log-probs. With ``quantization=None`` this covers vLLM's unquantized CPU MoE, whose prepack
    push_weights has to refresh."""
    pytest.importorskip("vllm")
    from _support import greedy, make_llm, release

    from quads.integrations.vllm.quant_method import QuadsLinearMethod, dequantize_linear_weight
    from quads.integrations.vllm.weight_push import engine_model
    from tests.scale_reference import reference_forward_weight

    path_a, path_b = checkpoint(kind, 0), checkpoint(kind, 1)
    trainer_b = build(kind, seed=1)
    quads.quantize_(trainer_b, quads.QuadsPolicy(side="trainer"))

    llm = make_llm(path_a, quantization=quantization)
    before = greedy(llm)
    n = push_weights(llm, trainer_b)
    assert n == len(load_file(str(path_b / "model.safetensors")))
    after = greedy(llm)
    state_pushed = _engine_state(llm)
    if quantization == "quads":  # the engine's weights are the trainer's forward weights
        layer = engine_model(llm).model.layers[1].self_attn.qkv_proj
        assert isinstance(layer.quant_method, QuadsLinearMethod)
        q = dequantize_linear_weight(layer)[0]
        masters = dict(trainer_b.named_parameters())
        assert torch.equal(q, reference_forward_weight(masters, "model.layers.1.self_attn.q_proj.weight"))
    release(llm)

    fresh = make_llm(path_b, quantization=quantization)
    expected = greedy(fresh)
    state_fresh = _engine_state(fresh)
    release(fresh)

    assert [c for _, c, _ in before] != [c for _, c, _ in after], "the push did not change the outputs"
    assert after == expected  # tokens and log-probs, exactly
    assert state_pushed.keys() == state_fresh.keys()
    for name in state_fresh:
        a, b = state_pushed[name], state_fresh[name]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name
