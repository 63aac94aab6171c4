"""Rollout-vs-trainer mismatch metrics (pure torch).

Inputs are per-token log-probs of the *sampled* completion tokens, shape (B, T):
``rollout_logps`` (log p_rollout, computed by the engine that sampled the tokens) and
``trainer_logps`` (log p_trainer, TRL's ``old_per_token_logps``), plus a mask (B, T) of the
completion tokens that count (TRL's ``completion_mask`` times its ``tool_mask``).

Conventions, chosen to match TRL 1.16's importance-sampling (IS) correction
(``GRPOTrainer._generate_and_score_completions`` with ``vllm_importance_sampling_correction``):

* the per-token log-ratio is ``log r_t = log p_trainer - log p_rollout`` (the IS weight that
  corrects rollout samples towards the trainer's policy);
* a token whose rollout log-prob is NaN (an engine that could not score it) gets ``log r_t = 0``
  in the IS ratios (as TRL does) and is left out of the gap / KL statistics;
* ``*_mask`` / ``*_truncate`` modes: ``sequence_*`` modes use one ratio per sequence,
  ``exp(sum_t log r_t)``; ``token_*`` modes one ratio per valid token. The *raw* ratios are the
  ones before TRL truncates (``*_truncate``: clamp to [clip_min, clip_max]) or masks
  (``*_mask``: set to 0 outside [clip_min, clip_max]); ``masked_fraction`` is the fraction of
  IS units (sequences or tokens) whose raw ratio lies outside that interval, i.e. the fraction
  TRL masks (mask modes) or clips (truncate modes). Sequences without a valid token are left
  out (their ratio is 1 and they carry no loss).

Raw ratios are computed in float64 so sequence-level products do not overflow to inf for
log-ratios up to ~700; the log-ratios are reported too.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "IS_MODES",
    "logp_gap_stats",
    "k3_kl",
    "importance_ratio_stats",
    "mismatch_metrics",
]

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")


def _check(rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if rollout_logps.shape != trainer_logps.shape:
        raise ValueError(f"rollout_logps {tuple(rollout_logps.shape)} and trainer_logps {tuple(trainer_logps.shape)} differ in shape")
    if mask is None:
        return torch.ones_like(trainer_logps, dtype=torch.bool)
    if mask.shape != trainer_logps.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the log-probs {tuple(trainer_logps.shape)}")
    return mask.bool()


def _valid_deltas(rollout_logps, trainer_logps, mask) -> torch.Tensor:
    """1-D float64 tensor of log p_trainer - log p_rollout over valid, finite tokens."""
    m = _check(rollout_logps, trainer_logps, mask)
    delta = trainer_logps.double() - rollout_logps.double()
    return delta[m & torch.isfinite(delta)]


def _quantile(x: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (numpy's default), 0.0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    return torch.quantile(x.double(), q).item()


def logp_gap_stats(
    rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Per-token |log p_rollout - log p_trainer| over the valid tokens: mean, p99, max, count.

    Tokens with a NaN log-prob are skipped. All values are 0.0 when no token is valid.
    """
    gap = _valid_deltas(rollout_logps, trainer_logps, mask).abs()
    n = gap.numel()
    return {
        "mean": gap.mean().item() if n else 0.0,
        "p99": _quantile(gap, 0.99),
        "max": gap.max().item() if n else 0.0,
        "num_tokens": float(n),
    }


def k3_kl(rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """k3 estimate of KL(p_rollout || p_trainer) per token, from tokens sampled by the rollout.

    With r = p_trainer / p_rollout at each sampled token, k3 = (r - 1) - log r (>= 0, unbiased
    for the KL since E_rollout[r] = 1; Schulman's estimator, verl's ``mismatch_k3_kl``). Mean over
    valid tokens; 0.0 when none.
    """
    log_r = _valid_deltas(rollout_logps, trainer_logps, mask)
    if log_r.numel() == 0:
        return 0.0
    return (torch.expm1(log_r) - log_r).mean().item()


def importance_ratio_stats(
    rollout_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    mask: torch.Tensor | None = None,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> dict[str, float]:
    """Raw IS ratios (before TRL's truncation / masking) under ``mode``, and the fraction hit.

    Returns ``raw_min``, ``raw_mean``, ``raw_max`` (of the ratios), ``log_raw_min``,
    ``log_raw_max`` (of the log-ratios), ``masked_fraction`` (units outside
    [clip_min, clip_max]; a None bound is open) and ``num_units``. See the module doc.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    m = _check(rollout_logps, trainer_logps, mask)
    delta = trainer_logps.double() - rollout_logps.double()
    delta = torch.nan_to_num(delta * m, nan=0.0)  # TRL: NaN rollout log-probs -> no correction
    if mode.startswith("sequence"):
        has_token = m.any(dim=-1)
        log_ratio = delta.sum(dim=-1)[has_token]
    else:
        log_ratio = delta[m]
    n = log_ratio.numel()
    if n == 0:
        return {k: 0.0 for k in ("raw_min", "raw_mean", "raw_max", "log_raw_min", "log_raw_max", "masked_fraction", "num_units")}
    ratio = torch.exp(log_ratio)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    outside = (ratio < lo) | (ratio > hi)
    return {
        "raw_min": ratio.min().item(),
        "raw_mean": ratio.mean().item(),
        "raw_max": ratio.max().item(),
        "log_raw_min": log_ratio.min().item(),
        "log_raw_max": log_ratio.max().item(),
        "masked_fraction": outside.double().mean().item(),
        "num_units": float(n),
    }


def mismatch_metrics(
    rollout_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    is_mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    prefix: str = "sampling/quads/",
) -> dict[str, float]:
    """All mismatch metrics of one batch as a flat ``{prefix + name: value}`` dict.

    Names: ``logp_gap_mean``, ``logp_gap_p99``, ``logp_gap_max``, ``k3_kl``,
    ``is_ratio_raw_min``, ``is_ratio_raw_mean``, ``is_ratio_raw_max``, ``is_log_ratio_raw_min``,
    ``is_log_ratio_raw_max``, ``is_masked_fraction``.
    """
    gap = logp_gap_stats(rollout_logps, trainer_logps, mask)
    isr = importance_ratio_stats(rollout_logps, trainer_logps, mask, is_mode, clip_min, clip_max)
    out = {
        "logp_gap_mean": gap["mean"],
        "logp_gap_p99": gap["p99"],
        "logp_gap_max": gap["max"],
        "k3_kl": k3_kl(rollout_logps, trainer_logps, mask),
        "is_ratio_raw_min": isr["raw_min"],
        "is_ratio_raw_mean": isr["raw_mean"],
        "is_ratio_raw_max": isr["raw_max"],
        "is_log_ratio_raw_min": isr["log_raw_min"],
        "is_log_ratio_raw_max": isr["log_raw_max"],
        "is_masked_fraction": isr["masked_fraction"],
    }
    return {prefix + k: v for k, v in out.items()}
