"""Diagnostics: rollout-vs-trainer mismatch metrics, scoring, ``quads diagnose``.
Imports ``tensor``, ``ops`` and ``policies``, never ``integrations``."""

from quads.diagnostics.mismatch import (
    IS_MODES,
    importance_ratio_stats,
    k3_kl,
    logp_gap_stats,
    mismatch_metrics,
    rollout_corr_metrics,
)
from quads.diagnostics.policy_gap import measure_policy_gap
from quads.diagnostics.scoring import build_scoring_batch, score_incremental, score_teacher_forced

__all__ = [
    "IS_MODES",
    "build_scoring_batch",
    "importance_ratio_stats",
    "k3_kl",
    "logp_gap_stats",
    "measure_policy_gap",
    "mismatch_metrics",
    "rollout_corr_metrics",
    "score_incremental",
    "score_teacher_forced",
]
