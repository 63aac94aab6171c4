"""``QuadsPolicy(kernel="fast")`` at real model shapes on the GPU: SmolLM2-135M's (hidden 576,
k/v 192, MLP 1536), a hidden-2880 Qwen3-MoE block's, Qwen3 dense and MoE shapes. Every model
converts with every layer on humming (widths humming cannot tile as they are held padded: no
layer keeps the exact kernels, no warning), the graphed decoder captures the fast model, and its
logits stay within a stated bound of the exact path's.

Marked ``gpu``, skipped without CUDA or humming: ``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: relative Frobenius error of the fast path's logits against the exact path's, 2-layer models
#: (humming's per-GEMM error is 6-7e-3 relative, docs/humming.md; a stack of them stays below this)
LOGIT_BOUND = 0.05


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=2048, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "smollm2":  # SmolLM2-135M's widths
        return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, **common)
    if kind == "moe-2880":  # hidden 2880, experts of width 2880
        return Qwen3MoeConfig(hidden_size=2880, intermediate_size=2880, moe_intermediate_size=2880, num_experts=8,
                              num_experts_per_tok=2, num_attention_heads=45, num_key_value_heads=5, head_dim=64,
                              decoder_sparse_step=1, **common)
    if kind == "qwen3-dense":
        return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, **common)
    if kind == "qwen3-moe":
        return Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=16,
                              num_experts_per_tok=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              decoder_sparse_step=1, **common)
    raise ValueError(kind)


def _worst_module_error(exact, fast, ids) -> float:
    """The largest relative (Frobenius) error of a fast rollout module's output against the exact
    one's, each run on the input the exact model's forward gave that module."""
    from quads.policies.modules import RolloutModule

    inputs, hooks = {}, []

    def keep(name):
        def hook(module, args, kwargs, out):
            inputs.setdefault(name, (args, kwargs, out))  # (returns None: the output stays as it is)
        return hook

    for name, m in exact.named_modules():
        if isinstance(m, RolloutModule):
            hooks.append(m.register_forward_hook(keep(name), with_kwargs=True))
    try:
        with torch.no_grad():
            exact(ids)
    finally:
        for h in hooks:
            h.remove()
    worst = 0.0
    with torch.no_grad():
        for name, (args, kwargs, want) in inputs.items():
            got = fast.get_submodule(name)(*args, **kwargs)
            want, got = (w[0] if isinstance(w, tuple) else w for w in (want, got))
            worst = max(worst, ((got.float() - want.float()).norm() / want.float().norm()).item())
    return worst


def _model(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.bfloat16)
    if hasattr(model.config, "num_experts"):
        model.config._experts_implementation = "grouped_mm"  # capturable (quads' experts replace it anyway)
    return model.cuda().eval()


#: (model, some layers keep the exact kernels, some run humming): none keeps them; SmolLM2's 576 and
#: 192 and the hidden-2880 block's 2880 and 320 run humming in padded layouts
SHAPES = [("smollm2", False, True), ("moe-2880", False, True), ("qwen3-dense", False, True), ("qwen3-moe", False, True)]


@pytest.mark.parametrize("kind,expect_kept,expect_humming", SHAPES)
def test_fast_kernel_runs_every_real_shape(kind, expect_kept, expect_humming):
    pytest.importorskip("humming")
    import quads
    from quads.engine import GraphedDecoder, SamplingSpec

    base = _model(kind)
    exact, fast = copy.deepcopy(base), copy.deepcopy(base)
    quads.quantize_(exact, quads.QuadsPolicy(side="rollout"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quads.quantize_(fast, quads.QuadsPolicy(side="rollout", kernel="fast"))
    kept_lines = [str(w.message) for w in caught if "keep the exact kernels" in str(w.message)]
    assert len(kept_lines) == (1 if expect_kept else 0), kept_lines
    backends = {name: m.quads_backend.name for name, m in fast.named_modules() if hasattr(m, "quads_backend")}
    assert ("humming" in backends.values()) == expect_humming, backends
    assert ("hopper" in backends.values()) == expect_kept, backends

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (4, 24), generator=g).cuda()
    with torch.no_grad():
        want, got = exact(ids).logits.float(), fast(ids).logits.float()
        for name, m in fast.named_modules():  # a kept layer is the exact path, bit for bit
            if backends.get(name) == "hopper" and isinstance(m, torch.nn.Linear):
                x = torch.randn(5, m.in_features, generator=g).to("cuda", torch.bfloat16)
                assert torch.equal(m(x), exact.get_submodule(name)(x)), name
    rel = ((got - want).norm() / want.norm()).item()
    assert torch.isfinite(got).all()
    if hasattr(base.config, "num_experts"):
        # an MoE's logits also move where a near-tie of the (BF16) router flips an expert: each
        # quantized module is compared on the exact model's own inputs instead (the same routing)
        worst = _worst_module_error(exact, fast, ids)
        assert worst < LOGIT_BOUND, (worst, rel)
    else:
        assert rel < LOGIT_BOUND, rel

    spec = SamplingSpec(max_new_tokens=8, eos_token_ids=(), pad_token_id=0, do_sample=False)
    decoder = GraphedDecoder(fast)
    tokens, logps = decoder.generate(ids[:, :8], torch.ones_like(ids[:, :8]), spec)
    assert decoder.num_captures == 1 and decoder.capture_blocker is None
    assert tokens.shape == (4, 8) and torch.isfinite(logps).all()
