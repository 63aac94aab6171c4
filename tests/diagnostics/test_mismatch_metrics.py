"""Unit tests of quads.diagnostics.mismatch (pure torch, no TRL)."""

import math

import pytest
import torch

from quads.diagnostics import IS_MODES, importance_ratio_stats, k3_kl, logp_gap_stats, mismatch_metrics


def _toy():
    # 2 sequences x 3 tokens; the last token of sequence 1 is padding.
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    trainer = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return rollout, trainer, mask


def test_gap_stats_match_numpy_definitions():
    rollout, trainer, mask = _toy()
    gaps = torch.tensor([0.5, 1.0, 0.0, 0.1, 1.0], dtype=torch.float64)
    s = logp_gap_stats(rollout, trainer, mask)
    assert s["mean"] == pytest.approx(gaps.mean().item())
    assert s["max"] == pytest.approx(1.0)
    assert s["p99"] == pytest.approx(torch.quantile(gaps, 0.99).item())
    assert s["num_tokens"] == 5
    # the padded position (gap 9) is ignored; without a mask it is not
    assert logp_gap_stats(rollout, trainer)["max"] == pytest.approx(9.0)


def test_gap_skips_nan_and_empty():
    r = torch.tensor([[float("nan"), -1.0]])
    t = torch.tensor([[-1.0, -1.25]])
    assert logp_gap_stats(r, t)["mean"] == pytest.approx(0.25)
    empty = logp_gap_stats(r, t, torch.zeros_like(r, dtype=torch.bool))
    assert empty == {"mean": 0.0, "p99": 0.0, "max": 0.0, "num_tokens": 0.0}
    assert k3_kl(r, t, torch.zeros_like(r)) == 0.0


def test_k3_is_nonnegative_zero_iff_equal_and_unbiased():
    rollout, trainer, mask = _toy()
    assert k3_kl(rollout, rollout, mask) == 0.0
    log_r = torch.tensor([-0.5, 1.0, 0.0, -0.1, 1.0], dtype=torch.float64)
    assert k3_kl(rollout, trainer, mask) == pytest.approx((log_r.exp() - 1 - log_r).mean().item())
    # Monte-Carlo: samples from q, k3 averages to KL(q || p)
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    x = torch.multinomial(q, 200_000, replacement=True, generator=g)
    est = k3_kl(q.log()[x].unsqueeze(0), p.log()[x].unsqueeze(0))
    exact = (q * (q / p).log()).sum().item()
    assert est == pytest.approx(exact, rel=0.03)


def test_sequence_level_ratios_and_masking():
    rollout, trainer, mask = _toy()
    # per-sequence log-ratio = sum over valid tokens of (trainer - rollout)
    lr = torch.tensor([-0.5 + 1.0 + 0.0, -0.1 + 1.0], dtype=torch.float64)
    s = importance_ratio_stats(rollout, trainer, mask, "sequence_mask", None, 2.0)
    assert s["raw_min"] == pytest.approx(math.exp(lr.min().item()))
    assert s["raw_max"] == pytest.approx(math.exp(lr.max().item()))
    assert s["raw_mean"] == pytest.approx(lr.exp().mean().item())
    assert s["log_raw_max"] == pytest.approx(0.9)
    assert s["num_units"] == 2
    assert s["masked_fraction"] == pytest.approx(0.5)  # exp(0.9)=2.46 > 2 is masked, exp(0.5)=1.65 is kept
    # truncate mode: same raw ratios and same "hit" fraction (clipped)
    t = importance_ratio_stats(rollout, trainer, mask, "sequence_truncate", None, 2.0)
    assert t["raw_max"] == s["raw_max"] and t["masked_fraction"] == s["masked_fraction"]
    # lower bound
    lo = importance_ratio_stats(rollout, trainer, mask, "sequence_mask", 1.8, None)
    assert lo["masked_fraction"] == pytest.approx(0.5)


def test_token_level_ratios():
    rollout, trainer, mask = _toy()
    s = importance_ratio_stats(rollout, trainer, mask, "token_mask", 0.9, 2.0)
    ratios = torch.tensor([-0.5, 1.0, 0.0, -0.1, 1.0], dtype=torch.float64).exp()
    assert s["num_units"] == 5
    assert s["raw_mean"] == pytest.approx(ratios.mean().item())
    # below 0.9: exp(-0.5); above 2: exp(1) twice -> 3 of 5
    assert s["masked_fraction"] == pytest.approx(3 / 5)


def test_nan_rollout_logprob_means_no_correction_like_trl():
    r = torch.tensor([[float("nan"), -1.0]])
    t = torch.tensor([[-5.0, -1.0]])
    s = importance_ratio_stats(r, t, None, "sequence_mask")
    assert s["raw_min"] == 1.0 and s["raw_max"] == 1.0


def test_sequences_without_tokens_are_left_out():
    r = torch.zeros(3, 2)
    t = torch.full((3, 2), -1.0)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    s = importance_ratio_stats(r, t, mask, "sequence_truncate", None, 3.0)
    assert s["num_units"] == 2
    assert s["raw_max"] == pytest.approx(math.exp(-1.0))


def test_matches_trl_formula():
    """The raw ratio equals TRL 1.16's `exp(sum((old - sampling) * mask))`, before clipping/masking."""
    g = torch.Generator().manual_seed(1)
    rollout = -torch.rand(4, 6, generator=g) * 3
    trainer = rollout + 0.3 * torch.randn(4, 6, generator=g)
    mask = (torch.arange(6) < torch.tensor([[6], [4], [2], [5]])).int()
    for mode in IS_MODES:
        diff = (trainer - rollout) * mask
        if mode.startswith("sequence"):
            trl_raw = torch.exp(diff.sum(-1, keepdim=True)).flatten()
        else:
            trl_raw = torch.exp(diff)[mask.bool()]
        s = importance_ratio_stats(rollout, trainer, mask, mode, None, 1.2)
        assert s["raw_min"] == pytest.approx(trl_raw.min().item(), rel=1e-5)
        assert s["raw_max"] == pytest.approx(trl_raw.max().item(), rel=1e-5)
        assert s["raw_mean"] == pytest.approx(trl_raw.mean().item(), rel=1e-5)
        assert s["masked_fraction"] == pytest.approx((trl_raw > 1.2).float().mean().item())


def test_mismatch_metrics_names():
    rollout, trainer, mask = _toy()
    m = mismatch_metrics(rollout, trainer, mask)
    expected = {
        "logp_gap_mean", "logp_gap_p99", "logp_gap_max", "k3_kl", "is_ratio_raw_min", "is_ratio_raw_mean",
        "is_ratio_raw_max", "is_log_ratio_raw_min", "is_log_ratio_raw_max", "is_masked_fraction",
    }
    assert set(m) == {"sampling/quads/" + k for k in expected}
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


def test_bad_inputs():
    with pytest.raises(ValueError):
        logp_gap_stats(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        importance_ratio_stats(torch.zeros(2, 3), torch.zeros(2, 3), mode="bogus")
    with pytest.raises(ValueError):
        k3_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))


def _verl_oracle(rollout, trainer, mask):
    """verl's compute_offpolicy_metrics written out per sequence, in Python floats."""
    import math

    seqs = []
    for q_row, p_row, m_row in zip(rollout.tolist(), trainer.tolist(), mask.tolist()):
        toks = [(p, q) for p, q, m in zip(p_row, q_row, m_row) if m]
        if toks:
            seqs.append(toks)
    toks = [t for s in seqs for t in s]
    m_p = [sum(p for p, _ in s) / len(s) for s in seqs]
    m_q = [sum(q for _, q in s) / len(s) for s in seqs]
    diff = [b - a for a, b in zip(m_p, m_q)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    clamp = lambda x: max(-20.0, min(20.0, x))  # noqa: E731
    return {
        "training_ppl": mean([math.exp(-x) for x in m_p]), "training_log_ppl": mean([-x for x in m_p]),
        "rollout_ppl": mean([math.exp(-x) for x in m_q]), "rollout_log_ppl": mean([-x for x in m_q]),
        "kl": mean([q - p for p, q in toks]), "k3_kl": mean([math.exp(p - q) - (p - q) - 1 for p, q in toks]),
        "log_ppl_diff": mean(diff), "log_ppl_abs_diff": mean([abs(d) for d in diff]),
        "log_ppl_diff_max": max(diff), "log_ppl_diff_min": min(diff), "ppl_ratio": mean([math.exp(d) for d in diff]),
        "chi2_token": mean([math.exp(2 * clamp(p - q)) for p, q in toks]) - 1,
        "chi2_seq": mean([math.exp(2 * clamp(sum(p - q for p, q in s))) for s in seqs]) - 1,
    }


def test_verl_rollout_corr_names_and_definitions():
    from quads.diagnostics import rollout_corr_metrics
    from quads.diagnostics.mismatch import ROLLOUT_CORR_ALIASES

    g = torch.Generator().manual_seed(4)
    trainer = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    rollout = trainer + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.2
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[2] = False  # a sequence without tokens is left out
    got = rollout_corr_metrics(rollout, trainer, mask)
    want = _verl_oracle(rollout, trainer, mask)
    assert set(got) == {f"rollout_corr/{k}" for k in want}
    for k, v in want.items():
        assert got[f"rollout_corr/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    both = mismatch_metrics(rollout, trainer, mask, rollout_corr=True)
    for verl_name, quads_name in ROLLOUT_CORR_ALIASES.items():  # the documented aliases: same value
        assert both[verl_name] == pytest.approx(both["sampling/quads/" + quads_name], rel=1e-12)
    assert {k for k in both if k.startswith("sampling/quads/")} == set(mismatch_metrics(rollout, trainer, mask))
    assert all(v == 0.0 for v in rollout_corr_metrics(rollout, trainer, torch.zeros_like(mask)).values())
