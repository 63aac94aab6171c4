"""quads.policies.routing on real transformers MoE models: the recorder writes the rollout's
actual routing at the right tokens, the trainer-side check counts flips (0 for the same model,
> 0 for a perturbed router), replay imposes the recorded experts with the router's gradient kept,
and disarmed / replay-off forwards are bit-identical to a model without the hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from quads.policies.routing import RoutingCheck, RoutingRecorder, moe_routers, routing_problem, scores_at
from tests.tiny_models import build


def _batch(model, batch=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 96, (batch, length), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0  # a left-padded row
    return ids, am


def _own_routing(model, ids, am):
    """(B, T, L, k) of the model's own top-k ids in one forward."""
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec.appending(ids.shape[0]) as out:
        model(input_ids=ids, attention_mask=am)
    return out[0]


def test_dense_and_unknown_routers_are_refused_in_one_line():
    assert "has no MoE routers" in routing_problem(build("llama"))
    model = build("mixtral")

    class OddRouter(nn.Module):
        top_k = 2

    model.model.layers[1].mlp.gate = OddRouter()
    problem = routing_problem(model)
    assert "model.layers.1.mlp: router class OddRouter is not supported" in problem and "\n" not in problem
    with pytest.raises(ValueError, match="OddRouter"):
        moe_routers(model)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_scores_at_own_ids_are_the_routers_bits(kind):
    model = build(kind)
    for router in moe_routers(model):
        h = torch.randn(11, model.config.hidden_size, dtype=torch.bfloat16)
        logits, scores, ids = router(h)
        got = scores_at(router, logits, ids)
        assert got.dtype == scores.dtype and torch.equal(got, scores)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_same_model_has_no_flips_and_replay_off_keeps_the_bits(kind):
    model = build(kind)  # BF16, no autocast
    ids, am = _batch(model)
    recorded = _own_routing(model, ids, am)
    assert recorded.shape == (3, 7, 2, 2) and recorded.dtype == torch.int16
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=am).logits
    check = RoutingCheck(model, replay=False)
    with torch.no_grad(), check.armed(recorded):
        hooked = model(input_ids=ids, attention_mask=am).logits
    assert torch.equal(plain, hooked)
    stats = check.take()
    assert stats["flip_topk"] == 0.0 and stats["flip_top1"] == 0.0 and stats["recorded"] == 21
    assert check.take() is None  # reset


def test_perturbed_router_flips_and_replay_imposes_the_recorded_experts():
    rollout, trainer = build("mixtral"), build("mixtral")
    with torch.no_grad():
        for r in moe_routers(rollout):
            r.weight.add_(torch.randn_like(r.weight))
    ids, am = _batch(trainer)
    recorded = _own_routing(rollout, ids, am)
    recorded[1, -1] = -1  # a token with nothing recorded routes freely

    check = RoutingCheck(trainer, replay=False)
    with torch.no_grad(), check.armed(recorded):
        trainer(input_ids=ids, attention_mask=am)
    stats = check.take()
    assert stats["flip_topk"] > 0 and stats["flip_top1"] > 0 and stats["flip_topk_max"] >= stats["flip_topk"]
    check.remove()

    replay = RoutingCheck(trainer, replay=True)
    effective = RoutingRecorder(trainer)  # hooks after the replay hook: sees the routing the experts get
    with effective.appending(ids.shape[0]) as seen, replay.armed(recorded):
        logits = trainer(input_ids=ids, attention_mask=am).logits
    routed = seen[0]
    valid = recorded[..., 0] >= 0
    assert torch.equal(routed[valid], recorded[valid])
    assert not torch.equal(routed[~valid], recorded[~valid])  # -1 rows: the router's own choice
    stats = replay.take()
    assert stats["replayed"] == pytest.approx(valid[am.bool()].float().mean().item())
    logits.float().logsumexp(-1).mean().backward()
    for r in moe_routers(trainer):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_forwards_take_their_rows_in_order_and_mismatch_is_refused():
    model = build("qwen3_moe")
    ids, am = _batch(model, batch=4)
    recorded = _own_routing(model, ids, am)
    check = RoutingCheck(model)
    with torch.no_grad(), check.armed(recorded):
        for start in (0, 2):  # TRL's chunked scoring
            model(input_ids=ids[start:start + 2], attention_mask=am[start:start + 2])
    assert check.take()["flip_topk"] == 0.0
    with torch.no_grad(), check.armed(recorded[:, :5]), pytest.raises(ValueError, match="do not match"):
        model(input_ids=ids, attention_mask=am)


def test_replay_survives_gradient_checkpointing_recompute():
    """Backward's recompute of a checkpointed layer routes by the same recorded rows: the
    gradients equal those without checkpointing."""
    rollout, model = build("mixtral", dtype=torch.float32), build("mixtral", dtype=torch.float32)
    with torch.no_grad():
        for r in moe_routers(rollout):
            r.weight.add_(torch.randn_like(r.weight))
    ids, am = _batch(model)
    recorded = _own_routing(rollout, ids, am)
    check = RoutingCheck(model, replay=True)
    model.train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        with check.armed(recorded):
            loss = model(input_ids=ids, attention_mask=am).logits.logsumexp(-1).mean()
        loss.backward()  # outside the armed block, as the Trainer's backward is
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_replay_off_keeps_the_bits_of_a_qat_trainer_under_autocast():
    import quads

    model = quads.quantize_(build("qwen3_moe", dtype=torch.float32), quads.QuadsPolicy(side="trainer"))
    ids, am = _batch(model)
    recorded = _own_routing(model, ids, am)
    recorded[0, 3:] = (recorded[0, 3:] + 1) % 4  # disagreeing rows: counted, not imposed
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(input_ids=ids, attention_mask=am).logits
        check = RoutingCheck(model, replay=False)
        with check.armed(recorded):
            hooked = model(input_ids=ids, attention_mask=am).logits
    assert torch.equal(plain, hooked) and check.take()["flip_topk"] > 0
