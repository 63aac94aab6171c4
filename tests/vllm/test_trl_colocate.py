"""GRPO with TRL's vLLM colocate mode on the quads engine (real TRL, real vLLM, CPU)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
trl = pytest.importorskip("trl")

import torch  # noqa: E402
from _support import release  # noqa: E402

import quads  # noqa: E402
from quads.integrations.vllm import weight_push  # noqa: E402
from quads.integrations.vllm.quant_method import QuadsFusedMoEMethod, dequantize_moe_weights  # noqa: E402
from quads.integrations.vllm.weight_push import engine_model  # noqa: E402
from quads.policies.modules import TrainerExperts, TrainerLinear  # noqa: E402
from quads.tensor import nvfp4_fake_quantize  # noqa: E402

pytestmark = pytest.mark.vllm


def test_grpo_steps_with_vllm_colocate(checkpoint, tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from _support import _LIVE
    from quads.integrations.vllm.trl_colocate import QuadsVLLMGRPOTrainer
    from quads.tasks.arithmetic import make_prompts, make_tokenizer, reward_exact_match

    while _LIVE:  # one engine per process at a time (see _support.release)
        release(_LIVE[-1])

    pushes = []
    original_push = weight_push.push_weights

    def counting_push(llm, model, *args, **kwargs):
        pushes.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return original_push(llm, model, *args, **kwargs)

    monkeypatch.setattr("quads.integrations.vllm.trl_colocate.push_weights", counting_push)

    path = checkpoint("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=5,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = QuadsVLLMGRPOTrainer(
        model=model,
        reward_funcs=reward_exact_match,
        args=args,
        train_dataset=Dataset.from_list(make_prompts(16)),
        processing_class=make_tokenizer(),
        rollout_config={"residual_fraction": 0.5},
        rollout_corr_metrics=True,
    )
    llm = trainer.vllm_generation.llm
    _LIVE.append(llm)
    try:
        # the trainer side is W4A16 QAT, the engine runs the quads method
        assert isinstance(trainer.model.model.layers[0].self_attn.q_proj, TrainerLinear)
        assert isinstance(trainer.model.model.layers[0].mlp.experts, TrainerExperts)
        experts = engine_model(llm).model.layers[0].mlp.experts.routed_experts
        assert isinstance(experts.quant_method, QuadsFusedMoEMethod)
        assert experts.quant_method.config.activation_quant == quads.ActivationQuant(0.5)

        trainer.train()

        # TRL synced through push_weights before each generation after an optimizer step
        assert len(pushes) == 2
        changed = [n for n in pushes[0] if not torch.equal(pushes[0][n], pushes[1][n])]
        assert changed, "the optimizer step changed no weight"
        # TRL's importance-sampling correction ran on vLLM's log-probs
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 2
        for h in logs:
            for key in (
                "sampling/sampling_logp_difference/mean",
                "sampling/sampling_logp_difference/max",
                "sampling/importance_sampling_ratio/mean",
            ):
                assert key in h and h[key] == h[key], key  # present, not NaN
            assert 0 < h["sampling/sampling_logp_difference/max"] < 5
            # the mismatch metrics of QuadsGRPOTrainer, on the engine's processed log-probs
            for key in ("sampling/quads/logp_gap_mean", "sampling/quads/logp_gap_p99", "sampling/quads/k3_kl",
                        "sampling/quads/is_ratio_raw_max", "sampling/quads/is_masked_fraction",
                        "rollout_corr/kl", "rollout_corr/chi2_seq", "rollout_corr/k3_kl"):
                assert key in h and h[key] == h[key], key
            assert h["sampling/quads/logp_gap_mean"] == pytest.approx(h["sampling/sampling_logp_difference/mean"],
                                                                      rel=1e-4, abs=1e-6)
            assert h["rollout_corr/k3_kl"] == pytest.approx(h["sampling/quads/k3_kl"], rel=1e-9)

        # After one more push the engine holds the trainer's current forward weights, bit for bit
        trainer.vllm_generation.sync_weights()
        w13, _ = dequantize_moe_weights(experts)
        master = trainer.model.model.layers[0].mlp.experts.gate_up_proj
        assert torch.equal(w13, nvfp4_fake_quantize(master.detach()))
    finally:
        release(llm)


@pytest.mark.parametrize("bad,match", [
    (dict(vllm_mode="server"), r"colocate mode only.*NCCL weight transfer.*push_weights.*vllm_mode='colocate'.*QuadsGRPOTrainer"),
    (dict(use_vllm=False), r"use_vllm=True.*QuadsGRPOTrainer"),
    (dict(trainer_policy=quads.QuadsPolicy(side="rollout")), r"trainer_policy=.*side='trainer'"),
    (dict(rollout_corr_metrics="yes"), r"rollout_corr_metrics=.*True or False"),
    (dict(routing_replay=True), r"routing_replay=True\) is not supported.*QuadsGRPOTrainer\(routing_replay=True\)"),
])
def test_vllm_trainer_refuses_bad_arguments_before_touching_the_model(bad, match, checkpoint, tmp_path):
    """Refused in one line before TRL's __init__ (no engine started, the caller's model untouched)."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from quads.integrations.vllm.trl_colocate import QuadsVLLMGRPOTrainer
    from quads.tasks.arithmetic import make_tokenizer, reward_exact_match

    model = AutoModelForCausalLM.from_pretrained(checkpoint("qwen3_moe"), dtype=torch.bfloat16)
    before = (set(vars(model)), model.config.use_cache)
    config = {"use_vllm": True, "vllm_mode": "colocate"}
    config.update({k: bad.pop(k) for k in ("vllm_mode", "use_vllm") if k in bad})
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                      num_generations=2, **config)
    with pytest.raises((ValueError, TypeError), match=match) as err:
        QuadsVLLMGRPOTrainer(model=model, reward_funcs=reward_exact_match, args=args,
                             processing_class=make_tokenizer(), **bad)
    assert "\n" not in str(err.value)
    assert (set(vars(model)), model.config.use_cache) == before
    assert not quads.quantized_modules(model)
