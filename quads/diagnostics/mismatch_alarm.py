"""The mismatch alarm: a step whose rollout-vs-trainer gap leaves the plan's expected band.

Each plan has its own gap level (the BF16 floor, NVFP4 plans above it); what signals a fault
(a drifting precision mismatch, a corrupted or stale rollout weight) is the gap leaving the
level the same run showed at its start. :class:`MismatchAlarm` takes the median of the first
``warmup`` steps' mean and max gaps as the baseline; a later step fires when its mean gap or
its max gap exceeds ``factor`` times its baseline (default 3x: the step-to-step spread of a
healthy run's mean gap stays well inside it). :func:`worst_layer` then names the decoder layer
where the two models part: one teacher-forced forward of each model over one sequence, the
layer whose output hidden state adds the most relative error over its input's.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn as nn

__all__ = ["DEFAULT_ALARM_FACTOR", "MismatchAlarm", "worst_layer"]

#: a step's gap above this multiple of the run's baseline fires the alarm
DEFAULT_ALARM_FACTOR = 3.0


class MismatchAlarm:
    """Watches a run's per-step mean and max gaps (see the module doc); ``factor=None``: off."""

    def __init__(self, factor: float | None = DEFAULT_ALARM_FACTOR, warmup: int = 5):
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 1):
            raise ValueError(f"mismatch alarm factor must be a number > 1 or None (off), got {factor!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"mismatch alarm warmup must be an int >= 1, got {warmup!r}")
        self.factor, self.warmup = factor, warmup
        self._first: list[tuple[float, float]] = []
        self.baseline: tuple[float, float] | None = None  # (mean gap, max gap)

    def check(self, mean_gap: float, max_gap: float) -> str | None:
        """None, or what left the band (``"mean gap 0.031 > 3x baseline 0.0042"``)."""
        if self.factor is None:
            return None
        if self.baseline is None:
            self._first.append((mean_gap, max_gap))
            if len(self._first) == self.warmup:
                self.baseline = tuple(statistics.median(v) for v in zip(*self._first))
            return None
        for what, value, base in (("mean", mean_gap, self.baseline[0]), ("max", max_gap, self.baseline[1])):
            if value > self.factor * base:
                return f"{what} gap {value:.4g} > {self.factor:g}x baseline {base:.4g}"
        return None


def _decoder_outputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return [h.float() for h in out.hidden_states]


@torch.no_grad()
def worst_layer(trainer: nn.Module, rollout: nn.Module, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[str, float]:
    """``("model.layers.<i>", added relative error)`` for the decoder layer whose output parts
    most from the trainer's beyond what its input already did (teacher forced over ``input_ids``;
    hidden states from ``output_hidden_states``: the embeddings, then one per layer, the last
    after the final norm, which a relative error passes nearly unchanged)."""
    h_t = _decoder_outputs(trainer, input_ids, attention_mask)
    h_r = _decoder_outputs(rollout, input_ids.to(h_t[0].device), attention_mask.to(h_t[0].device))
    keep = attention_mask.bool().to(h_t[0].device)
    errs = [((r - t)[keep].norm() / t[keep].norm().clamp_min(1e-30)).item() for t, r in zip(h_t, h_r)]
    added = [errs[i + 1] - errs[i] for i in range(len(errs) - 1)]  # the last layer's output comes normed
    i = max(range(len(added)), key=added.__getitem__)
    return f"model.layers.{i}", added[i]
