"""Log-probs of given completions: the trainer path (one teacher-forced forward) and the
rollout-engine path (prefill + decode steps with a KV cache).

Layout is TRL's: prompts left-padded, completions right-padded (:func:`build_scoring_batch`);
the result is ``log_softmax(logits / temperature)`` at each completion token, float32,
shape (B, n_completion), the layout of TRL's ``old_per_token_logps``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["build_scoring_batch", "positions_from_mask", "score_teacher_forced", "score_incremental"]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding (what ``generate`` uses)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def build_scoring_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_token_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """TRL's layout of a scoring batch: prompts left-padded, completions right-padded.

    Returns ``(input_ids, attention_mask, completion_mask, n_completion)``.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError("build_scoring_batch: one completion per prompt")
    if not prompt_ids:
        raise ValueError("build_scoring_batch: no prompts")
    b = len(prompt_ids)
    pw = max(len(p) for p in prompt_ids)
    cw = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((b, pw + cw), pad_token_id, dtype=torch.long)
    am = torch.zeros((b, pw + cw), dtype=torch.long)
    cm = torch.zeros((b, cw), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if p:
            ids[i, pw - len(p) : pw] = torch.tensor(p)
            am[i, pw - len(p) : pw] = 1
        if c:
            ids[i, pw : pw + len(c)] = torch.tensor(c)
            am[i, pw : pw + len(c)] = 1
            cm[i, : len(c)] = 1
    if device is not None:
        ids, am, cm = ids.to(device), am.to(device), cm.to(device)
    return ids, am, cm, cw


def _token_logps(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def score_teacher_forced(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    n_completion: int,
    temperature: float = 1.0,
    batch_size: int | None = None,
    mask_positions: bool = False,
) -> torch.Tensor:
    """Log-probs of the last ``n_completion`` tokens from one full forward per batch (the trainer path).

    ``mask_positions=False`` (default) scores exactly as TRL's trainer forward does (no position
    ids: the model's own); ``True`` passes position ids that skip left padding, as ``generate``
    and :func:`score_incremental` do.
    """
    out = []
    n = input_ids.size(0)
    batch_size = batch_size or n
    for s in range(0, n, batch_size):
        ids, am = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
        kwargs = dict(input_ids=ids, attention_mask=am, logits_to_keep=n_completion + 1)
        if mask_positions:
            kwargs["position_ids"] = positions_from_mask(am)
        logits = model(**kwargs).logits[:, :-1]
        out.append(_token_logps(logits, ids[:, -n_completion:], temperature))
    return torch.cat(out, dim=0)


@torch.no_grad()
def score_incremental(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    n_completion: int,
    temperature: float = 1.0,
    tokens_per_step: int = 1,
) -> torch.Tensor:
    """Log-probs of the last ``n_completion`` tokens by prefill + decode steps with a KV cache
    (the rollout engine path).

    ``tokens_per_step=1`` is token-by-token decoding. Larger steps feed that many completion
    tokens per cached forward (as an engine's chunked prefill does): each query still attends
    to the cached keys and the causally earlier chunk tokens only, and row-granular activation
    quantization is per token, so the log-probs are the same function of the inputs; on CPU they
    are bit-identical to token-by-token (tested), at a fraction of the per-call overhead.
    """
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    prompt_len = input_ids.shape[1] - n_completion
    end = input_ids.shape[1] - 1  # the last token is only a target
    pos = positions_from_mask(attention_mask)
    out = model(input_ids=input_ids[:, :prompt_len], attention_mask=attention_mask[:, :prompt_len],
                position_ids=pos[:, :prompt_len], use_cache=True)
    past, steps = out.past_key_values, [out.logits[:, -1:]]
    for t in range(prompt_len, end, tokens_per_step):
        stop = min(t + tokens_per_step, end)
        out = model(input_ids=input_ids[:, t:stop], attention_mask=attention_mask[:, :stop],
                    position_ids=pos[:, t:stop], past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits)
    return _token_logps(torch.cat(steps, dim=1), input_ids[:, prompt_len:], temperature)
