"""``benchmarks.rl.rl_step``: the first step's humming cache state, named per row (a tiny CPU run)."""

import json

from benchmarks.rl import rl_step


def test_humming_cache_state_is_cold_for_a_missing_or_empty_directory(tmp_path):
    assert rl_step.humming_cache_state(tmp_path / "missing") == "cold"
    assert rl_step.humming_cache_state(tmp_path) == "cold"
    (tmp_path / "abc123").mkdir()
    assert rl_step.humming_cache_state(tmp_path) == "warm"


def test_humming_cache_option_points_humming_there_and_each_row_says_cold_or_warm(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HUMMING_CACHE_DIR", str(tmp_path / "elsewhere"))  # restored after the run sets its own
    cache, out = tmp_path / "cache", tmp_path / "out"
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--models", "dense", "--variants", "bf16@bf16",
            "--warmup", "1", "--steps", "1", "--prompts", "2", "--generations", "2", "--prompt-len", "8",
            "--new-tokens", "2", "--humming-cache", str(cache), "--csv", str(tmp_path / "results.csv")]
    assert rl_step.main(argv) == 0
    import os

    assert os.environ["HUMMING_CACHE_DIR"] == str(cache)
    (row,) = json.loads((out / "rl_step.json").read_text())["rows"]
    assert row["humming_cache"] == "cold" and "humming cache cold" in capsys.readouterr().out
    cache.mkdir()
    (cache / "kernel").write_text("")
    assert rl_step.main(argv) == 0
    (row,) = json.loads((out / "rl_step.json").read_text())["rows"]
    assert row["humming_cache"] == "warm" and "(warm) |" in (out / "rl_step.md").read_text()
