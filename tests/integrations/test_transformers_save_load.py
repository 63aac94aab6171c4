"""quads models through transformers' own ``save_pretrained`` / ``from_pretrained``
(``quant_method="quads"``, quads.integrations.transformers): real transformers, tiny models,
every round trip bit for bit; tampered files and misuse refused in one line."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

import quads
from quads.integrations.transformers import QuadsConfig, QuadsHfQuantizer
from quads.policies.modules import RolloutModule, TrainerModule
from tests.tiny_models import build

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
KINDS = ["llama", "qwen3_moe", "mixtral"]


def _plain(tmp_path, kind, seed=0):
    """A plain BF16 checkpoint of ``kind``, and its directory."""
    path = tmp_path / f"plain-{kind}-{seed}"
    if not path.exists():
        build(kind, seed).save_pretrained(path)
    return path


def _load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw)


def _quantized(tmp_path, kind, side):
    """quads.quantize_ after a plain from_pretrained (the reference every load must equal)."""
    model = _load(_plain(tmp_path, kind))
    quads.quantize_(model, quads.QuadsPolicy(side=side))
    return model


def _assert_same(a, b):
    """Same classes, parameters (packed parts: qdata, scale bits, global scales), buffers, logits."""
    assert [type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        x, y = sa[k], sb[k]
        assert type(x) is type(y) and x.dtype == y.dtype, k
        if isinstance(x, quads.NVFP4Tensor):
            assert x.orig_dtype == y.orig_dtype and x.transposed == y.transposed, k
            for p, q in zip(x.parts, y.parts):
                assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                                   q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q), k
        else:
            assert torch.equal(x, y), k
    for (n, x), (m, y) in zip(a.named_buffers(), b.named_buffers()):
        assert n == m and x.dtype == y.dtype and torch.equal(x, y), n
    policies = {m.quads_policy for m in b.modules() if isinstance(m, (RolloutModule, TrainerModule))}
    assert policies == {m.quads_policy for m in a.modules() if isinstance(m, (RolloutModule, TrainerModule))}
    with torch.no_grad():
        assert torch.equal(a(IDS).logits, b(IDS).logits)


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_save_pretrained_from_pretrained_is_bit_exact(kind, tmp_path):
    rollout = _quantized(tmp_path, kind, "rollout")
    rollout.save_pretrained(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "quads" and config["format_version"] == 1
    assert config["policy"]["side"] == "rollout" and set(config["policy"]) == set(
        f.name for f in quads.QuadsPolicy.__dataclass_fields__.values())
    assert sorted(os.listdir(tmp_path / "r")) == ["config.json", "generation_config.json", "model.safetensors"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "r")  # no arguments: the checkpoint says it all
    assert isinstance(back.hf_quantizer, QuadsHfQuantizer) and back.config.quantization_config.policy.side == "rollout"
    _assert_same(rollout, back)
    back.save_pretrained(tmp_path / "again")  # and saves the same file again (header and tensor bytes)
    assert _header_and_data(tmp_path / "again") == _header_and_data(tmp_path / "r")


def _header_and_data(folder):
    raw = (folder / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + size]), raw[8 + size:]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_trainer_save_pretrained_from_pretrained_is_bit_exact(kind, tmp_path):
    trainer = _quantized(tmp_path, kind, "trainer")
    trainer.save_pretrained(tmp_path / "t")
    assert json.loads((tmp_path / "t" / "config.json").read_text())["quantization_config"]["policy"]["side"] == "trainer"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    assert isinstance(back.model.layers[0].self_attn.q_proj, TrainerModule)
    _assert_same(trainer, back)


@pytest.mark.parametrize("side", ["trainer", "rollout"])
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_quads_config_quantizes_a_plain_checkpoint_at_load(kind, side, tmp_path):
    policy = quads.QuadsPolicy(side=side, extra_skip_patterns=(r"layers\.1\.self_attn\.o_proj$",))
    loaded = _load(_plain(tmp_path, kind), quantization_config=QuadsConfig(policy))
    ours = _load(_plain(tmp_path, kind))
    quads.quantize_(ours, policy)
    _assert_same(ours, loaded)
    assert loaded.config.quantization_config.policy == policy


def test_policy_round_trips_through_config_json_field_by_field(tmp_path):
    policy = quads.QuadsPolicy(side="rollout", residual_fraction=0.5, activation_granularity="tensor",
                               extra_skip_patterns=("x$", "y$"), weight_global_scale="tensor",
                               weight_block_scaling="4over6", activation_block_scaling="4over6",
                               skip_last_layers=1)
    written = json.loads(json.dumps(QuadsConfig(policy).to_dict()))
    assert QuadsConfig.from_dict(written).policy == policy
    rollout = _load(_plain(tmp_path, "llama"), quantization_config=QuadsConfig(policy))
    rollout.save_pretrained(tmp_path / "r")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    assert back.config.quantization_config.policy == policy
    _assert_same(rollout, back)


def _tamper(path, tensor, offset=0):
    """Flip one byte of ``tensor``'s data in a safetensors file."""
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8:8 + size])[tensor]["data_offsets"][0]
    raw[8 + size + start + offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("part", ["qdata", "scale"])
def test_a_tampered_rollout_checkpoint_is_refused_naming_tensor_and_file(part, tmp_path):
    _quantized(tmp_path, "qwen3_moe", "rollout").save_pretrained(tmp_path / "r")
    name = f"model.layers.1.mlp.experts.down_proj.{part}"
    _tamper(tmp_path / "r" / "model.safetensors", name, offset=3)
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    message = str(err.value)
    assert "\n" not in message and name in message and str(tmp_path / "r" / "model.safetensors") in message, message


def test_a_nonfinite_dense_value_in_a_rollout_checkpoint_is_refused(tmp_path):
    """A NaN written with a matching checksum (a bad save, not a flipped bit) is still refused."""
    from quads.tensor import load_safetensors, save_safetensors

    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / "model.safetensors"
    state = load_safetensors(path)
    state["model.norm.weight"] = state["model.norm.weight"].clone()
    state["model.norm.weight"][0] = float("nan")
    save_safetensors(state, path)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r")


def test_torchao_trainer_and_rollout_save_so_that_a_plain_load_keeps_them(tmp_path):
    pytest.importorskip("torchao")
    from transformers import TorchAoConfig

    import quads.integrations.torchao  # noqa: F401

    for side in ("trainer", "rollout"):
        policy = quads.QuadsPolicy(side=side)
        model = _load(_plain(tmp_path, "llama"), quantization_config=TorchAoConfig(policy))
        model.save_pretrained(tmp_path / side)
        assert isinstance(model.config.quantization_config, TorchAoConfig)  # the model keeps its own config
        back = AutoModelForCausalLM.from_pretrained(tmp_path / side)
        assert isinstance(back.config.quantization_config, QuadsConfig)
        _assert_same(model, back)


def test_a_rollout_checkpoint_into_another_architecture_is_refused(tmp_path):
    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match=r"a quads checkpoint of LlamaForCausalLM cannot load into Qwen3MoeForCausalLM"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path / "r")


def test_a_policy_field_unknown_to_this_version_is_refused_by_name(tmp_path):
    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    config["quantization_config"]["policy"]["residual_bits"] = 3
    (tmp_path / "r" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"field 'residual_bits' is unknown to this quads version"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    config["quantization_config"]["policy"].pop("residual_bits")
    config["quantization_config"]["policy"]["residual_selection"] = "top"
    (tmp_path / "r" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"QuadsPolicy\.residual_selection"):  # the policy's own error
        AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    config["quantization_config"]["policy"]["residual_selection"] = "per_token"
    config["quantization_config"]["format_version"] = 2
    (tmp_path / "r" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"format_version 2 is newer than this quads reads \(1\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r")


def test_a_static_residual_rollout_is_refused_before_anything_is_written(tmp_path):
    rollout = _load(_plain(tmp_path, "llama"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", residual_selection="static"))
    with pytest.raises(ValueError, match=r"residual_selection='static'"):
        rollout.save_pretrained(tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_checkpoint_of_another_side_than_asked_is_refused(tmp_path):
    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match=r"holds a quads rollout with side='rollout'.*asks for side='trainer'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r",
                                             quantization_config=QuadsConfig(quads.QuadsPolicy(side="trainer")))
    same = AutoModelForCausalLM.from_pretrained(tmp_path / "r",
                                                quantization_config=QuadsConfig(quads.QuadsPolicy(side="rollout")))
    assert isinstance(same.model.layers[0].self_attn.q_proj, RolloutModule)


def test_unsupported_device_maps_and_dtypes_are_refused(tmp_path):
    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match=r"device_map='auto' is not supported"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r", device_map="auto")
    with pytest.raises(ValueError, match=r"device_map over \['cpu', 'disk'\] is not supported"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r", device_map={"model": "cpu", "lm_head": "disk"})
    with pytest.raises(ValueError, match=r"dtype=torch.float64 is not supported"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"is torch.bfloat16 in the checkpoint, torch.float32 in the model"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r", dtype=torch.float32)


def test_save_pretrained_replaces_a_planted_symlink_and_leaves_no_temporary(tmp_path):
    rollout = _quantized(tmp_path, "llama", "rollout")
    out = tmp_path / "r"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (out / "model.safetensors").symlink_to(victim)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # an earlier sharded save
    rollout.save_pretrained(out)
    assert victim.read_bytes() == b"keep" and not (out / "model.safetensors").is_symlink()
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    _assert_same(rollout, AutoModelForCausalLM.from_pretrained(out))


def test_rollout_save_pretrained_refuses_what_it_cannot_write_before_writing(tmp_path):
    rollout = _quantized(tmp_path, "llama", "rollout")
    with pytest.raises(ValueError, match=r"state_dict= is not supported"):
        rollout.save_pretrained(tmp_path / "r", state_dict=rollout.state_dict())
    with pytest.raises(TypeError, match=r"does not take max_shard_size="):
        rollout.save_pretrained(tmp_path / "r", max_shard_size="1MB")
    assert not (tmp_path / "r").exists()


def test_import_quads_stays_light_and_registers_with_transformers_in_either_order():
    code = ("import sys, quads; assert 'transformers' not in sys.modules; "
            "from transformers import AutoModelForCausalLM; from transformers.quantizers import auto; "
            "assert auto.AUTO_QUANTIZER_MAPPING['quads'].__name__ == 'QuadsHfQuantizer'")
    other = ("import transformers.modeling_utils; import quads; from transformers.quantizers import auto; "
             "assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING['quads'].__name__ == 'QuadsConfig'")
    for src in (code, other):
        run = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(quads.__file__)))
        assert run.returncode == 0, run.stderr[-2000:]


def test_a_loaded_rollout_is_refreshed_before_it_is_returned(tmp_path):
    """load_state_dict writes the packed parts in place (their versions move); the load then runs
    every rollout module's quads_weights_changed, so what the kernels read is current before any
    forward (nothing is left for a forward to notice)."""
    _quantized(tmp_path, "qwen3_moe", "rollout").save_pretrained(tmp_path / "r")
    refreshed = []
    original = RolloutModule.quads_weights_changed

    def counting(self):
        refreshed.append(self)
        return original(self)

    RolloutModule.quads_weights_changed = counting
    try:
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    finally:
        RolloutModule.quads_weights_changed = original
    rollouts = [m for m in back.modules() if isinstance(m, RolloutModule)]
    assert rollouts
    seen = {id(m) for m in refreshed}
    assert all(id(m) in seen for m in rollouts)  # every module refreshed after its weights were loaded


def test_trainer_save_pretrained_writes_the_state_dict_it_is_given(tmp_path):
    """A trainer's save passes ``state_dict=`` to transformers (Trainer and FSDP saves hand one over)."""
    trainer = _quantized(tmp_path, "llama", "trainer")
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    state["model.norm.weight"] += 1
    trainer.save_pretrained(tmp_path / "t", state_dict=state)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    assert torch.equal(back.model.norm.weight, state["model.norm.weight"])
    assert not torch.equal(back.model.norm.weight, trainer.model.norm.weight)


def test_quads_export_takes_a_quads_trainer_checkpoint_and_refuses_a_rollout(tmp_path, capsys):
    """The commands that take BF16 masters (``quads export``, ``quads diagnose``) read a quads
    trainer checkpoint's masters as a plain checkpoint's; a rollout's packed weights are refused."""
    from safetensors.torch import load_file

    from quads.cli import main

    _quantized(tmp_path, "llama", "trainer").save_pretrained(tmp_path / "t")
    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    assert main(["export", "--model", str(_plain(tmp_path, "llama")), "--out", str(tmp_path / "o1")]) == 0
    assert main(["export", "--model", str(tmp_path / "t"), "--out", str(tmp_path / "o2")]) == 0
    a, b = load_file(tmp_path / "o1" / "model.safetensors"), load_file(tmp_path / "o2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert main(["export", "--model", str(tmp_path / "r"), "--out", str(tmp_path / "o3")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "holds a quads rollout checkpoint" in err[0], err


def test_a_rollout_checkpoint_loaded_without_quads_fails_in_one_line(tmp_path):
    """Without quads' quantizer transformers would initialise the packed weights randomly (its
    load report only); the rollout's config.json makes that load fail first, in one line. A
    trainer checkpoint (BF16 masters) still loads as a plain model."""
    from quads.integrations.transformers.config import PLAIN_LOAD_REFUSAL

    _quantized(tmp_path, "llama", "rollout").save_pretrained(tmp_path / "r")
    _quantized(tmp_path, "llama", "trainer").save_pretrained(tmp_path / "t")
    assert json.loads((tmp_path / "r" / "config.json").read_text())["transformers_weights"] == PLAIN_LOAD_REFUSAL
    assert "transformers_weights" not in json.loads((tmp_path / "t" / "config.json").read_text())
    src = ("import sys; from transformers import AutoModelForCausalLM\n"
           "try:\n"
           f"    AutoModelForCausalLM.from_pretrained({str(tmp_path / 'r')!r})\n"
           "except ValueError as err:\n"
           "    print('REFUSED', str(err))\n"
           f"t = AutoModelForCausalLM.from_pretrained({str(tmp_path / 't')!r})\n"
           "print('TRAINER', type(t).__name__, 'quads' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1 and refused[0].endswith(PLAIN_LOAD_REFUSAL), run.stdout
    assert "TRAINER LlamaForCausalLM False" in run.stdout


def test_a_rollout_checkpoint_loaded_with_quantization_config_none_fails_in_one_line(tmp_path):
    rollout = _quantized(tmp_path, "llama", "rollout")
    rollout.save_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match=r"import quads before from_pretrained \(and pass no quantization_config=None"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "r", quantization_config=None)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "r")  # quads' quantizer drops the key before the load
    assert not hasattr(back.config, "transformers_weights")
    _assert_same(rollout, back)
    back.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (tmp_path / "r" / "config.json").read_text())
