"""The Hopper kernel layout of packed NVFP4 weights: host round trip, the layout kernel (bytes equal
to the torch reference), in-place rewrites, bad inputs, and the in-kernel decode, bit-exact."""

import re

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

import triton.language as tl  # noqa: E402

from quads.kernels.hopper.weight_layout import to_hopper_layout_triton  # noqa: E402
from quads.kernels.hopper.weight_decode import load_weight_tile  # noqa: E402
from quads.kernels.hopper.weight_layout import (  # noqa: E402
    HopperWeight,
    from_hopper_layout,
    to_hopper_layout,
    to_hopper_layout_reference,
)
from quads.ops.backend_registry import get_backend  # noqa: E402
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


def _random_parts(shape, seed):
    """Random packed parts: every code byte and every scale byte equally likely (E4M3 NaN included)."""
    *lead, n, k = shape
    g = torch.Generator().manual_seed(seed)
    qdata = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 256, (*lead, n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    return qdata.to(DEV), scale.to(DEV)


def _assert_same_layout(got: HopperWeight, want: HopperWeight):
    assert (got.n, got.k) == (want.n, want.k)
    assert got.values.shape == want.values.shape and got.scales.shape == want.scales.shape
    assert got.values.dtype == got.scales.dtype == torch.uint8
    bad = (got.values != want.values).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} value bytes differ, first at {bad[0].tolist()}"
    bad = (got.scales != want.scales).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} scale bytes differ, first at {bad[0].tolist()}"


# N = 17, 70 and K = 16, 48, 80 need padding (K = 48, 80: a multiple of 16, not of 64); 3-D: experts
LAYOUT_SHAPES = [(64, 64), (64, 4096), (17, 16), (70, 48), (17, 80), (70, 128), (130, 192), (3, 17, 80), (2, 70, 48)]


@pytest.mark.parametrize("shape", LAYOUT_SHAPES)
def test_kernel_equals_the_reference(shape):
    """The kernel's bytes are the reference's (itself round-trip tested above), padding included,
    and invert to the inputs."""
    qdata, scale = _random_parts(shape, seed=sum(shape))
    got = to_hopper_layout_triton(qdata, scale)
    want = to_hopper_layout_reference(qdata.cpu(), scale.cpu())
    assert want.values.any() and (want.values != want.values.flatten()[0]).any()  # not a trivial layout
    _assert_same_layout(HopperWeight(got.values.cpu(), got.scales.cpu(), got.n, got.k), want)
    q, s = from_hopper_layout(got)
    assert torch.equal(q, qdata) and torch.equal(s.view(torch.uint8), scale.view(torch.uint8))


def test_kernel_every_code_byte_and_scale_byte():
    """(64, 64): the 2048 code bytes run through 0..255 eight times, the 256 scale bytes are 0..255."""
    qdata = torch.arange(64 * 32, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(64, 32)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(64, 4).view(torch.float8_e4m3fn)
    got = to_hopper_layout_triton(qdata.to(DEV), scale.to(DEV))
    want = to_hopper_layout_reference(qdata, scale)
    _assert_same_layout(HopperWeight(got.values.cpu(), got.scales.cpu(), got.n, got.k), want)
    assert torch.equal(torch.sort(got.scales.flatten().cpu()).values, torch.arange(256).to(torch.uint8))


@pytest.mark.parametrize("build", [to_hopper_layout_triton, to_hopper_layout], ids=["kernel", "dispatch"])
def test_rewrite_in_place(build):
    """``out`` is rewritten in place (same tensors, same addresses) with the new weight's layout."""
    q1, s1 = _random_parts((2, 70, 48), seed=1)
    q2, s2 = _random_parts((2, 70, 48), seed=2)
    out = build(q1, s1)
    ptrs = (out.values.data_ptr(), out.scales.data_ptr())
    again = build(q2, s2, out=out)
    assert again.values is out.values and again.scales is out.scales
    assert (out.values.data_ptr(), out.scales.data_ptr()) == ptrs
    want = to_hopper_layout_reference(q2.cpu(), s2.cpu())
    assert not torch.equal(want.values, to_hopper_layout_reference(q1.cpu(), s1.cpu()).values)
    _assert_same_layout(HopperWeight(out.values.cpu(), out.scales.cpu(), out.n, out.k), want)


def _bad_inputs():
    q, s = _random_parts((70, 48), seed=3)
    held = to_hopper_layout_reference(q.cpu(), s.cpu())
    held = HopperWeight(held.values.to(DEV), held.scales.to(DEV), held.n, held.k)
    other = to_hopper_layout_reference(*(t.cpu() for t in _random_parts((70, 128), seed=4)))
    return {
        "qdata dtype": (q.view(torch.int8), s, held, "qdata must be a uint8"),
        "scale dtype": (q, s.view(torch.uint8), held, "scale must be a torch.float8_e4m3fn"),
        "K not a multiple of 16": (q[:, :20], s[:, :2], held, "K = 40"),
        "scale shape": (q, s[:60], held, "scale has shape (60, 3)"),
        "out shape": (q, s, HopperWeight(other.values.to(DEV), other.scales.to(DEV), 70, 48), "out.values has shape"),
        "out dtype": (q, s, HopperWeight(held.values.view(torch.int8), held.scales, 70, 48),
                      "out.values is torch.int8"),
        "out device": (q, s, HopperWeight(held.values, held.scales.to("meta"), 70, 48), "out.scales is on meta"),
        "out n, k": (q, s, HopperWeight(held.values, held.scales, 69, 48), "69 x 48 weight"),
        "out type": (q, s, (held.values, held.scales), "out must be a HopperWeight"),
    }


@pytest.mark.parametrize("build", [to_hopper_layout_triton, to_hopper_layout], ids=["kernel", "dispatch"])
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_names_the_culprit_and_writes_nothing(build, case):
    qdata, scale, out, message = _bad_inputs()[case]
    tensors = [t for t in out if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    before = [t.clone() for t in tensors]
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        build(qdata, scale, out=out)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_prepare_weight_rewrites_a_fitting_layout_and_replaces_another():
    hopper = get_backend("hopper")
    w1, w2 = nvfp4_quantize(torch.randn(70, 96)), nvfp4_quantize(torch.randn(70, 96))
    held = hopper.prepare_weight(w1)
    kept = hopper.prepare_weight(w2, held)
    assert kept.values.data_ptr() == held.values.data_ptr()
    _assert_same_layout(kept, to_hopper_layout_reference(w2.qdata, w2.scale))
    wide = nvfp4_quantize(torch.randn(70, 160))
    before = held.values.clone()
    fresh = hopper.prepare_weight(wide, held)  # another shape: a new layout, the held one untouched
    assert fresh.values.data_ptr() != held.values.data_ptr() and torch.equal(held.values, before)
    _assert_same_layout(fresh, to_hopper_layout_reference(wide.qdata, wide.scale))


@pytest.mark.parametrize("kbi", [1, 2])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 96), (128, 320)])
@pytest.mark.parametrize("build", [to_hopper_layout_reference, to_hopper_layout_triton], ids=["reference", "kernel"])
def test_tile_decode_is_the_unscaled_weight(n, k, kbi, build):
    """load_weight_tile gives e2m1 * s * 2^-14 in fp16, exactly; padding decodes to zero."""
    p = nvfp4_quantize(_weight(n, k, seed=k))
    hw = build(p.qdata.to(DEV), p.scale.to(DEV))
    num_kb = hw.values.shape[1]
    out = torch.full((hw.values.shape[0] * 16, num_kb * 64), float("nan"), dtype=torch.float16, device=DEV)
    _decode_tiles[(out.shape[0] // 64, triton.cdiv(num_kb, kbi))](hw.values, hw.scales, out, num_kb, KBI=kbi,
                                                                  USE_ASM=USE_ASM)
    ref = (nvfp4_dequantize(p.qdata, p.scale, torch.ones(())) * 2.0**-14).to(torch.float16)
    got = out.cpu()
    assert torch.equal(got[:n, :k].view(torch.int16) & 0x7FFF, ref.view(torch.int16) & 0x7FFF)  # magnitudes
    assert torch.equal(got[:n, :k], ref)  # values (signed; +-0 compare equal)
    assert (got[n:] == 0).all() and (got[:, k:] == 0).all()
