"""The embedded default model: a tiny Qwen3-MoE trained on :mod:`quads.tasks.arithmetic`.

The checkpoint ships inside the package (``quads/assets/tiny-moe-arith``) and is rebuilt by
``examples/build_default_model.py``.  Loading never touches the network.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["DEFAULT_MODEL_DIR", "default_model_config", "load_default_model", "load_default_tokenizer"]

#: Directory of the shipped checkpoint (config.json, model.safetensors, tokenizer files).
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent.parent / "assets" / "tiny-moe-arith"


def default_model_config(
    vocab_size: int = 32, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2
) -> Qwen3MoeConfig:
    """Config of the default model.

    Every linear layer's input dim is a multiple of 16 (NVFP4 blocks): hidden 128,
    q/o 4 heads x 32 = 128, k/v 2 heads x 32, experts' intermediate 128.  All layers are MoE
    (8 experts, top-2); ``intermediate_size`` (dense MLP, unused since no layer is dense) is
    also a multiple of 16.
    """
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=64,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.01,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    cfg._experts_implementation = "eager"
    return cfg


def load_default_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The character-level tokenizer saved next to the default model (left padding)."""
    tok = AutoTokenizer.from_pretrained(str(path or DEFAULT_MODEL_DIR), local_files_only=True)
    tok.padding_side = "left"
    return tok


def load_default_model(
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    experts_implementation: str = "eager",
    path: str | Path | None = None,
) -> tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from the shipped directory (``local_files_only=True``), in eval mode."""
    path = Path(path or DEFAULT_MODEL_DIR)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no default model at {path}; run examples/build_default_model.py")
    model = Qwen3MoeForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True, experts_implementation=experts_implementation
    )
    model.to(device)
    model.eval()
    return model, load_default_tokenizer(path)
