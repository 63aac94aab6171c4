"""FSDP2 (``fully_shard``) with quads QAT and the sharded trainer -> rollout sync, on 2 CPU
processes joined by gloo, against the single-process result, bit for bit.

Two spawns (module fixtures) run every check; each test asserts on one part of the results.
The per-rank code is in ``fsdp_workers.py``. ``QUADS_DIST_DEVICE=cuda`` runs the same checks on
2 GPUs with NCCL (see docs/distributed.md).
"""

from __future__ import annotations

import pytest
import torch

from quads.ops import get_backend
from quads.policies.shards import shard_rows
from quads.tensor import nvfp4_quantize
from quads.tensor.nvfp4_math import global_amax, global_encode_scale_from_amax
from tests.distributed.fsdp_workers import KINDS, PRECISIONS
from tests.distributed.launch import run_on_ranks

CASES = [(k, p) for k in KINDS for p in PRECISIONS]


@pytest.fixture(scope="module")
def fsdp_results():
    return run_on_ranks("tests.distributed.fsdp_workers:fsdp_checks", world=2)


@pytest.fixture(scope="module")
def failure_results():
    return run_on_ranks("tests.distributed.fsdp_workers:failure_checks", world=2)


# -- single-process foundations --------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 33, 97])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_rows_is_torch_chunk(rows, world):
    chunks = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        start, stop = shard_rows(rows, world, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == want


@pytest.mark.parametrize("backend", ["torch", "hopper"])
@pytest.mark.parametrize("shape", [(33, 64), (3, 32, 48)])
def test_quantizing_row_shards_with_the_global_scale_gives_the_whole_tensors_bits(backend, shape):
    """The sharded sync's premise: rows quantized with the whole weight's S_enc are the rows of
    the whole weight's quantization (NVFP4 blocks run along the last dim)."""
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-2, 1, shape[-1])
    w = w.to("cuda" if torch.cuda.is_available() else "cpu")  # hopper: interpreter on CPU, kernels on a GPU
    gran = "expert" if w.dim() == 3 else "tensor"
    whole = nvfp4_quantize(w, gran)
    scale = global_encode_scale_from_amax(global_amax(w, gran))
    be = get_backend(backend)
    for start, stop in (shard_rows(shape[0], 2, r) for r in range(2)):
        rows = w[start:stop]
        s = scale[start:stop] if gran == "expert" else scale
        q, sc, gs = be.quantize_weight(rows, gran, s)
        assert torch.equal(q, whole.qdata[start:stop])
        assert torch.equal(sc.view(torch.uint8), whole.scale[start:stop].view(torch.uint8))
        assert torch.equal(gs, whole.global_encode_scale[start:stop] if gran == "expert" else whole.global_encode_scale)


# -- the trainer under FSDP2 -----------------------------------------------------------------


@pytest.mark.parametrize("kind,precision", CASES)
def test_fsdp_trainer_forward_and_grads_are_bitwise_single_process(fsdp_results, kind, precision):
    for rank, res in enumerate(fsdp_results):
        r = res[f"trainer/{kind}/{precision}"]
        assert r["n_sharded_params"] == r["n_params"], r  # everything is really sharded
        assert r["n_forward_weights"] > 0 and r["forward_weight_names_match"], r
        # inside forward, each quads layer fake-quantizes the whole unsharded weight (a plain tensor)
        assert r["forward_weights_plain_and_whole"], r
        # FP32 masters under BF16 autocast: the forward weight is written in BF16 (what autocast makes)
        assert r["forward_weight_dtypes"] == ["torch.bfloat16"], r
        assert r["forward_weights_differ"] == [], (rank, r)
        assert r["logits_equal"] and r["loss_equal"], (rank, r["logits_max_diff"])
        assert r["grads_differ"] == [], (rank, r["grads_differ"])


@pytest.mark.parametrize("kind", KINDS)
def test_quads_adds_no_collective_to_fsdp(fsdp_results, kind):
    for res in fsdp_results:
        c = res[f"collectives/{kind}"]
        gathers = sum(n for name, (n, _) in c["plain"].items() if name.startswith("all_gather"))
        assert gathers > 0, c  # the spies see FSDP's own all-gathers (the op's name depends on torch)
        assert c["quads"] == c["plain"], c


# -- the sharded sync ------------------------------------------------------------------------


@pytest.mark.parametrize("kind,precision", CASES)
def test_sharded_sync_is_bitwise_single_process_and_aligned(fsdp_results, kind, precision):
    for rank, res in enumerate(fsdp_results):
        r = res[f"sync/{kind}/{precision}"]
        assert r["n_synced"] == r["n_rollout_params"] and r["n_packed"] > 0, r
        assert r["n_changed_by_sync"] == r["n_rollout_params"], r  # the sync really wrote everything
        assert r["differ_from_single_process"] == [], (rank, r)
        # and the rollout's dequantized weights are the sharded trainer's next forward weights
        assert r["n_aligned_checked"] == r["n_packed"], r
        assert r["rollout_vs_trainer_forward_misaligned"] == [], (rank, r)


@pytest.mark.parametrize("case,backend", [("uneven", "torch"), ("uneven_hopper", "hopper")])
def test_sharded_sync_uneven_and_empty_shards_and_buckets(fsdp_results, case, backend):
    shapes = [res[case]["local_shapes"] for res in fsdp_results]
    assert shapes[0]["one_row.weight"] == [1, 64] and shapes[1]["one_row.weight"] == [0, 64]
    assert shapes[0]["experts.gate_up_proj"][0] == 2 and shapes[1]["experts.gate_up_proj"][0] == 1
    assert shapes[0]["embed.weight"][0] == 49 and shapes[1]["embed.weight"][0] == 48
    for res in fsdp_results:
        assert res[case]["backends"] == [backend]
        assert res[case]["differ_from_single_process"] == []
        if backend == "torch":  # the bucketing is backend-independent: checked once
            assert res[case]["small_buckets_differ"] == []


def test_sharded_sync_with_tied_embeddings(fsdp_results):
    for res in fsdp_results:
        r = res["tied"]
        assert r["tied"] and r["n_synced"] == r["n_rollout_params"], r
        assert r["differ_from_single_process"] == [], r


def test_build_rollout_model_from_a_sharded_trainer(fsdp_results):
    for res in fsdp_results:
        assert res["build_rollout"]["differ_from_single_process"] == []


# -- all or nothing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,on_rank1,on_rank0,match",
    [
        ("nan_on_one_rank", "ValueError", "ValueError", "model.layers.1.mlp.up_proj.weight: 1 non-finite"),
        ("mismatch_on_one_rank", "ValueError", "ShardedSyncError", "model.embed_tokens.weight has shape"),
        ("staging_failure_on_one_rank", "RuntimeError", "ShardedSyncError", "injected staging failure"),
        ("unsupported_placement", "NotImplementedError", "NotImplementedError", "Shard\\(dim=1\\)"),
    ],
)
def test_failed_sync_raises_everywhere_and_writes_nothing(failure_results, case, on_rank1, on_rank0, match):
    import re

    r0, r1 = failure_results[0][case], failure_results[1][case]
    assert r1["raised"] == on_rank1 and re.search(match, r1["message"]), r1
    assert r0["raised"] == on_rank0, r0
    if on_rank0 == "ShardedSyncError":
        assert "rank(s) [1]" in r0["message"] and "no rollout weight was written" in r0["message"], r0
    assert r0["changed"] == [] and r1["changed"] == []


def test_dtensor_weight_in_a_forward_is_refused(failure_results):
    for res in failure_results:
        r = res["dtensor_in_forward"]
        assert r["raised"] == "RuntimeError" and "whole weight" in r["message"], r


def test_sharded_sync_of_an_unsharded_trainer_is_refused(failure_results):
    for res in failure_results:
        r = res["not_sharded"]
        assert r["raised"] == "ValueError" and "quads.sync_weights_" in r["message"], r
