"""GQA attention without ``repeat_kv`` (quads.engine.gqa_attention): equal to transformers'
own sdpa and eager attention, switched in only inside the decoder's forwards."""

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers.models.llama.modeling_llama import eager_attention_forward

import quads
from quads.engine.gqa_attention import ATTENTION_NAME, gqa_sdpa_attention, use_gqa_attention
from quads.engine import GraphedDecoder, SamplingSpec
from tests.tiny_models import build


class _Attn(torch.nn.Module):
    """What the attention functions read from a module: its group count and training flag."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def _left_padded_mask(batch: int, q_len: int, length: int, pads=(0, 3, 7)) -> torch.Tensor:
    """(B, 1, q, L) boolean: causal over the last q of L keys, the first pads[b] keys of row b
    padding (every query row keeps at least its own key)."""
    keys = torch.arange(length)
    queries = torch.arange(length - q_len, length)
    causal = keys[None, :] <= queries[:, None]
    valid = torch.stack([keys >= pads[b % len(pads)] for b in range(batch)])
    return (causal[None] & valid[:, None, :])[:, None]


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def _tripwire(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", boom)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("mask_heads", ["one", "all"])
def test_equals_transformers_sdpa_and_eager_fp32(groups, q_len, mask_heads):
    torch.manual_seed(0)
    b, kv, d, length = 3, 2, 16, 24
    q = torch.randn(b, kv * groups, q_len, d)
    k, v = torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
    mask = _left_padded_mask(b, q_len, length)
    if mask_heads == "all":
        mask = mask.expand(b, kv * groups, q_len, length).clone()
        mask[:, 0, :, -1] = mask[:, 0, :, -2]  # heads differ: the mapping of heads to groups matters
    module = _Attn(groups)
    got, _ = gqa_sdpa_attention(module, q, k, v, mask, scaling=0.3)
    want, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    eager, _ = eager_attention_forward(module, q, k, v, _additive(mask, torch.float32), scaling=0.3)
    assert got.shape == want.shape == (b, q_len, kv * groups, d) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-5)
    additive, _ = gqa_sdpa_attention(module, q, k, v, _additive(mask, torch.float32), scaling=0.3)
    torch.testing.assert_close(additive, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 6])
def test_bf16_error_is_the_sdpa_paths(q_len):
    """In bf16 both paths round the same computation: each within bf16 rounding of the fp32 result."""
    torch.manual_seed(1)
    b, kv, groups, d, length = 2, 2, 4, 32, 40
    q = torch.randn(b, kv * groups, q_len, d)
    k, v = torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
    mask = _left_padded_mask(b, q_len, length)
    module = _Attn(groups)
    exact, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask)
    bf = [t.bfloat16() for t in (q, k, v)]
    got, _ = gqa_sdpa_attention(module, *bf, mask)
    want, _ = hf_sdpa.sdpa_attention_forward(module, *bf, mask)
    err_got, err_want = (got.float() - exact).abs().max(), (want.float() - exact).abs().max()
    assert err_got <= 2 * err_want + 1e-3, (err_got, err_want)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_decode_mask_and_query_are_views():
    """At decode (q = 1) the grouped query and the broadcast mask are views: no copy of either."""
    from quads.engine.gqa_attention import _group_mask

    mask = torch.ones(4, 1, 1, 64, dtype=torch.bool)
    grouped = _group_mask(mask, 2, 8, 1)
    assert grouped.shape == (4, 1, 8, 64) and grouped.data_ptr() == mask.data_ptr() and grouped.stride(2) == 0
    q = torch.randn(4, 1, 16, 8).transpose(1, 2)  # (B, H, 1, D) as the models make it
    assert q.reshape(4, 2, 8, 8).data_ptr() == q.data_ptr()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_model_forward_equals_sdpa_and_eager(kind, monkeypatch):
    """Whole tiny models, left-padded prompts: logits inside ``use_gqa_attention`` equal the
    model's own sdpa and eager ones; no repeat_kv ran; the config is back to sdpa after."""
    model = build(kind).float().eval()
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(8, 96, (3, 9), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :4] = 0
    am[2, :8] = 0
    real = am.bool()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).logits
        model.config._attn_implementation = "eager"
        eager = model(input_ids=ids, attention_mask=am).logits
        model.config._attn_implementation = "sdpa"
        with monkeypatch.context() as mp:
            _tripwire(mp)
            with use_gqa_attention(model):
                assert model.config._attn_implementation == ATTENTION_NAME
                got = model(input_ids=ids, attention_mask=am).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[real], eager[real], atol=1e-5, rtol=1e-5)


def _attn_spy(model):
    seen = []
    attn = model.model.layers[0].self_attn
    handle = attn.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation))
    return seen, handle


def _prompts():
    ids = torch.randint(8, 96, (3, 6), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[0, :3] = 0
    am[2, :5] = 0
    return ids, am


@pytest.mark.parametrize("kind,side", [("llama", None), ("qwen3_moe", "rollout")])
def test_decoder_uses_it_for_prefill_and_decode_and_restores(kind, side, monkeypatch):
    model = build(kind).float().eval()
    if side:
        quads.quantize_(model, quads.QuadsPolicy(side=side))
    ids, am = _prompts()
    spec = SamplingSpec(max_new_tokens=6, eos_token_ids=(), pad_token_id=0, do_sample=False)
    seen, handle = _attn_spy(model)
    with monkeypatch.context() as mp:
        _tripwire(mp)
        tokens, logps = GraphedDecoder(model, use_cuda_graph=False).generate(ids, am, spec)
    assert seen == [ATTENTION_NAME] * 6  # prefill + 5 decode steps
    assert model.config._attn_implementation == "sdpa"
    seen.clear()
    ref_tokens, ref_logps = GraphedDecoder(model, use_cuda_graph=False, gqa_attention=False).generate(ids, am, spec)
    handle.remove()
    assert seen == ["sdpa"] * 6
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=0)


def test_eager_models_stay_eager_and_errors_restore():
    model = build("llama").float().eval()
    model.config._attn_implementation = "eager"
    ids, am = _prompts()
    spec = SamplingSpec(max_new_tokens=3, eos_token_ids=(), pad_token_id=0, do_sample=False)
    seen, handle = _attn_spy(model)
    GraphedDecoder(model, use_cuda_graph=False).generate(ids, am, spec)
    assert seen == ["eager"] * 3
    handle.remove()

    model.config._attn_implementation = "sdpa"

    def fail(module, args):
        raise RuntimeError("boom")

    model.model.layers[1].self_attn.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        GraphedDecoder(model, use_cuda_graph=False).generate(ids, am, spec)
    assert model.config._attn_implementation == "sdpa"
