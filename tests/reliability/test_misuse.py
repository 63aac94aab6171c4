"""Plausible mistakes with the public API and the CLI: each is refused before anything changes,
with an error of the stated type whose message is ONE line naming the culprit (the module, field
or argument), and the models and files involved are unchanged; or the call is valid and says so.

Each case builds its own tiny models (tests/tiny_models.py), so a refusal that changed a model
is caught by :func:`tests.model_state.assert_unchanged`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import quads
from quads import QuadsPolicy
from quads.cli import main
from quads.tensor import load_safetensors, save_safetensors
from tests.model_state import assert_unchanged, snapshot
from tests.tiny_models import build

P = QuadsPolicy


def _trainer(kind="llama", seed=0, **kw):
    model = build(kind, seed)
    quads.quantize_(model, P(side="trainer", **kw))
    return model


def _rollout(kind="llama", seed=0, **kw):
    model = build(kind, seed)
    quads.quantize_(model, P(side="rollout", **kw))
    return model


def _refused(call, error, *culprits, models=()):
    """``call()`` raises ``error`` with a one-line message naming every culprit, and no model of
    ``models`` changed; returns the exception."""
    before = [snapshot(m) for m in models]
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, f"{len(message.splitlines())} lines: {message[:300]}"
    for culprit in culprits:
        assert culprit in message, (culprit, message)
    for m, b in zip(models, before):
        assert_unchanged(b, m)
    return caught.value


# -- QuadsPolicy: every field checked where it is made -----------------------------------------

@pytest.mark.parametrize("fields, error, culprit", [
    (dict(side="both"), ValueError, "QuadsPolicy.side"),
    (dict(side="rollout", scope="experts"), ValueError, "QuadsPolicy.scope"),
    (dict(side="rollout", kernel="fastest"), ValueError, "QuadsPolicy.kernel"),
    (dict(side="rollout", weight_global_scale="row"), ValueError, "QuadsPolicy.weight_global_scale"),
    (dict(side="rollout", weight_block_scaling=6), ValueError, "QuadsPolicy.weight_block_scaling"),
    (dict(side="rollout", activations="fp8"), ValueError, "QuadsPolicy.activations"),
    (dict(side="rollout", skip_patterns="lm_head"), TypeError, "QuadsPolicy.skip_patterns"),
    (dict(side="rollout", extra_skip_patterns=("[",)), ValueError, "bad skip pattern '['"),
    (dict(side="rollout", residual_fraction=1.5), ValueError, "QuadsPolicy.residual_fraction"),
    (dict(side="rollout", activation_granularity="col"), ValueError, "QuadsPolicy.activation_granularity"),
    (dict(side="rollout", skip_first_layers=-1), ValueError, "QuadsPolicy.skip_first_layers"),
    (dict(side="rollout", skip_last_layers=True), ValueError, "QuadsPolicy.skip_last_layers"),
    # rollout-only fields on a trainer policy would be ignored silently
    (dict(side="trainer", residual_fraction=0.5), ValueError, "QuadsPolicy.residual_fraction=0.5 is a rollout-side"),
    (dict(side="trainer", residual_selection="static"), ValueError, "QuadsPolicy.residual_selection='static' is a"),
    (dict(side="trainer", kernel="fast"), ValueError, "QuadsPolicy.kernel='fast' is a rollout-side field"),
])
def test_policy_field(fields, error, culprit):
    _refused(lambda: P(**fields), error, culprit)


def test_policy_defaults_on_both_sides_are_valid():
    assert P(side="trainer", residual_fraction=1).residual_fraction == 1.0  # the default, as an int: valid
    assert P(side="rollout", residual_fraction=0.5, kernel="fast").kernel == "fast"


# -- quantize_: all or nothing, the module named ----------------------------------------------

def test_quantize_a_state_dict():
    sd = build("llama").state_dict()
    _refused(lambda: quads.quantize_(sd, P(side="rollout")), TypeError, "state dict")


def test_quantize_with_a_preset_name():
    model = build("llama")
    _refused(lambda: quads.quantize_(model, "quads"), TypeError, "QuadsPolicy", models=[model])


def test_quantize_twice():
    model = _trainer()
    _refused(lambda: quads.quantize_(model, P(side="trainer")), ValueError, "already quantized", models=[model])


def test_quantize_with_a_filter_that_matches_nothing():
    model = build("llama")
    _refused(lambda: quads.quantize_(model, P(side="rollout"), filter_fn=lambda m, n: False), ValueError,
             "matched no module", models=[model])


def test_quantize_k_not_a_multiple_of_16():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(20, 32)).bfloat16()
    _refused(lambda: quads.quantize_(model, P(side="rollout")), ValueError, "1", "16", models=[model])


def test_quantize_a_nan_weight():
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    _refused(lambda: quads.quantize_(model, P(side="rollout")), ValueError, "model.layers.1.mlp.down_proj",
             models=[model])


def test_quantize_routed_experts_scope_on_a_dense_model():
    model = build("llama")
    _refused(lambda: quads.quantize_(model, P(side="rollout", scope="routed_experts")), ValueError,
             "routed_experts", models=[model])


def test_quantize_more_boundary_layers_than_the_model_has():
    model = build("llama")
    _refused(lambda: quads.quantize_(model, P(side="rollout", skip_first_layers=2, skip_last_layers=1)), ValueError,
             "skip_first_layers", models=[model])


def test_quantize_a_module_with_an_instance_forward():
    model = build("llama")
    layer = model.model.layers[0].self_attn.q_proj
    layer.forward = lambda x: x
    _refused(lambda: quads.quantize_(model, P(side="rollout")), TypeError, "model.layers.0.self_attn.q_proj",
             "instance-level forward", models=[model])


# -- sync_weights_: the roles, the plans, one line for many layers ---------------------------

def test_sync_with_the_arguments_swapped():
    trainer, rollout = _trainer(), _rollout()
    _refused(lambda: quads.sync_weights_(trainer, rollout), ValueError,
             "the arguments look swapped: it is sync_weights_(rollout, trainer)", models=[trainer, rollout])


def test_sync_from_a_rollout():
    rollout, other = _rollout(), _rollout(seed=1)
    _refused(lambda: quads.sync_weights_(rollout, other), ValueError, "trainer_model holds packed NVFP4 weights",
             models=[rollout, other])


def test_sync_from_a_never_quantized_trainer():
    trainer, rollout = build("llama"), _rollout()
    _refused(lambda: quads.sync_weights_(rollout, trainer), ValueError, "trainer_model has no quads layers",
             "plain_trainer=True", models=[trainer, rollout])


def test_sync_from_a_plain_trainer_when_asked_is_valid():
    """The BF16-trainer plans (``naive``): the masters are the forward weights."""
    trainer, rollout = build("llama"), _rollout(seed=1)
    assert quads.sync_weights_(rollout, trainer, plain_trainer=True) == len(list(rollout.parameters()))


def test_sync_with_another_global_scale_mode_is_one_line_with_the_list_on_the_error():
    trainer, rollout = _trainer(weight_global_scale="tensor"), _rollout()
    err = _refused(lambda: quads.sync_weights_(rollout, trainer), ValueError, "weight_global_scale='group'",
                   "'tensor'", "model.layers.0.self_attn.q_proj", ".problems", models=[trainer, rollout])
    assert len(err.problems) == 14 and all("weight_global_scale" in p for p in err.problems)


def test_sync_with_another_block_scaling():
    trainer, rollout = _trainer(weight_block_scaling="4over6"), _rollout()
    _refused(lambda: quads.sync_weights_(rollout, trainer), ValueError, "weight_block_scaling", models=[rollout])


def test_sync_a_llama_rollout_from_an_moe_trainer():
    trainer, rollout = _trainer("qwen3_moe"), _rollout("llama")
    err = _refused(lambda: quads.sync_weights_(rollout, trainer), ValueError, "'llama' model", "'qwen3_moe'",
                   "build_rollout_model", models=[rollout])
    assert "strict=False" not in str(err)  # no advice that would sync two architectures


def test_sync_sides_converted_with_different_plans():
    trainer, rollout = _trainer("qwen3_moe", skip_first_layers=1), _rollout("qwen3_moe")
    _refused(lambda: quads.sync_weights_(rollout, trainer), ValueError, "skip_first_layers=1", models=[rollout])


def test_sync_a_wider_rollout_lists_every_layer_on_the_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import COMMON

    trainer = _trainer()
    wide = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=128)).bfloat16()
    quads.quantize_(wide, P(side="rollout"))
    err = _refused(lambda: quads.sync_weights_(wide, trainer), ValueError, "model.layers.0.mlp.gate_proj.weight has "
                   "shape", models=[wide])
    assert len(err.problems) == 6


def test_sync_a_nan_master():
    trainer, rollout = _trainer(), _rollout()
    with torch.no_grad():
        trainer.model.norm.weight[0] = float("nan")
    _refused(lambda: quads.sync_weights_(rollout, trainer), ValueError, "model.norm.weight", models=[rollout])


def test_sync_from_a_state_dict():
    rollout = _rollout()
    _refused(lambda: quads.sync_weights_(rollout, build("llama").state_dict()), TypeError, "trainer_model",
             models=[rollout])


def test_sync_strict_not_a_bool():
    trainer, rollout = _trainer(), _rollout()
    _refused(lambda: quads.sync_weights_(rollout, trainer, strict="yes"), TypeError, "strict", models=[rollout])


# -- presets and rollout copies -----------------------------------------------------------------

def test_unknown_preset_name():
    from quads.policies import get_preset

    _refused(lambda: get_preset("quadz"), ValueError, "'quadz'")


def test_one_policy_where_a_pair_is_expected():
    from quads.policies import get_preset

    _refused(lambda: get_preset(P(side="rollout")), TypeError, "(trainer, rollout) pair")


def test_build_a_rollout_with_a_trainer_policy():
    from quads.policies import build_rollout_model

    trainer = _trainer()
    _refused(lambda: build_rollout_model(trainer, P(side="trainer")), ValueError, "side='trainer'", models=[trainer])


# -- loading a checkpoint into the wrong model kind ---------------------------------------------

@pytest.fixture
def rollout_file(tmp_path):
    path = tmp_path / "rollout.safetensors"
    save_safetensors(_rollout(seed=3).state_dict(), str(path))
    return str(path)


def test_load_a_rollout_checkpoint_into_a_trainer(rollout_file):
    trainer = _trainer()
    state = load_safetensors(rollout_file)
    _refused(lambda: trainer.load_state_dict(state), ValueError, "nothing was loaded",
             "model.layers.0.self_attn.q_proj.weight is a packed NVFP4 weight", models=[trainer])


def test_load_a_rollout_checkpoint_into_a_plain_model(rollout_file):
    plain = build("llama")
    state = load_safetensors(rollout_file)
    _refused(lambda: plain.load_state_dict(state), ValueError, "packed NVFP4", models=[plain])


def test_load_a_rollout_checkpoint_into_a_plain_model_non_strict(rollout_file):
    plain = build("llama")
    state = load_safetensors(rollout_file)
    _refused(lambda: plain.load_state_dict(state, strict=False), ValueError,
             "model.layers.0.self_attn.q_proj.weight is a packed NVFP4 weight", "quantize_", models=[plain])


def test_load_a_rollout_file_read_without_quads_into_a_plain_model(rollout_file):
    from safetensors.torch import load_file

    plain = build("llama")
    _refused(lambda: plain.load_state_dict(load_file(rollout_file), strict=False), ValueError,
             "model.layers.0.self_attn.q_proj.weight.qdata", "load_safetensors", models=[plain])


def test_load_a_rollout_checkpoint_into_a_rollout_of_another_scope():
    """The attention a scoped rollout keeps dense would receive the dequantized weights."""
    full = _rollout("qwen3_moe", seed=3)
    scoped = _rollout("qwen3_moe", scope="routed_experts")
    _refused(lambda: scoped.load_state_dict(full.state_dict()), ValueError,
             "model.layers.0.self_attn.q_proj.weight is a packed NVFP4 weight", models=[scoped])


def test_load_a_per_tensor_scale_checkpoint_into_a_group_rollout(tmp_path):
    path = tmp_path / "tensor.safetensors"
    save_safetensors(_rollout(weight_global_scale="tensor").state_dict(), str(path))
    rollout = _rollout()
    state = load_safetensors(str(path))
    _refused(lambda: rollout.load_state_dict(state), ValueError, "sibling group", "weight_global_scale='tensor'",
             "Nothing was loaded", models=[rollout])


def test_load_a_nan_value_into_a_rollout():
    rollout = _rollout()
    state = build("llama").state_dict()
    state["model.norm.weight"][0] = float("nan")
    _refused(lambda: rollout.load_state_dict(state), ValueError, "model.norm.weight", models=[rollout])


def test_load_safetensors_of_a_missing_file(tmp_path):
    _refused(lambda: load_safetensors(str(tmp_path / "nope.safetensors")), FileNotFoundError, "nope.safetensors")


def test_load_safetensors_of_a_corrupt_file(rollout_file):
    data = bytearray(Path(rollout_file).read_bytes())
    data[-5] ^= 0xFF
    Path(rollout_file).write_bytes(bytes(data))
    _refused(lambda: load_safetensors(rollout_file), ValueError, "rollout.safetensors")


# -- QuadsGRPOTrainer: every argument checked before TRL touches the model ------------------------

trl = pytest.importorskip("trl")


def _grpo(tmp_path, model, args=None, **kwargs):
    from trl import GRPOConfig

    from quads.integrations.trl import QuadsGRPOTrainer

    args = args or GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1,
                              per_device_train_batch_size=2, num_generations=2)
    return QuadsGRPOTrainer(model, lambda completions, **k: [0.0] * len(completions), args, **kwargs)


@pytest.mark.parametrize("kwargs, error, culprit", [
    (dict(rollout_dtype=torch.int8), ValueError, "rollout_dtype"),
    (dict(decompose_mismatch="yes"), TypeError, "decompose_mismatch"),
    (dict(rollout_corr_metrics=1), TypeError, "rollout_corr_metrics"),
    (dict(graphed_decode="auto"), TypeError, "graphed_decode"),
    (dict(quads_policy="quadz"), ValueError, "'quadz'"),
    (dict(peft_config=object()), NotImplementedError, "peft_config"),
])
def test_grpo_trainer_argument(tmp_path, kwargs, error, culprit):
    model = build("llama")
    _refused(lambda: _grpo(tmp_path, model, **kwargs), error, culprit, models=[model])


def test_grpo_trainer_with_use_vllm(tmp_path):
    from trl import GRPOConfig

    model = build("llama")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], use_vllm=True,
                      per_device_train_batch_size=2, num_generations=2)
    _refused(lambda: _grpo(tmp_path, model, args), ValueError, "use_vllm=False", "QuadsVLLMGRPOTrainer",
             models=[model])


def test_grpo_trainer_of_a_model_quantized_with_another_global_scale(tmp_path):
    """A plan mismatch is found at construction, not at the first sync inside ``train()``."""
    model = _trainer(weight_global_scale="tensor")
    _refused(lambda: _grpo(tmp_path, model), ValueError, "already quantized", "weight_global_scale='group'",
             models=[model])


def test_grpo_trainer_of_a_rollout_model(tmp_path):
    model = _rollout()
    _refused(lambda: _grpo(tmp_path, model), ValueError, "side(s) ['rollout']", models=[model])


def test_grpo_trainer_argument_that_differs_from_its_config(tmp_path):
    from quads.integrations.trl import QuadsGRPOConfig

    model = build("llama")
    args = QuadsGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], quads_policy="w4a16",
                           per_device_train_batch_size=2, num_generations=2)
    _refused(lambda: _grpo(tmp_path, model, args, quads_policy="quads"), ValueError, "quads_policy='quads'",
             "QuadsGRPOConfig.quads_policy='w4a16'", models=[model])


# -- the command line: exit status 2, one error line, nothing written ------------------------------

@pytest.mark.parametrize("argv, culprit", [
    (["--bogus"], "--bogus"),
    (["diagnose", "--plans", "quadz"], "quadz"),
    (["diagnose", "--threads", "0"], "--threads"),
    (["diagnose", "--device", "tpu"], "tpu"),
    (["diagnose", "--temperature", "nan"], "--temperature"),
    (["demo", "--residual-fraction", "2"], "--residual-fraction"),
    (["export", "--model", "MISSING", "--out", "OUT"], "MISSING"),
    (["export", "--model", "quads/assets/tiny-moe-arith", "--out", "OUT", "--format", "nvfp4"], "--calib"),
])
def test_cli(argv, culprit, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(quads.__file__).resolve().parents[1])
    argv = [str(tmp_path / "out") if a == "OUT" else str(tmp_path / "missing") if a == "MISSING" else a
            for a in argv]
    culprit = str(tmp_path / "missing") if culprit == "MISSING" else culprit
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if "error" in l]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert culprit in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
