"""Exact-emulation W4A4 (+ residual) GEMMs vs ``w4a4_matmul_reference``: the decode kernel (Hopper
weight layout, split-K over canonical segments) and the prefill kernel (materialized fp16 weight);
determinism and batch invariance (a row's bits do not depend on the other rows, on M, or on which
kernel ran); the prefill kernel's TMA loads against its pointer loads (bits); the interpreter
configs are the GPU defaults on smaller tiles; the archived cuBLAS prefill (lab) within the bound.

Tolerance: the kernels and the reference sum the same exact products in different fp32 orders,
so |y - ref| <= 2 * K * 2^-24 * (|x̂| + |r̂|) |Ŵ|ᵀ / (S_x S_w) elementwise (the residual shares S_x).
"""

import os

import pytest
import torch


triton = pytest.importorskip("triton")
# the interpreter evaluates 1/0 -> inf on purpose (E4M3 zero scales): numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from quads.kernels.hopper.weight_layout import to_hopper_layout  # noqa: E402
from quads.kernels.hopper.w4a4_decode import DecodeConfig, decode_gemm  # noqa: E402
from quads.kernels.hopper.w4a4_gemm import GemmConfig, w4a4_gemm  # noqa: E402
from lab.cublas_prefill import cublas_prefill  # noqa: E402  (archived: no library caller)
from quads.ops import ActivationQuant, get_backend, rollout_linear, use_backend, w4a4_matmul_reference  # noqa: E402
from quads.ops.activation_quant import (  # noqa: E402
    QuantizedActivation,
    activation_operands_triton,
    quantize_activation_reference,
)
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize, nvfp4_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def _operands(m, k, n, seed=0, residual=True, fraction=0.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[0, :16] *= 1e-3  # a small block
    w = torch.randn(n, k, generator=g) * 0.05
    w[1, :16] = 1e-6  # weight block with a tiny / subnormal scale
    w[2, 16:32] = 0.0  # an all-zero block: scale 0
    wp = nvfp4_quantize(w.to(DEV))
    act = ActivationQuant(residual_fraction=fraction if residual else 0.0)
    ref_qa = quantize_activation_reference(x, act)
    q = activation_operands_triton(x.to(DEV), act)
    return x, wp, ref_qa, q


def _cpu(p: NVFP4Parts) -> NVFP4Parts:
    return NVFP4Parts(p.qdata.cpu(), p.scale.cpu(), p.global_encode_scale.cpu())


def _bound(qa: QuantizedActivation, wp: NVFP4Parts, k: int) -> torch.Tensor:
    one = torch.ones(())
    w = nvfp4_dequantize(wp.qdata.cpu(), wp.scale.cpu(), one).abs()
    m = qa.main
    b = nvfp4_dequantize(m.qdata, m.scale, one).abs() @ w.T
    if qa.residual is not None:  # the residual shares the rows' global scales
        b = b + nvfp4_dequantize(qa.residual.qdata, qa.residual.scale, one).abs() @ w.T
    return 2 * k * 2.0**-24 * b / (m.global_encode_scale.reshape(-1, 1) * wp.global_encode_scale.cpu()) + 1e-30


def _decode(q, wp, m, residual, bias=None, config=None):
    hw = to_hopper_layout(wp.qdata, wp.scale)
    return decode_gemm(q.stacked, q.main_scale, hw, wp.global_encode_scale, m, residual, bias, config=config)


def _prefill(q, wp, bias=None):
    return w4a4_gemm(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale, q.residual, bias=bias)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_gemm_matches_reference(kernel, residual):
    m, k, n = 5, 1088, 72  # odd M; N not a multiple of the tile; 3 segments, the last one partial
    x, wp, qa, q = _operands(m, k, n, residual=residual)
    ref = w4a4_matmul_reference(qa, _cpu(wp))
    if kernel == "decode":
        y = _decode(q, wp, m, residual)
    else:
        y = _prefill(q, wp)
    err = (y.cpu() - ref).abs()
    assert torch.all(err <= _bound(qa, wp, k)), err.max()


@pytest.mark.parametrize("kbi", [1, 2, 4])
def test_decode_k_tail_and_bias(kbi):
    """K not a multiple of 64 (layout padding) nor of the per-iteration blocks; a bias."""
    m, k, n = 3, 208, 64
    x, wp, qa, q = _operands(m, k, n, seed=1)
    bias = torch.randn(n).to(DEV)
    ref = w4a4_matmul_reference(qa, _cpu(wp)) + bias.cpu()
    cfg = DecodeConfig(bn=64, kbi=kbi, num_warps=4, num_stages=1, use_asm=not INTERP, prefetch=kbi == 4 and not INTERP)
    y = _decode(q, wp, m, True, bias, cfg)
    assert torch.all((y.cpu() - ref).abs() <= _bound(qa, wp, k) + 1e-6 * bias.abs().cpu())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("m,k,n", [(5, 1088, 72), (3, 208, 64), (16, 640, 128)])
def test_decode_epilogue_variants_have_the_same_bits(m, k, n, residual):
    """The split-K reduction as a second launch (``reduce_kernel``), the prefetched segment halves
    and the programmatic dependent launch option give the default's bits (odd M, N not a
    multiple of the tile, K with a partial last segment and a K tail inside a layout block, bias
    or not). ``kbi = 4`` throughout: under the interpreter a dot's rounding depends on its width."""
    x, wp, qa, q = _operands(m, k, n, seed=5, residual=residual)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(DEV)
    asm = not INTERP
    base = DecodeConfig(bn=64, kbi=4, num_warps=4, num_stages=1, use_asm=asm)
    for b in (None, bias):
        want = _decode(q, wp, m, residual, b, base)
        for cfg in (DecodeConfig(bn=64, kbi=4, use_asm=asm, reduce_kernel=True),
                    DecodeConfig(bn=64, kbi=4, use_asm=asm, prefetch=True),
                    DecodeConfig(bn=64, kbi=4, use_asm=asm, prefetch=True, pdl=True, reduce_kernel=True)):
            got = _decode(q, wp, m, residual, b, cfg)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), cfg
    ref = w4a4_matmul_reference(qa, _cpu(wp))
    assert torch.all((want.cpu() - bias.cpu() - ref).abs() <= _bound(qa, wp, k) + 1e-6 * bias.abs().cpu())


def test_batch_invariance_and_determinism():
    """A row's output bits: alone == in a batch, run to run; and (on a GPU,
    where every kernel chains the same k16 wgmma steps) decode == prefill. The interpreter's dot
    is numpy's matmul, whose summation order depends on the tile shapes, so across the two
    kernels (different tiles) it is only checked within the fp32 bound there."""
    m, k, n = 7, 1088, 64
    x, wp, qa, q = _operands(m, k, n, seed=2)
    dec = _decode(q, wp, m, True)
    pre = _prefill(q, wp)
    assert torch.equal(dec, _decode(q, wp, m, True))
    assert torch.equal(pre, _prefill(q, wp))
    if INTERP:
        assert torch.all((dec.cpu() - pre.cpu()).abs() <= 2 * _bound(qa, wp, k))
    else:
        assert torch.equal(dec, pre)
    for row in (0, 3, 6):
        q1 = activation_operands_triton(x[row:row + 1].to(DEV), ActivationQuant(residual_fraction=0.5))
        assert torch.equal(_decode(q1, wp, 1, True)[0], dec[row])
        assert torch.equal(_prefill(q1, wp)[0], pre[row])


def test_nan_row_stays_in_its_row():
    m, k, n = 4, 64, 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g)
    x[2, 5] = float("nan")
    wp = nvfp4_quantize((torch.randn(n, k, generator=g) * 0.1).to(DEV))
    q = activation_operands_triton(x.to(DEV), ActivationQuant())
    for y in (_decode(q, wp, m, True), _prefill(q, wp)):
        assert torch.isnan(y[2]).all()
        assert torch.isfinite(y[[0, 1, 3]]).all()


@pytest.mark.parametrize("act", [ActivationQuant(), ActivationQuant(residual_fraction=0.0),
                                 ActivationQuant(granularity="tensor")],
                         ids=["res", "plain", "tensor-scale"])
def test_rollout_linear_dispatch(act):
    """quads.ops.rollout_linear with the kernel backend equals the torch backend (bf16 out)."""
    g = torch.Generator().manual_seed(4)
    w = NVFP4Tensor.from_float((torch.randn(24, 48, generator=g) * 0.1).bfloat16())
    x = torch.randn(2, 3, 48, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    ref = rollout_linear(x, w, bias, act)
    with use_backend("hopper"):
        got = rollout_linear(x.to(DEV), w.to(DEV), bias.to(DEV), act)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    # bf16 output: equal up to one bf16 rounding step of the fp32 summation-order difference
    assert torch.allclose(got.cpu().float(), ref.float(), rtol=2**-7, atol=1e-3)


def test_forced_blackwell_without_sm100_uses_emulation():
    g = torch.Generator().manual_seed(5)
    w = NVFP4Tensor.from_float((torch.randn(16, 32, generator=g) * 0.1))
    x = torch.randn(3, 32, generator=g)
    act = ActivationQuant()
    ref = rollout_linear(x, w, None, act)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("native Blackwell path: covered by test_kernel_blackwell")
    got = get_backend("blackwell").linear(x.to(DEV), w.parts if not torch.cuda.is_available() else w.to(DEV).parts,
                                          None, act, None)
    assert torch.allclose(got.cpu(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
def test_stacked_weights_with_per_row_global_scales(residual):
    """Weights stacked along N (fused q/k/v), each with its own global scale, passed with one
    ``S_w`` per row: every output column has the bits of its own weight's GEMM."""
    m, k = 3, 640
    x, wa, qa, q = _operands(m, k, 64, seed=7, residual=residual)
    g = torch.Generator().manual_seed(8)
    wb = nvfp4_quantize((torch.randn(128, k, generator=g) * 3.0).to(DEV))  # another global scale
    assert not torch.equal(wa.global_encode_scale, wb.global_encode_scale)
    stacked = to_hopper_layout(torch.cat([wa.qdata, wb.qdata]), torch.cat([wa.scale, wb.scale]))
    sw = torch.cat([wa.global_encode_scale.reshape(1).expand(64), wb.global_encode_scale.reshape(1).expand(128)])
    bias = torch.randn(192, generator=g).to(DEV)
    got = decode_gemm(q.stacked, q.main_scale, stacked, sw.float(), m, residual, bias)
    want = torch.cat([_decode(q, wa, m, residual, bias[:64]), _decode(q, wb, m, residual, bias[64:])], dim=1)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="one scale per weight row"):
        decode_gemm(q.stacked, q.main_scale, stacked, sw[:100].float(), m, residual)


# Prefill load variants vs pointer loads. Under the interpreter a dot is numpy's matmul, whose
# summation order depends on the tile shape, so the variants run on the base's tile; on a GPU
# (k16 wgmma chains) any tile gives the same bits.
_TILE = dict(bn=16, bm=16, bk=64, num_warps=1, num_stages=1) if INTERP else dict(bn=64, bm=64, bk=64, num_warps=4,
                                                                                num_stages=3)
_VARIANTS = {
    "tma": dict(loads="tma"),
    "tma-group3": dict(loads="tma", group=3),
    "pointer-group1": dict(loads="pointer", group=1),
}


def _variant_run(q, wp, cfg, residual, bias=None, out_dtype=torch.float32):
    return w4a4_gemm(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale,
                     q.residual if residual else None, bias=bias, out_dtype=out_dtype, config=cfg)


@pytest.fixture(scope="module")
def pointer_load_bases():
    """Per ``residual``: the operands, bias and pointer-load outputs every variant is compared
    with (the same inputs for all variants: computed once per module, read only)."""
    cache = {}

    def get(residual):
        if residual not in cache:
            m, k, n = 37, 1040, 72
            x, wp, qa, q = _operands(m, k, n, seed=6, residual=residual)
            bias = torch.randn(n).to(DEV) if residual else None
            base_cfg = GemmConfig(**_TILE, loads="pointer")
            dtypes = (torch.float32, torch.bfloat16) if residual else (torch.float32,)
            cache[residual] = (q, wp, bias, {dt: _variant_run(q, wp, base_cfg, residual, bias, dt) for dt in dtypes})
        return cache[residual]

    return get


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_prefill_load_variants_equal_pointer_load_bits(variant, residual, pointer_load_bases):
    """Odd M (a partial token tile), N not a multiple of the tile, K = 1040: two segments and a
    partial third, K not a multiple of 64 (TMA zero fill, masks); group sizes not dividing the
    grid; fp32 output with a bias (plain: without), and with the residual also a bf16 output."""
    q, wp, bias, bases = pointer_load_bases(residual)  # m, k, n = 37, 1040, 72
    cfg = GemmConfig(**_TILE, **_VARIANTS[variant])
    for out_dtype, base in bases.items():
        got = _variant_run(q, wp, cfg, residual, bias, out_dtype)
        assert got.dtype == out_dtype
        assert torch.equal(got, base)


def test_prefill_operands_outside_one_buffer():
    """The residual rows a slice of a larger stacked buffer (the gap is not M rows), or a separate
    tensor: TMA takes the first as a 3-D view and falls back to pointer loads for the second."""
    m, k, n = 21, 576, 64
    x, wp, qa, q = _operands(m + 11, k, n, seed=7)
    cfg = GemmConfig(**_TILE, loads="tma")
    base = w4a4_gemm(q.main[:m], q.main_scale[:m], wp.qdata, wp.scale, wp.global_encode_scale, q.residual[:m],
                     config=GemmConfig(**_TILE, loads="pointer"))
    for r16 in (q.residual[:m], q.residual[:m].clone()):
        y = w4a4_gemm(q.main[:m], q.main_scale[:m], wp.qdata, wp.scale, wp.global_encode_scale, r16, config=cfg)
        assert torch.equal(y, base)


@pytest.mark.parametrize("residual", [False, True])
def test_cublas_prefill_within_bound(residual):
    """The opt-in cuBLAS path (not batch invariant) meets the kernels' fp32-order bound."""
    m, k, n = 37, 1040, 72
    x, wp, qa, q = _operands(m, k, n, seed=8, residual=residual)
    bias = torch.randn(n).to(DEV)
    ref = w4a4_matmul_reference(qa, _cpu(wp)) + bias.cpu()
    y = cublas_prefill(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale, q.residual, bias)
    assert torch.all((y.cpu() - ref).abs() <= _bound(qa, wp, k) + 1e-6 * bias.abs().cpu())
    yb = cublas_prefill(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale, q.residual, bias,
                        out_dtype=torch.bfloat16)
    assert torch.equal(yb, y.to(torch.bfloat16))


def test_decode_tile_overhanging_the_row_padding():
    """128-row tiles over a weight whose rows pad to 64 but not 128 (N = 72 -> 128 stored rows ok;
    N = 136 -> 192 stored rows, the last 128-row tile half outside): nothing past the stored rows
    is read (masked), and the result has the 64-row tiles' bits."""
    m, k, n = 2, 512, 136
    x, wp, qa, q = _operands(m, k, n, seed=9)
    asm = not INTERP
    want = _decode(q, wp, m, True, None, DecodeConfig(bn=64, kbi=1, use_asm=asm))
    configs = [DecodeConfig(bn=128, kbi=1, num_warps=8, use_asm=asm)]
    if not INTERP:  # under the interpreter a 256-channel dot rounds unlike four 64-channel ones
        configs.append(DecodeConfig(bn=128, kbi=4, num_warps=8, use_asm=asm, prefetch=True))
    for cfg in configs:
        got = _decode(q, wp, m, True, None, cfg)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), cfg
