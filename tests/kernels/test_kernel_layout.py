"""The Hopper kernel layout of packed NVFP4 weights: host round trip and in-kernel decode, bit-exact."""

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

import triton.language as tl  # noqa: E402

from quads.kernels.hopper_weight_layout import from_hopper_layout, load_weight_tile, to_hopper_layout  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_dequantize, nvfp4_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
USE_ASM = torch.cuda.is_available()


@triton.jit
def _decode_tiles(VALS, SCALES, OUT, num_kb, KBI: tl.constexpr, USE_ASM: tl.constexpr):
    pid = tl.program_id(0)
    kb = tl.program_id(1) * KBI
    w = load_weight_tile(VALS, SCALES, pid * 4, kb, num_kb, 64, KBI, USE_ASM)
    n = pid * 64 + tl.arange(0, 64)
    kk = kb * 64 + tl.arange(0, KBI * 64)
    tl.store(OUT + n[:, None] * (num_kb * 64) + kk[None, :], w, mask=(kk < num_kb * 64)[None, :])


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-7, 1, n)[:, None]  # E4M3-subnormal block scales too
    w[0, :16] = 0  # scale 0
    w[min(3, n - 1)] = torch.tensor([0.0, 0.5, -1, 1.5, 2, -3, 4, 6] * (k // 8)) * 0.01  # every E2M1 magnitude, both signs
    return w


@pytest.mark.parametrize("n,k", [(64, 64), (100, 96), (16, 208), (3, 32)])
def test_round_trip(n, k):
    p = nvfp4_quantize(_weight(n, k, seed=n))
    hw = to_hopper_layout(p.qdata, p.scale)
    assert hw.values.shape[-2:] == (32, 16) and hw.values.shape[0] * 16 % 64 == 0
    q, s = from_hopper_layout(hw)
    assert torch.equal(q, p.qdata) and torch.equal(s.view(torch.uint8), p.scale.view(torch.uint8))
    e = nvfp4_quantize(torch.randn(3, n, k))  # 3-D experts: one layout per expert
    he = to_hopper_layout(e.qdata, e.scale)
    q3, s3 = from_hopper_layout(he)
    assert torch.equal(q3, e.qdata) and torch.equal(s3.view(torch.uint8), e.scale.view(torch.uint8))


@pytest.mark.parametrize("kbi", [1, 2])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 96), (128, 320)])
def test_tile_decode_is_the_unscaled_weight(n, k, kbi):
    """load_weight_tile gives e2m1 * s * 2^-14 in fp16, exactly; padding decodes to zero."""
    p = nvfp4_quantize(_weight(n, k, seed=k))
    hw = to_hopper_layout(p.qdata.to(DEV), p.scale.to(DEV))
    num_kb = hw.values.shape[1]
    out = torch.full((hw.values.shape[0] * 16, num_kb * 64), float("nan"), dtype=torch.float16, device=DEV)
    _decode_tiles[(out.shape[0] // 64, triton.cdiv(num_kb, kbi))](hw.values, hw.scales, out, num_kb, KBI=kbi,
                                                                  USE_ASM=USE_ASM)
    ref = (nvfp4_dequantize(p.qdata, p.scale, torch.ones(())) * 2.0**-14).to(torch.float16)
    got = out.cpu()
    assert torch.equal(got[:n, :k].view(torch.int16) & 0x7FFF, ref.view(torch.int16) & 0x7FFF)  # magnitudes
    assert torch.equal(got[:n, :k], ref)  # values (signed; +-0 compare equal)
    assert (got[n:] == 0).all() and (got[:, k:] == 0).all()
