"""The real-model GRPO driver's rollout sampling: the graphed decoder (its CUDA path, run eagerly
here) and transformers ``generate`` (its CPU path) give the same greedy tokens and log-probs."""

import pytest
import torch

import quads
from benchmarks.real_grpo import RolloutSampler, completion_mask, sample
from tests.tiny_models import build

EOS, PAD = 7, 0


def _left_padded(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 6, 3][:batch]
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    am = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(8, 96, (n,), generator=g)
        am[i, width - n:] = 1
    return ids, am


def _until_eos(row):
    out = []
    for t in row:
        out.append(t)
        if t == EOS:
            break
    return out


@pytest.mark.parametrize("side", [None, "rollout"])
def test_graphed_and_generate_give_the_same_greedy_tokens(side):
    model = build("llama").float().eval()
    if side:
        quads.quantize_(model, quads.QuadsPolicy(side=side))
    model.set_attn_implementation("eager")  # the driver's rollout engine attention
    ids, am = _left_padded()
    graphed = RolloutSampler(model, EOS, PAD, engine="graphed")
    generate = RolloutSampler(model, EOS, PAD, engine="generate")
    assert graphed.engine == "graphed" and generate.engine == "generate"
    tok_g, lp_g = graphed.sample(ids, am, 12, do_sample=False)
    tok_h, lp_h = generate.sample(ids, am, 12, do_sample=False)
    assert tok_g.shape[1] <= 12 and tok_h.shape[1] <= 12
    for i, (a, b) in enumerate(zip(tok_g.tolist(), tok_h.tolist())):
        a, b = _until_eos(a), _until_eos(b)
        assert a == b
        torch.testing.assert_close(lp_g[i, : len(a)], lp_h[i, : len(b)], atol=2e-5, rtol=0)
    assert (lp_g <= 0).all() and torch.isfinite(lp_g).all()


def test_sampled_groups_and_completion_mask():
    model = build("llama").float().eval()
    model.set_attn_implementation("eager")
    ids, am = _left_padded(batch=2)
    torch.manual_seed(0)
    rep_ids, rep_am, completion, logps = sample(RolloutSampler(model, EOS, PAD, engine="graphed"), ids, am,
                                                group=3, max_new_tokens=9)
    assert rep_ids.shape[0] == 6 and torch.equal(rep_ids[:3], ids[:1].expand(3, -1))
    assert completion.shape == logps.shape and completion.shape[0] == 6
    mask = completion_mask(completion, EOS)
    for row, m in zip(completion.tolist(), mask.tolist()):
        n = len(_until_eos(row))
        assert m[:n] == [1] * n and not any(m[n:])


def test_unknown_engine_is_named():
    with pytest.raises(ValueError, match="engine"):
        RolloutSampler(build("llama"), EOS, PAD, engine="vllm")


def test_micro_batched_backward_gives_the_batch_gradient():
    """The driver's GRPO backward in micro-batches equals one whole-batch backward (same loss)."""
    from benchmarks.real_grpo import grpo_backward

    ids, am = _left_padded()
    g = torch.Generator().manual_seed(1)
    completion = torch.randint(8, 96, (4, 6), generator=g)
    completion[1, 3:] = EOS
    cmask = completion_mask(completion, EOS)
    rollout_lp = -torch.rand(4, 6, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
    grads = []
    for micro in (4, 3, 1):
        model = build("llama").float()
        lp, loss = grpo_backward(model, ids, am, completion, cmask, rollout_lp, adv, micro)
        assert lp.shape == (4, 6) and not lp.requires_grad
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for other in grads[1:]:
        assert len(other) == len(grads[0])
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_state_and_summary_writes_are_atomic(tmp_path, monkeypatch):
    """An interrupted write leaves the old file, and no temporary file behind."""
    import json

    from benchmarks import real_grpo

    path = tmp_path / "summary.json"
    real_grpo._write_json(path, {"steps": 1})

    def interrupted(f):
        f.write(b'{"steps": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        real_grpo._write_atomically(path, interrupted)
    assert json.loads(path.read_text()) == {"steps": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    state = tmp_path / "state.pt"
    real_grpo._write_atomically(state, lambda f: torch.save({"step": 3, "rng": torch.get_rng_state()}, f))
    assert torch.load(state, weights_only=True)["step"] == 3
