"""The mismatch alarm's band and its worst-layer localization."""

import pytest
import torch

from quads.diagnostics.mismatch_alarm import MismatchAlarm, worst_layer
from quads.policies import copy_model
from tests.policies.test_autocast_experts import moe_masters


def test_band_is_a_factor_over_the_median_of_the_first_steps():
    alarm = MismatchAlarm(3.0, warmup=3, max_factor=3.0)
    assert [alarm.check(m, 5 * m) for m in (0.01, 0.02, 0.012)] == [None] * 3  # warm-up: never fires
    assert alarm.baseline == pytest.approx((0.012, 0.06))
    assert alarm.check(0.035, 0.1) is None  # inside 3x
    assert alarm.check(0.04, 0.1) == "mean gap 0.04 > 3x baseline 0.012"
    assert alarm.check(0.01, 0.2).startswith("max gap 0.2 > 3x baseline 0.06")
    off = MismatchAlarm(None)
    assert all(off.check(v, v) is None for v in (1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e3))
    mean_only = MismatchAlarm(3.0, warmup=1)  # the default: one token's max gap alone never fires
    mean_only.check(0.01, 0.1)
    assert mean_only.check(0.02, 10.0) is None


def test_replayed_h200_runs_fire_as_documented():
    """The module doc's numbers: the ten logged H200 ablation runs replayed through the alarm."""
    import csv
    import pathlib

    runs = sorted(pathlib.Path(__file__).resolve().parents[2].glob("results/ablation_h200_*/*.metrics.csv"))
    assert len(runs) == 10
    fired_mean, fired_max = [], []
    for path in runs:
        rows = [r for r in csv.DictReader(path.open()) if r.get("sampling/quads/logp_gap_mean")]
        for alarm, out in ((MismatchAlarm(), fired_mean), (MismatchAlarm(None, max_factor=3.0), fired_max)):
            out.append(sum(alarm.check(float(r["sampling/quads/logp_gap_mean"]),
                                       float(r["sampling/quads/logp_gap_max"])) is not None for r in rows))
    assert sum(fired_mean) == 9 and sum(f > 0 for f in fired_mean) == 4
    assert min(fired_max) == 6 and max(fired_max) == 41


@pytest.mark.parametrize("bad", [1.0, 0, -2, "3", True])
def test_bad_factor_is_refused(bad):
    with pytest.raises(ValueError, match="mismatch alarm factor"):
        MismatchAlarm(bad)
    with pytest.raises(ValueError, match="mismatch alarm max_factor"):
        MismatchAlarm(max_factor=bad)


def test_worst_layer_names_the_corrupted_layer():
    trainer = moe_masters()
    rollout = copy_model(trainer, torch.bfloat16)
    with torch.no_grad():
        rollout.model.layers[1].self_attn.o_proj.weight.mul_(1.3)
    ids = torch.arange(1, 13)[None]
    name, added = worst_layer(trainer, rollout, ids, torch.ones_like(ids))
    assert name == "model.layers.1" and added > 0.05
