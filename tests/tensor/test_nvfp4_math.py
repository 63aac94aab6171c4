"""The NVFP4 recipe (quads.tensor.nvfp4_math) against the spec and an independent oracle."""

import math

import pytest
import torch

from quads.tensor.nvfp4_math import (
    e2m1_codes_rne,
    global_encode_scale_from_amax,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
    pack_e2m1,
    unpack_e2m1,
)
from tests import nvfp4_oracle as oracle

# value -> expected E2M1 magnitude after RNE (docs/nvfp4_spec.md)
TIE_TABLE = [
    (0.0, 0.0), (0.25, 0.0), (0.26, 0.5), (0.5, 0.5), (0.75, 1.0), (1.0, 1.0), (1.25, 1.0),
    (1.26, 1.5), (1.75, 2.0), (2.5, 2.0), (2.6, 3.0), (3.5, 4.0), (4.9, 4.0), (5.0, 4.0),
    (5.01, 6.0), (6.0, 6.0),
]


def _codes(parts):
    return unpack_e2m1(parts.qdata)


def test_tie_table_rounds_to_even():
    # Block amax 6 with S_enc = 1 gives block scale exactly 1, so values are encoded as they are.
    vals = torch.tensor([v for v, _ in TIE_TABLE], dtype=torch.float32)
    expected = torch.tensor([e for _, e in TIE_TABLE], dtype=torch.float32)
    x = torch.cat([vals, -vals]).reshape(2, 16)
    parts = nvfp4_quantize(x, global_encode_scale=torch.tensor(1.0))
    assert parts.scale.float().eq(1.0).all()
    out = nvfp4_dequantize(*parts)
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], -expected)


def test_e2m1_codes_saturation_sign_and_nan():
    v = torch.tensor([7.0, -7.0, -0.0, -0.1, float("nan")])
    codes = e2m1_codes_rne(torch.clamp(v, -6, 6))
    assert codes[0] == 7 and codes[1] == 15
    assert codes[2] == 8 and codes[3] == 8  # negative zero keeps the sign bit
    assert codes[4] & 7 == 0  # NaN has magnitude 0


def test_pack_layout_even_element_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_global_scale_guards():
    s = global_encode_scale_from_amax(torch.tensor([0.0, 2688.0, float("inf"), 1e-45]))
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 1.0
    assert s[3] == torch.finfo(torch.float32).max  # 2688/1e-45 overflows, clamped to FLT_MAX


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1.0, 1e4, 1e30])
def test_matches_independent_oracle(seed, magnitude):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 48, generator=g) * magnitude
    # spread block ranges so some block scales are e4m3 subnormals or underflow to zero
    x = x * torch.logspace(0, -5, 3 * 3).reshape(3, 3, 1).repeat_interleave(16, dim=2).reshape(3, 48)
    parts = nvfp4_quantize(x)
    s_enc = oracle.global_encode_scale(float(x.abs().max()))
    assert parts.global_encode_scale.item() == float(s_enc)
    codes, scales = oracle.quantize_row_groups(x.reshape(-1).numpy(), s_enc)
    assert _codes(parts).reshape(-1).tolist() == codes
    assert parts.scale.float().reshape(-1).tolist() == scales


def test_oracle_also_covers_subnormal_scales():
    # A block whose scale lands in the e4m3 subnormal range (< 2^-6) and one that underflows.
    x = torch.zeros(1, 48)
    x[0, 0] = 1.0  # sets amax: S_enc = 2688
    x[0, 16:32] = torch.linspace(-1e-3, 1e-3, 16)  # block scale 2688/6*1e-3 = 0.448 (normal)
    x[0, 32:48] = torch.linspace(-5e-6, 5e-6, 16)  # 0.00224: e4m3 subnormal
    parts = nvfp4_quantize(x)
    s = parts.scale.float()[0]
    assert 0 < s[2] < 2**-6
    codes, scales = oracle.quantize_row_groups(x.reshape(-1).numpy(), oracle.global_encode_scale(1.0))
    assert parts.scale.float().reshape(-1).tolist() == scales
    assert _codes(parts).reshape(-1).tolist() == codes


def test_zeros_and_underflowing_blocks_get_zero_scale():
    x = torch.zeros(2, 32)
    parts = nvfp4_quantize(x)
    assert parts.global_encode_scale.item() == 1.0
    assert parts.scale.float().eq(0).all()
    assert nvfp4_dequantize(*parts).eq(0).all()
    y = torch.zeros(1, 32)
    y[0, 0] = 1e4
    y[0, 16:] = 1e-8  # far below the smallest representable block scale relative to amax
    p = nvfp4_quantize(y)
    assert p.scale.float()[0, 1] == 0
    assert nvfp4_dequantize(*p)[0, 16:].eq(0).all()


def test_per_expert_global_scales_equal_separate_quantization():
    w = torch.randn(4, 8, 32) * torch.tensor([1e-3, 1.0, 10.0, 1e3]).reshape(4, 1, 1)
    parts = nvfp4_quantize(w)
    assert parts.global_encode_scale.shape == (4,)
    for e in range(4):
        pe = nvfp4_quantize(w[e])
        assert torch.equal(parts.qdata[e], pe.qdata)
        assert torch.equal(parts.scale[e].view(torch.uint8), pe.scale.view(torch.uint8))
        assert parts.global_encode_scale[e] == pe.global_encode_scale


def test_row_granularity_is_batch_invariant():
    x = torch.randn(5, 64)
    full = nvfp4_quantize(x, "row")
    for i in range(5):
        alone = nvfp4_quantize(x[i : i + 1], "row")
        assert torch.equal(full.qdata[i], alone.qdata[0])
        assert torch.equal(full.scale[i].view(torch.uint8), alone.scale[0].view(torch.uint8))


def test_dequantize_formula_and_error_bound():
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    parts = nvfp4_quantize(x)
    vals = torch.tensor(oracle.E2M1)[(unpack_e2m1(parts.qdata) & 7).long()]
    vals = torch.where(unpack_e2m1(parts.qdata) >= 8, -vals, vals)
    expected = (vals.reshape(16, 16, 16) * parts.scale.float().unsqueeze(-1)) / parts.global_encode_scale
    assert torch.equal(nvfp4_dequantize(*parts), expected.reshape(16, 256))
    rel = (nvfp4_dequantize(*parts) - x.float()).norm() / x.float().norm()
    assert 0.05 < rel < 0.15  # NVFP4 on Gaussian data is ~9-10% relative error


def test_fake_quantize_is_idempotent_and_keeps_dtype():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    fq = nvfp4_fake_quantize(w)
    assert fq.dtype == torch.bfloat16
    # Re-quantizing the fake-quantized weight lands on the same grid points (up to the bf16
    # rounding of x_hat); the codes must at least be stable for most elements.
    assert (nvfp4_fake_quantize(fq) == fq).float().mean() > 0.95


def test_inf_saturates_and_nan_poisons_its_group():
    x = torch.randn(2, 32)
    x[0, 3] = float("inf")
    p = nvfp4_quantize(x)
    assert p.global_encode_scale.item() == 1.0
    out = nvfp4_dequantize(*p)
    assert out[0, 3] == 448 * 6  # saturates to the largest encodable value
    y = torch.randn(2, 32)
    y[1, 5] = float("nan")
    q = nvfp4_quantize(y, "row")
    out = nvfp4_dequantize(*q)
    assert torch.isfinite(out[0]).all()  # other rows unaffected with per-row scales
    assert torch.isnan(out[1]).all()  # the NaN's group is poisoned, loudly
    assert q.scale[1].view(torch.uint8).eq(0x7F).all()


@pytest.mark.parametrize("bad", [torch.randn(4, 24), torch.randn(4, 32).to(torch.int32), torch.tensor(1.0)])
def test_bad_inputs_raise(bad):
    with pytest.raises((ValueError, TypeError)):
        nvfp4_quantize(bad)


def test_random_property_roundtrip_is_nearest_grid_point():
    # For any element, the dequantized value is the E2M1 grid point (times the block decode
    # scale) nearest to x*enc, so |x_hat - x| <= half a grid step of that block.
    g = torch.Generator().manual_seed(123)
    x = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 100
    p = nvfp4_quantize(x)
    dec = p.scale.float() / p.global_encode_scale  # decode scale per block
    err = (nvfp4_dequantize(*p) - x).abs().reshape(64, 8, 16)
    assert (err <= dec.unsqueeze(-1) * 1.0 + 1e-30).all()  # max half-step is 1.0 (between 4 and 6)
    assert math.isfinite(err.max().item())
