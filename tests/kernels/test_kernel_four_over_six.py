"""Four Over Six block scaling in the Triton kernels vs the recipe (``block_scaling="4over6"``):
the weight quantizer (rollout packing, sync) and the trainer's fused fake-quant pass, bit-exact.

Runs under TRITON_INTERPRET=1 on CPU (small row counts, the GPU's tile configs) or natively on a
GPU. Inputs: the adversarial rows of the quantizer tests, the fused pass's E2M1 tie sweep (with
S_enc = 1 both candidates' block scales are exact: many equal errors, the tie rule), NaN / inf,
given global scales, the real K of SmolLM2 / the benchmark models (576, 960, 1408, 2880).
"""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from quads.kernels import fake_quantize_nvfp4 as fq_kernel  # noqa: E402
from quads.kernels.nvfp4_blocks import pairwise_block_sum  # noqa: E402
from quads.ops import weight_quant  # noqa: E402
from quads.tensor.nvfp4_math import block_squared_error, nvfp4_dequantize, nvfp4_fake_quantize, nvfp4_quantize  # noqa: E402

from tests.kernels.test_kernel_fake_quantize import _fused_vs_recipe, _master, _tie_sweep_rows, assert_same_bits  # noqa: E402
from tests.kernels.test_kernel_quantize import DEV, adversarial, assert_parts_equal  # noqa: E402

FOS = "4over6"


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g)).to(dtype).to(DEV)


def _quantize(w, gran=None, gs=None):
    got = weight_quant.quantize_weight_triton(w, gran, gs, FOS)
    want = nvfp4_quantize(w.cpu(), gran, None if gs is None else gs.cpu(), FOS)
    assert_parts_equal(got, want, torch.isnan(w.cpu()))
    return got


@pytest.mark.parametrize("shape,gran,dtype", [
    ((4, 576), None, torch.bfloat16),  # SmolLM2's hidden size
    ((3, 960), "row", torch.float32),
    ((2, 3, 1408), None, torch.bfloat16),  # 3-D experts: one scale per expert
    ((2, 2880), "tensor", torch.float16),
], ids=str)
def test_weight_quantizer_bit_exact(shape, gran, dtype):
    _quantize(_weight(shape, dtype, seed=shape[-1]), gran)


def test_weight_quantizer_adversarial_nan_inf_and_given_scale():
    x = adversarial(m=9, k=80, seed=3)
    _quantize(x, "row")  # one scale per row: zeros, subnormal scales, ties, inf, huge, tiny
    _quantize(x.clamp(-1e30, 1e30))  # one scale for the tensor
    x[8, 3] = float("nan")
    _quantize(x, "row")
    w = _weight((5, 64), torch.bfloat16, seed=2)
    _quantize(w, "tensor", torch.tensor(2688.0 / 3))  # a given (e.g. sibling group) S_enc, as it is
    _quantize(w, "tensor", torch.tensor(1536.0 / 7))


def test_weight_quantizer_tie_sweep_keeps_6_on_equal_errors():
    x = _tie_sweep_rows().to(DEV)
    parts = _quantize(x, "row", torch.ones(x.shape[0]))
    six = nvfp4_quantize(x.cpu(), "row", torch.ones(x.shape[0]))
    picked_4 = parts.scale.cpu().view(torch.uint8) != six.scale.view(torch.uint8)
    assert 0 < picked_4.float().mean() < 1  # both choices occur (and ties keep 6, as the reference)
    _quantize(x, "row")


@pytest.mark.parametrize("master", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("out", (torch.float32, torch.bfloat16), ids=str)
def test_fake_quant_adversarial_bit_exact(master, out):
    x = _master(master, seed=0)
    got, gs = weight_quant.fake_quantize_weight_triton(x, out, None, FOS)
    assert_same_bits(got, nvfp4_fake_quantize(x.cpu(), dtype=out, block_scaling=FOS))
    again, _ = weight_quant.fake_quantize_weight_triton(x, out, gs, FOS)  # the backward's recomputation
    assert_same_bits(again, got)
    e = x.reshape(9, 1, 80)  # one expert per row: each adversarial row its own global scale
    got_e, _ = weight_quant.fake_quantize_weight_triton(e, out, None, FOS)
    assert_same_bits(got_e, nvfp4_fake_quantize(e.cpu(), dtype=out, block_scaling=FOS))


def test_fake_quant_tie_sweep_nan_inf_and_extreme_scales():
    x = _tie_sweep_rows()
    _fused_vs_recipe(x, 1, gs=torch.ones(x.shape[0]), block_scaling=FOS)
    _fused_vs_recipe(x, 1, block_scaling=FOS)
    _fused_vs_recipe(x, x.shape[0], out_dtype=torch.bfloat16, block_scaling=FOS)
    y = _master(torch.float32, seed=12, m=9, k=64)
    y[8, 3] = float("nan")
    y[0, 17] = -float("inf")
    _fused_vs_recipe(y, 1, block_scaling=FOS)
    scales = torch.tensor([1e-40, 1e-38, 2.0 ** -126, 7.9e-36, 1.0, 3e5, 3.4028234663852886e38, float("inf"), 0.0])
    _fused_vs_recipe(y, 1, gs=scales, block_scaling=FOS)


@pytest.mark.parametrize("tile", [(8, 16, 4), (4, 16, 4), (8, 4, 2)], ids=str)
def test_fake_quant_tiles_and_real_k(monkeypatch, tile):
    rows, blocks, warps = tile
    monkeypatch.setattr(fq_kernel, "TILE_ROWS", rows)
    monkeypatch.setattr(fq_kernel, "TILE_BLOCKS", blocks)
    monkeypatch.setattr(fq_kernel, "_NUM_WARPS", warps)
    for k, n in ((576, 11), (1408, 3)):
        w = _weight((n, k), torch.bfloat16, seed=k)
        got, _ = weight_quant.fake_quantize_weight_triton(w, None, None, FOS)
        assert_same_bits(got, nvfp4_fake_quantize(w.cpu(), block_scaling=FOS))
    e = _weight((3, 4, 960), torch.float32, seed=9)  # experts whose groups straddle the tile rows
    got, _ = weight_quant.fake_quantize_weight_triton(e, torch.bfloat16, None, FOS)
    assert_same_bits(got, nvfp4_fake_quantize(e.cpu(), dtype=torch.bfloat16, block_scaling=FOS))


def test_fake_quant_group_amax_bits_derive_the_4over6_scale():
    """A sibling group's amax bits (the kernel backends' group scale): the fused pass derives
    ``S_enc = 256 * 6 / amax`` from them, the reference's shared scale, and the same bits."""
    from quads.tensor.nvfp4_math import shared_global_encode_scale

    ws = [_weight((8, 64), torch.bfloat16, seed=s) * (s + 1) for s in range(3)]
    bits = weight_quant.group_amax_bits_triton(ws)
    shared = shared_global_encode_scale([w.cpu() for w in ws], FOS)
    for w in ws:
        got, gs = weight_quant.fake_quantize_weight_triton(w, None, bits, FOS)
        assert gs.cpu().item() == shared.item()
        assert_same_bits(got, nvfp4_fake_quantize(w.cpu(), global_encode_scale=shared, block_scaling=FOS))


def test_standard_path_is_unchanged_by_the_option():
    x = _master(torch.bfloat16, seed=5)
    six, _ = weight_quant.fake_quantize_weight_triton(x, None, None, "6")
    assert_same_bits(six, nvfp4_fake_quantize(x.cpu()))
    fos, _ = weight_quant.fake_quantize_weight_triton(x, None, None, FOS)
    assert not torch.equal(six.cpu(), fos.cpu())
    with pytest.raises(ValueError, match="block scaling"):
        weight_quant.fake_quantize_weight_triton(x, None, None, "4/6")
    with pytest.raises(ValueError, match="block scaling"):
        weight_quant.quantize_weight_triton(x, None, None, "4/6")


@triton.jit
def _pairwise_probe_kernel(E, OUT, B: tl.constexpr):
    i = tl.arange(0, B)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(OUT + tl.arange(0, B), pairwise_block_sum(tl.load(E + i)))


def test_kernel_sums_squared_errors_in_the_reference_order():
    """The kernels' block sum is the reference's pairwise tree, on blocks whose float32 sum
    depends on the order (a left-to-right or any other order would differ on some)."""
    g = torch.Generator().manual_seed(0)
    d = torch.randn(64, 16, generator=g) * torch.logspace(-4, 4, 16)[torch.randperm(16, generator=g)]
    d[0] = torch.tensor([1.0, 2**-12, 2**-12, 2**-12] * 4)
    ref = block_squared_error(d, torch.zeros_like(d))
    out = torch.empty(64, device=DEV)
    _pairwise_probe_kernel[(1,)]((d * d).to(DEV), out, B=64)
    assert torch.equal(out.cpu(), ref)
    assert not torch.equal(ref, (d * d).cumsum(-1)[:, -1])  # the data does tell orders apart


# ---------------------------------------------------------------------------------------------
# Activations and the residual (QuadsPolicy.activation_block_scaling): the row kernel's branch
# ---------------------------------------------------------------------------------------------


def _check_act(x, cfg, static_mask=None, nan=False, **kw):
    """The row kernel (packed parts, fp16 operands, or the summed operand) against the reference."""
    from quads.kernels.quantize_activations import quantize_rows
    from quads.ops.activation_quant import _kernel_residual_args, quantize_activation_reference

    ref = quantize_activation_reference(x.cpu(), cfg, None if static_mask is None else static_mask.cpu())
    residual, k_top, mask = _kernel_residual_args(x, cfg, static_mask)
    out = quantize_rows(x, residual=residual, k_top=k_top, static_mask=mask, granularity=cfg.granularity,
                        write_packed=True, write_operand=True, block_scaling=cfg.block_scaling, **kw)
    nan_elems = torch.isnan(x.cpu()) if nan else None
    assert_parts_equal(out.main.parts(), ref.main, nan_elems)
    one = torch.ones((), dtype=torch.float32)
    want = nvfp4_dequantize(ref.main.qdata, ref.main.scale, one).to(torch.float16)
    assert torch.equal(out.main.operand.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
    if ref.residual is not None:
        assert_parts_equal(out.residual.parts(), ref.residual, nan_elems)
    return ref


@pytest.mark.parametrize("fraction,gran", [(1.0, "row"), (0.5, "row"), (0.0, "row"), (1.0, "tensor")], ids=str)
def test_activation_row_kernel_bit_exact(fraction, gran):
    from quads.ops.activation_quant import ActivationQuant

    cfg = ActivationQuant(fraction, granularity=gran, block_scaling=FOS)
    x = adversarial(m=9, k=80, seed=8)
    if gran == "row":
        x[8, 3] = float("nan")  # its own row only
    ref = _check_act(x, cfg, nan=gran == "row")
    if gran == "row":  # the global scale's numerator is 256 * 6
        assert ref.main.global_encode_scale[0].item() == torch.tensor(1536.0).div(x[0].abs().max().cpu()).item()


def test_activation_row_kernel_static_mask_bf16_chunks_gather_and_sum():
    from quads.kernels.quantize_activations import quantize_rows
    from quads.ops.activation_quant import ActivationQuant, quantize_activation_reference, summed_operand_triton

    x = adversarial(m=6, k=96, seed=9)
    mask = (torch.rand(96, generator=torch.Generator().manual_seed(2)) > 0.5).to(DEV)
    _check_act(x, ActivationQuant(selection="static", block_scaling=FOS), static_mask=mask)
    _check_act(x.to(torch.bfloat16), ActivationQuant(block_scaling=FOS))
    _check_act(x, ActivationQuant(block_scaling=FOS), row_chunk=32)  # a row cut into programs
    idx = torch.tensor([4, 0, 0, 5], dtype=torch.int32, device=DEV)
    cfg = ActivationQuant(block_scaling=FOS)
    out = quantize_rows(x, residual="all", row_idx=idx, write_packed=True, block_scaling=FOS)
    ref = quantize_activation_reference(x.cpu()[idx.long().cpu()], cfg)
    assert_parts_equal(out.main.parts(), ref.main)
    assert_parts_equal(out.residual.parts(), ref.residual)
    summed, _ = summed_operand_triton(x, cfg)
    full = quantize_activation_reference(x.cpu(), cfg)
    one = torch.ones((), dtype=torch.float32)
    want = (nvfp4_dequantize(full.main.qdata, full.main.scale, one).to(torch.float16).float()
            + nvfp4_dequantize(full.residual.qdata, full.residual.scale, one).to(torch.float16).float()).to(torch.float16)
    assert torch.equal(summed.cpu().nan_to_num(7.0), want.nan_to_num(7.0))


def test_activation_policy_field_reaches_the_rollout_linear():
    import quads
    from tests.tiny_models import build

    with pytest.raises(ValueError, match="activation_block_scaling"):
        quads.QuadsPolicy(side="rollout", activation_block_scaling="4/6")
    model = build("llama")
    quads.quantize_(model, quads.QuadsPolicy(side="rollout", activation_block_scaling=FOS))
    layer = model.model.layers[0].self_attn.o_proj
    assert layer.quads_act.block_scaling == FOS
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    from quads.ops.activation_quant import ActivationQuant
    from quads.ops.linear_op import linear_reference

    parts = layer.weight.parts
    assert torch.equal(y, linear_reference(x, parts, layer.bias, ActivationQuant(block_scaling=FOS)))
    assert not torch.equal(y, linear_reference(x, parts, layer.bias, ActivationQuant()))
