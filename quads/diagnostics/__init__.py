"""Diagnostics: rollout-vs-trainer mismatch metrics."""

from quads.diagnostics.mismatch import IS_MODES, importance_ratio_stats, k3_kl, logp_gap_stats, mismatch_metrics

__all__ = ["IS_MODES", "importance_ratio_stats", "k3_kl", "logp_gap_stats", "mismatch_metrics"]
