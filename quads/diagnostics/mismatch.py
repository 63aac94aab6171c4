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
    "rollout_corr_metrics",
    "ROLLOUT_CORR_ALIASES",
]

#: verl's ``rollout_corr/*`` names that are the same quantity as a quads (TRL-side) metric, with
#: the quads name (``mismatch_metrics``' names without prefix).
ROLLOUT_CORR_ALIASES = {"rollout_corr/k3_kl": "k3_kl"}

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


#: verl clamps log-ratios to this before exponentiating in its chi-squared metrics
_VERL_SAFETY_BOUND = 20.0


def rollout_corr_metrics(
    rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """verl's off-policy diagnostics (``rollout_corr/*``, its ``compute_offpolicy_metrics``) under
    verl's names and definitions, for dashboards built on verl.

    With ``log p_t`` (trainer, verl's ``old_log_prob``) and ``log q_t`` (rollout), per-sequence
    means ``m_p``, ``m_q`` over its valid tokens, ``rho_t = p_t / q_t``:
    ``training_ppl`` = mean_seq exp(-m_p), ``training_log_ppl`` = mean_seq(-m_p), the same for
    ``rollout_*``; ``kl`` = mean_tok(log q - log p) (direct estimator of KL(rollout || trainer));
    ``k3_kl`` = mean_tok(rho - 1 - log rho) (= quads' ``k3_kl``: :data:`ROLLOUT_CORR_ALIASES`);
    ``log_ppl_diff`` = mean_seq(m_q - m_p), ``log_ppl_abs_diff`` its mean |.|,
    ``log_ppl_diff_max`` / ``_min``; ``ppl_ratio`` = mean_seq exp(m_q - m_p); ``chi2_token`` =
    mean_tok(rho^2) - 1 and ``chi2_seq`` = mean_seq(prod_t rho_t)^2 - 1 (log-ratios clamped to
    +-20 first, as verl does). Tokens are quads' valid ones (mask, and finite log-probs: verl has
    no NaN rule); sequences without one are left out; all 0.0 when nothing is valid.
    """
    m = _check(rollout_logps, trainer_logps, mask)
    p, q = trainer_logps.double(), rollout_logps.double()
    valid = m & torch.isfinite(p) & torch.isfinite(q)
    names = ("training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "kl", "k3_kl", "log_ppl_diff",
             "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")
    if not bool(valid.any()):
        return {f"rollout_corr/{k}": 0.0 for k in names}
    if valid.dim() == 1:
        valid, p, q = valid[None], p[None], q[None]
    zero = torch.zeros((), dtype=torch.float64)
    p, q = torch.where(valid, p, zero), torch.where(valid, q, zero)
    count = valid.sum(dim=-1)
    has = count > 0
    m_p = (p.sum(dim=-1)[has] / count[has])
    m_q = (q.sum(dim=-1)[has] / count[has])
    log_r = (p - q)[valid]
    diff = m_q - m_p
    log_r_seq = (p - q).sum(dim=-1)[has].clamp(-_VERL_SAFETY_BOUND, _VERL_SAFETY_BOUND)
    out = {
        "training_ppl": torch.exp(-m_p).mean().item(),
        "training_log_ppl": (-m_p).mean().item(),
        "rollout_ppl": torch.exp(-m_q).mean().item(),
        "rollout_log_ppl": (-m_q).mean().item(),
        "kl": (-log_r).mean().item(),
        "k3_kl": (torch.expm1(log_r) - log_r).mean().item(),
        "log_ppl_diff": diff.mean().item(),
        "log_ppl_abs_diff": diff.abs().mean().item(),
        "log_ppl_diff_max": diff.max().item(),
        "log_ppl_diff_min": diff.min().item(),
        "ppl_ratio": torch.exp(diff).mean().item(),
        "chi2_token": torch.exp(2 * log_r.clamp(-_VERL_SAFETY_BOUND, _VERL_SAFETY_BOUND)).mean().item() - 1.0,
        "chi2_seq": torch.exp(2 * log_r_seq).mean().item() - 1.0,
    }
    return {f"rollout_corr/{k}": out[k] for k in names}


def mismatch_metrics(
    rollout_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    is_mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    prefix: str = "sampling/quads/",
    rollout_corr: bool = False,
) -> dict[str, float]:
    """All mismatch metrics of one batch as a flat ``{prefix + name: value}`` dict.

    Names: ``logp_gap_mean``, ``logp_gap_p99``, ``logp_gap_max``, ``k3_kl``,
    ``is_ratio_raw_min``, ``is_ratio_raw_mean``, ``is_ratio_raw_max``, ``is_log_ratio_raw_min``,
    ``is_log_ratio_raw_max``, ``is_masked_fraction``. ``rollout_corr=True`` adds verl's
    ``rollout_corr/*`` names (:func:`rollout_corr_metrics`, not prefixed), so one run can be read
    by TRL-style and verl-style dashboards.
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
    result = {prefix + k: v for k, v in out.items()}
    if rollout_corr:
        result.update(rollout_corr_metrics(rollout_logps, trainer_logps, mask))
    return result
