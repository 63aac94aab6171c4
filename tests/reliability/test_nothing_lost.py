"""Nothing lost: what a user saves loads back, concurrent or interrupted operations leave whole
models and folders, and a damaged export is refused instead of loaded."""

import copy
import json
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quads
from benchmarks.studies.reliability_sweeps import (
    concurrent_sync_sweep,
    export_bitflip_sweep,
    export_race_sweep,
    quantize_interrupt_sweep,
    same_objects,
    structure,
    tensor_state,
    tiny_model,
)
from quads.tensor import NVFP4Tensor, load_safetensors, save_safetensors
from tests.tiny_models import COMMON


def _tied_llama(seed=0):
    """SmolLM2's layout: ``lm_head.weight`` is ``model.embed_tokens.weight``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**COMMON, "tie_word_embeddings": True, "intermediate_size": 96})
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


# -- tied embeddings save and load -------------------------------------------------------------


def test_tied_embeddings_save_once_and_load_tied(tmp_path):
    model = _tied_llama()
    path = tmp_path / "model.safetensors"
    save_safetensors(model.state_dict(), path)
    state = load_safetensors(path)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    fresh = _tied_llama(seed=1)
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_tied_rollout_round_trips(tmp_path):
    rollout = _tied_llama()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    path = tmp_path / "rollout.safetensors"
    save_safetensors(rollout.state_dict(), path)
    other = _tied_llama(seed=1)
    quads.quantize_(other, quads.QuadsPolicy(side="rollout"))
    other.load_state_dict(load_safetensors(path))
    assert other.lm_head.weight is other.model.embed_tokens.weight
    for name, p in rollout.named_parameters():
        q = dict(other.named_parameters())[name]
        if isinstance(p, NVFP4Tensor):
            assert all(torch.equal(a, b) for a, b in zip(p.parts, q.parts)), name
        else:
            assert torch.equal(p, q), name


def test_overlapping_views_of_one_buffer_are_stored_as_copies(tmp_path):
    buf = torch.arange(32, dtype=torch.float32)
    state = {"a": buf[:20], "b": buf[10:]}
    save_safetensors(state, tmp_path / "v.safetensors")
    back = load_safetensors(tmp_path / "v.safetensors")
    assert torch.equal(back["a"], buf[:20]) and torch.equal(back["b"], buf[10:])
    assert back["a"] is not back["b"]


# -- concurrent syncs into one rollout ---------------------------------------------------------


def test_two_threads_syncing_one_rollout_take_turns(monkeypatch):
    """Each sync waits in its staging step for a second sync to arrive there too; if syncs
    of one rollout could overlap, both would be inside at once."""
    import quads.policies.sync as sync

    trainers = []
    for seed in (1, 2):
        t = tiny_model(seed=seed, dtype=torch.float32)
        quads.quantize_(t, quads.QuadsPolicy(side="trainer"))
        trainers.append(t)
    rollout = tiny_model()
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    expected = []
    for t in trainers:
        r = copy.deepcopy(rollout)
        quads.sync_weights_(r, t)
        expected.append(tensor_state(r))

    inside, peak, guard = [0], [0], threading.Lock()
    meet = threading.Barrier(2, timeout=0.5)
    real_stage, real_write = sync._stage, sync._write

    def stage(writes):
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        try:
            meet.wait()
        except threading.BrokenBarrierError:
            pass  # the other sync waits for the lock: it cannot arrive
        real_stage(writes)

    def write(writes, model):
        real_write(writes, model)
        with guard:
            inside[0] -= 1

    monkeypatch.setattr(sync, "_stage", stage)
    monkeypatch.setattr(sync, "_write", write)
    errors = []

    def work(trainer):
        try:
            quads.sync_weights_(rollout, trainer)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert peak[0] == 1, "two syncs of one rollout ran at once"
    assert tensor_state(rollout) in expected


def test_concurrent_syncs_sampled_sweep():
    """Real threads, no patching: 30 races of two syncs (without the lock about 1 in 7 tore)."""
    result = concurrent_sync_sweep(trials=30, threads=2, syncs=1)
    assert result.bad == 0, result


# -- Ctrl-C anywhere in quantize_ -----------------------------------------------------------------


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_interrupt_at_sampled_lines_of_quantize_leaves_whole_models(side):
    """KeyboardInterrupt at 60 executed lines (of every frame) of quantize_: each of the last 40
    (the model-level finishing: hooks, attributes, the refused save_pretrained) and 20 others;
    never a half-converted model, and a retry converts it."""
    result = quantize_interrupt_sweep(side, points=60, seed=1, tail=40)
    assert result.bad == 0, result
    assert result.outcomes.get("unchanged", 0) >= 40, result


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_interrupt_after_the_swap_rolls_back_hooks_and_attributes(side, monkeypatch):
    """An interrupt in the model-level finishing (group hooks, load checks, save_pretrained)."""
    import quads.policies.quantize as quantize

    target = "_attach_trainer_groups" if side == "trainer" else "install_save_pretrained"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    model = tiny_model()
    before, objects = structure(model), same_objects(model)
    state = tensor_state(model)
    monkeypatch.setattr(quantize, target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        quads.quantize_(model, quads.QuadsPolicy(side=side))
    assert structure(model) == before and same_objects(model) == objects and tensor_state(model) == state
    monkeypatch.undo()
    quads.quantize_(model, quads.QuadsPolicy(side=side))  # a retry converts it
    assert quads.quantized_modules(model)


# -- exports carry checksums -------------------------------------------------------------------


def _export_dir(tmp_path, **kw):
    from quads.integrations.modelopt import export_modelopt

    out = tmp_path / "export"
    model = tiny_model(dtype=torch.float32)
    export_modelopt(model, out, "w4a16", **kw)
    return out


def test_a_flipped_bit_in_an_export_is_refused_on_load(tmp_path):
    from quads.integrations.modelopt import load_exported
    from quads.tensor.modelopt_format import read_modelopt_checkpoint

    out = _export_dir(tmp_path)
    shard = out / "model.safetensors"
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    data = bytearray(shard.read_bytes())
    data[header + 100] ^= 0x10  # one bit of a tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: checksum mismatch"):
        load_exported(out)
    with pytest.raises(ValueError, match=r"model\.safetensors: checksum mismatch"):
        read_modelopt_checkpoint(out)
    read_modelopt_checkpoint(out, verify=False)  # the documented opt-out reads it unchecked
    report = json.loads((out / "quads_export.json").read_text())
    assert set(report["checksums"]) == {p.name for p in out.iterdir()} - {"quads_export.json"}


def test_export_bit_flips_sampled_sweep():
    result = export_bitflip_sweep(flips=40, seed=3, full_loads=1)
    assert result.bad == 0 and result.outcomes.get("refused", 0) >= 30, result


# -- two exports to one --out ------------------------------------------------------------------


def test_an_export_racing_another_to_the_same_out_refuses_in_one_line(tmp_path, monkeypatch):
    """While this export writes its shards, another export to the same --out finishes."""
    import quads.integrations.modelopt.export as export
    from quads.tensor.modelopt_format import verify_checksums

    out = tmp_path / "export"
    real = export._write_shards
    raced = []

    def write_shards(*args, **kwargs):
        if not raced:
            raced.append(True)
            export.export_modelopt(tiny_model(seed=5, dtype=torch.float32), out, "w4a16")  # the other one, whole
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "_write_shards", write_shards)
    with pytest.raises(FileExistsError, match=r"^export: .*export was created by another process") as err:
        export.export_modelopt(tiny_model(dtype=torch.float32), out, "w4a16")
    assert "\n" not in str(err.value)
    assert verify_checksums(out) > 0  # the other export's folder, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary directory left


def test_export_races_sampled_sweep():
    result = export_race_sweep(trials=2)
    assert result.bad == 0, result


def test_an_interrupt_at_any_line_of_taking_a_sync_lock_leaves_other_rollouts_syncable():
    """Ctrl-C at every executed line of taking and leaving one rollout's sync lock: another thread
    still gets another rollout's lock at once (no lock of the table is left held)."""
    import sys

    import torch.nn as nn

    from quads.policies import sync_lock

    other = nn.Linear(16, 16)
    n = 0
    while True:
        n += 1
        seen = {"lines": 0, "hit": False}

        def tracer(frame, event, arg):
            if event == "line":
                seen["lines"] += 1
                if seen["lines"] == n:
                    seen["hit"] = True
                    raise KeyboardInterrupt(f"injected at line {n}")
            return tracer

        rollout = nn.Linear(16, 16)
        sys.settrace(tracer)
        try:
            with sync_lock.rollout_write_lock(rollout):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if not seen["hit"]:
            break
        got = []
        worker = threading.Thread(target=lambda: (sync_lock._lock_of(other), got.append(True)), daemon=True)
        worker.start()
        worker.join(5)
        assert got, f"an interrupt at executed line {n} left the sync lock table held"
    assert n > 3  # the sweep reached the lines of the lock code
