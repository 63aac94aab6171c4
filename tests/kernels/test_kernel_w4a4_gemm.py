"""Exact-emulation W4A4 (+ residual) GEMM vs ``w4a4_matmul_reference``; determinism and batch
invariance (a row's bits do not depend on the other rows, the split, or the kernel regime).

Tolerance: the kernel and the reference sum the same exact products in different fp32 orders,
so |y - ref| <= 2 * K * 2^-24 * (|x̂| |Ŵ|ᵀ / (S_x S_w) + |r̂| |Ŵ|ᵀ / (S_r S_w)) elementwise.
"""

import os

import pytest
import torch


triton = pytest.importorskip("triton")
# the interpreter evaluates 1/0 -> inf on purpose (E4M3 zero scales): numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from quads.kernels.w4a4_gemm_hopper import GemmConfig, w4a4_gemm  # noqa: E402
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
SEG = 32 if INTERP else 1024  # small canonical segments on CPU so split-K is exercised


def cfg(split, bm=16, w_mode=0):
    if INTERP:
        return GemmConfig(bn=16, bm=bm, bk=32, split=split, num_warps=1, num_stages=1, use_asm=False, w_mode=w_mode)
    return GemmConfig(bn=64, bm=bm, bk=128, split=split, num_warps=4, num_stages=3, w_mode=w_mode)


def _operands(m, k, n, seed=0, residual=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[0, :16] *= 1e-3  # a small block
    w = torch.randn(n, k, generator=g) * 0.05
    w[1, :16] = 1e-6  # weight block with a tiny / subnormal scale
    wp = nvfp4_quantize(w.to(DEV))
    act = ActivationQuant(residual_fraction=0.5 if residual else 0.0)
    ref_qa = quantize_activation_reference(x, act)
    q = activation_operands_triton(x.to(DEV), act)
    return x, wp, ref_qa, q


def _bound(qa: QuantizedActivation, wp: NVFP4Parts, k: int) -> torch.Tensor:
    one = torch.ones(())
    w = nvfp4_dequantize(wp.qdata.cpu(), wp.scale.cpu(), one).abs()
    m = qa.main
    b = nvfp4_dequantize(m.qdata, m.scale, one).abs() @ w.T / (m.global_encode_scale.reshape(-1, 1) * wp.global_encode_scale.cpu())
    if qa.residual is not None:
        r = qa.residual
        b = b + nvfp4_dequantize(r.qdata, r.scale, one).abs() @ w.T / (r.global_encode_scale.reshape(-1, 1) * wp.global_encode_scale.cpu())
    return 2 * k * 2.0**-24 * b + 1e-30


@pytest.mark.parametrize("split,w_mode", [(False, 0), (True, 0), (False, 1)], ids=["plain", "splitk", "w16"])
@pytest.mark.parametrize("residual", [False, True])
def test_gemm_matches_reference(split, w_mode, residual):
    m, k, n = 5, 96, 40  # odd M, N not a multiple of the tile, 3 segments on CPU
    x, wp, qa, q = _operands(m, k, n, residual=residual)
    ref = w4a4_matmul_reference(qa, NVFP4Parts(wp.qdata.cpu(), wp.scale.cpu(), wp.global_encode_scale.cpu()))
    y = w4a4_gemm(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale,
                  q.residual if residual else None, q.residual_scale if residual else None, config=cfg(split, w_mode=w_mode), seg_k=SEG)
    err = (y.cpu() - ref).abs()
    assert torch.all(err <= _bound(qa, wp, k)), err.max()


def test_gemm_k16_bias_and_tail():
    m, k, n = 3, 16, 24
    x, wp, qa, q = _operands(m, k, n, seed=1)
    bias = torch.randn(n).to(DEV)
    ref = w4a4_matmul_reference(qa, NVFP4Parts(wp.qdata.cpu(), wp.scale.cpu(), wp.global_encode_scale.cpu())) + bias.cpu()
    y = w4a4_gemm(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale, q.residual, q.residual_scale, bias=bias,
                  config=cfg(False), seg_k=SEG)
    assert torch.all((y.cpu() - ref).abs() <= _bound(qa, wp, k) + 1e-6 * bias.abs().cpu())


def test_batch_invariance_and_determinism():
    """A row's output bits: alone == in a batch == split-K == non-split, and run to run."""
    m, k, n = 7, 96, 32
    x, wp, qa, q = _operands(m, k, n, seed=2)
    args = (wp.qdata, wp.scale, wp.global_encode_scale)
    full_split = w4a4_gemm(q.main, q.main_scale, *args, q.residual, q.residual_scale, config=cfg(True), seg_k=SEG)
    full_plain = w4a4_gemm(q.main, q.main_scale, *args, q.residual, q.residual_scale, config=cfg(False), seg_k=SEG)
    full_w16 = w4a4_gemm(q.main, q.main_scale, *args, q.residual, q.residual_scale, config=cfg(False, w_mode=1), seg_k=SEG)
    again = w4a4_gemm(q.main, q.main_scale, *args, q.residual, q.residual_scale, config=cfg(True), seg_k=SEG)
    assert torch.equal(full_split, again)
    assert torch.equal(full_split, full_plain)
    assert torch.equal(full_split, full_w16)
    for row in (0, 3, 6):
        q1 = activation_operands_triton(x[row:row + 1].to(DEV), ActivationQuant())
        alone = w4a4_gemm(q1.main, q1.main_scale, *args, q1.residual, q1.residual_scale, config=cfg(True), seg_k=SEG)
        assert torch.equal(alone[0], full_split[row])
        assert torch.equal(alone[0], full_plain[row])


def test_nan_row_stays_in_its_row():
    m, k, n = 4, 32, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g)
    x[2, 5] = float("nan")
    wp = nvfp4_quantize((torch.randn(n, k, generator=g) * 0.1).to(DEV))
    q = activation_operands_triton(x.to(DEV), ActivationQuant())
    y = w4a4_gemm(q.main, q.main_scale, wp.qdata, wp.scale, wp.global_encode_scale, q.residual, q.residual_scale, config=cfg(True), seg_k=SEG)
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
