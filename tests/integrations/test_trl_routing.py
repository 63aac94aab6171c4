"""Routing agreement and replay with real TRL and real tiny transformers MoE models: the rollout
engine records the experts it used (graphed decoder run eagerly, and ``generate``), laid out as
TRL lays out the trainer's input, and QuadsGRPOTrainer logs the routing flips (and replays)."""

from __future__ import annotations

import math
import os

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import GenerationConfig  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl.trainer.utils import pad  # noqa: E402

from quads.engine import GraphedDecoder, SamplingSpec  # noqa: E402
from quads.integrations.trl import QuadsGRPOTrainer  # noqa: E402
from quads.integrations.trl.engine import QuadsRolloutEngine  # noqa: E402
from quads.policies.routing import RoutingCheck, RoutingRecorder, moe_routers  # noqa: E402
from quads.tasks import make_prompts, make_tokenizer  # noqa: E402
from tests.integrations.test_trl_integration import reward_digit_ones, tiny_model  # noqa: E402
from tests.tiny_models import build  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
EOS = 7
PROMPTS = [[11, 12, 13], [20, 21, 22, 23, 24, 25], [30], [40, 41, 42, 43]]


def _engine(model, graphed):
    gc = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          eos_token_id=EOS, pad_token_id=0)
    return QuadsRolloutEngine(model, trainer_model=lambda: model, global_step=lambda: 0, generation_config=gc,
                              pad_token_id=0, eos_token_ids=[EOS], graphed=graphed, record_routing=True)


def _trainer_input(prompts, completions, rows):
    """TRL's padding of prompt_ids / completion_ids, and the same padding of the routing rows."""
    ids = torch.cat([pad([torch.tensor(p) for p in prompts], padding_value=0, padding_side="left"),
                     pad([torch.tensor(c) for c in completions], padding_value=0, padding_side="right")], dim=1)
    masks = [pad([torch.ones(len(x), dtype=torch.long) for x in xs], padding_value=0, padding_side=side)
             for xs, side in ((prompts, "left"), (completions, "right"))]
    routing = torch.cat([pad(rows[0], padding_value=-1, padding_side="left"),
                         pad(rows[1], padding_value=-1, padding_side="right")], dim=1)
    return ids, torch.cat(masks, dim=1), routing


def test_graphed_decoder_records_every_fed_token_at_its_slot():
    model = build("qwen3_moe").float().eval()
    ids = torch.tensor([[0, 0, 11, 12], [20, 21, 22, 23]])
    am = (ids != 0).long()
    seen = RoutingRecorder(model)  # an independent record of each forward's routing
    decoder = GraphedDecoder(model, use_cuda_graph=False, record_routing=True)
    with seen.appending(2) as forwards:
        spec = SamplingSpec(max_new_tokens=5, eos_token_ids=(), pad_token_id=0, do_sample=False)
        tokens, _ = decoder.generate(ids, am, spec)
    fed = forwards[0]  # prompt (4 slots) then each decode step's fed token
    assert decoder.last_routing.shape == (2, 4 + tokens.shape[1] - 1, 2, 2)
    assert torch.equal(decoder.last_routing, fed)


@pytest.mark.parametrize("graphed", [True, False], ids=["graphed-decoder", "generate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_routing_is_the_trainer_inputs_routing(graphed, dtype):
    """Same model on both sides, same dtype, no autocast: the trainer's full forward picks the
    experts the rollout recorded (layout checked through the flips: a shifted layout flips).
    In float32 exactly; in BF16 the incremental forward's rounding may reorder a near tie (a
    probability gap within BF16's resolution), and only such ties."""
    model = build("qwen3_moe").to(dtype).eval()
    engine = _engine(model, graphed)
    torch.manual_seed(0)
    _, completions, _, _ = engine.generate(PROMPTS)
    assert engine.decode_report()["decoder"] == ("graphed" if graphed else "generate")
    prompt_rows, completion_rows = engine.last_routing
    for p, c, pr, cr in zip(PROMPTS, completions, prompt_rows, completion_rows, strict=True):
        assert pr.shape == (len(p), 2, 2) and cr.shape == (len(c), 2, 2) and pr.dtype == torch.int16
        assert (pr >= 0).all() and (cr[-1] == -1).all() and (cr[:-1] >= 0).all()  # the last token is never fed
    ids, am, routing = _trainer_input(PROMPTS, completions, engine.last_routing)
    assert ((routing[..., 0, 0] >= 0) == (am.bool() & (routing[..., 0, 0] != -1))).all()
    check = RoutingCheck(model)
    with torch.no_grad(), check.armed(routing):
        model(input_ids=ids, attention_mask=am)
    stats = check.take()
    assert stats["recorded"] == sum(len(p) + len(c) - 1 for p, c in zip(PROMPTS, completions))
    if dtype == torch.float32:
        assert stats["flip_topk"] == 0.0 and stats["flip_top1"] == 0.0
    else:
        assert stats["flip_top1"] < 0.05 and _flips_are_near_ties(model, ids, am, routing, tol=0.01)
    # the layout matters: one token off, the experts disagree
    with torch.no_grad(), check.armed(torch.roll(routing, 1, dims=1)):
        model(input_ids=ids, attention_mask=am)
    assert check.take()["flip_topk"] > 0


def _flips_are_near_ties(model, ids, am, routing, tol):
    """Every token whose recorded experts differ (as a set or at top-1) from the model's own has
    its recorded experts' probabilities within ``tol`` of its own top-k's."""
    probs = []
    hooks = [r.register_forward_hook(lambda m, a, o: probs.append(torch.softmax(o[0].float(), -1)))
             for r in moe_routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=am)
    finally:
        for h in hooks:
            h.remove()
    routing = routing.long()
    for layer, p in enumerate(probs):
        p = p.view(*ids.shape, -1)
        rec = routing[:, :, layer]
        valid = rec[..., 0] >= 0
        own_vals = p.topk(rec.shape[-1], dim=-1).values
        rec_vals = p.gather(-1, rec.clamp(min=0))
        if ((own_vals - rec_vals).abs().amax(-1)[valid] > tol).any():
            return False
    return True


def _trainer(tmp_path, **kw):
    tok = make_tokenizer()
    ds = datasets.Dataset.from_list(make_prompts(16, seed=0))
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=2, logging_steps=1, report_to=[],
                      learning_rate=1e-2, save_strategy="no", seed=0, disable_tqdm=True)
    return QuadsGRPOTrainer(tiny_model(tok), reward_digit_ones, args, train_dataset=ds, processing_class=tok, **kw)


KEYS = ["sampling/quads/routing_flip_topk", "sampling/quads/routing_flip_topk_max",
        "sampling/quads/routing_flip_top1", "sampling/quads/routing_flip_worst_layer"]


@pytest.mark.parametrize("policy,replay,graphed", [("w4a16", False, False), ("quads", True, True),
                                                   ("quads+r3", False, False)])
def test_trainer_logs_routing_flips_and_replays(policy, replay, graphed, tmp_path):
    trainer = _trainer(tmp_path, quads_policy=policy, routing_replay=replay, graphed_decode=graphed)
    replaying = replay or policy.endswith("+r3")
    assert trainer.quads_routing is not None and trainer.quads_routing.replay == replaying
    trainer.train()
    assert trainer.quads_rollout.decode_report()["decoder"] == ("graphed" if graphed else "generate")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for h in logs:
        for key in KEYS:
            assert key in h and math.isfinite(h[key]), key
        assert 0.0 <= h["sampling/quads/routing_flip_top1"] <= 1.0
        assert h["sampling/quads/routing_flip_topk"] <= h["sampling/quads/routing_flip_topk_max"]
        if replaying:
            assert 0.5 < h["sampling/quads/routing_replayed"] <= 1.0
        else:
            assert "sampling/quads/routing_replayed" not in h


def test_dense_model_has_no_routing_keys_and_replay_is_refused(tmp_path):
    from tests.integrations.test_trl_integration import make_trainer  # noqa: F401  (same set-up, dense model below)

    tok = make_tokenizer()
    dense = build("llama").float()
    dense.resize_token_embeddings(len(tok))
    ds = datasets.Dataset.from_list(make_prompts(8, seed=0))
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                      disable_tqdm=True)
    with pytest.raises(ValueError, match="routing_replay=True.*has no MoE routers"):
        QuadsGRPOTrainer(dense, reward_digit_ones, args, train_dataset=ds, processing_class=tok,
                         quads_policy="bf16", routing_replay=True)
    trainer = QuadsGRPOTrainer(dense, reward_digit_ones, args, train_dataset=ds, processing_class=tok,
                               quads_policy="bf16")
    assert trainer.quads_routing is None and not trainer.quads_rollout.record_routing
    trainer.train()
    (h,) = [h for h in trainer.state.log_history if "reward" in h]
    assert not [k for k in h if "routing" in k]


def test_replay_routes_the_loss_forward_by_the_recorded_experts(tmp_path):
    """The loss forward's effective routing is the recorded one, and the routers get a gradient."""
    trainer = _trainer(tmp_path, quads_policy="w4a16", routing_replay=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    effective = RoutingRecorder(model)
    batches = []
    original = trainer._compute_loss

    def spy(m, inputs):
        with effective.appending(inputs["prompt_ids"].shape[0]) as seen:
            loss = original(m, inputs)
        grads = torch.autograd.grad(loss, [r.weight for r in moe_routers(model)], retain_graph=True)
        batches.append((inputs["quads_routing"], seen[0], grads))
        return loss

    trainer._compute_loss = spy
    trainer.train()
    assert batches
    for recorded, routed, grads in batches:
        valid = recorded[..., 0] >= 0
        assert valid.any() and torch.equal(routed[valid], recorded[valid].to(routed.device))
        assert all(g.abs().sum() > 0 for g in grads)  # the routers still learn through the gathered scores


def test_example_logs_routing_flips_with_replay(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo_quads.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "run"
    summary = example.main(["--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "2", "--eval-n", "0",
                            "--no-plot", "--max-completion-length", "8", "--output-dir", str(out), "--routing-replay"])
    assert summary["policy"] == "quads+r3"
    assert 0.0 <= summary["routing_flip_topk_mean"] <= 1.0 and 0.0 <= summary["routing_flip_top1_mean"] <= 1.0
    assert json.loads((out / "summary.json").read_text())["routing_flip_topk_mean"] == summary["routing_flip_topk_mean"]
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"sampling/quads/routing_flip_topk", "sampling/quads/routing_replayed"} <= set(header)
    steps = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in l]
    assert len(steps) == 2 and all(0.5 < s["sampling/quads/routing_replayed"] <= 1.0 for s in steps)
    assert [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")][0].split()[-2] == "flips"


def _a_tool(x: int) -> int:
    """Adds one.

    Args:
        x: a number.
    """
    return x + 1


def test_multi_call_rollouts_record_no_routing_and_refuse_replay(tmp_path):
    """With TRL tools a batch's rollout is several engine calls (the tool-calling rows again): no
    one recording covers it, so replay is refused in one line, before TRL runs; without replay
    the trainer records no routing (flips not measured rather than a crash on a recording of
    another shape)."""
    with pytest.raises(ValueError, match=r"routing_replay=True\): tools= rolls a batch out in several engine calls"):
        _trainer(tmp_path / "r", routing_replay=True, tools=[_a_tool])
    trainer = _trainer(tmp_path / "m")
    trainer._quads_check_routing(trainer.model, False, "tools")
    assert trainer.quads_routing_replay is None


def test_a_failed_set_up_takes_the_routing_hooks_off(tmp_path, monkeypatch):
    """A failure in the trainer's last set-up steps (the precision probe's forward) leaves the
    caller's model without quads' routing hooks, so a retry does not stack a second set."""
    tok = make_tokenizer()
    model = tiny_model(tok)
    ds = datasets.Dataset.from_list(make_prompts(16, seed=0))
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, logging_steps=1, report_to=[],
                      save_strategy="no", disable_tqdm=True)

    def boom(self, args):
        raise RuntimeError("probe failed")

    monkeypatch.setattr(QuadsGRPOTrainer, "_quads_precision_probe", boom)
    routers = moe_routers(model)
    before = [len(r._forward_hooks) for r in routers]
    with pytest.raises(RuntimeError, match="probe failed"):
        QuadsGRPOTrainer(model, reward_digit_ones, args, train_dataset=ds, processing_class=tok)
    assert [len(r._forward_hooks) for r in routers] == before


@pytest.mark.parametrize("policy", ["quads", "w4a16"])
def test_the_decode_step_is_captured_once_over_training_steps(policy, tmp_path, monkeypatch):
    """Over three GRPO steps (a weight sync after each), the rollout's captured decode step stays
    valid: what it reads is written in place (one capture per session); the decoder's stand-in
    capture on CPU (the decision to capture, keep or capture again is the real one)."""
    from tests.engine.test_graphed_decode import _recording_decoder

    _recording_decoder(None, monkeypatch)  # (patches the class; the engine makes its own decoder)
    trainer = _trainer(tmp_path, quads_policy=policy, graphed_decode=True)
    trainer.args.max_steps = 3
    trainer.train()
    report = trainer.quads_rollout.decode_report()
    assert report["decoder"] == "graphed" and report["captures"] == 1, report
