"""NVFP4Tensor: construction, layout ops, weight-only matmuls, serialization, compile."""

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from quads.tensor import NVFP4Tensor, load_safetensors, nvfp4_fake_quantize, save_safetensors


def _w(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_from_float_parts_and_public_attributes():
    w = _w(32, 64)
    t = NVFP4Tensor.from_float(w)
    assert t.shape == (32, 64) and t.dtype == torch.bfloat16
    assert t.qdata.dtype == torch.uint8 and t.qdata.shape == (32, 32)
    assert t.scale.dtype == torch.float8_e4m3fn and t.scale.shape == (32, 4)
    assert t.global_encode_scale.shape == ()
    assert torch.equal(t.dequantize(torch.bfloat16), nvfp4_fake_quantize(w))
    assert t.dequantize().dtype == torch.float32


def test_3d_expert_weights_have_per_expert_scales_and_slice():
    w = _w(4, 32, 64)
    t = NVFP4Tensor.from_float(w)
    assert t.global_encode_scale.shape == (4,)
    full = t.dequantize()
    assert torch.equal(t[2].dequantize(), full[2])
    assert torch.equal(t.index_select(0, torch.tensor([3, 1])).dequantize(), full[[3, 1]])
    assert torch.equal(t[torch.tensor([0, 0, 2])].dequantize(), full[[0, 0, 2]])
    assert torch.equal(t[1:3].dequantize(), full[1:3])


@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_matmuls_equal_dense_of_dequantized(bias):
    w = _w(48, 64)
    t = NVFP4Tensor.from_float(w)
    dense = t.dequantize(torch.bfloat16)
    x = _w(5, 64, seed=1)
    b = _w(48, seed=2) if bias else None
    assert torch.equal(F.linear(x, t, b), F.linear(x, dense, b))
    assert torch.equal(x @ t.t(), x @ dense.t())
    assert torch.equal(torch.matmul(x, t.transpose(0, 1)), torch.matmul(x, dense.t()))
    assert torch.equal(torch.mm(x, t.t()), torch.mm(x, dense.t()))
    assert torch.equal(torch.addmm(_w(48, seed=3), x, t.t()), torch.addmm(_w(48, seed=3), x, dense.t()))
    assert torch.equal(t.t().t().dequantize(), t.dequantize())


def test_bmm_and_grouped_mm_with_expert_weights():
    t = NVFP4Tensor.from_float(_w(3, 32, 64))
    dense = t.dequantize(torch.bfloat16)
    x = _w(3, 5, 64, seed=1)
    assert torch.equal(torch.bmm(x, t.transpose(-2, -1)), torch.bmm(x, dense.transpose(-2, -1)))
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    xs = _w(9, 64, seed=2)
    offs = torch.tensor([3, 5, 9], dtype=torch.int32)
    got = torch._grouped_mm(xs, t.transpose(-2, -1), offs=offs)
    want = torch._grouped_mm(xs, dense.transpose(-2, -1), offs=offs)
    assert torch.equal(got, want)


def test_views_detach_clone_to_copy():
    t = NVFP4Tensor.from_float(_w(4, 8, 32))
    assert torch.equal(t.detach().dequantize(), t.dequantize())
    c = t.clone()
    assert c.qdata.data_ptr() != t.qdata.data_ptr() and torch.equal(c.dequantize(), t.dequantize())
    t2 = NVFP4Tensor.from_float(_w(8, 32))
    v = t2.view(2, 4, 32)
    assert torch.equal(v.dequantize().reshape(8, 32), t2.dequantize())
    assert torch.equal(t2.reshape(8, 32).dequantize(), t2.dequantize())
    with pytest.raises(NotImplementedError):
        t.view(32, 32)  # would merge experts with different global scales
    assert t.to("cpu").device.type == "cpu"
    assert t.to(torch.float16).dtype == torch.float16
    # copy_ from a dense tensor quantizes in place with the same recipe
    new = _w(4, 8, 32, seed=9)
    ptr = t.qdata.data_ptr()
    t.copy_(new)
    assert t.qdata.data_ptr() == ptr
    assert torch.equal(t.dequantize(torch.bfloat16), nvfp4_fake_quantize(new))
    c.copy_(t)
    assert torch.equal(c.dequantize(), t.dequantize())


def test_unsupported_op_names_the_op():
    t = NVFP4Tensor.from_float(_w(16, 32))
    with pytest.raises(NotImplementedError, match="aten.add"):
        t + 1
    with pytest.raises(NotImplementedError, match="aten.sum"):
        t.sum()


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Tensor.from_float(torch.randn(4, 24))
    with pytest.raises(TypeError):
        NVFP4Tensor.from_float(torch.ones(4, 32, dtype=torch.int64))
    bad = torch.randn(4, 32)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        NVFP4Tensor.from_float(bad)
    with pytest.raises(ValueError):
        NVFP4Tensor.from_float(torch.randn(32))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(NVFP4Tensor.from_float(_w(32, 64)), requires_grad=False)
        self.experts = nn.Parameter(NVFP4Tensor.from_float(_w(4, 32, 64, seed=1)), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.w) + F.linear(x, self.experts[1])


def _same_state(a, b):
    for k in a:
        assert torch.equal(a[k].qdata, b[k].qdata)
        assert torch.equal(a[k].scale.view(torch.uint8), b[k].scale.view(torch.uint8))
        assert torch.equal(a[k].global_encode_scale, b[k].global_encode_scale)


def test_state_dict_torch_save_weights_only_and_safetensors(tmp_path):
    m = _Tiny()
    x = _w(3, 64, seed=5)
    ref = m(x)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded["w"], NVFP4Tensor)
    _same_state(loaded, m.state_dict())
    m2 = _Tiny.__new__(_Tiny)
    nn.Module.__init__(m2)
    m2.w = nn.Parameter(NVFP4Tensor.from_float(torch.zeros(32, 64)), requires_grad=False)
    m2.experts = nn.Parameter(NVFP4Tensor.from_float(torch.zeros(4, 32, 64)), requires_grad=False)
    m2.load_state_dict(loaded)
    assert torch.equal(_Tiny.forward(m2, x), ref)
    path = str(tmp_path / "m.safetensors")
    save_safetensors(m.state_dict(), path)
    _same_state(load_safetensors(path), m.state_dict())


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    lin = nn.Linear(64, 32, bias=True)
    lin.weight = nn.Parameter(NVFP4Tensor.from_float(_w(32, 64).float()), requires_grad=False)
    x = torch.randn(4, 64)
    compiled = torch.compile(lin, fullgraph=True)
    assert torch.equal(compiled(x), lin(x))  # single op: bit-exact
    m = _Tiny()
    xf = _w(3, 64, seed=5, dtype=torch.float32)  # fp32 activations: the weight dequantizes to fp32
    got = torch.compile(m, fullgraph=True)(xf)
    torch.testing.assert_close(got, m(xf))  # expert slicing + two linears + add, fp32 tolerance
