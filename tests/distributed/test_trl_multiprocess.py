"""TRL GRPO with accelerate across 2 CPU processes (gloo): real TRL, real accelerate (DDP on CPU:
accelerate 1.15 enables FSDP only on accelerators), a rollout replica per rank.

3 GRPO steps of 8 sequences (4 per rank); about 25 s on 2 CPU cores. Per-rank body in
``trl_workers.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests.distributed.launch import run_on_ranks  # noqa: E402


def test_grpo_two_processes_each_rank_samples_with_an_exactly_synced_replica(tmp_path):
    results = run_on_ranks(
        "tests.distributed.trl_workers:grpo_steps", world=2, timeout_s=300, output_dir=str(tmp_path), steps=3
    )
    for r in results:
        assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU", r
        assert r["wrapped"] == "DistributedDataParallel", r
        assert r["n_logs"] == 3 and r["quads_metrics_finite"] and r["trl_is_metrics"], r
        # synced before the first generation of every step, each time bit-exact with the trainer
        assert r["sync_steps"] == [0, 1, 2] and r["num_syncs"] == 3, r
        assert all(n > 0 for n in r["n_packed_exact"]), r
        # the ranks started from different random inits: DDP's broadcast + the syncs made them one
        assert r["masters_equal_across_ranks"] and r["rollouts_equal_across_ranks"], r
        assert r["rollout_changed_between_syncs"], r  # the optimizer steps moved the rollout
        # each rank's engine generated its own share of the prompts
        assert r["prompts_differ_across_ranks"], r
    assert results[0]["rewards"] == results[1]["rewards"]  # TRL logs the global (gathered) reward
