"""``kernel="fast"`` on shapes humming cannot serve, on CUDA with humming's real GEMMs.

SmolLM2-135M's shapes (hidden 576, k/v 192, intermediate 1536) and a hidden-2880 Qwen3-MoE
block: every layer humming cannot serve keeps the exact kernels (bit-exact with
``kernel="exact"``), the rest run on humming within its bound, one warning names them, and the
graphed decoder pays humming's JIT before its first capture.

Marked ``gpu`` and skipped without CUDA or humming: ``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("humming") is None, reason="needs humming-kernels")]


def _smollm2_shapes(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()


def _moe_2880(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=2880, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, intermediate_size=2880, moe_intermediate_size=2880,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).cuda().eval()


def _quantize(build, kernel):
    import quads

    model = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel=kernel))
    return model, [str(w.message) for w in caught if str(w.message).startswith("quads:")]


@pytest.mark.parametrize("build", [_smollm2_shapes, _moe_2880], ids=["smollm2", "moe2880"])
def test_fast_runs_with_the_exact_kernels_where_humming_cannot(build):
    from quads.policies.modules import RolloutModule

    fast, lines = _quantize(build, "fast")
    exact, none = _quantize(build, "exact")
    assert len(lines) == 1 and "keep the exact kernels: humming needs N % 128 == 0" in lines[0], lines
    assert not none
    print(lines[0])
    modules = {n: m for n, m in fast.named_modules() if isinstance(m, RolloutModule)}
    ref = {n: m for n, m in exact.named_modules() if isinstance(m, RolloutModule)}
    names = {m.quads_backend.name for m in modules.values()}
    assert names == {"humming", "hopper"}, names
    g = torch.Generator(device="cuda").manual_seed(1)
    for n, m in modules.items():
        if m.quads_backend.name != "hopper" or not hasattr(m, "in_features"):
            continue
        x = torch.randn(5, m.in_features, device="cuda", generator=g).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(m(x), ref[n](x)), n  # the fallback: the exact path's bits
    ids = torch.randint(0, 512, (2, 16), device="cuda", generator=g)
    with torch.no_grad():
        y, want = fast(ids).logits.float(), exact(ids).logits.float()
    assert torch.isfinite(y).all()
    rel = float((y - want).abs().max() / want.abs().max())
    print(f"fast vs exact logits: max |diff| / max |exact| = {rel:.2e}")
    assert rel < 5e-2


def test_warm_up_before_capture_prints_one_progress_line(capsys):
    import quads
    from quads.engine.decoder import GraphedDecoder
    from quads.engine.sampling import SamplingSpec

    model, _ = _quantize(_smollm2_shapes, "fast")
    assert quads.warm_up_kernels(model) > 0
    err = capsys.readouterr().err
    assert "compiling humming kernels" in err and "ready in" in err
    decoder = GraphedDecoder(model)
    ids = torch.randint(0, 512, (2, 8), device="cuda")
    decoder.generate(ids, torch.ones_like(ids), SamplingSpec(max_new_tokens=4, eos_token_ids=(), pad_token_id=0))
    assert decoder.num_captures == 1
