"""The fused fake-quantization kernel vs the recipe (``nvfp4_fake_quantize``): bit-exact.

Runs under TRITON_INTERPRET=1 on CPU (small shapes, the GPU's tile config) or natively on a GPU.
Inputs: the adversarial rows of the quantizer tests (zeros, E4M3-subnormal and zero block scales,
E2M1 ties, +-inf, huge, fp32-subnormal results), as one tensor (one global scale) and as 3-D
experts with one row per expert (each row's own global scale, so every corner is reached).
"""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from quads.kernels import fake_quantize_nvfp4 as fq_kernel  # noqa: E402
from quads.ops import weight_quant  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_fake_quantize, nvfp4_quantize  # noqa: E402

from tests.kernels.test_kernel_quantize import DEV, adversarial  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    got, ref = got.cpu(), ref.cpu()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    diff = _bits(got) != _bits(ref)
    diff &= ~nan
    assert not diff.any(), f"bits differ at {diff.nonzero()[:8].tolist()}: {got[diff][:4]} vs {ref[diff][:4]}"


def fake_quantize_weight_triton(x, dtype=None, global_encode_scale=None):
    out, gs = weight_quant.fake_quantize_weight_triton(x, dtype, global_encode_scale)
    _, ref_gs = weight_quant.fake_quantize_weight_reference(x.cpu(), dtype)
    assert gs.shape == ref_gs.shape and torch.equal(gs.cpu().nan_to_num(-1), ref_gs.nan_to_num(-1))
    if global_encode_scale is None:  # the scale handed back reproduces the same bits without an amax
        again, _ = weight_quant.fake_quantize_weight_triton(x, dtype, gs)
        assert_same_bits(again, out)
    return out


def _master(dtype: torch.dtype, seed: int, m: int = 9, k: int = 80) -> torch.Tensor:
    x = adversarial(m=m, k=k, dtype=torch.float32, seed=seed)
    if dtype == torch.float16:  # keep fp16 finite where fp32 is (1e37 rows become inf otherwise)
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


@pytest.mark.parametrize("master", DTYPES, ids=str)
@pytest.mark.parametrize("out", DTYPES, ids=str)
def test_fake_quantize_2d_bit_exact(master, out):
    x = _master(master, seed=0)
    assert_same_bits(fake_quantize_weight_triton(x, out), nvfp4_fake_quantize(x.cpu(), dtype=out))


@pytest.mark.parametrize("master", DTYPES, ids=str)
@pytest.mark.parametrize("out", DTYPES, ids=str)
def test_fake_quantize_experts_bit_exact(master, out):
    """3-D (E, N, K), one global scale per expert: with N = 1 every adversarial row is its own
    group (tiny rows reach the per-element division path); with N = 3 groups mix rows."""
    for n in (1, 3):
        x = _master(master, seed=1, m=9).reshape(9 // n, n, 80)
        assert_same_bits(fake_quantize_weight_triton(x, out), nvfp4_fake_quantize(x.cpu(), dtype=out))


def test_fake_quantize_nan_and_edge_shapes():
    x = _master(torch.float32, seed=2)
    x[3, 7] = float("nan")  # the whole tensor's global scale is NaN: every output NaN, as the recipe
    assert_same_bits(fake_quantize_weight_triton(x), nvfp4_fake_quantize(x.cpu()))
    e = _master(torch.bfloat16, seed=3, m=9, k=48).reshape(3, 3, 48)
    e[1, 2, 5] = float("nan")  # poisons expert 1 only
    got = fake_quantize_weight_triton(e)
    assert_same_bits(got, nvfp4_fake_quantize(e.cpu()))
    assert torch.isnan(got[1]).all() and not torch.isnan(got[0]).any()
    # more rows than one tile, K not a multiple of the tile's 256 columns, a non-contiguous master
    w = torch.randn(19 * 16, 13, device=DEV).t()  # (13, 304), column-major
    assert not w.is_contiguous()
    assert_same_bits(fake_quantize_weight_triton(w), nvfp4_fake_quantize(w.cpu()))
    assert fake_quantize_weight_triton(torch.zeros(0, 32, device=DEV)).shape == (0, 32)
    ref, gs = weight_quant.fake_quantize_weight_reference(x.cpu(), torch.bfloat16)
    assert_same_bits(ref, nvfp4_fake_quantize(x.cpu(), dtype=torch.bfloat16))
    assert_same_bits(weight_quant.fake_quantize_weight_reference(x.cpu(), torch.bfloat16, gs)[0], ref)


def test_fake_quantize_bad_input_names_culprit():
    with pytest.raises(ValueError, match="multiple of 16"):
        fake_quantize_weight_triton(torch.randn(4, 24, device=DEV))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        fake_quantize_weight_triton(torch.randn(4, 32, device=DEV), torch.float64)
    with pytest.raises(ValueError, match="3-D experts"):
        fake_quantize_weight_triton(torch.randn(2, 2, 2, 32, device=DEV))
    with pytest.raises(ValueError, match="groups of"):
        fq_kernel.fake_quantize_rows(torch.randn(5, 32, device=DEV), 2, torch.float32)



@pytest.mark.parametrize("tile", [(4, 16, 4), (8, 16, 4), (8, 4, 2)], ids=str)
def test_fake_quantize_fused_tiles(monkeypatch, tile):
    """The fused pass's tile (rows x blocks of 16 x warps): the shipped 8 x 16, the earlier
    4 x 16 and a narrow one; row counts that are and are not multiples of the tile rows, 2-D and
    3-D with groups straddling tiles, with the adversarial rows: the recipe's bits each time."""
    rows, blocks, warps = tile
    monkeypatch.setattr(fq_kernel, "TILE_ROWS", rows)
    monkeypatch.setattr(fq_kernel, "TILE_BLOCKS", blocks)
    monkeypatch.setattr(fq_kernel, "_NUM_WARPS", warps)
    g = torch.Generator().manual_seed(6)
    k = 208
    adv = adversarial(m=9, k=k, seed=7).cpu()
    x = torch.cat([torch.randn(12, k, generator=g), adv])  # 21 rows
    for out in (torch.bfloat16, torch.float32):
        assert_same_bits(fake_quantize_weight_triton(x.to(DEV), out), nvfp4_fake_quantize(x, dtype=out))
    for n in (3, 7):  # rows per expert: groups straddle the tiles' rows
        e = x.clamp(-1e30, 1e30)[: (21 // n) * n].reshape(-1, n, k)
        assert_same_bits(fake_quantize_weight_triton(e.to(DEV)), nvfp4_fake_quantize(e))


@pytest.mark.parametrize("amax_tile", [(8, 32, 2), (2, 16, 3), (4, 64, 1)], ids=str)
def test_fake_quantize_amax_tiles(monkeypatch, amax_tile):
    """The amax pass's tiling (rows x columns x column iterations per program, then one atomic
    max per group): several column chunks, tiles inside one group (one scalar atomic) and tiles
    straddling groups, with the adversarial rows (inf, NaN, huge) placed so their group's max
    sits in a late chunk and a late row; global scales and bits as the recipe."""
    rows, cols, iters = amax_tile
    monkeypatch.setattr(fq_kernel, "AMAX_ROWS", rows)
    monkeypatch.setattr(fq_kernel, "AMAX_COLS", cols)
    monkeypatch.setattr(fq_kernel, "AMAX_ITERS", iters)
    g = torch.Generator().manual_seed(5)
    k = 208  # 13 blocks: several column chunks of every tile above, a partial last one
    base = torch.randn(48, k, generator=g)
    base[37, 201] = 40.0  # the tensor's amax: last rows, last chunk
    adv = adversarial(m=9, k=k, seed=4).cpu()
    for name, x in (("2d", base), ("2d-adv", torch.cat([base, adv])[7:])):
        x = x.to(DEV)
        assert_same_bits(fake_quantize_weight_triton(x, torch.bfloat16), nvfp4_fake_quantize(x.cpu(), dtype=torch.bfloat16))
    for n in (16, 8, 6, 3):  # rows per expert: multiples of the tile rows and not
        e = torch.cat([base, adv[:9].clamp(-1e30, 1e30)]).reshape(-1, k)[: (57 // n) * n].reshape(-1, n, k).to(DEV)
        assert_same_bits(fake_quantize_weight_triton(e), nvfp4_fake_quantize(e.cpu()))
    e = base.reshape(3, 16, k).clone()
    e[2, 15, 200] = float("nan")  # poisons expert 2 only, found in the last tile's last chunk
    e[0, 9, 3] = float("inf")  # expert 0: S_enc 1
    assert_same_bits(fake_quantize_weight_triton(e.to(DEV)), nvfp4_fake_quantize(e))


# ---------------------------------------------------------------------------------------------
# The fused pass's float arithmetic (_lean_quant_blocks: E2M1 and E4M3 rounding by magic-number
# adds, no codes built) on the inputs that stress it: E2M1 ties, outliers, NaN / inf and given
# global scales far outside what an amax gives, compared with the recipe directly.
# ---------------------------------------------------------------------------------------------

_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: below this given S_enc, s / S_enc overflows float32 for a block scale s of 448 (S_enc never
#: that small from an amax: 2688 / FLT_MAX ~ 7.9e-36)
_S_ENC_OVERFLOW = 448.0 / 3.4028234663852886e38


def _fused_vs_recipe(x2, rows_per_group, out_dtype=torch.float32, gs=None, block_scaling="6"):
    """The fused pass on rows ``x2`` (groups of ``rows_per_group`` rows, S_enc from the amax or
    ``gs``) against the recipe: the same S_enc and the same bits. One documented exception, only
    for a given S_enc below ``_S_ENC_OVERFLOW`` (unreachable from an amax): in a block holding
    +-inf, where the recipe's value is 0 (``v = inf * enc`` with ``enc == 0``), the fast
    dequantization may give NaN (the quotient ``s / S_enc`` is inf, times 0) -- as the removed
    code-building branch did. On a GPU also, only for a given S_enc that is FP32-subnormal (below
    2^-126, equally unreachable): the GPU flushes subnormal operands to zero, so a result the
    recipe gives as -0 may come out +0 (measured on the H200: the rows of S_enc 1e-40
    and 1e-38, all zeros; the sign of a zero only)."""
    out, gs_got = fq_kernel.fake_quantize_rows(x2.to(DEV), rows_per_group, out_dtype, gs, block_scaling=block_scaling)
    groups = x2.shape[0] // rows_per_group
    e = x2.cpu().reshape(groups, rows_per_group, -1)
    gs_ref = nvfp4_quantize(e, "expert", None if gs is None else gs.cpu(), block_scaling,
                            check_values=False).global_encode_scale  # the kernel takes a given S_enc as it is
    gs_ref = gs_ref.reshape(-1).expand(groups)
    assert torch.equal(gs_got.cpu().reshape(-1).nan_to_num(-1), gs_ref.nan_to_num(-1))
    want = nvfp4_fake_quantize(e, granularity="expert", dtype=out_dtype, global_encode_scale=gs_ref,
                               block_scaling=block_scaling, check_values=False).reshape(x2.shape)
    got = out.cpu()
    if gs is not None:
        tiny = (gs_ref < _S_ENC_OVERFLOW).repeat_interleave(rows_per_group)  # (rows,)
        inf_blk = torch.isinf(x2.cpu().float()).reshape(x2.shape[0], -1, 16).any(-1)
        inf_blk = inf_blk.repeat_interleave(16, dim=1) & tiny[:, None]
        excused = inf_blk & (want == 0) & torch.isnan(got)
        if DEV == "cuda":
            subnormal = ((gs_ref > 0) & (gs_ref < 2.0 ** -126)).repeat_interleave(rows_per_group)
            excused |= subnormal[:, None] & (want == 0) & (got == 0)
        got = torch.where(excused, want, got)
    assert_same_bits(got, want)
    return out


def _tie_sweep_rows(k_exps=(-9, -3, 0, 5, 8)) -> torch.Tensor:
    """Rows of blocks whose scaled values v = x * enc hit the E2M1 ties, their float32 neighbours
    and every multiple of 2^-6 in [0, 6] (and beyond, to the clamp): with S_enc = 1 and a block
    max of 6 * 2^k, the block scale is exactly 2^k and enc = 2^-k, so x = v * 2^k."""
    vals = [t for t in _TIES] + [2.0, 4.0, 6.0, 6.5, 7.0, 1e3]
    v = torch.tensor(vals, dtype=torch.float32)
    up = torch.nextafter(v, torch.full_like(v, float("inf")))
    dn = torch.nextafter(v, torch.zeros_like(v))
    grid = torch.arange(0, 6 * 64 + 1, dtype=torch.float32) / 64
    allv = torch.cat([v, up, dn, grid, torch.nextafter(grid, torch.full_like(grid, 7.0)),
                      torch.nextafter(grid, torch.zeros_like(grid))])
    allv = torch.cat([allv, -allv])
    n15 = 15 * ((allv.numel() + 14) // 15)
    allv = torch.cat([allv, torch.zeros(n15 - allv.numel())]).reshape(-1, 15)
    rows = []
    for k in k_exps:
        blocks = torch.cat([torch.full((allv.shape[0], 1), 6.0), allv], dim=1) * 2.0 ** k
        rows.append(blocks.reshape(1, -1))
    return torch.cat(rows)


def test_fake_quantize_fused_adversarial():
    """The adversarial rows (2-D one scale; one expert per row) in every output dtype."""
    x = _master(torch.float32, seed=11)
    for out in DTYPES:
        assert_same_bits(fake_quantize_weight_triton(x, out), nvfp4_fake_quantize(x.cpu(), dtype=out))
    e = x.reshape(9, 1, 80)
    assert_same_bits(fake_quantize_weight_triton(e, torch.bfloat16), nvfp4_fake_quantize(e.cpu(), dtype=torch.bfloat16))


def test_fake_quantize_fused_tie_sweep():
    """E2M1 ties (0.25 ... 5 times the block scale), their neighbours and a 2^-6 grid of scaled
    values, at block scales 2^-9 (E4M3 subnormal) .. 2^8, one row per scale: the recipe's bits;
    also with the rows' own global scales and with S_enc = 1 given."""
    x = _tie_sweep_rows()
    _fused_vs_recipe(x, 1, gs=torch.ones(x.shape[0]))
    _fused_vs_recipe(x, 1)
    _fused_vs_recipe(x, x.shape[0], out_dtype=torch.bfloat16)
    # non-power-of-two global scales: ties land between grid points after the scale rounding
    _fused_vs_recipe(x, 1, gs=torch.tensor([3.0, 0.7, 1e-3, 6.1e4, 2688.0 / 7]))


def test_fake_quantize_fused_random_outliers():
    """Random rows with outliers (per-block amax 10^(+-6) apart), random signs and zero blocks."""
    g = torch.Generator().manual_seed(21)
    k = 256
    x = torch.randn(24, k, generator=g) * torch.logspace(-6, 6, 24)[:, None]
    x[torch.rand(24, k, generator=g) < 0.01] *= 1e4
    x[:, 32:48] = 0.0
    x[5, 64:80] = -0.0
    x[7, 100:116] = 1e-40  # fp32-subnormal inputs
    for n in (1, 4, 24):
        _fused_vs_recipe(x, n)
        _fused_vs_recipe(x, n, out_dtype=torch.bfloat16)


def test_fake_quantize_fused_nan_inf_and_extreme_scales():
    """NaN / inf rows and given global scales from subnormal to FLT_MAX, inf, 0 and NaN: the
    recipe's bits (scales unreachable from an amax: up to the one exception of
    ``_fused_vs_recipe``). S_enc = 1e-40 with an inf in the block is the ``enc == 0`` case of
    ``_lean_quant_blocks``."""
    x = _master(torch.float32, seed=12, m=9, k=64)
    x[8, 3] = float("nan")
    x[0, 17] = -float("inf")
    _fused_vs_recipe(x, 1)  # one scale per row: only row 8 is NaN
    _fused_vs_recipe(x, 9)
    scales = torch.tensor([1e-40, 1e-38, 2.0 ** -126, 7.9e-36, 1.0, 3e5, 3.4028234663852886e38,
                           float("inf"), 0.0])
    _fused_vs_recipe(x, 1, gs=scales)
    ok = torch.tensor([False, False, False, True, True, True, True, False, False])
    _fused_vs_recipe(x[ok], 1, gs=scales[ok])
    _fused_vs_recipe(x, 1, gs=torch.full((9,), float("nan")))
    _fused_vs_recipe(x, 9, gs=torch.tensor(1e-40))
