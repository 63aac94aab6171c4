"""``quads export``: ModelOpt NVFP4 checkpoints of real transformers models, read back by
``quads.tensor`` and compared with the QUADS trainer's forward weights."""

import os
import json

import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

import quads
from quads.cli import main as cli_main
from quads.integrations.modelopt import export_modelopt
from quads.policies.walk import conversion_targets
from quads.tasks.arithmetic import make_tokenizer
from quads.tensor import nvfp4_dequantize, nvfp4_fake_quantize, nvfp4_quantize
from quads.tensor.modelopt_format import ENCODE_SCALE_KEY, read_modelopt_checkpoint
from tests.scale_reference import reference_forward_weight
from tests.tiny_models import build

KINDS = ["llama", "qwen3_moe", "mixtral"]


def _calib(n=4):
    return [torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _forward_weights(model, mode="group", block_scaling="6"):
    """Checkpoint name -> the trainer's forward weight (quads targets, ``weight_global_scale=mode``,
    ``weight_block_scaling=block_scaling``) or the stored tensor."""
    targets = {f"{n}.weight" if k == "linear" else f"{n}.{p}" for n, _, k in conversion_targets(model, quads.QuadsPolicy(side="trainer").skips)
               for p in (("weight",) if k == "linear" else ("gate_up_proj", "down_proj"))}
    masters = {k: v.detach() for k, v in model.state_dict().items() if k in targets}
    state = {k: reference_forward_weight(masters, k, mode, block_scaling=block_scaling) if k in targets else v.detach()
             for k, v in model.state_dict().items()}
    return revert_weight_conversion(model, state)


@pytest.mark.parametrize("kind", KINDS)
def test_separate_scales_read_back_bit_exact(kind, tmp_path):
    model = build(kind)
    tensor_mode = quads.QuadsPolicy(side="trainer", weight_global_scale="tensor")
    with pytest.warns(UserWarning, match="largest weight_scale_2"):  # vLLM's fused layers
        report = export_modelopt(model, tmp_path / "ck", "w4a16", fused_scales="separate", policy=tensor_mode)
    assert report.mismatched_fused_groups
    back = read_modelopt_checkpoint(tmp_path / "ck")
    expected = _forward_weights(model, "tensor")
    packed = {k for k, v in back.items() if isinstance(v, quads.NVFP4Tensor)}
    assert len(packed) == report.quantized_weights == report.exact_weights > 0
    assert back.keys() == expected.keys()  # save_pretrained's names, no extra tensor
    for name, value in back.items():
        got = value.dequantize(torch.bfloat16) if name in packed else value
        assert torch.equal(got, expected[name]), name
    if kind != "llama":  # per-expert names; gate and up of an expert share its global scale
        e0 = [k for k in packed if ".experts.0." in k and ("gate_proj" in k or "w1" in k or "up_proj" in k or "w3" in k)]
        assert len(e0) == 4 and len({back[k].global_encode_scale.item() for k in e0 if ".layers.0." in k}) == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("quantized", [False, True])
def test_group_scales_export_every_weight_exactly(kind, quantized, tmp_path):
    """weight_global_scale="group" (the default): the fused layers' shards already share one
    global scale, so "shared" re-quantizes nothing and every NVFP4 tensor is the trainer's
    forward weight bit for bit (a plain model, or a trainer quantized in group mode)."""
    model = build(kind)
    expected = _forward_weights(model, "group")
    if quantized:
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    report = export_modelopt(model, tmp_path / "ck", "w4a16")  # fused_scales="shared"
    assert report.requantized == {} and report.mismatched_fused_groups == []
    assert report.exact_weights == report.quantized_weights > 0
    back = read_modelopt_checkpoint(tmp_path / "ck")
    packed = {k for k, v in back.items() if isinstance(v, quads.NVFP4Tensor)}
    assert len(packed) == report.quantized_weights
    for name in packed:
        assert torch.equal(back[name].dequantize(torch.bfloat16), expected[name]), name
    attn = "model.layers.0.self_attn"
    assert len({back[f"{attn}.{p}_proj.weight"].global_encode_scale.item() for p in "qkv"}) == 1
    tensor_mode = _forward_weights(model if not quantized else build(kind), "tensor")
    assert not torch.equal(expected[f"{attn}.k_proj.weight"], tensor_mode[f"{attn}.k_proj.weight"])  # a real change


def test_shared_scales_requantize_only_mismatched_shards(tmp_path):
    model = build("llama")
    tensor_mode = quads.QuadsPolicy(side="trainer", weight_global_scale="tensor")
    report = export_modelopt(model, tmp_path / "ck", "w4a16", policy=tensor_mode)  # fused_scales="shared"
    assert len(report.requantized) == 6  # q/k/v and gate/up of 2 layers, less the members holding the group's scale
    back = read_modelopt_checkpoint(tmp_path / "ck")
    expected = _forward_weights(model, "tensor")
    attn = "model.layers.0.self_attn"
    scales = [back[f"{attn}.{p}_proj.weight"].global_encode_scale for p in "qkv"]
    assert len({s.item() for s in scales}) == 1  # one global scale for vLLM's qkv_proj
    gate_up = [back[f"model.layers.0.mlp.{p}_proj.weight"].global_encode_scale.item() for p in ("gate", "up")]
    assert gate_up[0] == gate_up[1]
    assert report.requantized and report.exact_weights == report.quantized_weights - len(report.requantized)
    for name, value in back.items():
        if not isinstance(value, quads.NVFP4Tensor):
            continue
        forward = expected[name]
        if name in report.requantized:
            # the trainer's forward weight re-quantized with the group's (smallest) encode scale
            again = nvfp4_quantize(forward, global_encode_scale=value.global_encode_scale)
            assert torch.equal(value.dequantize(torch.bfloat16), nvfp4_dequantize(*again, dtype=torch.bfloat16))
            err = report.requantized[name]
            assert 0 < err["rel_error"] < 0.1 and err["max_abs_error"] > 0
        else:
            assert torch.equal(value.dequantize(torch.bfloat16), forward), name


def test_trained_model_deploys_its_training_forward_weights(tmp_path):
    """After QAT steps, the exported weights are the training forward weights: a fresh model
    loaded with them computes the trainer's logits bit for bit."""
    trainer = build("llama")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))  # group global scales
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        trainer(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    report = export_modelopt(trainer, tmp_path / "ck", "w4a16")  # the default "shared": nothing to re-quantize
    assert report.exact_weights == report.quantized_weights == 14 and not report.requantized
    back = read_modelopt_checkpoint(tmp_path / "ck")
    served = build("llama", seed=1)  # other random weights, all replaced below
    served.load_state_dict({k: v.dequantize(torch.bfloat16) if isinstance(v, quads.NVFP4Tensor) else v for k, v in back.items()})
    with torch.no_grad():
        assert torch.equal(served(ids).logits, trainer(ids).logits)


def test_rollout_model_exports_the_same_bits(tmp_path):
    master, rollout = build("qwen3_moe"), build("qwen3_moe")
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    export_modelopt(master, tmp_path / "a", "w4a16")
    export_modelopt(rollout, tmp_path / "b", "w4a16")
    a, b = read_modelopt_checkpoint(tmp_path / "a"), read_modelopt_checkpoint(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, quads.NVFP4Tensor):
            assert torch.equal(x.qdata, y.qdata) and torch.equal(x.global_encode_scale, y.global_encode_scale), k
        else:
            assert torch.equal(x, y), k


def test_nvfp4_format_input_scales_are_calibrated_amaxes(tmp_path):
    model = build("qwen3_moe")
    calib = _calib()
    seen = {}
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("o", max(seen.get("o", 0.0), a[0].abs().max().item())))
    with torch.no_grad():
        for ids in calib:
            model(ids)
    hook.remove()
    export_modelopt(model, tmp_path / "ck", "nvfp4", calibration=calib)
    back = read_modelopt_checkpoint(tmp_path / "ck")
    packed = [k for k, v in back.items() if isinstance(v, quads.NVFP4Tensor)]
    assert all(f"{k.removesuffix('.weight')}.input_scale" in back for k in packed)
    o = back["model.layers.0.self_attn.o_proj.input_scale"]
    assert o.dtype == torch.float32 and o.dim() == 0
    assert o.item() == pytest.approx(seen["o"] / 2688, rel=1e-6)
    qkv = {back[f"model.layers.0.self_attn.{p}_proj.input_scale"].item() for p in "qkv"}
    assert len(qkv) == 1  # one input, one scale
    gate = [back[f"model.layers.1.mlp.experts.{e}.gate_proj.input_scale"].item() for e in range(4)]
    up = [back[f"model.layers.1.mlp.experts.{e}.up_proj.input_scale"].item() for e in range(4)]
    assert gate == up and all(g > 0 for g in gate)


def test_config_files_follow_modelopt(tmp_path):
    model = build("qwen3_moe")
    export_modelopt(model, tmp_path / "w4a16", "w4a16", tokenizer=make_tokenizer())
    export_modelopt(model, tmp_path / "w4a4", "nvfp4", calibration=_calib())
    for name, algo in (("w4a16", "W4A16_NVFP4"), ("w4a4", "NVFP4")):
        config = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        legacy = json.loads((tmp_path / name / "hf_quant_config.json").read_text())["quantization"]
        assert config["quant_method"] == "modelopt" and config["quant_algo"] == algo == legacy["quant_algo"]
        assert config["group_size"] == legacy["group_size"] == 16 and "kv_cache_quant_algo" in legacy
        excluded = ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
        assert config["ignore"] == legacy["exclude_modules"] == excluded
        acts = config["config_groups"]["group_0"]["input_activations"]
        assert (acts is None) == (name == "w4a16")
    assert (tmp_path / "w4a16" / "tokenizer.json").exists()
    report = json.loads((tmp_path / "w4a16" / "quads_export.json").read_text())
    assert report["quant_algo"] == "W4A16_NVFP4" and report["quantized_weights"] == 32


def test_exact_encode_scales_travel_in_the_metadata(tmp_path):
    """A global scale that no float32 weight_scale_2 represents is kept exactly in the header."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = build("llama")
    with torch.no_grad():  # amax whose S_enc = 2688/amax is not 1/(1/S_enc) in float32
        for amax in torch.linspace(0.5, 0.9, 400).bfloat16():  # the weight is BF16
            s = torch.tensor(2688.0) / amax.float()
            if (1 / (1 / s)).item() != s.item():
                break
        w = model.model.layers[0].self_attn.o_proj.weight
        w.div_(w.abs().max()).mul_(amax)
    export_modelopt(model, tmp_path / "ck", "w4a16")
    file = tmp_path / "ck" / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        meta = json.loads(f.metadata()[ENCODE_SCALE_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = "model.layers.0.self_attn.o_proj.weight_scale_2"
    assert key in meta
    back = read_modelopt_checkpoint(tmp_path / "ck")["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(back.dequantize(torch.bfloat16), nvfp4_fake_quantize(w.detach()))
    save_file(tensors, str(file), metadata={"format": "pt"})  # as another tool would write it
    plain = read_modelopt_checkpoint(tmp_path / "ck", verify=False)["model.layers.0.self_attn.o_proj.weight"]
    assert plain.global_encode_scale.item() != back.global_encode_scale.item()  # 1/weight_scale_2: an ulp off


def test_sharded_output_reads_back_the_same(tmp_path):
    model = build("qwen3_moe")
    export_modelopt(model, tmp_path / "one", "w4a16")
    report = export_modelopt(model, tmp_path / "many", "w4a16", max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in report.files and len([f for f in report.files if f.startswith("model-")]) > 2
    a, b = read_modelopt_checkpoint(tmp_path / "one"), read_modelopt_checkpoint(tmp_path / "many")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].qdata, b[k].qdata) if isinstance(a[k], quads.NVFP4Tensor) else torch.equal(a[k], b[k]) for k in a)


def test_errors_leave_no_files(tmp_path):
    model = build("llama")
    with pytest.raises(ValueError, match="calibration"):
        export_modelopt(model, tmp_path / "a", "nvfp4")
    with pytest.raises(ValueError, match="no activation scales"):
        export_modelopt(model, tmp_path / "a", "w4a16", calibration=_calib())
    with pytest.raises(ValueError, match="format"):
        export_modelopt(model, tmp_path / "a", "fp8")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.weight.*non-finite"):
        export_modelopt(model, tmp_path / "a", "w4a16")
    with pytest.raises(ValueError, match="fuses them"):
        export_modelopt(build("llama"), tmp_path / "a", "w4a16", policy=quads.QuadsPolicy(side="trainer", extra_skip_patterns=(r"k_proj$",)))
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary directory left
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        export_modelopt(build("llama"), tmp_path / "full", "w4a16")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


def test_cli_export(tmp_path, capsys):
    src = tmp_path / "trainer"
    build("qwen3_moe").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    (tmp_path / "calib.txt").write_text("12+34=\n7+8=\n999+1=\n")
    assert cli_main(["export", "--model", str(src), "--out", str(tmp_path / "ck"), "--format", "nvfp4",
                     "--calib", str(tmp_path / "calib.txt")]) == 0
    out = capsys.readouterr().out
    assert "NVFP4: 32 NVFP4 weights" in out
    assert read_modelopt_checkpoint(tmp_path / "ck")["model.layers.0.mlp.experts.3.down_proj.input_scale"].item() > 0
    assert cli_main(["export", "--model", str(src), "--out", str(tmp_path / "ck2"), "--format", "nvfp4"]) == 2
    assert "needs --calib" in capsys.readouterr().err
    assert cli_main(["export", "--model", str(src), "--out", str(tmp_path / "ck")]) == 2
    assert "not an empty directory" in capsys.readouterr().err


def _export_error(capsys, argv, match):
    """Exit status 2, one line 'quads export: error: ...' (no doubled prefix), no traceback."""
    rc = cli_main(["export", *argv])
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if "error:" in l.lower()]
    assert rc == 2, (argv, err)
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in err, (argv, err)
    assert lines[0].startswith("quads export: error:") and "error: export:" not in lines[0], lines[0]


def test_cli_export_bad_inputs_exit_2_before_any_work(tmp_path, capsys, monkeypatch):
    """Each bad input (33 of them, an unwritable --out included) is one line, exit 2, before
    any work: no raw traceback, no refusal after the work is done."""
    import quads.integrations.modelopt.export as export_module

    src = tmp_path / "trainer"
    build("llama").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    calib = tmp_path / "calib.txt"
    calib.write_text("12+34=\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((src / "config.json").read_text())
    truncated = tmp_path / "truncated"
    build("llama").save_pretrained(truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    out = str(tmp_path / "out")
    reached = []
    monkeypatch.setattr(export_module, "export_modelopt", lambda *a, **k: reached.append(1) or pytest.fail("ran"))
    cases = [
        (["--model", str(tmp_path / "missing"), "--out", out], "does not exist"),
        (["--model", str(empty), "--out", out], "has no config.json"),
        (["--model", str(a_file), "--out", out], "is not a directory"),
        (["--model", str(corrupt), "--out", out], "not a readable JSON config"),
        (["--model", str(noweights), "--out", out], "has no weights"),
        (["--model", str(truncated), "--out", out], "could not load a causal LM"),
        (["--model", str(src), "--out", out, "--format", "nvfp4", "--calib", str(tmp_path / "none.txt")],
         "cannot read prompts"),
        (["--model", str(src), "--out", out, "--format", "nvfp4", "--calib", str(empty)], "cannot read prompts"),
        (["--model", str(src), "--out", out, "--calib", str(calib)], "drop --calib"),
        (["--model", str(src), "--out", str(a_file / "sub" / "out")], "is not a directory"),
        (["--model", str(src), "--out", str(link)], "symbolic link"),
        (["--model", str(src), "--out", str(a_file)], "not an empty directory"),
    ]
    for argv, match in cases:
        _export_error(capsys, argv, match)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["export", "--model", str(src), "--out", out, "--extra-skip", "(["])
    assert exit_.value.code == 2 and "not a valid regular expression" in capsys.readouterr().err
    assert not reached and not (tmp_path / "out").exists()
    assert sorted(p.name for p in target.iterdir()) == []


def test_cli_export_model_errors_are_one_line_exit_2(tmp_path, capsys):
    """A model the export cannot convert (K not a multiple of 16) is one line, exit 2, no
    'export: export:' prefix, and no temporary directory is left."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import COMMON

    src = tmp_path / "k24"
    LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 1}, intermediate_size=24)).save_pretrained(src)
    _export_error(capsys, ["--model", str(src), "--out", str(tmp_path / "out")], "not a multiple of 16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k24"]


def test_killed_export_leaves_a_temp_dir_the_next_run_removes(tmp_path):
    """A SIGKILL during the write leaves a hidden .out.XXXX directory: the next export to the
    same --out removes a dead export's directory and keeps a live one's."""
    import subprocess
    import sys

    from quads.integrations.modelopt.export import stale_temp_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = tmp_path / f".ck.quads-export-{dead_pid}.abc123"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"partial")
    alive = tmp_path / f".ck.quads-export-{os.getpid()}.def456"
    alive.mkdir()
    other = tmp_path / ".ckx.quads-export-1.zzz"
    other.mkdir()
    with pytest.warns(UserWarning, match="did not finish"):
        assert stale_temp_dirs(tmp_path / "ck") == [alive]
    assert not left.exists() and alive.exists() and other.exists()
    with pytest.warns(UserWarning, match="did not finish"):
        left.mkdir()
        export_modelopt(build("llama"), tmp_path / "ck", "w4a16")
    assert not left.exists() and (tmp_path / "ck" / "config.json").exists()


def test_index_file_cannot_point_outside_the_checkpoint(tmp_path):
    """read_modelopt_checkpoint refuses ../ and absolute paths in an index file."""
    import json as json_

    ck = tmp_path / "ck"
    export_modelopt(build("llama"), ck, "w4a16")
    shard = next(ck.glob("*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(shard.read_bytes())
    (ck / "link.safetensors").symlink_to(outside)
    for name in ("../outside.safetensors", str(outside), "link.safetensors"):
        (ck / "model.safetensors.index.json").write_text(json_.dumps({"weight_map": {"x": name}}))
        with pytest.raises(ValueError, match="outside the checkpoint|not a file name inside"):
            read_modelopt_checkpoint(ck)
