"""QuadsGRPOTrainer with real TRL (no mocks): every policy preset trains, the rollout is synced
exactly after each optimizer step, the metrics reach TRL's logs, and on the embedded model the
QUADS rollout is closer to its trainer than the naive W4A4 rollout.

Tiny model, 2 GRPO steps of 4 sequences per preset; runs in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import quads  # noqa: E402
from quads.integrations.trl import (  # noqa: E402
    POLICY_PRESETS,
    QuadsGRPOTrainer,
    build_scoring_batch,
    copy_model,
    measure_policy_gap,
    score_teacher_forced,
)
from quads.policies.modules import RolloutExperts, RolloutLinear, TrainerExperts, TrainerLinear  # noqa: E402
from quads.policies.presets import preset_problem  # noqa: E402
from quads.tasks import make_prompts, make_tokenizer  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from tests.scale_reference import reference_forward_weight  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
QUADS_KEYS = [
    "sampling/quads/logp_gap_mean",
    "sampling/quads/logp_gap_p99",
    "sampling/quads/logp_gap_max",
    "sampling/quads/k3_kl",
    "sampling/quads/is_ratio_raw_min",
    "sampling/quads/is_ratio_raw_mean",
    "sampling/quads/is_ratio_raw_max",
    "sampling/quads/is_masked_fraction",
]


def tiny_model(tok, seed=0, experts="eager"):
    """A tiny Qwen3-MoE (all linear input dims multiples of 16), float32 masters, peaked outputs."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    cfg._experts_implementation = experts
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # default init is near-uniform; sharpen it so precision shows
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model.float()


def reward_digit_ones(completions, **kwargs):
    """A reward with variance on a random model: fraction of '1' characters."""
    return [c.count("1") / max(1, len(c)) for c in completions]


def make_trainer(policy, tmp_path, steps=2, lr=1e-2, decompose=False, rollout_corr=False, experts="eager", **cfg):
    tok = make_tokenizer()
    model = tiny_model(tok, experts=experts)
    ds = datasets.Dataset.from_list(make_prompts(16, seed=0))
    args = GRPOConfig(
        output_dir=str(tmp_path / (policy if isinstance(policy, str) else "custom")), use_cpu=True, bf16=True,
        per_device_train_batch_size=4,
        num_generations=2, max_completion_length=4, max_steps=steps, logging_steps=1, report_to=[],
        learning_rate=lr, save_strategy="no", seed=0, disable_tqdm=True, **cfg,
    )
    return QuadsGRPOTrainer(
        model, reward_digit_ones, args, train_dataset=ds, processing_class=tok,
        quads_policy=policy, decompose_mismatch=decompose, rollout_corr_metrics=rollout_corr,
    )


def test_verl_rollout_corr_names_are_logged_beside_trls(tmp_path):
    trainer = make_trainer("quads", tmp_path, steps=1, rollout_corr=True)
    trainer.train()
    (h,) = [h for h in trainer.state.log_history if "reward" in h]
    for key in QUADS_KEYS + ["rollout_corr/kl", "rollout_corr/chi2_seq", "rollout_corr/log_ppl_abs_diff"]:
        assert key in h and math.isfinite(h[key]), key
    assert h["rollout_corr/k3_kl"] == pytest.approx(h["sampling/quads/k3_kl"], rel=1e-9)  # the documented alias


@pytest.mark.parametrize("policy", ["bf16", "bf16-fp32-experts"])
def test_precision_probe_warns_once_for_fp32_experts_only(policy, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(policy, tmp_path, steps=1, experts="grouped_mm")
    lines = [str(w.message) for w in caught if "quads precision probe" in str(w.message)]
    if policy == "bf16":
        assert lines == []
    else:
        assert len(lines) == 1 and "model.layers.0.mlp.experts: trainer float32, rollout bfloat16" in lines[0]


def _sides(model):
    return {type(m).__mro__[1] for m in quads.quantized_modules(model).values()}


@pytest.mark.parametrize("policy", sorted(POLICY_PRESETS))
def test_policy_trains_and_logs_metrics(policy, tmp_path):
    preset = POLICY_PRESETS[policy]
    problem = preset_problem(preset, tiny_model(make_tokenizer()))
    if problem:  # a plan this 2-layer model cannot take (quads-boundary) is refused with the reason
        with pytest.raises(ValueError, match=re.escape(problem.partition(": ")[2])):
            make_trainer(policy, tmp_path)
        return
    trainer = make_trainer(policy, tmp_path, decompose=(policy in ("w4a16-qat", "quads-experts")))
    trainer_model = trainer.accelerator.unwrap_model(trainer.model)
    # the layers each side got
    if preset.trainer is None:
        assert not quads.quantized_modules(trainer_model)
    else:
        scoped = preset.trainer.scope == "routed_experts"
        assert _sides(trainer_model) == ({TrainerExperts} if scoped else {TrainerLinear, TrainerExperts})
        act = preset.trainer.activations
        assert all(m.quads_policy.activations == act for m in quads.quantized_modules(trainer_model).values())
    if preset.rollout is None:
        assert not quads.quantized_modules(trainer.rollout_model)
    else:
        scoped = preset.rollout.scope == "routed_experts"
        assert _sides(trainer.rollout_model) == ({RolloutExperts} if scoped else {RolloutLinear, RolloutExperts})
        fr = {m.quads_policy.residual_fraction for m in quads.quantized_modules(trainer.rollout_model).values()}
        assert fr == {preset.rollout.residual_fraction}
    assert trainer.rollout_model is not trainer_model

    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for h in logs:
        for key in QUADS_KEYS:
            assert key in h and math.isfinite(h[key]), key
        # TRL's own IS correction ran on the rollout log-probs (its vLLM-path metrics)
        assert "sampling/importance_sampling_ratio/mean" in h
        assert h["sampling/quads/logp_gap_mean"] == pytest.approx(h["sampling/sampling_logp_difference/mean"], rel=1e-4, abs=1e-6)
        assert h["sampling/quads/logp_gap_max"] == pytest.approx(h["sampling/sampling_logp_difference/max"], rel=1e-4, abs=1e-6)
        assert h["sampling/quads/logp_gap_mean"] <= h["sampling/quads/logp_gap_p99"] + 1e-9 <= h["sampling/quads/logp_gap_max"] + 2e-9
        assert h["sampling/quads/k3_kl"] >= 0
        assert 0.0 <= h["sampling/quads/is_masked_fraction"] <= 1.0
        # sequence_mask (TRL default, cap 3): the post-masking max can only be <= the raw max
        assert h["sampling/importance_sampling_ratio/max"] <= h["sampling/quads/is_ratio_raw_max"] + 1e-5
        if policy == "w4a16-qat":
            # same weights on both sides under QAT: the weight term is exactly zero
            assert h["sampling/quads/delta_weight_abs_mean"] == 0.0
            assert h["sampling/quads/delta_act_abs_mean"] > 0.0
    assert trainer.quads_rollout.num_syncs == 2  # before the generation of step 0 and of step 1


def _check_exact(rollout, trainer_model):
    masters = dict(trainer_model.named_parameters())
    n_packed = 0
    for name, p in rollout.named_parameters():
        m = masters[name].detach()
        if isinstance(p, NVFP4Tensor):
            # the rollout's dequantized weight is the trainer's forward (fake-quant) weight, bitwise
            assert torch.equal(p.dequantize(torch.float32), reference_forward_weight(masters, name, dtype=torch.float32)), name
            assert torch.equal(p.dequantize(torch.bfloat16), reference_forward_weight(masters, name, dtype=torch.bfloat16)), name
            n_packed += 1
        else:
            assert torch.equal(p, m.to(p.dtype)), name
    return n_packed


@pytest.mark.parametrize("policy", ["quads", "naive"])
def test_sync_after_optimizer_step_is_exact(policy, tmp_path):
    trainer = make_trainer(policy, tmp_path)
    engine = trainer.quads_rollout
    trainer_model = trainer.accelerator.unwrap_model(trainer.model)
    original = engine.sync_weights
    seen = []

    def spy():
        n = original()
        n_packed = _check_exact(engine.model, trainer_model)
        expert = engine.model.model.layers[0].mlp.experts.gate_up_proj
        seen.append((trainer.state.global_step, n_packed, expert.dequantize(torch.float32).clone()))
        return n

    engine.sync_weights = spy
    trainer.train()
    assert [s[0] for s in seen] == [0, 1]
    assert all(s[1] > 0 for s in seen)
    # the optimizer step between the two generations moved the quantized rollout weights
    assert not torch.equal(seen[0][2], seen[1][2])
    # and the trainer's quantized forward sees exactly those weights (QAT) / its masters (BF16)
    layer = trainer_model.model.layers[0].mlp.experts
    if POLICY_PRESETS[policy].trainer is not None:
        assert isinstance(layer, TrainerExperts)


@pytest.mark.parametrize("policy,graphed", [("bf16", False), ("quads", False), ("quads", True)])
def test_rollout_logprobs_are_the_sampling_distribution(policy, graphed, tmp_path):
    """The engine's log-probs are log_softmax(logits / T) of the rollout model at the sampled
    tokens, through ``generate`` and through the graphed decoder's step loop (eager on CPU)."""
    temperature = 0.7
    trainer = make_trainer(policy, tmp_path, temperature=temperature)
    trainer.quads_rollout.graphed = graphed
    tok = trainer.processing_class
    prompts = [tok(p["prompt"])["input_ids"] for p in make_prompts(6, seed=3)]
    torch.manual_seed(0)
    p_ids, c_ids, lps, _ = trainer.vllm_generation.generate(prompts, None, 1)  # what TRL calls
    assert p_ids == prompts and len(c_ids) == len(prompts)
    assert (trainer.quads_rollout._decoder is not None) == graphed, trainer.quads_rollout.fallback_reason
    ids, am, cm, keep = build_scoring_batch(p_ids, c_ids, tok.pad_token_id)
    rescored = score_teacher_forced(trainer.rollout_model, ids, am, keep, temperature)
    untempered = score_teacher_forced(trainer.rollout_model, ids, am, keep, 1.0)
    got = torch.zeros_like(rescored)
    for i, seq in enumerate(lps):
        assert len(seq) == len(c_ids[i]) and all(len(x) == 1 for x in seq)
        got[i, : len(seq)] = torch.tensor([x[0] for x in seq])
    mask = cm.bool()
    assert (got[mask] <= 0).all()
    diff = (got - rescored)[mask].abs()
    # decode-time (KV cache) vs one prefill of the same rollout model: bf16 noise only (bf16
    # logits of a peaked random model are coarse, and W4A4 rounding can amplify it at a token)
    assert diff.mean() < 0.02 and diff.max() < 0.3, diff
    # and the temperature is applied as TRL applies it to the trainer's log-probs
    assert (got - untempered)[mask].abs().mean() > 10 * diff.mean()


def test_copy_model_is_independent_of_trl_patching(tmp_path):
    trainer = make_trainer("bf16", tmp_path, steps=1)
    trainer_model = trainer.accelerator.unwrap_model(trainer.model)
    clone = copy_model(trainer_model)
    with torch.no_grad():
        trainer_model.lm_head.weight.add_(1.0)
    assert not torch.equal(clone.lm_head.weight, trainer_model.lm_head.weight)
    ids = torch.tensor([[1, 5, 6, 18]])
    out_clone = clone(input_ids=ids).logits
    with torch.no_grad():
        trainer_model.lm_head.weight.sub_(1.0)
    torch.testing.assert_close(out_clone, trainer_model(input_ids=ids).logits)


def test_rejects_use_vllm_naming_the_vllm_trainer(tmp_path):
    tok = make_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, report_to=[],
                      per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ValueError, match=r"use_vllm=False.*quads\.integrations\.vllm\.trl_colocate\.QuadsVLLMGRPOTrainer"):
        QuadsGRPOTrainer(tiny_model(tok), reward_digit_ones, args, processing_class=tok)


def test_policy_pair_sets_both_sides(tmp_path):
    """quads_policy takes a (trainer, rollout) pair of QuadsPolicy (and a PolicyPreset, and a name)."""
    from quads.policies import PolicyPreset

    trainer_policy = quads.QuadsPolicy(side="trainer")
    rollout_policy = quads.QuadsPolicy(side="rollout", residual_fraction=0.5)
    for given in ((trainer_policy, rollout_policy), PolicyPreset("mine", trainer_policy, rollout_policy, "k = 50%")):
        trainer = make_trainer(given, tmp_path, steps=1)
        trainer_model = trainer.accelerator.unwrap_model(trainer.model)
        assert {m.quads_policy for m in quads.quantized_modules(trainer_model).values()} == {trainer_policy}
        assert {m.quads_policy for m in quads.quantized_modules(trainer.rollout_model).values()} == {rollout_policy}
    trainer.train()
    (h,) = [h for h in trainer.state.log_history if "reward" in h]
    assert math.isfinite(h["sampling/quads/logp_gap_mean"])
    bf16_rollout = make_trainer((trainer_policy, None), tmp_path, steps=1)
    assert not quads.quantized_modules(bf16_rollout.rollout_model)


def _untouched_state(model):
    return ({n: (type(m), set(vars(m))) for n, m in model.named_modules()}, model.config.use_cache,
            getattr(model, "model_tags", None))


@pytest.mark.parametrize("bad,error,match", [
    (dict(rollout_dtype=torch.int8), ValueError, r"rollout_dtype=.*torch\.bfloat16.*got torch\.int8"),
    (dict(rollout_dtype="bfloat16"), ValueError, r"rollout_dtype=.*got 'bfloat16'"),
    (dict(decompose_mismatch="yes"), TypeError, r"decompose_mismatch=.*True or False"),
    (dict(rollout_corr_metrics=1), TypeError, r"rollout_corr_metrics=.*True or False"),
    (dict(graphed_decode="auto"), TypeError, r"graphed_decode=.*None, True or False"),
    (dict(routing_replay="on"), TypeError, r"routing_replay=.*True or False"),
    (dict(quads_policy=quads.QuadsPolicy(side="rollout", residual_fraction=0.5)), TypeError,
     r"single QuadsPolicy\(side='rollout'\).*\(trainer, rollout\) pair"),
    (dict(quads_policy=(quads.QuadsPolicy(side="rollout"), None)), ValueError, r"trainer entry.*side='rollout'"),
    (dict(quads_policy="fast"), ValueError, r"unknown quads policy preset 'fast'"),
    (dict(peft_config=object()), NotImplementedError, r"does not support PEFT models"),
])
def test_bad_arguments_are_refused_before_trl_touches_the_model(bad, error, match, tmp_path):
    """One-line errors raised before GRPOTrainer.__init__: no wrapper, model_tags or use_cache
    change left on the caller's model (TRL's init sets all three)."""
    tok = make_tokenizer()
    model = tiny_model(tok)
    before = _untouched_state(model)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[], per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, save_strategy="no", disable_tqdm=True)
    with pytest.raises(error, match=match) as err:
        QuadsGRPOTrainer(model, reward_digit_ones, args, processing_class=tok,
                         train_dataset=datasets.Dataset.from_list(make_prompts(8, seed=0)), **bad)
    assert "\n" not in str(err.value)
    assert _untouched_state(model) == before


def _default_model_or_skip():
    from quads.tasks import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("embedded default model not built yet")
    from quads.tasks import load_default_model

    return load_default_model(dtype=torch.float32)


def embedded_gap(n_prompts=64, seed=0, presets=("naive", "quads")):
    """Mismatch metrics of ``presets`` on the embedded model over the same held-out prompts and
    the same completions (sampled once at T=1 from the BF16 model), by teacher forcing."""
    from quads.tasks import generate_completions

    model, tok = _default_model_or_skip()
    probs = make_prompts(n_prompts, seed=seed, split="heldout")
    prompts = [p["prompt"] for p in probs]
    texts = generate_completions(model, tok, prompts, greedy=False, temperature=1.0, seed=seed)
    p_ids = [tok(p)["input_ids"] for p in prompts]
    c_ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    ids, am, cm, _ = build_scoring_batch(p_ids, c_ids, tok.pad_token_id)
    return {p: measure_policy_gap(model, p, ids, am, cm) for p in presets}


def test_embedded_model_quads_gap_smaller_than_naive():
    gaps = embedded_gap()
    q, n = gaps["quads"], gaps["naive"]
    print({p: round(g["sampling/quads/logp_gap_mean"], 5) for p, g in gaps.items()})
    assert q["sampling/quads/logp_gap_mean"] < n["sampling/quads/logp_gap_mean"]
    assert q["sampling/quads/k3_kl"] < n["sampling/quads/k3_kl"]


def _one_step_args(tmp_path):
    """A one-step CPU GRPOConfig with BF16 autocast (the failed-init tests)."""
    return GRPOConfig(output_dir=str(tmp_path / "x"), use_cpu=True, bf16=True, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, report_to=[], save_strategy="no",
                      disable_tqdm=True)


def test_trl_failure_leaves_the_callers_model_unconverted(tmp_path, monkeypatch):
    """When TRL's __init__ fails after the model's conversion, the model's module classes are
    restored and a retry works."""
    tok = make_tokenizer()
    model = tiny_model(tok)
    classes = {n: type(m) for n, m in model.named_modules()}
    attrs = {n: set(vars(m)) for n, m in model.named_modules()}
    ds = datasets.Dataset.from_list(make_prompts(16, seed=0))
    args = _one_step_args(tmp_path)
    real_init = trl.GRPOTrainer.__init__

    def failing_init(self, *a, **k):
        real_init(self, *a, **k)
        raise ValueError("TRL refused")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", failing_init)
    before = _untouched_state(model)
    with pytest.raises(ValueError, match="TRL refused"):
        QuadsGRPOTrainer(model, reward_digit_ones, args, train_dataset=ds, processing_class=tok, quads_policy="quads")
    assert {n: type(m) for n, m in model.named_modules()} == classes
    added = {n: set(vars(m)) - attrs[n] for n, m in model.named_modules()}
    assert not any("quads" in a for new in added.values() for a in new), added
    assert _untouched_state(model) == before  # TRL's own model_tags, autocast forward and use_cache too
    assert not quads.quantized_modules(model)
    monkeypatch.setattr(trl.GRPOTrainer, "__init__", real_init)
    trainer = QuadsGRPOTrainer(model, reward_digit_ones, args, train_dataset=ds, processing_class=tok,
                               quads_policy="w4a16-qat")
    assert _sides(trainer.model) == {TrainerLinear, TrainerExperts}


class _CorruptLayerAfter(TrainerCallback):
    """A synthetic rollout fault: from step ``step`` on, rollout layer 1's output is scaled and shifted."""

    def __init__(self, trainer, step):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            def corrupt(module, inputs, out):
                h = out[0] if isinstance(out, tuple) else out
                h = h * 1.5 + 0.5 * h.std()
                return (h, *out[1:]) if isinstance(out, tuple) else h
            self.trainer.rollout_model.model.layers[1].register_forward_hook(corrupt)


@pytest.mark.parametrize("fault", [False, True])
def test_mismatch_alarm_fires_on_a_fault_and_names_the_layer(fault, tmp_path):
    trainer = make_trainer("bf16", tmp_path, steps=8, lr=1e-5)
    if fault:
        trainer.add_callback(_CorruptLayerAfter(trainer, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    alarms = [h["sampling/quads/alarm"] for h in trainer.state.log_history if "reward" in h]
    lines = [str(w.message) for w in caught if "quads mismatch alarm" in str(w.message)]
    assert len(alarms) == 8
    if fault:
        assert alarms[:6] == [0.0] * 6 and alarms[6:] == [1.0, 1.0]
        # one line when the gap leaves the band (not one per step while it stays out)
        assert len(lines) == 1 and "at step 6" in lines[0] and "worst layer model.layers.1 " in lines[0]
        assert "3x baseline" in lines[0]
    else:
        assert alarms == [0.0] * 8 and lines == []


def test_mismatch_alarm_factor_is_checked_before_the_model_is_touched(tmp_path):
    with pytest.raises(ValueError, match="mismatch alarm factor"):
        QuadsGRPOTrainer(None, reward_digit_ones, GRPOConfig(output_dir=str(tmp_path), use_cpu=True),
                         mismatch_alarm=0.5)


def test_trl_failure_restores_the_experts_implementation(tmp_path, monkeypatch):
    tok = make_tokenizer()
    model = tiny_model(tok, experts="grouped_mm")
    args = _one_step_args(tmp_path)
    real_init = trl.GRPOTrainer.__init__

    def failing_init(self, *a, **k):
        real_init(self, *a, **k)
        assert self.model.config._experts_implementation == "quads_autocast_grouped_mm"
        raise ValueError("TRL refused")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", failing_init)
    with pytest.raises(ValueError, match="TRL refused"):
        QuadsGRPOTrainer(model, reward_digit_ones, args, train_dataset=datasets.Dataset.from_list(make_prompts(16)),
                         processing_class=tok, quads_policy="bf16")
    assert model.config._experts_implementation == "grouped_mm"
