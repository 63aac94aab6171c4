"""Grouped-query attention without ``repeat_kv``: the attention function of the graphed decoder.

Why: transformers' sdpa attention (``transformers/integrations/sdpa_attention.py``) repeats the
keys and values over the query groups whenever an attention mask is given (CUDA's masked
kernels took no ``enable_gqa`` when it was written). The graphed decoder always passes a mask,
and its cache is the whole static cache, so every layer of every decode step copied
``B x H x L x D`` keys and as many values (4x / 8x the cache for Llama-3-8B / Qwen3-30B-A3B
shapes), and the attention kernel then read the copies.

:func:`gqa_sdpa_attention` computes the same attention without the copy: the ``G = H / H_kv``
query heads that share a key/value head become ``G`` query rows of that head, ``(B, H_kv, G*q,
D)`` against ``(B, H_kv, L, D)``, with the mask broadcast over the group (a stride-0 view at
decode, ``q = 1``). One ``scaled_dot_product_attention`` call, the same kernel family the sdpa
path uses with a mask (the memory-efficient kernel on the H200); per query row it is the same
softmax(q k^T * scale + mask) v over the same keys, so results equal the sdpa path's up to the
kernel's blocking. ``enable_gqa=True`` is not used (why: docs/engine.md). No host syncs, no
data-dependent shapes: capturable in a CUDA graph.

:func:`use_gqa_attention` registers it with transformers' ``AttentionInterface`` (and the sdpa
mask builder under the same name) and switches a model's configs from ``"sdpa"`` to it for
the duration of a ``with`` block only, restoring each config's value after (the model is left
as it was, exceptions included). Configs on another implementation (eager, flash, flex) are
left alone. The transformers versions it was checked against: docs/engine.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

__all__ = ["ATTENTION_NAME", "gqa_sdpa_attention", "model_configs", "register_gqa_attention", "use_gqa_attention"]

#: the name under which the function is registered in transformers' attention registry
ATTENTION_NAME = "quads_gqa_sdpa"


def _sdpa_fallback():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _group_mask(mask: torch.Tensor, kv_heads: int, groups: int, q_len: int) -> torch.Tensor:
    """A (b, 1 | H, q, L) mask as (b, 1 | H_kv, G*q, L): row ``g*q + t`` of kv head ``h`` is the
    mask of query head ``h*G + g`` at token ``t``. A view when q == 1 or the mask has heads."""
    b, heads, rows, length = mask.shape
    if rows != q_len:
        mask = mask.expand(b, heads, q_len, length)
    if heads == 1:
        return mask[:, :, None].expand(b, 1, groups, q_len, length).reshape(b, 1, groups * q_len, length)
    if heads != kv_heads * groups:
        raise ValueError(f"gqa_sdpa_attention: mask has {heads} heads, the query {kv_heads * groups}")
    return mask.reshape(b, kv_heads, groups * q_len, length)


def gqa_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, q, D), key/value (B, H_kv, L, D),
    a 4-D mask (boolean: True attends; or additive). Returns ((B, q, H, D) contiguous, None) as
    the sdpa function does. Cases it does not cover (no mask, no key/value grouping, position
    biases, paged caches, attention weights requested) go to transformers' own sdpa function."""
    groups = query.shape[1] // key.shape[1] if key.shape[1] else 0
    plain = (
        attention_mask is None
        or attention_mask.dim() != 4
        or groups <= 1
        or query.shape[1] != groups * key.shape[1]
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions", False)
        or kwargs.get("s_aux") is not None
    )
    if plain:
        return _sdpa_fallback()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs)
    b, heads, q_len, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    mask = attention_mask[..., :length]
    mask = _group_mask(mask, kv_heads, groups, q_len)
    grouped = query.reshape(b, kv_heads, groups * q_len, d)  # a view at decode (q == 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False)
    # (B, H_kv, G*q, Dv) -> (B, H, q, Dv) -> (B, q, H, Dv): one small copy of the output
    out = out.reshape(b, kv_heads, groups, q_len, out.shape[-1]).reshape(b, heads, q_len, out.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def register_gqa_attention() -> str:
    """Register :func:`gqa_sdpa_attention` (and the sdpa mask builder) under :data:`ATTENTION_NAME`;
    idempotent. Returns the name."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not gqa_sdpa_attention:
        AttentionInterface.register(ATTENTION_NAME, gqa_sdpa_attention)
    if ATTENTION_NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # 2-D masks built as sdpa builds them
    return ATTENTION_NAME


def model_configs(model: nn.Module) -> list:
    """Every distinct transformers config the model's modules read (the attention modules hold
    the text config of a multimodal model), the model's own first."""
    from transformers.configuration_utils import PreTrainedConfig

    found = {}
    for cfg in [getattr(model, "config", None)] + [getattr(m, "config", None) for m in model.modules()]:
        if isinstance(cfg, PreTrainedConfig):
            found.setdefault(id(cfg), cfg)
    return list(found.values())


def _set(cfg, value: str | None) -> None:
    # the internal attribute: the public setter would also overwrite the sub-configs' values
    if hasattr(cfg, "_attn_implementation_internal"):
        cfg._attn_implementation_internal = value
    else:  # pragma: no cover - a transformers without the internal attribute
        cfg._attn_implementation = value


@contextlib.contextmanager
def use_gqa_attention(model: nn.Module, configs: list | None = None):
    """Inside the block, ``model``'s sdpa attention runs :func:`gqa_sdpa_attention`; every
    config's implementation is restored on exit. ``configs``: the model's configs if the
    caller has them (:func:`model_configs` walks the modules)."""
    name = register_gqa_attention()
    switched = [c for c in (configs if configs is not None else model_configs(model))
                if getattr(c, "_attn_implementation", None) == "sdpa"]
    for cfg in switched:
        _set(cfg, name)
    try:
        yield
    finally:
        for cfg in switched:
            _set(cfg, "sdpa")
