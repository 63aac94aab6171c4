"""The rollout-vs-trainer mismatch metrics both quads GRPO trainers log each step.

:class:`MismatchLogging` is a mixin for a ``trl.GRPOTrainer`` subclass whose rollout log-probs
reach TRL's vLLM code path (``sampling_per_token_logps``): ``QuadsGRPOTrainer`` (its own
engine) and ``QuadsVLLMGRPOTrainer`` (a colocated vLLM engine). After TRL has scored a batch it
adds ``sampling/quads/*`` (and, with ``quads_rollout_corr``, verl's ``rollout_corr/*``) to TRL's
metrics, gathered across processes, so every logger TRL feeds gets them.

With ``quads_alarm`` set (a :class:`~quads.diagnostics.mismatch_alarm.MismatchAlarm`), each
training step also logs ``sampling/quads/alarm`` (1 when this step's gap left the
run's band, else 0) and warns in one line naming the step, the value, the band and the worst
decoder layer when the gap leaves the band (again every 50 steps while it stays out). Locating the
layer costs one teacher-forced forward of the trainer and one of the rollout model over the
batch's first sequence, only on a step that warns (a trainer without a torch rollout model, e.g.
vLLM, names none).
"""

from __future__ import annotations

import warnings

import torch

from quads.diagnostics.mismatch import mismatch_metrics
from quads.diagnostics.mismatch_alarm import MismatchAlarm, worst_layer

__all__ = ["MismatchLogging", "TRL_ALIASES"]

#: quads names that are the same quantity as one of TRL's own metrics of the batch: logged as
#: TRL's value (one number under two names; docs/trl.md has the table of how the rest relate)
TRL_ALIASES = {
    "sampling/quads/logp_gap_mean": "sampling/sampling_logp_difference/mean",
    "sampling/quads/logp_gap_max": "sampling/sampling_logp_difference/max",
}

# How the quads metrics combine across processes.
_REDUCE = {"min": "min", "max": "max", "p99": "max", "alarm": "max"}


def _reducer(name: str) -> str:
    for suffix, how in _REDUCE.items():
        if name.endswith(suffix):
            return how
    return "mean"


class MismatchLogging:
    """Logs :func:`quads.diagnostics.mismatch_metrics` of every generated batch (see the module doc)."""

    quads_rollout_corr: bool = False  # also verl's rollout_corr/* names
    quads_alarm: MismatchAlarm | None = None  # the mismatch alarm (module doc); None: off

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
        if mode == "train" and self.quads_alarm is not None:
            metrics["sampling/quads/alarm"] = self._quads_check_alarm(metrics, output)
        self._quads_log(mode, metrics)
        return output

    #: while a run stays out of its band, the alarm warns again only every this many steps
    ALARM_REPEAT_STEPS = 50

    def _quads_check_alarm(self, metrics: dict[str, float], output) -> float:
        """1.0 when this step's gap leaves the band, else 0.0; one warning line when the gap
        leaves the band, then one every :attr:`ALARM_REPEAT_STEPS` steps while it stays out."""
        reason = self.quads_alarm.check(metrics["sampling/quads/logp_gap_mean"], metrics["sampling/quads/logp_gap_max"])
        streak = self.__dict__.get("_quads_alarm_streak", 0)
        self._quads_alarm_streak = 0 if reason is None else streak + 1
        if reason is None:
            return 0.0
        if streak % self.ALARM_REPEAT_STEPS:
            return 1.0
        where = "worst layer unknown (no torch rollout model)"
        rollout = getattr(self, "rollout_model", None)
        if rollout is not None:
            ids = torch.cat([output["prompt_ids"][:1], output["completion_ids"][:1]], dim=1)
            am = torch.cat([output["prompt_mask"][:1], output["completion_mask"][:1]], dim=1)
            name, added = worst_layer(self.accelerator.unwrap_model(self.model), rollout, ids, am)
            where = f"worst layer {name} (+{added:.3g} relative hidden-state error)"
        still = f" (out of the band for {streak + 1} steps)" if streak else ""
        warnings.warn(f"quads mismatch alarm at step {self.state.global_step}{still}: {reason}; {where}", stacklevel=2)
        return 1.0
