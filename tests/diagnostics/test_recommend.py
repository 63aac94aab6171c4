"""The plan `quads diagnose` recommends: its rule on measured gaps and the measured speed table."""

from pathlib import Path

import pytest

from quads.diagnostics import plan_speeds, recommend as rec
from quads.diagnostics.plan_speeds import HARDWARE, MODEL_KINDS, PLAN_SPEEDS, StepTime, measured_speed
from quads.policies import POLICY_PRESETS

REPO = Path(__file__).resolve().parents[2]


def _rows(**gaps):
    return [{"config": n, "preset": n, "gap_mean": g} for n, g in gaps.items()]


@pytest.fixture
def speeds(monkeypatch):
    table = {("hopper", "moe"): {}}
    monkeypatch.setattr(plan_speeds, "PLAN_SPEEDS", table)
    monkeypatch.setattr(rec, "PLAN_SPEEDS", table)
    return table[("hopper", "moe")]


def test_the_fastest_measured_plan_within_the_gap_factor_wins(speeds):
    speeds.update(quads=StepTime(0.8, 1.0, "runs/a"), **{"quads-experts": StepTime(0.7, 1.0, "runs/b"),
                                                         "naive": StepTime(0.5, 1.0, "runs/c")})
    r = rec.recommend(_rows(bf16=0.01, quads=0.014, **{"quads-experts": 0.012}, naive=0.2), "hopper", "moe")
    assert r.plan == "quads-experts"  # 1.43x BF16's step; naive is faster but 20x the floor
    assert r.qualifying == ("bf16", "quads-experts", "quads") and r.unmeasured == ()
    assert "1.43x BF16's whole RL step (runs/b)" in r.reason and "naive" not in r.reason
    assert r.line().startswith("recommended plan (hopper, moe model): quads-experts: mean gap 1.20x the BF16 floor")


def test_unmeasured_plans_are_named_never_guessed(speeds):
    speeds["quads"] = StepTime(1.25, 1.0, "runs/a")  # slower than BF16
    r = rec.recommend(_rows(bf16=0.01, quads=0.012, w4a16=0.011), "hopper", "moe")
    assert r.plan == "bf16" and r.unmeasured == ("w4a16",)
    assert "no plan within that is measured faster than BF16" in r.reason and "quads 0.80x" in r.reason
    assert "their speed would decide: w4a16" in r.reason


def test_only_the_floor_within_the_factor(speeds):
    r = rec.recommend(_rows(bf16=0.01, quads=0.0151, naive=0.3), "hopper", "moe")
    assert r.plan == "bf16" and r.qualifying == ("bf16",)
    assert "no other plan's mean gap is within 1.5x the BF16 floor (closest: quads 1.51x)" in r.reason
    with pytest.raises(ValueError, match="no BF16 floor"):
        rec.recommend(_rows(quads=0.01), "hopper", "moe")


def test_hardware_without_measurements_recommends_bf16_naming_the_candidates():
    r = rec.recommend(_rows(bf16=0.01, quads=0.012), "blackwell", "dense")
    assert r.plan == "bf16" and r.unmeasured == ("quads",)


def test_speed_table_holds_measurements_from_the_repo_only():
    assert set(PLAN_SPEEDS) <= {(h, k) for h in HARDWARE for k in MODEL_KINDS}
    for key, table in PLAN_SPEEDS.items():
        assert "bf16" not in table  # the reference, 1x by definition
        for plan, t in table.items():
            assert plan in POLICY_PRESETS, (key, plan)
            assert t.plan_s > 0 and t.bf16_s > 0
            assert (REPO / t.source.split()[0]).exists(), t.source  # the result file it came from
    assert measured_speed("bf16", "blackwell", "moe") == 1.0
    assert measured_speed("quads", "blackwell", "moe") is None  # the native-FP4 path has never run
