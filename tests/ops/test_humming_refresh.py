"""The humming layout on CPU: the refresh of a weight sync, the layout restated in torch, packed parts on demand.

* :mod:`quads.kernels.humming.layout` against a line-by-line Python transcription of humming's
  ``weight_repack_nk`` kernel (``process.cuh``, 4-bit weight, 16-bit activations, interleave mode
  3), and its inverse.
* With humming 0.1.19 importable (the ``humming`` extra; skipped otherwise) and a faked H200
  ``DeviceInfo``: humming's own Python (schema conversion, layer configuration, padding checks,
  block-scale transform) runs on CPU; only its CUDA repack kernel is replaced, by the reference
  above. The in-place refresh (:func:`quads.ops.backends.humming.library.transform_into_`: one repack
  launch into the held tensor) gives bit for bit the tensors of the stage-1 refresh (a scratch
  ``HummingLayer`` built from the new parts, transformed, copied over), at the same addresses,
  and the packed parts derived from the layout are quads' parts. The GPU run
  (``benchmarks/ops/bench_humming.py``, sync rows) checks the same against humming's real kernel.
"""

from __future__ import annotations

import types

import pytest
import torch

from quads.kernels.humming.layout import (repack_reference, scale_layout, scale_permutation, scale_unlayout,
                                          unrepack_reference)
from quads.tensor.nvfp4_math import nvfp4_quantize

# the weight quantizer kernel runs once per distinct weight in the session (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("memo_weight_kernel")


def kernel_literal(qdata: torch.Tensor) -> torch.Tensor:
    """humming's ``weight_repack_nk<4, 16, packed, no INT2FP, no ZP, no mini-block transpose, 0, no
    packed K, no native dequant>`` with ``interleave_mode = 3``, transcribed loop by loop (one
    thread block = 64 n x 64 k, 32 threads)."""
    q = qdata.unsqueeze(0) if qdata.dim() == 2 else qdata
    e_n, n_, k_ = q.shape[0], q.shape[1], q.shape[2] * 2
    w32 = q.contiguous().view(torch.int32).tolist()
    gmem_stride, out_stride = k_ // 8, 16 * n_ * 4 // 32
    out = [[0] * out_stride for _ in range(e_n * k_ // 16)]
    for z in range(e_n):
        for bx in range(n_ // 64):
            for by in range((k_ + 63) // 64):
                smem = [[(w32[z][bx * 64 + r][by * 8 + c] & 0xFFFFFFFF)
                         if bx * 64 + r < n_ and by * 8 + c < gmem_stride else 0 for c in range(8)] for r in range(64)]
                for t in range(32):
                    tmp = [0] * 128
                    for i in range(8):
                        row = smem[i * 8 + t // 4]
                        for j in range(8):
                            for k in range(2):
                                index = j * 8 + (t % 4) * 2 + k
                                v = (row[index * 4 // 32] >> (index * 4 % 32)) & 0xF
                                i1, i2, i3, i4, i5, i6 = j // 2, (i * 8) // 64, (i * 8) % 64 // 16, i % 2, j % 2, k
                                tmp[((((i1 + i2) * 4 + i3) * 2 + i4) * 2 + i5) * 2 + i6] = v
                    out_arr = [0] * 16
                    for i in range(4):
                        for j in range(4):
                            val = 0
                            for k in range(8):
                                new_k = (k % 4) * 2 + k // 4  # get_interleaved_index: N = 8, stride = 2
                                s = tmp[i * 32 + j * 8 + new_k]
                                val |= (s & 7) << (k * 4)  # interleave_mode % 2 == 1: from new_k
                                val |= (s & 8) << (k * 4)  # interleave_mode / 2 == 1: from new_k
                            out_arr[i * 4 + j] = val
                    col_offset = 16 * (64 * bx) * 4 // 32
                    for i in range(4):
                        if by * 64 + i * 16 >= k_:
                            continue
                        r = (by * 64 + z * k_) // 16 + i
                        for k in range(4):
                            out[r][col_offset + t * 4 + k] = out_arr[i * 4 + k]
    t = torch.tensor(out, dtype=torch.int64)
    t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32).view(e_n, k_ // 16, out_stride)
    return t.squeeze(0) if qdata.dim() == 2 else t


@pytest.mark.parametrize("shape", [(64, 32), (128, 64), (2, 64, 64), (3, 128, 32)])
def test_layout_reference_is_humming_repack_kernel_and_inverts(shape):
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    lay = repack_reference(q)
    assert torch.equal(lay, kernel_literal(q))
    assert lay.shape == (*shape[:-2], shape[-1] * 2 // 16, 2 * shape[-2]) and lay.dtype == torch.int32
    assert torch.equal(unrepack_reference(lay), q)


@pytest.mark.parametrize("on_c", [False, True])
def test_scale_layout_inverts(on_c):
    s = nvfp4_quantize(torch.randn(3, 128, 256)).scale  # (3, 128, 16) e4m3
    ws = scale_layout(s, on_c)
    assert ws.shape == (3, 16, 128) and ws.dtype == s.dtype
    assert torch.equal(scale_unlayout(ws, on_c).view(torch.uint8), s.view(torch.uint8))
    assert sorted(scale_permutation(on_c).tolist()) == list(range(scale_permutation(on_c).numel()))


def test_layout_reference_rejects_partial_tiles():
    with pytest.raises(ValueError, match="multiples of 64"):
        repack_reference(torch.zeros(64, 16, dtype=torch.uint8))


# -- humming's own Python on CPU --------------------------------------------------------------------

@pytest.fixture
def humming_on_cpu(monkeypatch):
    """humming importable, its device faked as an H200, its CUDA repack kernel replaced by the reference."""
    pytest.importorskip("humming")
    import humming.config.config as cc
    import humming.device as hd
    import humming.ops as hops
    from humming.config import LayerConfig

    from quads.ops.backends.humming import library as hg

    fake = types.SimpleNamespace(index=0, name="NVIDIA H200", is_ppu=False, sm_count=132, sm_major=9, sm_minor=0,
                                 sm_version=90, max_threads_per_block=1024, max_threads_per_sm=2048,
                                 max_registers_per_sm=65536, max_smem_size=227 * 1024)
    monkeypatch.setattr(hd.current_device, "_value", fake)
    monkeypatch.setattr(hd.current_device, "_index", 0)
    monkeypatch.setitem(hd.DeviceInfo._instances, 0, hd.current_device)
    monkeypatch.setattr(hd, "get_device_index", lambda device=None: 0)
    monkeypatch.setattr(cc, "_cuda_compiler_version", lambda *a, **k: (12, 8))
    if hasattr(LayerConfig, "check_device"):
        monkeypatch.setattr(LayerConfig, "check_device", lambda self, d: None)

    class _Dev:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(torch.cuda, "device", _Dev)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # HummingLayer's Stream-K locks
    monkeypatch.setattr(hg, "check_humming_device", lambda d: torch.device(d))
    launches = []

    def repack(inputs, weight_bits, activation_bits, is_weight_packed, should_preprocess_for_int2fp=False,
               should_preprocess_with_zp=False, use_fused_e8m0_scale=False, interleave_mode=3, group_size_zp=0,
               padded_shape_n=None, padded_shape_k=None, zero_point=None, use_packed_k_layout=False,
               use_native_dequant=False, outputs=None):
        # the configuration the reference restates, and nothing else
        assert (weight_bits, activation_bits, is_weight_packed, interleave_mode) == (4, 16, True, 3)
        assert not (should_preprocess_for_int2fp or should_preprocess_with_zp or use_fused_e8m0_scale
                    or use_packed_k_layout or use_native_dequant or zero_point is not None or padded_shape_n)
        launches.append(tuple(inputs.shape))
        lay = repack_reference(inputs.contiguous().view(torch.uint8))
        if outputs is None:
            return lay
        outputs.copy_(lay)
        return outputs

    monkeypatch.setattr(hops, "repack_weight", repack)
    return launches


def _stage1_refresh(layer, qdata, scale, gs):
    """The reference refresh: a scratch layer built from the new parts, copied over."""
    scratch = layer._build(qdata, scale, gs)
    held = dict(layer.layer.named_parameters())
    for name, p in scratch.named_parameters():
        held[name].data.copy_(p.data)
    layer._write_scales(scale, gs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,gran", [((64, 128), "tensor"), ((3, 128, 64), "expert")])
def test_in_place_refresh_is_bit_exact_against_the_stage1_refresh(humming_on_cpu, dtype, shape, gran):
    from quads.ops.backends.humming import library as hg

    g = torch.Generator().manual_seed(1)
    w1 = nvfp4_quantize(torch.randn(*shape, generator=g) * 0.05, gran)
    w2 = nvfp4_quantize(torch.randn(*shape, generator=g) * 3.0, gran)
    a = hg.HummingNVFP4(*w1, dtype=dtype, operand_max={"unit": None, "w4a4": 2688.0})
    b = hg.HummingNVFP4(*w1, dtype=dtype, operand_max={"unit": None, "w4a4": 2688.0})
    assert hg.direct_repack(a.layer.humming_config)
    assert torch.equal(a.layer.weight, repack_reference(w1.qdata))  # the build went through the stand-in too
    ptrs = {n: p.data_ptr() for n, p in a.layer.named_parameters()}
    launches = len(humming_on_cpu)
    a.refresh_(*w2)
    assert len(humming_on_cpu) == launches + 1  # one repack launch for the whole tensor (all experts)
    _stage1_refresh(b, *w2)
    assert ptrs == {n: p.data_ptr() for n, p in a.layer.named_parameters()}  # in place
    held_a, held_b = dict(a.layer.named_parameters()), dict(b.layer.named_parameters())
    assert held_a.keys() == held_b.keys() and {"weight", "weight_scale", "weight_scale_2"} <= held_a.keys()
    for name in held_a:
        x, y = held_a[name].data, held_b[name].data
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name
    for name in a.ws2:
        assert torch.equal(a.ws2[name], b.ws2[name]) and torch.equal(a.unshift[name], b.unshift[name])
    # the packed parts derived on demand from humming's layout are quads' parts
    q, s = a.packed_parts()
    assert torch.equal(q, w2.qdata) and torch.equal(s.view(torch.uint8), w2.scale.view(torch.uint8))


def test_scale_layout_restates_humming(humming_on_cpu):
    from humming.transform import transform_humming_weight_scale

    s = nvfp4_quantize(torch.randn(2, 128, 256)).scale
    for on_c in (False, True):
        ref = transform_humming_weight_scale(s, to_apply_on_c=on_c)
        assert torch.equal(scale_layout(s, on_c).view(torch.uint8), ref.view(torch.uint8))


def test_refresh_checks_before_writing(humming_on_cpu):
    from quads.ops.backends.humming import library as hg

    w = nvfp4_quantize(torch.randn(64, 128) * 0.05)
    layer = hg.HummingNVFP4(*w, dtype=torch.float16)
    before = layer.layer.weight.clone()
    with pytest.raises(ValueError, match="humming layer"):
        layer.refresh_(*nvfp4_quantize(torch.randn(128, 128)))
    layer.layer.weight_scale.data = layer.layer.weight_scale.data[:4]  # a held tensor of another shape
    with pytest.raises(RuntimeError, match="changed shape"):
        layer.refresh_(*nvfp4_quantize(torch.randn(64, 128)))
    assert torch.equal(layer.layer.weight, before)  # nothing written


def test_one_layout_for_both_activation_dtypes(humming_on_cpu):
    """fp16 (W4A4 operands) and bf16 (W4A16) layers of one weight hold one layout: ~1.0x the packed
    bytes besides the packed parts, not one per dtype (bytes measured on CPU)."""
    from quads.ops.backends.humming.backend import HummingWeight

    g = torch.Generator().manual_seed(2)
    w1 = nvfp4_quantize(torch.randn(4, 128, 256, generator=g) * 0.05, "expert")
    w2 = nvfp4_quantize(torch.randn(4, 128, 256, generator=g), "expert")
    hw = HummingWeight(w1, "default")
    h16, hbf = hw.layer(torch.float16), hw.layer(torch.bfloat16)
    assert not h16.shared and hbf.shared and hbf.layer.weight is h16.layer.weight
    packed = sum(t.numel() * t.element_size() for t in w1)
    layout = sum(p.numel() * p.element_size() for p in h16.layer.parameters())
    locks = sum(b.numel() * b.element_size() for b in h16.layer.buffers())
    assert abs(layout / packed - 1.0) < 1e-3  # humming's repack of the same 4.5 bits
    assert hw.nbytes == layout + 2 * locks  # one layout, each layer its own Stream-K locks
    hw.write_parts_(w2)
    assert torch.equal(hbf.layer.weight, repack_reference(w2.qdata))
    q, s = hbf.packed_parts()
    assert torch.equal(q, w2.qdata) and torch.equal(s.view(torch.uint8), w2.scale.view(torch.uint8))
    # a layout that differs is not shared
    other = HummingWeight(w1, "default").layer(torch.float16)  # its layout's owner; h16 holds w2 now
    assert not other.share_layout_(h16) and not other.shared
