"""The rollout-vs-trainer mismatch metrics both quads GRPO trainers log each step.

:class:`MismatchLogging` is a mixin for a ``trl.GRPOTrainer`` subclass whose rollout log-probs
reach TRL's vLLM code path (``sampling_per_token_logps``): ``QuadsGRPOTrainer`` (its own
engine) and ``QuadsVLLMGRPOTrainer`` (a colocated vLLM engine). After TRL has scored a batch it
adds ``sampling/quads/*`` (and, with ``quads_rollout_corr``, verl's ``rollout_corr/*``) to TRL's
metrics, gathered across processes, so every logger TRL feeds gets them.
"""

from __future__ import annotations

import torch

from quads.diagnostics.mismatch import mismatch_metrics

__all__ = ["MismatchLogging", "TRL_ALIASES"]

#: quads names that are the same quantity as one of TRL's own metrics of the batch: logged as
#: TRL's value (one number under two names; docs/trl.md has the table of how the rest relate)
TRL_ALIASES = {
    "sampling/quads/logp_gap_mean": "sampling/sampling_logp_difference/mean",
    "sampling/quads/logp_gap_max": "sampling/sampling_logp_difference/max",
}

# How the quads metrics combine across processes.
_REDUCE = {"min": "min", "max": "max", "p99": "max"}


def _reducer(name: str) -> str:
    for suffix, how in _REDUCE.items():
        if name.endswith(suffix):
            return how
    return "mean"


class MismatchLogging:
    """Logs :func:`quads.diagnostics.mismatch_metrics` of every generated batch (see the module doc)."""

    quads_rollout_corr: bool = False  # also verl's rollout_corr/* names

    def _quads_log(self, mode: str, metrics: dict[str, float]) -> None:
        device = self.accelerator.device
        for name in sorted(metrics):
            value = torch.tensor([metrics[name]], dtype=torch.float64, device=device)
            gathered = self.accelerator.gather(value)
            how = _reducer(name)
            if how == "max":
                v = gathered.max().item()
            elif how == "min":
                v = gathered.min().item()
            else:
                v = gathered.mean().item()
            self._metrics[mode][name].append(v)

    def _quads_extra_metrics(self, output, rollout_lp, trainer_lp, mask) -> dict[str, float]:
        """More metrics of the same batch (the δ decomposition of ``QuadsGRPOTrainer``); none here."""
        return {}

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        rollout_lp = output.get("sampling_per_token_logps")
        trainer_lp = output.get("old_per_token_logps")
        if rollout_lp is None or trainer_lp is None:  # vllm_importance_sampling_correction=False
            return output
        mask = output["completion_mask"].bool()
        if "tool_mask" in output:
            mask = mask & output["tool_mask"].bool()
        metrics = mismatch_metrics(
            rollout_lp,
            trainer_lp,
            mask,
            is_mode=self.vllm_importance_sampling_mode,
            clip_min=self.vllm_importance_sampling_clip_min,
            clip_max=self.vllm_importance_sampling_clip_max,
            rollout_corr=self.quads_rollout_corr,
        )
        for name, trl_name in TRL_ALIASES.items():  # TRL logged them for this batch just now
            logged = self._metrics[mode].get(trl_name)
            if logged:
                metrics[name] = logged[-1]
        metrics.update(self._quads_extra_metrics(output, rollout_lp, trainer_lp, mask))
        self._quads_log(mode, metrics)
        return output
