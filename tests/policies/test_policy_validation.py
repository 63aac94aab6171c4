"""QuadsPolicy validates every field on every side, and the error names the field."""

import pytest

import quads


@pytest.mark.parametrize("side", ["trainer", "rollout"])
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(residual_fraction=float("nan")), ValueError, r"QuadsPolicy\.residual_fraction .*got nan"),
    (dict(residual_fraction=True), ValueError, r"QuadsPolicy\.residual_fraction .*got True"),
    (dict(residual_fraction="0.5"), ValueError, r"QuadsPolicy\.residual_fraction"),
    (dict(residual_fraction=1.5), ValueError, r"QuadsPolicy\.residual_fraction"),
    (dict(residual_selection="bogus"), ValueError, r"QuadsPolicy\.residual_selection .*'bogus'"),
    (dict(residual_fraction=float("nan"), residual_selection="bogus"), ValueError, r"QuadsPolicy\.residual_"),
    (dict(activation_granularity="token"), ValueError, r"QuadsPolicy\.activation_granularity"),
    (dict(activations="fp8"), ValueError, r"QuadsPolicy\.activations"),
    (dict(activations=4), ValueError, r"QuadsPolicy\.activations"),
    (dict(extra_skip_patterns="v_proj"), TypeError, r"QuadsPolicy\.extra_skip_patterns .*\('v_proj',\)"),
    (dict(skip_patterns="lm_head"), TypeError, r"QuadsPolicy\.skip_patterns"),
    (dict(skip_patterns=(r"lm_head", 3)), TypeError, r"QuadsPolicy\.skip_patterns"),
    (dict(extra_skip_patterns={"v_proj"}), TypeError, r"QuadsPolicy\.extra_skip_patterns"),
    (dict(extra_skip_patterns=(p for p in ["v_proj"])), TypeError, r"QuadsPolicy\.extra_skip_patterns"),
    (dict(extra_skip_patterns=("(unclosed",)), ValueError, r"bad skip pattern"),
])
def test_bad_fields_raise_naming_the_field(side, kwargs, error, match):
    with pytest.raises(error, match=match):
        quads.QuadsPolicy(side=side, **kwargs)


def test_bad_side_and_list_patterns():
    for side in ("both", None, ["trainer"]):
        with pytest.raises(ValueError, match=r"QuadsPolicy\.side"):
            quads.QuadsPolicy(side=side)
    p = quads.QuadsPolicy(side="rollout", extra_skip_patterns=["v_proj$"])  # a list is fine, stored as a tuple
    assert p.extra_skip_patterns == ("v_proj$",) and p.skips("model.layers.0.self_attn.v_proj")
