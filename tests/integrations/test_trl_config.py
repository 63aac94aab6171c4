"""``QuadsGRPOConfig``: the QuadsGRPOTrainer options as TRL config fields (YAML, ``TrlParser``),
read by the trainer; the trainer's state says no vLLM runs; the metrics TRL already logs are
aliases, one number under two names. Real TRL, the tiny model of test_trl_integration."""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import TrlParser  # noqa: E402

import quads  # noqa: E402
from quads.integrations.trl import POLICY_PRESETS, QuadsGRPOConfig, QuadsGRPOTrainer  # noqa: E402
from quads.integrations.trl.metrics import TRL_ALIASES  # noqa: E402
from quads.tasks import make_prompts, make_tokenizer  # noqa: E402
from tests.integrations.test_trl_integration import reward_digit_ones, tiny_model  # noqa: E402
from tests.model_state import assert_unchanged, snapshot  # noqa: E402

BASE = dict(use_cpu=True, bf16=True, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
            max_steps=1, logging_steps=1, report_to=[], learning_rate=1e-2, save_strategy="no", seed=0,
            disable_tqdm=True)


def _config(tmp_path, **quads_fields) -> QuadsGRPOConfig:
    return QuadsGRPOConfig(output_dir=str(tmp_path / "out"), **BASE, **quads_fields)


def _trainer(args, **kwargs):
    tok = make_tokenizer()
    return QuadsGRPOTrainer(tiny_model(tok), reward_digit_ones, args, train_dataset=datasets.Dataset.from_list(
        make_prompts(16, seed=0)), processing_class=tok, **kwargs)


def test_trl_parser_reads_the_quads_fields_from_yaml_and_the_command_line(tmp_path):
    yaml = tmp_path / "grpo.yaml"
    yaml.write_text(f"output_dir: {tmp_path / 'out'}\nquads_policy: w4a16\nquads_rollout_dtype: float32\n"
                    "quads_decompose_mismatch: true\nquads_graphed_decode: false\nuse_cpu: true\n")
    (config,) = TrlParser((QuadsGRPOConfig,)).parse_args_and_config(
        args=["--config", str(yaml), "--quads_rollout_corr_metrics", "true", "--quads_kernel", "exact",
              "--quads_importance_sampling_clip_max", "2.5"])
    assert isinstance(config, QuadsGRPOConfig)
    assert (config.quads_policy, config.quads_rollout_dtype, config.quads_kernel) == ("w4a16", "float32", "exact")
    assert config.quads_decompose_mismatch is True and config.quads_graphed_decode is False
    assert config.quads_rollout_corr_metrics is True
    assert config.vllm_importance_sampling_clip_max == 2.5  # the engine-neutral name sets TRL's field
    options = config.quads_trainer_options()
    assert options["quads_policy"] == POLICY_PRESETS["w4a16"] and options["rollout_dtype"] is torch.float32


@pytest.mark.parametrize("fields, culprit", [
    (dict(quads_policy="quadz"), "QuadsGRPOConfig.quads_policy: unknown preset 'quadz'"),
    (dict(quads_kernel="fastest"), "QuadsGRPOConfig.quads_kernel must be one of"),
    (dict(quads_rollout_dtype="bf16"), "QuadsGRPOConfig.quads_rollout_dtype must be one of"),
    (dict(quads_residual_fraction=1.5), "QuadsGRPOConfig.quads_residual_fraction must be a number in [0, 1]"),
    (dict(quads_policy="bf16", quads_kernel="fast"), "QuadsGRPOConfig.quads_kernel: preset 'bf16' has no"),
    (dict(quads_policy="w4a16", quads_residual_fraction=0.5), "QuadsGRPOConfig.quads_residual_fraction: preset"),
    (dict(quads_importance_sampling_clip_max=2.0, vllm_importance_sampling_clip_max=4.0),
     "quads_importance_sampling_clip_max=2.0 and vllm_importance_sampling_clip_max=4.0"),
])
def test_a_bad_field_is_one_line_naming_it(tmp_path, fields, culprit):
    with pytest.raises(ValueError) as err:
        _config(tmp_path, **fields)
    assert culprit in str(err.value) and "\n" not in str(err.value)


def test_trainer_built_from_the_config_trains_a_step_and_says_no_vllm_runs(tmp_path):
    args = _config(tmp_path, quads_policy="quads", quads_residual_fraction=0.5, quads_rollout_corr_metrics=True)
    trainer = _trainer(args)
    fractions = {m.quads_policy.residual_fraction for m in quads.quantized_modules(trainer.rollout_model).values()}
    assert fractions == {0.5} and trainer.quads_preset.name == "quads-50"
    assert trainer.quads_rollout_corr is True
    # truthful state: no vLLM, the quads engine is the one TRL's engine path runs
    assert trainer.use_vllm is False and args.use_vllm is False
    assert trainer.generation_engine == "quads" and trainer.quads_engine is trainer.vllm_generation
    trainer.train()
    assert trainer.use_vllm is False
    (h,) = [h for h in trainer.state.log_history if "reward" in h]
    assert "sampling/importance_sampling_ratio/mean" in h  # TRL's correction ran on the engine's log-probs
    assert math.isfinite(h["rollout_corr/kl"])
    for quads_name, trl_name in TRL_ALIASES.items():  # aliases: the same number, not a recomputation
        assert h[quads_name] == h[trl_name], quads_name


def test_constructor_arguments_still_work_and_a_conflict_is_one_line(tmp_path):
    tok_model = tiny_model(make_tokenizer())
    before = snapshot(tok_model)
    args = _config(tmp_path, quads_policy="w4a16")
    with pytest.raises(ValueError) as err:
        QuadsGRPOTrainer(tok_model, reward_digit_ones, args, quads_policy="naive")
    assert str(err.value) == ("QuadsGRPOTrainer(quads_policy='naive') differs from QuadsGRPOConfig.quads_policy="
                              "'w4a16'; set it in one place")
    assert_unchanged(before, tok_model)  # refused before the model was touched
    # the same value in both places, or a field left at its default: the constructor argument counts
    assert _trainer(args, quads_policy="w4a16").quads_preset.name == "w4a16"
    assert _trainer(_config(tmp_path), quads_policy="naive").quads_preset.name == "naive"
    with pytest.raises(ValueError, match=r"^QuadsGRPOTrainer\(decompose_mismatch=False\) differs from "
                                         r"QuadsGRPOConfig.quads_decompose_mismatch=True"):
        _trainer(_config(tmp_path, quads_decompose_mismatch=True), decompose_mismatch=False)
