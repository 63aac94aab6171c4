"""The FP8 W8A8 reference: weights rounded per forward and stored in place give the same bits."""

import copy

import pytest
import torch
import torch.nn as nn

from quads.diagnostics.fp8_reference import fp8_fake_quantize, fp8_w8a8_, round_fp8_weights_


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).to(torch.bfloat16)


def test_stored_weights_match_per_forward_rounding():
    base = _model()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    per_forward = fp8_w8a8_(copy.deepcopy(base))
    stored = fp8_w8a8_(copy.deepcopy(base), weights="stored")
    assert torch.equal(per_forward(x), stored(x))
    # the stored model's weights are the E4M3 round trips; the per-forward model keeps the masters
    assert torch.equal(stored[0].weight, fp8_fake_quantize(base[0].weight))
    assert torch.equal(per_forward[0].weight, base[0].weight)
    assert not torch.equal(stored[0].weight, base[0].weight)


def test_round_after_copy_follows_new_weights():
    stored = fp8_w8a8_(_model(0), weights="stored")
    new = _model(1)
    with torch.no_grad():
        for p, q in zip(stored.parameters(), new.parameters()):
            p.copy_(q)
    assert round_fp8_weights_(stored) == 2
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(stored(x), fp8_w8a8_(new)(x))


def test_per_forward_model_is_not_rounded_in_place():
    model = fp8_w8a8_(_model())
    before = model[0].weight.clone()
    assert round_fp8_weights_(model) == 0
    assert torch.equal(model[0].weight, before)


def test_bad_weight_mode_names_the_argument():
    with pytest.raises(ValueError, match="weights must be one of"):
        fp8_w8a8_(_model(), weights="cached")
