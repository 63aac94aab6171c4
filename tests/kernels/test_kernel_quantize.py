"""Activation / weight quantization kernels vs the NVFP4 reference: bit-exact.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU (small shapes), or natively on a GPU.
"""


import pytest
import torch


triton = pytest.importorskip("triton")
# the interpreter evaluates 1/0 -> inf on purpose (E4M3 zero scales): numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

import triton.language as tl  # noqa: E402

from quads.kernels.nvfp4_blocks import e2m1_mag_code  # noqa: E402
from quads.kernels.quantize_activations import quantize_rows  # noqa: E402
from quads.ops import use_backend  # noqa: E402
from quads.ops.activation_quant import (  # noqa: E402
    ActivationQuant,
    num_residual_channels,
    quantize_activation_reference,
    quantize_activation_triton,
)
from quads.ops.weight_quant import quantize_weight_triton  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize, nvfp4_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.uint8)


def assert_parts_equal(got: NVFP4Parts, ref: NVFP4Parts, nan_elems: torch.Tensor | None = None):
    """Bit equality of qdata / scale / global scale. Elements listed in ``nan_elems`` (input NaN)
    may differ in their sign bit only (NaN sign propagation is platform-defined, see the kernel
    doc); NaN global scales compare as NaN."""
    assert got.qdata.shape == ref.qdata.shape and got.scale.shape == ref.scale.shape
    assert got.scale.dtype == torch.float8_e4m3fn and got.qdata.dtype == torch.uint8
    q, qr = got.qdata.cpu(), ref.qdata.cpu()
    if nan_elems is not None and nan_elems.any():
        nan_elems = nan_elems.cpu()
        sign = torch.zeros_like(nan_elems, dtype=torch.uint8)
        sign[nan_elems] = 0x8
        sign_mask = sign[..., 0::2] | (sign[..., 1::2] << 4)
        q, qr = q & ~sign_mask, qr & ~sign_mask
    assert torch.equal(q, qr), f"qdata differs at {(q != qr).nonzero()[:8].tolist()}"
    assert torch.equal(_bits(got.scale).cpu(), _bits(ref.scale).cpu()), "block scales differ"
    g, gr = got.global_encode_scale.cpu(), ref.global_encode_scale.cpu()
    assert g.shape == gr.shape
    both_nan = torch.isnan(g) & torch.isnan(gr)
    assert torch.equal(torch.where(both_nan, 0, _bits(g)), torch.where(both_nan, 0, _bits(gr))), (g, gr)


def adversarial(m=9, k=48, dtype=torch.float32, seed=0):
    """Rows that hit every corner of the recipe (see the comments)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(m, 9), k, generator=g) * 3
    x[1] = 0  # all-zero row: S_enc = 1, scales 0, residual zero
    x[2, :16] = 1e-6  # block scale underflows to 0 / E4M3 subnormal scales
    x[2, 16:32] = 3e-3
    x[2, 32:] = 1e3
    x[3] = torch.tensor([1.0, -1.0, 0.5, -0.25] * (k // 4))  # ties in |r| and E2M1 ties
    x[4, 5], x[4, 7] = float("inf"), -float("inf")  # inf: S_enc = 1, scale 448
    x[5] *= 1e37  # huge
    x[6] *= 1e-38  # tiny: fp32-subnormal dequantized values (per-element division path)
    x[7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (k // 8)) * (1 / 6)  # E2M1 ties
    return x[:m].to(dtype).to(DEV)


CONFIGS = [
    ActivationQuant(residual_fraction=0.5),
    ActivationQuant(residual_fraction=0.25),
    ActivationQuant(residual_fraction=1.0),
    ActivationQuant(residual_fraction=0.0),
    ActivationQuant(residual_fraction=0.01),  # k = 0 channels: a zero residual, not None
    ActivationQuant(granularity="tensor"),
]


def _check_activation(x, cfg, search, static_mask=None, nan_rows=None):
    ref = quantize_activation_reference(x.cpu(), cfg, None if static_mask is None else static_mask.cpu())
    k_top = num_residual_channels(x.shape[1], cfg.residual_fraction)
    residual = "none" if cfg.residual_fraction == 0 else cfg.selection
    if residual == "per_token" and k_top == x.shape[1]:
        residual = "all"  # k = 100%: no selection (what the ops glue launches)
    out = quantize_rows(
        x, residual=residual, k_top=k_top,
        static_mask=static_mask, granularity=cfg.granularity, write_packed=True, write_operand=True,
        topk_search=search,
    )
    nan_elems = torch.isnan(x.cpu()) if nan_rows else None
    assert_parts_equal(out.main.parts(), ref.main, nan_elems)
    # the fp16 GEMM operand is exactly e2m1 * f32(scale)
    one = torch.ones((), dtype=torch.float32)
    unscaled = nvfp4_dequantize(ref.main.qdata, ref.main.scale, one).to(torch.float16)
    fin = ~torch.isnan(unscaled)
    assert torch.equal(out.main.operand.cpu()[fin], unscaled[fin])
    if ref.residual is None:
        assert out.residual is None
    else:
        assert_parts_equal(out.residual.parts(), ref.residual)
        ru = nvfp4_dequantize(ref.residual.qdata, ref.residual.scale, one).to(torch.float16)
        got_r = out.residual.operand.cpu()
        assert torch.equal(torch.isnan(got_r), torch.isnan(ru))
        assert torch.equal(got_r[~torch.isnan(ru)], ru[~torch.isnan(ru)])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.residual_fraction}-{c.selection}-{c.granularity}")
def test_activation_bit_exact(cfg):
    _check_activation(adversarial(), cfg, search="binary")


@pytest.mark.parametrize("search", ["binary", "packed5"])
def test_topk_search_variants(search):
    _check_activation(adversarial(seed=1), ActivationQuant(residual_fraction=0.5), search=search)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_low_precision_inputs(dtype):
    x = adversarial(m=7, dtype=dtype, seed=2)
    if dtype == torch.float16:
        x = torch.nan_to_num(x, posinf=60000.0, neginf=-60000.0)
    _check_activation(x, ActivationQuant(residual_fraction=0.5), search="packed5")


def test_activation_k16_odd_m():
    x = (torch.randn(5, 16) * 4).to(DEV)
    for cfg, search in ((ActivationQuant(residual_fraction=0.5), "binary"), (ActivationQuant(residual_fraction=0.5), "packed5"),
                        (ActivationQuant(residual_fraction=0.0), "binary")):
        _check_activation(x, cfg, search=search)


def test_activation_nan_rows():
    x = adversarial(m=5, seed=3)
    x[3, 9] = float("nan")
    _check_activation(x, ActivationQuant(residual_fraction=0.5), search="binary", nan_rows=True)  # NaN row: residual zero
    _check_activation(x, ActivationQuant(residual_fraction=0.5), search="packed5", nan_rows=True)
    _check_activation(x, ActivationQuant(residual_fraction=0.5), search="auto", nan_rows=True)
    _check_activation(x, ActivationQuant(granularity="tensor"), search="binary", nan_rows=True)
    _check_activation(x, ActivationQuant(residual_fraction=1.0), search="binary", nan_rows=True)  # NaN residual row


def test_activation_static_mask():
    x = adversarial(seed=4)
    mask = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(0)) > 0.5
    _check_activation(x, ActivationQuant(selection="static"), search="binary", static_mask=mask.to(DEV))


def test_entry_point_and_dispatch():
    x = adversarial(m=3, seed=5).to(torch.bfloat16)  # odd M
    cfg = ActivationQuant(residual_fraction=0.5)
    ref = quantize_activation_reference(x.cpu(), cfg)
    got = quantize_activation_triton(x, cfg)
    assert_parts_equal(got.main, ref.main)
    assert_parts_equal(got.residual, ref.residual)
    from quads.ops import quantize_activation

    with use_backend("hopper"):
        got2 = quantize_activation(x, cfg)
    assert_parts_equal(got2.residual, ref.residual)
    with pytest.raises(ValueError, match="calibrated channel mask"):
        quantize_activation_triton(x, ActivationQuant(selection="static"))
    with pytest.raises(ValueError):
        quantize_activation_triton(x[0], cfg)


def test_row_gather():
    x = adversarial(m=6, seed=6)
    idx = torch.tensor([4, 0, 0, 5], dtype=torch.int32, device=DEV)
    out = quantize_rows(x, residual="per_token", k_top=24, row_idx=idx, write_packed=True)
    ref = quantize_activation_reference(x.cpu()[idx.long().cpu()], ActivationQuant(residual_fraction=0.5))
    assert_parts_equal(out.main.parts(), ref.main)
    assert_parts_equal(out.residual.parts(), ref.residual)


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    flat = w.view(-1, shape[-1])
    flat[0] = 0
    flat[1, :16] = 1e-9
    flat[2, 3] = 40.0
    return w.to(dtype).to(DEV)


@pytest.mark.parametrize(
    "shape,gran,dtype",
    [
        ((12, 48), None, torch.bfloat16),
        ((5, 32), "row", torch.float32),
        ((3, 6, 32), None, torch.bfloat16),  # expert scales
        ((3, 6, 32), "tensor", torch.float16),
    ],
)
def test_weight_bit_exact(shape, gran, dtype):
    w = _weight(shape, dtype, seed=len(shape))
    assert_parts_equal(quantize_weight_triton(w, gran), nvfp4_quantize(w.cpu(), gran))


def test_weight_nonfinite_agrees_with_reference():
    w = _weight((4, 32), torch.float32, seed=9)
    w[1, 4] = float("inf")
    assert_parts_equal(quantize_weight_triton(w, "row"), nvfp4_quantize(w.cpu(), "row"))
    w[2, 5] = float("nan")
    assert_parts_equal(quantize_weight_triton(w, "row"), nvfp4_quantize(w.cpu(), "row"), torch.isnan(w.cpu()))


def test_weight_sync_through_kernel_backend():
    """quantize_ and sync_weights_ on a hopper-backend rollout module give the reference's bits."""
    import torch.nn as nn

    import quads

    w = _weight((16, 64), torch.bfloat16, seed=11)
    trainer, rollout = nn.Linear(64, 16, bias=False), nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        trainer.weight.copy_(w.cpu().float())
    rollout = rollout.to(torch.bfloat16).to(DEV)
    with use_backend("hopper"):
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    assert rollout.quads_backend.name == "hopper"
    ref = NVFP4Tensor.from_float(w.cpu() * 2)
    with torch.no_grad():
        trainer.weight.mul_(2)
    quads.sync_weights_(rollout, trainer.to(torch.bfloat16).to(DEV), plain_trainer=True)
    assert_parts_equal(rollout.weight.parts, ref.parts)


@triton.jit
def _e2m1_probe_kernel(A, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(A + offs, mask=offs < n, other=0.0)
    tl.store(OUT + offs, e2m1_mag_code(a), mask=offs < n)


def e2m1_code_probe(a: torch.Tensor) -> torch.Tensor:
    """The kernels' E2M1 magnitude index of |v| values in [0, 6] (int32)."""
    a = a.float().contiguous()
    out = torch.empty(a.shape, dtype=torch.int32, device=a.device)
    _e2m1_probe_kernel[(triton.cdiv(a.numel(), 1024),)](a, out, a.numel(), BLOCK=1024)
    return out


def test_e2m1_rounding_exhaustive():
    """The kernel's E2M1 rounding equals the reference's threshold ladder on every fp32 value
    of [0, 6] reachable by the tie points and their neighbours, plus a dense random sample."""
    from quads.tensor.nvfp4_math import e2m1_codes_rne

    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    near = torch.cat([ties, torch.nextafter(ties, torch.full_like(ties, 10.0)),
                      torch.nextafter(ties, torch.full_like(ties, -10.0)).clamp(min=0)])
    dense = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 6
    vals = torch.cat([near, dense, torch.tensor([float("nan"), 1e-40, 1e-45])])
    got = e2m1_code_probe(vals.to(DEV)).cpu()
    ref = e2m1_codes_rne(vals)
    assert torch.equal(got.to(torch.uint8), ref & 0x7)


@pytest.mark.parametrize("cfg", [ActivationQuant(residual_fraction=1.0), ActivationQuant(residual_fraction=0.0),
                                 ActivationQuant(selection="static")], ids=["all", "plain", "static"])
def test_row_chunks_equal_whole_rows(cfg):
    """Rows cut into programs of 32 channels (each reads the whole row for its amax) give the
    reference's bits, NaN rows and a K that is not a multiple of the chunk included."""
    x = adversarial(m=6, k=80, seed=7)
    x[5, 3] = float("nan")
    mask = (torch.rand(80, generator=torch.Generator().manual_seed(1)) > 0.5).to(DEV)
    sm = mask if cfg.selection == "static" else None
    ref = quantize_activation_reference(x.cpu(), cfg, None if sm is None else sm.cpu())
    residual = "none" if cfg.residual_fraction == 0 else ("all" if cfg.selection == "per_token" else "static")
    out = quantize_rows(x, residual=residual, static_mask=sm, write_packed=True, write_operand=True, row_chunk=32)
    nan_elems = torch.isnan(x.cpu())
    assert_parts_equal(out.main.parts(), ref.main, nan_elems)
    if ref.residual is not None:
        assert_parts_equal(out.residual.parts(), ref.residual, nan_elems)
    with pytest.raises(ValueError, match="whole rows"):
        quantize_rows(x, residual="per_token", k_top=40, row_chunk=32)
