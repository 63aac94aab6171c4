"""The mismatch alarm: a step whose rollout-vs-trainer gap leaves the plan's expected band.

Each plan has its own gap level (the BF16 floor, NVFP4 plans above it); what signals a fault
(a drifting precision mismatch, a corrupted or stale rollout weight) is the gap leaving the
level the same run showed at its start. :class:`MismatchAlarm` takes the median of the first
``warmup`` steps' mean (and max) gaps as the baseline; a later step fires when its mean gap
exceeds ``factor`` times its baseline, or its max gap ``max_factor`` times its own.

Defaults, replayed on the ten logged H200 ablation runs (``results/ablation_h200_*``: SmolLM2,
five plans x two seeds, 400 steps each): the mean gap above 3x fires on 9 of their 3,950 steps
after warm-up (4 runs; 5 of them in one ``bf16`` run whose mean gap reached 7x its start), and
catches a gap that grows 4x; the max gap (one token's) above 3x fires on 6 to 41 steps of every
run, so ``max_factor`` is off (None) by default.

:func:`worst_layer` then names the decoder layer where the two models part: one teacher-forced
forward of each model over one sequence, the layer whose output hidden state adds the most
relative error over its input's.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn as nn

__all__ = ["DEFAULT_ALARM_FACTOR", "MismatchAlarm", "worst_layer"]

#: a step's gap above this multiple of the run's baseline fires the alarm
DEFAULT_ALARM_FACTOR = 3.0


class MismatchAlarm:
    """Watches a run's per-step mean and max gaps (see the module doc); a factor of None: that
    check off."""

    def __init__(self, factor: float | None = DEFAULT_ALARM_FACTOR, warmup: int = 5, max_factor: float | None = None):
        for what, value in (("factor", factor), ("max_factor", max_factor)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 1):
                raise ValueError(f"mismatch alarm {what} must be a number > 1 or None (off), got {value!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"mismatch alarm warmup must be an int >= 1, got {warmup!r}")
        self.factor, self.warmup, self.max_factor = factor, warmup, max_factor
        self._first: list[tuple[float, float]] = []
        self.baseline: tuple[float, float] | None = None  # (mean gap, max gap)

    def check(self, mean_gap: float, max_gap: float) -> str | None:
        """None, or what left the band (``"mean gap 0.031 > 3x baseline 0.0042"``)."""
        if self.factor is None and self.max_factor is None:
            return None
        if self.baseline is None:
            self._first.append((mean_gap, max_gap))
            if len(self._first) == self.warmup:
                self.baseline = tuple(statistics.median(v) for v in zip(*self._first))
            return None
        for what, value, base, factor in (("mean", mean_gap, self.baseline[0], self.factor),
                                          ("max", max_gap, self.baseline[1], self.max_factor)):
            if factor is not None and value > factor * base:
                return f"{what} gap {value:.4g} > {factor:g}x baseline {base:.4g}"
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
