"""``benchmarks.rl.colocated_memory``: the batch search, the byte arithmetic, and a tiny CPU run
against a simulated capacity (a byte counter) that finds the batch the counter allows."""

import json

import pytest

from benchmarks.rl import colocated_memory as cm

GIB = 2**30


@pytest.mark.parametrize("answer", [0, 1, 2, 37, 64, 1000])
@pytest.mark.parametrize("start", [1, 16, 999, 5000])
def test_search_finds_the_largest_fitting_batch(answer, start):
    seen = []

    def fits(b):
        seen.append(b)
        return b <= answer

    best, tries = cm.largest_batch(fits, start=start, resolution=1, limit=4096)
    assert best == answer
    assert [b for b, _ in tries] == seen and all(ok == (b <= answer) for b, ok in tries)
    assert len(tries) <= 2 * 13 + 2  # doubling steps, then bisection: logarithmic in the distance


def test_search_resolution_and_limit():
    best, _ = cm.largest_batch(lambda b: b <= 1000, start=1, resolution=16, limit=4096)
    assert 1000 - 16 < best <= 1000
    best, tries = cm.largest_batch(lambda b: True, start=3, resolution=1, limit=50)
    assert best == 50 and max(b for b, _ in tries) == 50
    with pytest.raises(ValueError, match="start"):
        cm.largest_batch(lambda b: True, start=0)


def test_out_of_memory_is_seen_through_a_chained_error():
    import torch

    assert cm.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as error:
        assert cm.is_oom(error)
    assert not cm.is_oom(RuntimeError("shape mismatch")) and not cm.is_oom(None)


class _Failing:
    """A decoder whose rollout fails with ``error``."""

    def __init__(self, error):
        self.error, self._state = error, None

    def generate(self, *args):
        raise self.error


def test_a_try_fails_on_memory_or_records_another_error():
    import torch

    memory = cm.SimulatedMemory(capacity=10**9, per_sequence=1)
    assert not cm.rollout_fits(_Failing(torch.OutOfMemoryError("CUDA out of memory")), memory, 4, 8, 2, 50)
    errors = []
    assert not cm.rollout_fits(_Failing(RuntimeError("grid too large\nmore")), memory, 4, 8, 2, 50, errors)
    assert errors == [(4, "RuntimeError: grid too large")]
    with pytest.raises(RuntimeError, match="grid"):
        cm.rollout_fits(_Failing(RuntimeError("grid too large")), memory, 4, 8, 2, 50)
    assert not cm.rollout_fits(_Failing(AssertionError()), cm.SimulatedMemory(10, 8), 2, 8, 2, 50)  # counter first
    got = cm.decode_rate(_Failing(RuntimeError("grid too large")), 4, 8, 2, 50)
    assert got == {"batch": 4, "error": "RuntimeError: grid too large"}


def test_arithmetic_at_qwen3_30b_a3b_shapes():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         vocab_size=151936)
    cache = cm.cache_positions(256, 512)
    assert cache == 768
    assert cm.kv_bytes_per_sequence(cfg, cache) == 48 * 2 * 4 * 128 * 768 * 2  # 72 MiB
    whole = cm.trainer_state_bytes(1000, 100, 1, 7)
    assert whole == {"masters": 4000, "grads": 4000, "adam_moments": 8000, "activations": 7}
    fsdp = cm.trainer_state_bytes(1000, 100, 8, 7)
    assert fsdp["masters"] == 500 and fsdp["adam_moments"] == 1000 and fsdp["fsdp_unsharded"] == 800
    assert fsdp["activations"] == 7  # each rank's own micro-batch: not sharded
    assert cm.activation_bytes(cfg, 2, 768) == 2 * cm.activation_bytes(cfg, 1, 768)


def test_tiny_run_finds_the_batch_the_simulated_budget_allows(tmp_path):
    budget_gib = 0.00614  # the tiny 1-layer trainer's state and BF16 rollout, plus 13 sequences' KV cache
    code = cm.main(["--tiny", "--budget-gib", str(budget_gib), "--layers", "1", "--search-tokens", "2",
                    "--time-tokens", "2", "--start-b", "8", "--variants", "bf16,w4a16-experts",
                    "--settings", "whole", "--out", str(tmp_path), "--csv", str(tmp_path / "kernels.csv")])
    assert code == 0
    out = json.loads((tmp_path / "colocated_memory.json").read_text())
    rows = {r["variant"]: r for r in out["rows"]}
    kv = out["arithmetic"]["kv_bytes_per_sequence"]
    for r in rows.values():
        held = r["rollout_gib"] * GIB + sum(r["state_bytes"].values())
        free = int(budget_gib * GIB) - round(held)
        assert r["free_gib"] * GIB == pytest.approx(free, abs=1)
        assert r["measured"] == r["predicted_kv"] == free // kv > 0  # the counter's exact answer
        assert any(not ok for _, ok in r["tries"]) and (r["measured"], True) in [tuple(t) for t in r["tries"]]
        assert r["decode_own"]["batch"] == r["measured"]
        assert r["decode_own"].get("decode_tok_s", 1) > 0 and r["decode_own"]["timed_s"] > 0
    bf16, nvfp4 = rows["bf16"], rows["w4a16-experts"]
    assert nvfp4["rollout_gib"] < bf16["rollout_gib"] and nvfp4["state_gib"] == bf16["state_gib"]
    assert bf16["measured"] == 13 and nvfp4["measured"] > bf16["measured"]
    assert nvfp4["decode_at_bf16"]["batch"] == bf16["measured"]
    csv_rows = (tmp_path / "kernels.csv").read_text().splitlines()
    timed = sum("step_us" in (r.get(k) or {}) for r in rows.values() for k in ("decode_own", "decode_at_bf16"))
    assert len(csv_rows) == 1 + timed and all(line.startswith("colocated_memory/decode_step,") for line in csv_rows[1:])
    md = (tmp_path / "colocated_memory.md").read_text().splitlines()
    assert md[0].startswith("| variant | setting | rollout GiB | trainer state GiB | KV GiB free")
    assert len(md) == 4 and md[3].startswith("| w4a16-experts | whole (N=1) |")
    assert md[3].split("|")[10].strip() == f"{nvfp4['measured'] / bf16['measured']:.2f}x"


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        cm.parse_args(["--tiny", "--budget-gib", "1", "--variants", "quads,bf16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        cm.parse_args(["--tiny", "--budget-gib", "1", "--settings", "half", "--out", str(tmp_path)])
