"""The mismatch alarm's band and its worst-layer localization."""

import pytest
import torch

from quads.diagnostics.mismatch_alarm import MismatchAlarm, worst_layer
from quads.policies import copy_model
from tests.policies.test_autocast_experts import moe_masters


def test_band_is_a_factor_over_the_median_of_the_first_steps():
    alarm = MismatchAlarm(3.0, warmup=3)
    assert [alarm.check(m, 5 * m) for m in (0.01, 0.02, 0.012)] == [None] * 3  # warm-up: never fires
    assert alarm.baseline == pytest.approx((0.012, 0.06))
    assert alarm.check(0.035, 0.1) is None  # inside 3x
    assert alarm.check(0.04, 0.1) == "mean gap 0.04 > 3x baseline 0.012"
    assert alarm.check(0.01, 0.2).startswith("max gap 0.2 > 3x baseline 0.06")
    off = MismatchAlarm(None)
    assert all(off.check(v, v) is None for v in (1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e3))


@pytest.mark.parametrize("bad", [1.0, 0, -2, "3", True])
def test_bad_factor_is_refused(bad):
    with pytest.raises(ValueError, match="mismatch alarm factor"):
        MismatchAlarm(bad)


def test_worst_layer_names_the_corrupted_layer():
    trainer = moe_masters()
    rollout = copy_model(trainer, torch.bfloat16)
    with torch.no_grad():
        rollout.model.layers[1].self_attn.o_proj.weight.mul_(1.3)
    ids = torch.arange(1, 13)[None]
    name, added = worst_layer(trainer, rollout, ids, torch.ones_like(ids))
    assert name == "model.layers.1" and added > 0.05
