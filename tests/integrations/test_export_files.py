"""``quads export`` output as files others read: modes, the dtype of the unquantized tensors,
and ``load_exported`` (round trip to the trainer's forward weights and to the quads rollout)."""

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open

import quads
from quads.integrations.modelopt import export_modelopt, load_exported
from quads.tensor import nvfp4_fake_quantize
from tests.scale_reference import reference_forward_weight
from tests.tiny_models import build


def _modes(path):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}, stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_files_get_save_pretrained_modes(tmp_path, mask):
    old = os.umask(mask)
    try:
        export_modelopt(build("llama"), tmp_path / "ck", "w4a16")
    finally:
        os.umask(old)
    files, directory = _modes(tmp_path / "ck")
    assert directory == 0o777 & ~mask
    assert set(files.values()) == {0o666 & ~mask}, files  # model.safetensors included


def _dtypes(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_unquantized_tensors_take_the_masters_dtype(tmp_path):
    model = build("qwen3_moe")
    model.model.embed_tokens.float()  # a mixed model: fp32 embeddings and head, BF16 masters
    model.lm_head.float()
    export_modelopt(model, tmp_path / "auto", "w4a16")
    dt = _dtypes(tmp_path / "auto")
    assert dt["model.embed_tokens.weight"] == dt["lm_head.weight"] == dt["model.norm.weight"] == "BF16"
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["dtype"] == "bfloat16"
    export_modelopt(model, tmp_path / "f32", "w4a16", dtype="float32")
    dt = _dtypes(tmp_path / "f32")
    assert dt["model.embed_tokens.weight"] == dt["model.layers.0.mlp.gate.weight"] == "F32"
    assert dt["model.layers.0.self_attn.q_proj.weight"] == "U8"
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_modelopt(model, tmp_path / "bad", "w4a16", dtype="fp8")
    assert not (tmp_path / "bad").exists()


def test_float32_masters_export_their_unquantized_tensors_in_bf16(tmp_path):
    """A TRL-trained model holds float32 masters, trained under BF16 autocast (bf16=True): its
    linears ran in BF16, and vLLM's modelopt_fp4 serves 16-bit activations only. auto writes
    BF16 (config dtype too); float32 stays available on request."""
    model = build("qwen3_moe", dtype=torch.float32)
    export_modelopt(model, tmp_path / "auto", "w4a16")
    dt = _dtypes(tmp_path / "auto")
    unquantized = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight")
    assert {dt[k] for k in unquantized} == {"BF16"}, dt
    assert dt["model.layers.0.self_attn.q_proj.weight"] == "U8"
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["dtype"] == "bfloat16"
    export_modelopt(model, tmp_path / "f32", "w4a16", dtype="float32")
    assert {_dtypes(tmp_path / "f32")[k] for k in unquantized} == {"F32"}


def _target_weights(model):
    """name -> weight of every quads target (linear weight, experts gate_up/down) of a plain model."""
    from quads.policies.walk import conversion_targets

    out = {}
    for name, module, kind in conversion_targets(model, quads.QuadsPolicy(side="trainer").skips):
        for p in ("weight",) if kind == "linear" else ("gate_up_proj", "down_proj"):
            out[f"{name}.{p}"] = getattr(module, p)
    return out


def _loaded(kind, seed, path):
    """A tiny model as users have one: saved, then ``from_pretrained`` (fp32 rotary buffers)."""
    from transformers import AutoModelForCausalLM

    build(kind, seed).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["group", "tensor"])
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "mixtral"])
def test_round_trip_to_trainer_forward_and_rollout(kind, mode, tmp_path):
    """Every weight exact (group mode: the default export; tensor mode: separate scales).
    Trainer side: the loaded model's weights are the trainer's forward weights and it computes
    the trainer's logits; rollout side: the packed parts a sync from that trainer writes, and
    the same logits as that rollout."""
    trainer = _loaded(kind, 0, tmp_path / "t")
    masters = {k: v.detach().clone() for k, v in _target_weights(trainer).items()}
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale=mode))
    rollout_policy = quads.QuadsPolicy(side="rollout", weight_global_scale=mode)
    rollout = _loaded(kind, 5, tmp_path / "r")
    quads.quantize_(rollout, rollout_policy)
    quads.sync_weights_(rollout, trainer)
    if mode == "group":
        assert not export_modelopt(trainer, tmp_path / "ck", "w4a16").requantized
    else:
        with pytest.warns(UserWarning, match="largest weight_scale_2"):
            export_modelopt(trainer, tmp_path / "ck", "w4a16", fused_scales="separate")

    served = load_exported(tmp_path / "ck", side="trainer")
    loaded = _target_weights(served)
    assert loaded.keys() == masters.keys()
    for name in masters:
        assert torch.equal(loaded[name], reference_forward_weight(masters, name, mode)), name
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if kind == "mixtral":  # transformers' Mixtral experts sum in another order than quads' TrainerExperts
            torch.testing.assert_close(served(ids).logits, trainer(ids).logits, rtol=0, atol=0.02)
        else:
            assert torch.equal(served(ids).logits, trainer(ids).logits)

    if mode == "tensor":  # per-tensor scales into a group-mode rollout: refused, naming the group
        with pytest.raises(ValueError, match=r"sibling group .*q_proj.*weight_global_scale='tensor'"):
            load_exported(tmp_path / "ck", side="rollout")
    back = load_exported(tmp_path / "ck", side="rollout", policy=rollout_policy)
    mine = dict(rollout.named_parameters())
    packed = {n: p for n, p in back.named_parameters() if isinstance(p, quads.NVFP4Tensor)}
    assert packed.keys() == {n for n, p in mine.items() if isinstance(p, quads.NVFP4Tensor)}
    for name, p in packed.items():
        q = mine[name]
        assert torch.equal(p.qdata, q.qdata) and torch.equal(p.scale.view(torch.uint8), q.scale.view(torch.uint8))
        assert torch.equal(p.global_encode_scale, q.global_encode_scale), name
    with torch.no_grad():
        assert torch.equal(back(ids).logits, rollout(ids).logits)


def test_shared_scales_load_the_exported_requantized_shards(tmp_path):
    trainer = build("llama")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale="tensor"))
    report = export_modelopt(trainer, tmp_path / "ck", "w4a16")
    served = _target_weights(load_exported(tmp_path / "ck"))
    exact = [n for n, w in _target_weights(trainer).items() if torch.equal(served[n], nvfp4_fake_quantize(w.detach()))]
    assert len(exact) == report.exact_weights and report.requantized  # the others: the group's scale
    for n in report.requantized:
        assert n not in exact


def test_load_errors_name_the_problem(tmp_path):
    (tmp_path / "plain").mkdir()
    build("llama").save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no ModelOpt quantization_config"):
        load_exported(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_exported(tmp_path / "nothing")
    with pytest.raises(ValueError, match="side must be one of"):
        load_exported(tmp_path / "plain", side="both")


def test_cli_dtype_flag(tmp_path):
    from quads.cli import main as cli_main

    src = tmp_path / "trainer"
    build("llama").save_pretrained(src)
    cli_main(["export", "--model", str(src), "--out", str(tmp_path / "ck"), "--dtype", "float32"])
    dt = _dtypes(tmp_path / "ck")
    assert dt["model.embed_tokens.weight"] == dt["lm_head.weight"] == "F32"
    assert dt["model.layers.0.self_attn.q_proj.weight"] == "U8"
