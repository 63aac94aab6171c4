"""Four Over Six block scaling (``block_scaling="4over6"``) in the recipe, quads.tensor.nvfp4_math:
against the independent oracle, on ties, zero / underflowing / tensor-max blocks and NaN/Inf."""

import pytest
import torch

from quads.tensor.nvfp4_math import (
    BLOCK_SCALINGS,
    block_squared_error,
    global_encode_scale_from_amax,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
    shared_global_encode_scale,
    unpack_e2m1,
)
from tests import nvfp4_oracle as oracle

ONE = torch.tensor(1.0)


def _scale_bytes(parts):
    return parts.scale.view(torch.uint8)


def _block_errors(x, parts):
    """The 4over6 error of each block: e2m1 * s (dequantized with S_enc = 1) against x * S_enc."""
    s_enc = parts.global_encode_scale
    unscaled = nvfp4_dequantize(parts.qdata, parts.scale, torch.ones_like(s_enc))
    target = x.float() * s_enc.reshape(s_enc.shape + (1,) * (x.dim() - s_enc.dim()))
    return block_squared_error(unscaled.reshape(*x.shape[:-1], -1, 16), target.reshape(*x.shape[:-1], -1, 16))


def test_global_scale_maps_amax_to_256():
    amax = torch.tensor([0.0, 1.0, 3.0, float("inf")])
    s = global_encode_scale_from_amax(amax, "4over6")
    assert s.tolist() == [1.0, 1536.0, torch.tensor(1536.0).div(torch.tensor(3.0)).item(), 1.0]
    assert global_encode_scale_from_amax(torch.tensor(3.0)).item() == torch.tensor(2688.0).div(3.0).item()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1.0, 1e4, 1e30])
def test_matches_independent_oracle(seed, magnitude):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g) * magnitude
    # spread block ranges so some block scales are e4m3 subnormals or underflow to zero
    x = x * torch.logspace(0, -5, 3 * 4).reshape(3, 4, 1).repeat_interleave(16, dim=2).reshape(3, 64)
    parts = nvfp4_quantize(x, block_scaling="4over6")
    s_enc = oracle.global_encode_scale(float(x.abs().max()), "4over6")
    assert parts.global_encode_scale.item() == float(s_enc)
    codes, scales = oracle.quantize_row_groups(x.reshape(-1).numpy(), s_enc, "4over6")
    assert unpack_e2m1(parts.qdata).reshape(-1).tolist() == codes
    assert parts.scale.float().reshape(-1).tolist() == scales


def test_chooses_the_candidate_with_less_squared_error_and_ties_keep_6():
    x = torch.zeros(4, 16)
    x[0, :2] = torch.tensor([6.0, 5.0])  # 6: 5 -> 4 (error 1); 4: scale 1.5, 5 -> 4.5 (error 0.25)
    x[1, :2] = torch.tensor([6.0, 1.0])  # 6: exact; 4: 1 -> 0.75
    x[2, :2] = torch.tensor([6.0, 3.0])  # exact under both: a tie at 0
    x[3, :2] = torch.tensor([6.0, 0.25])  # 0.25 -> 0 under both: a tie at 0.0625
    parts = nvfp4_quantize(x, "row", ONE.expand(4), block_scaling="4over6")
    assert parts.scale.float().reshape(-1).tolist() == [1.5, 1.0, 1.0, 1.0]
    assert nvfp4_dequantize(*parts)[0, :2].tolist() == [6.0, 4.5]
    err6 = _block_errors(x, nvfp4_quantize(x, "row", ONE.expand(4), block_scaling="6"))
    err = _block_errors(x, parts)
    assert err6.reshape(-1).tolist() == [1.0, 0.0, 0.0, 0.0625]
    assert err.reshape(-1).tolist() == [0.25, 0.0, 0.0, 0.0625]


def test_six_candidate_is_the_standard_recipe_so_no_block_gets_worse():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(96, 576, generator=g) * torch.rand(96, 1, generator=g)).bfloat16()
    parts = nvfp4_quantize(x, block_scaling="4over6")
    standard = nvfp4_quantize(x, global_encode_scale=parts.global_encode_scale)  # same S_enc, always 6
    err, err6 = _block_errors(x, parts), _block_errors(x, standard)
    assert (err <= err6).all()
    kept_6 = parts.scale.view(torch.uint8) == standard.scale.view(torch.uint8)
    assert torch.equal(unpack_e2m1(parts.qdata).reshape(96, 36, 16)[kept_6],
                       unpack_e2m1(standard.qdata).reshape(96, 36, 16)[kept_6])
    assert 0.2 < (~kept_6).float().mean() < 0.8  # both candidates are chosen on Gaussian blocks
    assert err.sum() < 0.9 * err6.sum()


def test_zero_and_underflowing_blocks():
    x = torch.zeros(2, 48)
    parts = nvfp4_quantize(x, block_scaling="4over6")
    assert parts.global_encode_scale.item() == 1.0 and parts.scale.float().eq(0).all()
    assert nvfp4_dequantize(*parts).eq(0).all()
    y = torch.zeros(1, 48)
    y[0, 0] = 1.0  # S_enc = 1536
    y[0, 16:32] = 1e-8  # both block scales underflow to 0: equal errors, 6 kept (scale 0)
    # 6: scale 1536/6*4.5e-6 = 0.00115 (< 2^-10: rounds to 0); 4: 0.0017 rounds to 2^-9
    y[0, 32:48] = 4.5e-6
    p = nvfp4_quantize(y, block_scaling="4over6")
    assert p.scale.float()[0, 1] == 0 and nvfp4_dequantize(*p)[0, 16:32].eq(0).all()
    assert p.scale.float()[0, 2] == 2**-9  # the 4 candidate keeps a (subnormal) scale: less error
    assert nvfp4_dequantize(*p)[0, 32:48].ne(0).all()


def test_tensor_max_block_scales_to_4_within_e4m3():
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([10.0, 8.3, -7.9])  # near-max values: the 4 candidate wins
    x[0, 16] = 0.1
    parts = nvfp4_quantize(x, block_scaling="4over6")
    assert parts.global_encode_scale.item() == torch.tensor(1536.0).div(torch.tensor(10.0)).item()
    assert parts.scale.float()[0, 0] == 384.0  # 10 * S_enc / 4, no clamp at 448
    assert nvfp4_dequantize(*parts)[0, 0].item() == pytest.approx(10.0, rel=1e-6)


def test_nan_poisons_and_inf_saturates_as_in_the_standard_recipe():
    y = torch.randn(2, 32)
    y[1, 5] = float("nan")
    q = nvfp4_quantize(y, "row", block_scaling="4over6")
    out = nvfp4_dequantize(*q)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
    assert q.scale[1].view(torch.uint8).eq(0x7F).all()
    x = torch.randn(2, 32)
    x[0, 3] = float("inf")
    p = nvfp4_quantize(x, block_scaling="4over6")
    assert p.global_encode_scale.item() == 1.0
    assert nvfp4_dequantize(*p)[0, 3] == 448 * 6  # the Inf's block: both candidates clamp to 448, 6 kept
    assert torch.equal(p.scale.view(torch.uint8)[0, 0], nvfp4_quantize(x).scale.view(torch.uint8)[0, 0])


def test_expert_and_row_groups_equal_separate_quantization():
    w = torch.randn(3, 8, 64) * torch.tensor([1e-3, 1.0, 1e3]).reshape(3, 1, 1)
    parts = nvfp4_quantize(w, block_scaling="4over6")
    for e in range(3):
        pe = nvfp4_quantize(w[e], block_scaling="4over6")
        assert torch.equal(parts.qdata[e], pe.qdata) and torch.equal(_scale_bytes(parts)[e], _scale_bytes(pe))
        assert parts.global_encode_scale[e] == pe.global_encode_scale
    rows = nvfp4_quantize(w[1], "row", block_scaling="4over6")
    for i in range(8):
        alone = nvfp4_quantize(w[1, i : i + 1], "row", block_scaling="4over6")
        assert torch.equal(rows.qdata[i], alone.qdata[0])


def test_shared_scale_and_fake_quantize_take_the_block_scaling():
    a, b = torch.randn(8, 32), torch.randn(4, 32) * 3
    shared = shared_global_encode_scale([a, b], "4over6")
    assert shared.item() == global_encode_scale_from_amax(torch.maximum(a.abs().max(), b.abs().max()), "4over6")
    fq = nvfp4_fake_quantize(a.bfloat16(), block_scaling="4over6")
    assert torch.equal(fq, nvfp4_dequantize(*nvfp4_quantize(a.bfloat16(), block_scaling="4over6"), dtype=torch.bfloat16))


def test_squared_error_sums_in_the_fixed_pairwise_order():
    # squares whose float32 sum depends on the order: the pairwise tree, not left to right
    d = torch.tensor([1.0, 2**-12, 2**-12, 2**-12] * 4)
    sq = d * d
    tree = ((sq[0::2] + sq[1::2]).reshape(4, 2).sum(-1)).reshape(2, 2).sum(-1).sum()
    left_to_right = torch.zeros(())
    for v in sq:
        left_to_right = left_to_right + v
    assert block_squared_error(d, torch.zeros(16)).item() == tree.item() != left_to_right.item()


def test_large_and_tiny_tensors_choose_as_at_unit_scale():
    # the error is measured in units of 1/S_enc: a tensor scaled by a power of two chooses the same
    # blocks (no squared error overflows at 1e30 or underflows at 1e-30)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=g)
    unit = nvfp4_quantize(x, block_scaling="4over6")
    for factor in (2.0**100, 2.0**-100):
        scaled = nvfp4_quantize(x * factor, block_scaling="4over6")
        assert torch.equal(scaled.qdata, unit.qdata) and torch.equal(_scale_bytes(scaled), _scale_bytes(unit))


@pytest.mark.parametrize("bad", ["4/6", "four_over_six", 6, None])
def test_unknown_block_scaling_is_refused(bad):
    with pytest.raises(ValueError, match="block scaling"):
        nvfp4_quantize(torch.randn(2, 16), block_scaling=bad)
    assert BLOCK_SCALINGS == ("6", "4over6")
