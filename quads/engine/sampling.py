"""Sampling as ``generate`` does it for a GRPO rollout, on static shapes (graph-safe).

:class:`SamplingSpec` (temperature, top-k, top-p, greedy, EOS / pad ids; built from a
``GenerationConfig``), :func:`unsupported_reason` (what it does not cover: callers fall back to
``generate``), :func:`process_logits` (the warpers) and :func:`sample_tokens` (the
exponential-race form of multinomial sampling, ``argmax(p / E)``, ``E ~ Exp(1)``, graph-safe on
CUDA's default generator; returns the token and its log-prob under the processed distribution,
what TRL keeps from vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingSpec", "process_logits", "sample_tokens", "unsupported_reason"]


@dataclass(frozen=True)
class SamplingSpec:
    """What one ``generate`` call samples: ``generate``'s warper semantics."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"SamplingSpec: temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingSpec: top_k must be >= 0, got {self.top_k}")

    @classmethod
    def from_generation_config(cls, gc, pad_token_id: int | None = None) -> "SamplingSpec":
        why = unsupported_reason(gc)
        if why:
            raise ValueError(f"SamplingSpec: generation config not supported ({why})")
        eos = gc.eos_token_id
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        pad = gc.pad_token_id if gc.pad_token_id is not None else pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        return cls(
            max_new_tokens=int(gc.max_new_tokens),
            eos_token_ids=tuple(int(e) for e in eos),
            pad_token_id=int(pad),
            do_sample=bool(gc.do_sample),
            temperature=float(gc.temperature if gc.temperature is not None else 1.0),
            top_k=int(gc.top_k or 0),
            top_p=float(gc.top_p if gc.top_p is not None else 1.0),
        )


def unsupported_reason(gc) -> str | None:
    """Why a ``GenerationConfig`` needs ``generate`` instead of the graphed decoder, or None."""
    if gc.max_new_tokens is None:
        return "max_new_tokens is not set"
    checks = {
        "num_beams": (getattr(gc, "num_beams", 1) or 1) == 1,
        "num_return_sequences": (getattr(gc, "num_return_sequences", 1) or 1) == 1,
        "repetition_penalty": (getattr(gc, "repetition_penalty", 1.0) or 1.0) == 1.0,
        "min_p": getattr(gc, "min_p", None) in (None, 0, 0.0),
        "typical_p": getattr(gc, "typical_p", None) in (None, 1, 1.0),
        "min_new_tokens": (getattr(gc, "min_new_tokens", None) or 0) == 0,
        "no_repeat_ngram_size": (getattr(gc, "no_repeat_ngram_size", None) or 0) == 0,
        "bad_words_ids": getattr(gc, "bad_words_ids", None) is None,
        "suppress_tokens": getattr(gc, "suppress_tokens", None) is None,
        "stop_strings": getattr(gc, "stop_strings", None) is None,
    }
    bad = [name for name, ok in checks.items() if not ok]
    return f"{', '.join(bad)} set" if bad else None


def process_logits(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """``generate``'s warpers on float32 logits (B, V): temperature, top-k, top-p (sampling only)."""
    if not spec.do_sample:
        return logits
    scores = logits / spec.temperature if spec.temperature != 1.0 else logits
    if spec.top_k and spec.top_k < scores.shape[-1]:
        kth = torch.topk(scores, spec.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - spec.top_p)
        drop_sorted[..., -1:] = False  # keep at least one token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_tokens(logits: torch.Tensor, spec: SamplingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (B,), its log-prob (B,) under the processed distribution) from float32 logits."""
    scores = process_logits(logits, spec)
    logp = torch.log_softmax(scores, dim=-1)
    if spec.do_sample:
        race = torch.empty_like(logp).exponential_()
        token = torch.argmax(logp.exp() / race, dim=-1)
    else:
        token = torch.argmax(scores, dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
