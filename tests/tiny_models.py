"""Tiny transformers models built from config with random weights (no hub downloads).

Every linear input dim is a multiple of 16 so NVFP4 applies everywhere.
"""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def build(kind: str, seed: int = 0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        model = MixtralForCausalLM(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(**COMMON, intermediate_size=96)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    return _scaled(model).to(dtype)


def _scaled(model):
    # Default init is near-uniform; scale weights up a little so logits are not all ~0.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model


def square_llama(seed: int = 0, width: int = 64, layers: int = 1, dtype=torch.bfloat16):
    """A Llama whose every linear is ``width x width`` (one head of ``width``): 64 is the Hopper
    stacked layout's row tile; 128 (N a multiple of 128, K of 64) the smallest shapes humming serves."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=width, hidden_size=width, intermediate_size=width,
                      num_hidden_layers=layers, num_attention_heads=1, num_key_value_heads=1, head_dim=width,
                      max_position_embeddings=width // 2, tie_word_embeddings=False)
    return _scaled(LlamaForCausalLM(cfg)).to(dtype)


def twin(kind: str, seed: int = 0):
    """Two identical models (for trainer/rollout pairs)."""
    return build(kind, seed), build(kind, seed)
