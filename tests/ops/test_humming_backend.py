"""The humming backend's CPU-testable parts (humming itself runs only on CUDA sm_90: NVRTC JIT).

Tested here: the humming inputs built from quads' NVFP4 parts, the output-range shift, the two
Triton kernels around the GEMM (interpreter), the backend glue end to end against the exact
reference with a stand-in for humming's GEMM that follows its documented arithmetic (exact
e2m1 x e4m3 weight decode, fp32 sums, ``* weight_scale_2``, one rounding to the activation
dtype), in-place refresh, selection (policy field, env overrides) and the error paths. The
GPU run (``benchmarks/ops/bench_humming.py``) checks the real kernels against the same references.
"""

from __future__ import annotations

import sys

import pytest
import torch

import quads
from quads.ops.backends.humming import library as hg
from quads.kernels.humming.layout import repack_reference, scale_layout, scale_unlayout, unrepack_reference
from quads.kernels.humming.operands import sum_stacked_rows, unscale_rows
from quads.ops import backend_registry as backend_mod
from quads.ops.backends.humming import backend as hb
from quads.ops.activation_quant import (ActivationQuant, activation_operands_triton, quantize_activation_reference,
                                       summed_operand_triton)
from quads.ops.linear_op import unscaled_values as _unscaled
from quads.ops.linear_op import unscaled_values, w4a4_linear_reference, w4a16_linear
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_dequantize, nvfp4_quantize

# the weight quantizer kernel runs once per distinct weight in the session (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("memo_weight_kernel")

_ORIG_CONFIGS = hg.HummingNVFP4._configs  # the fixture stands in for it; one test checks the real one


def _weight(n=64, k=128, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return nvfp4_quantize(torch.randn(n, k, generator=g) * scale)


def _x(m=5, k=128, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 3] *= 30.0  # an outlier channel, as in LLM activations
    return x.to(dtype)


# -- humming inputs from quads' parts --------------------------------------------------------------

def test_modelopt_tensors_take_the_parts_as_they_are():
    w = _weight()
    t = hg.modelopt_tensors(*w)
    assert t["weight"].dtype == torch.uint8 and torch.equal(t["weight"], w.qdata)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and torch.equal(t["weight_scale"].view(torch.uint8),
                                                                          w.scale.view(torch.uint8))
    assert t["weight_scale_2"].shape == (1,) and t["weight_scale_2"].dtype == torch.float32
    # the ModelOpt meaning: DQ(W) = e2m1 * f32(scale) * weight_scale_2
    dq = unscaled_values(w) * t["weight_scale_2"]
    torch.testing.assert_close(dq, nvfp4_dequantize(*w), rtol=2**-23, atol=0)
    shifted = hg.modelopt_tensors(*w, shift=torch.tensor([3.0]))
    assert torch.equal(shifted["weight_scale_2"], t["weight_scale_2"] / 8)


def test_modelopt_tensors_reject_what_humming_cannot_hold():
    w = _weight()
    rowwise = nvfp4_quantize(torch.randn(64, 128), "row")
    with pytest.raises(ValueError, match="row-granular"):
        hg.modelopt_tensors(*rowwise)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        hg.modelopt_tensors(w.qdata, w.scale.view(torch.uint8), w.global_encode_scale)
    with pytest.raises(ValueError, match="shapes do not match"):
        hg.modelopt_tensors(w.qdata[:, :32], w.scale, w.global_encode_scale)
    experts = nvfp4_quantize(torch.randn(3, 32, 64), "expert")
    assert hg.modelopt_tensors(*experts)["weight_scale_2"].shape == (3,)


@pytest.mark.parametrize("scale", [1e-3, 0.05, 3.0, 200.0])
def test_output_shift_is_the_smallest_power_of_two_that_bounds_the_fp16_output(scale):
    w = _weight(n=32, k=256, scale=scale)
    amax = 6.0 * 448.0
    c = hg.output_shift(w.scale, w.global_encode_scale, amax)
    assert c.shape == (1,) and float(c) == int(float(c)) and float(c) >= 0
    # the true worst case over operands with |a| <= amax: amax * max_n sum_k |DQ(W)_nk|
    worst = amax * nvfp4_dequantize(*w).abs().sum(-1).max()
    assert worst / 2.0 ** float(c) <= hg.FP16_OUTPUT_LIMIT
    bound = amax * 96 * w.scale.float().sum(-1).max() / w.global_encode_scale
    if float(c) > 0:  # minimal: one power less would break the (cheap) bound
        assert bound / 2.0 ** (float(c) - 1) > hg.FP16_OUTPUT_LIMIT


@pytest.mark.parametrize("shape,gran", [((64, 256), "tensor"), ((3, 128, 64), "expert")])
def test_run_time_scales_are_each_ranges_shift_written_in_place(fake_humming, shape, gran):
    """Every operand range's ``c`` (one pass for all ranges) is :func:`output_shift`'s for that range
    alone, maxed over experts; ``weight_scale_2 = (1 / S_w) * 2^-c`` and ``2^c`` follow it, each range's
    in its own aligned tensor; a refresh rewrites them at the same addresses."""
    ranges = {"unit": None, "w4a4": 6.0 * 448.0, "summed": 2 * 6.0 * 448.0}
    g = torch.Generator().manual_seed(2)
    weights = [nvfp4_quantize(torch.randn(*shape, generator=g) * s, gran) for s in (0.01, 40.0)]
    layer = hg.HummingNVFP4(*weights[0], dtype=torch.float16, operand_max=ranges)
    ptrs = {name: (layer.ws2[name].data_ptr(), layer.unshift[name].data_ptr()) for name in ranges}
    # humming reads each weight_scale_2 at a 16-byte-aligned address (a row of a shared tensor is not)
    assert all(layer.ws2[name].data_ptr() % 16 == 0 for name in ranges)
    for w in weights:
        layer.refresh_(*w)
        assert ptrs == {name: (layer.ws2[name].data_ptr(), layer.unshift[name].data_ptr()) for name in ranges}
        gs = w.global_encode_scale.reshape(-1).float()
        for name, amax in ranges.items():
            c = torch.zeros(1) if amax is None else hg.output_shift(w.scale, w.global_encode_scale, amax).amax().reshape(1)
            assert torch.equal(layer.shift[name], c), name
            assert torch.equal(layer.ws2[name], torch.ones(1) / gs * torch.exp2(-c)), name
            assert torch.equal(layer.unshift[name], torch.exp2(c)), name
    assert float(layer.shift["summed"]) > float(layer.shift["w4a4"]) > 0  # the last weight's ranges shift, apart


# -- the kernels around the GEMM (interpreter) -------------------------------------------------------

def test_sum_stacked_rows_is_one_rounding_of_the_fp32_sum():
    ops = activation_operands_triton(_x(m=4).float(), ActivationQuant())
    s = sum_stacked_rows(ops.stacked, 4)
    want = (ops.main.float() + ops.residual.float()).half()
    assert torch.equal(s, want)
    with pytest.raises(ValueError, match="2\\*4"):
        sum_stacked_rows(ops.stacked[:6], 4)


@pytest.mark.parametrize("act", [ActivationQuant(), ActivationQuant(0.5), ActivationQuant(0.0),
                                 ActivationQuant(0.25, selection="static")])
@pytest.mark.parametrize("m", [3, 70])  # 70 rows: whole-row programs; 3: rows cut into chunks (k = 100%)
def test_fused_summed_operand_is_bit_exact(act, m):
    """The quantization kernel's summed operand = fp16(f32(x̂ operand) + f32(r̂ operand)) of the torch
    reference's parts (one launch instead of quantize + sum), and the 3-kernel path's bits."""
    k = 1024
    x = _x(m=m, k=k)
    mask = (torch.arange(k) % 3 == 0) if act.selection == "static" else None
    op, scale = summed_operand_triton(x, act, mask)
    ref = quantize_activation_reference(x, act, mask)
    want = _unscaled(ref.main).float()
    if ref.residual is not None:
        want = want + _unscaled(ref.residual).float()
    assert op.dtype == torch.float16 and op.shape == (m, k)
    assert torch.equal(op, want.half())
    assert torch.equal(scale, ref.main.global_encode_scale.reshape(-1).expand(m))
    ops = activation_operands_triton(x, act, mask)
    old = sum_stacked_rows(ops.stacked, m) if ops.residual is not None else ops.main
    assert torch.equal(op, old)
    # rows gathered (repeated, out of order) quantize to their token's bits
    idx = torch.tensor([m - 1, 0, 0, 1, m - 1])
    op_g, scale_g = summed_operand_triton(x, act, mask, row_idx=idx)
    assert torch.equal(op_g, op[idx]) and torch.equal(scale_g, scale[idx])


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_unscale_rows_matches_torch(stacked, out_dtype):
    m, n = 3, 40
    g = torch.Generator().manual_seed(0)
    o = (torch.randn(2 * m if stacked else m, n, generator=g) * 100).half()
    u = torch.tensor([8.0])
    s = torch.rand(m, generator=g) * 50 + 1
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    acc = o[:m].float() + (o[m:].float() if stacked else 0)
    want = (acc * 8.0 / s[:, None] + bias.float()).to(out_dtype)
    got = unscale_rows(o, m, u, s, bias, out_dtype, stacked)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got, want, rtol=2**-22 if out_dtype == torch.float32 else 0, atol=0)
    with pytest.raises(ValueError, match="GEMM output rows"):
        unscale_rows(o[:1], m, u, s, None, out_dtype, stacked)


# -- the backend glue against the exact reference, humming's GEMM stood in for ------------------------

class _FakeConfig:
    should_apply_bs_on_c = False

    def __init__(self, key, direct=True):
        self.key, self.direct = key, direct

    def to_str(self):
        return self.key


class _FakeLayer(torch.nn.Module):
    """A humming layer's arithmetic on CPU: exact decoded weight, fp32 sums, weight_scale_2, one rounding."""

    def __init__(self, qdata, scale, dtype):
        super().__init__()
        # humming's layout (the torch restatement of its repack) where it applies (N, K multiples of 64),
        # else the parts as they are (a layout the parts cannot be read back from)
        direct = qdata.shape[-2] % 64 == 0 and qdata.shape[-1] % 32 == 0
        self.weight = torch.nn.Parameter(_lay(qdata, direct), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(_lay_scale(scale, direct), requires_grad=False)
        self.humming_config = _FakeConfig(f"{tuple(qdata.shape)}{dtype}", direct)


def _lay(qdata, direct):
    return repack_reference(qdata) if direct else qdata.clone()


def _lay_scale(scale, direct):
    return scale_layout(scale, False) if direct else scale.clone()


def _fake_parts(layer):
    """The packed (qdata, scale) the stand-in layer holds."""
    if layer.humming_config.direct:
        return unrepack_reference(layer.weight.data), scale_unlayout(layer.weight_scale.data, False)
    return layer.weight.data, layer.weight_scale.data


@pytest.fixture
def fake_humming(monkeypatch):
    calls = []

    def build(self, qdata, scale, gs):
        return _FakeLayer(qdata, scale, self.dtype)

    def call(self, a, scaling="unit", out=None, expert_layout=None):
        """HummingNVFP4.__call__ with humming's GEMM stood in for (the padding around it is quads')."""
        assert a.dtype == self.dtype
        calls.append((tuple(a.shape), scaling))
        a = self.padded_input(a)
        w = unscaled_values(NVFP4Parts(*_fake_parts(self.layer), torch.ones(())))
        if expert_layout is None:
            return self.logical_output(((a.float() @ w.T) * self.ws2[scaling]).to(self.dtype))
        y = torch.full((a.shape[0], w.shape[-2]), float("nan"), dtype=self.dtype)  # unwritten rows: garbage
        bounds = expert_layout.tolist()
        for e in range(len(bounds) - 1):
            lo, hi = bounds[e], bounds[e + 1]
            y[lo:hi] = ((a[lo:hi].float() @ w[e].T) * self.ws2[scaling][e]).to(self.dtype)
        return self.logical_output(y)

    monkeypatch.setattr(hg, "check_humming_device", lambda d: torch.device(d))
    monkeypatch.setattr(hg, "import_humming", lambda: None)
    monkeypatch.setattr(hg.HummingNVFP4, "_build", build)
    monkeypatch.setattr(hg.HummingNVFP4, "_configs", lambda self: (None, None))
    monkeypatch.setattr(hg.HummingNVFP4, "__call__", call)
    monkeypatch.setattr(hg, "transform_into_", _fake_transform_into)
    monkeypatch.setattr(hg, "direct_repack", lambda cfg: cfg.direct)
    return calls


def _fake_transform_into(layer, qdata, scale, gs):
    """The stand-in layer's refresh: the new parts copied into its held tensors (in place)."""
    direct = layer.humming_config.direct
    layer.weight.data.copy_(_lay(qdata, direct))
    layer.weight_scale.data.copy_(_lay_scale(scale, direct))


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("layout", ["stacked", "summed"])
def test_w4a4_residual_through_humming_matches_the_exact_path(fake_humming, layout):
    w, x, act = _weight(), _x(), ActivationQuant()
    bias = torch.randn(64).to(torch.bfloat16)
    be = hb.HummingBackend(mode="no_stream_k", residual_layout=layout)
    prepared = be.prepare_weight(w)
    y = be.linear(x, w, bias, act, prepared=prepared)
    ref = w4a4_linear_reference(x, w, bias, act)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert fake_humming[-1] == ((10, 128) if layout == "stacked" else (5, 128), "w4a4" if layout == "stacked"
                                else "summed")
    # bf16 outputs: at most about one bf16 ulp of the largest output apart
    assert _rel(y, ref) <= 2**-7
    exact = w4a4_linear_reference(x.float(), w, None, act)  # fp32: the exact path before its rounding
    y32 = hb.humming_w4a4(x.float(), prepared.layer(torch.float16), None, act, residual_layout=layout)
    assert _rel(y32, exact) <= (2**-10 if layout == "stacked" else 2**-9)


def test_plain_w4a4_and_w4a16_through_humming(fake_humming):
    w, x = _weight(), _x()
    be = hb.HummingBackend()
    naive = ActivationQuant(residual_fraction=0.0)
    y = be.linear(x, w, None, naive)
    assert fake_humming[-1] == ((5, 128), "w4a4")
    assert _rel(y, w4a4_linear_reference(x, w, None, naive)) <= 2**-7
    y32 = hb.humming_w4a4(x.float(), be.prepare_weight(w).layer(torch.float16), None, naive)
    assert _rel(y32, w4a4_linear_reference(x.float(), w, None, naive)) <= 2**-11
    y16 = be.linear(x, w, None, None)  # W4A16: the bf16 activations go in directly
    assert fake_humming[-1] == ((5, 128), "unit") and y16.dtype == torch.bfloat16
    assert _rel(y16, w4a16_linear(x, w, None)) <= 2**-7


def test_refresh_rewrites_the_held_tensors_in_place(fake_humming):
    be = hb.HummingBackend()
    w1, w2 = _weight(seed=0), _weight(seed=5, scale=2.0)
    held = be.prepare_weight(w1)
    layer = held.layer(torch.float16)
    ptrs = [p.data_ptr() for p in layer.layer.parameters()] + [layer.ws2["w4a4"].data_ptr(),
                                                                layer.unshift["w4a4"].data_ptr()]
    shift1 = float(layer.shift["w4a4"])
    (again,) = be.refresh_prepared((held,), [w2])
    assert again is held
    assert ptrs == [p.data_ptr() for p in layer.layer.parameters()] + [layer.ws2["w4a4"].data_ptr(),
                                                                       layer.unshift["w4a4"].data_ptr()]
    assert torch.equal(layer.packed_parts()[0], w2.qdata)
    assert float(layer.shift["w4a4"]) != shift1  # a 40x larger weight needs a larger shift
    x, act = _x(), ActivationQuant()
    y = hb.humming_w4a4(x.float(), layer, None, act)
    assert _rel(y, w4a4_linear_reference(x.float(), w2, None, act)) <= 2**-10
    with pytest.raises(ValueError, match="humming layer"):
        layer.refresh_(*_weight(n=32))


def test_weights_humming_cannot_hold_go_to_the_hopper_layout(fake_humming, monkeypatch):
    rowwise = nvfp4_quantize(torch.randn(64, 128), "row")
    assert not hb.humming_supports(rowwise) and hb.humming_supports(_weight())
    assert hb.humming_supports(nvfp4_quantize(torch.randn(2, 32, 64), "expert"))
    assert not hb.humming_supports(nvfp4_quantize(torch.randn(2, 32, 64), "tensor"))  # one S_w for all experts
    monkeypatch.setattr(hb, "prepare_weight_hopper", lambda w, out=None: ("hopper", w))
    assert hb.HummingBackend().prepare_weight(rowwise)[0] == "hopper"


@pytest.mark.parametrize("act", [None, ActivationQuant(), ActivationQuant(residual_fraction=0.0)])
def test_grouped_experts_through_humming_match_the_exact_path(fake_humming, act):
    from quads.ops import get_backend
    from quads.ops.experts_op import Routing

    g = torch.Generator().manual_seed(3)
    w = nvfp4_quantize(torch.randn(4, 48, 64, generator=g) * torch.tensor([0.01, 0.1, 1.0, 5.0])[:, None, None],
                       "expert")
    x = _x(m=6, k=64)
    idx = torch.tensor([[0, 2], [1, 3], [3, 0], [2, 2], [1, 0], [9, 3]])  # 9: an expert-parallel sentinel
    route = Routing(idx, 4)
    be = hb.HummingBackend()
    prepared = be.prepare_weight(w)
    assert isinstance(prepared, hb.HummingWeight)
    y = be.grouped_linear(x, route.token_of_row, route.offsets, w, None, act, None, route.num_rows, prepared)
    ref = get_backend("torch").grouped_linear(x, route.token_of_row, route.offsets, w, None, act, None, route.num_rows)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert torch.all(y[int(route.offsets[-1]):] == 0)  # the sentinel's row: no expert, zero
    for e in range(4):  # per expert (their scales differ by 500x): bf16 roundings + the summed operand's
        lo, hi = int(route.offsets[e]), int(route.offsets[e + 1])
        if hi > lo:
            assert _rel(y[lo:hi], ref[lo:hi]) <= 2**-7, e
    h = _x(m=route.num_rows, k=48, seed=4)  # the down projection's input: already sorted rows
    wd = nvfp4_quantize(torch.randn(4, 64, 48, generator=g) * 0.05, "expert")
    yd = be.grouped_linear(h, None, route.offsets, wd, None, act, None, route.num_rows, be.prepare_weight(wd))
    refd = get_backend("torch").grouped_linear(h, None, route.offsets, wd, None, act, None, route.num_rows)
    assert _rel(yd, refd) <= 2**-7


def test_experts_projections_humming_does_not_serve_take_the_exact_kernel(fake_humming):
    """Per projection: a biased one and ``"tensor"`` activation scales run the Hopper experts kernel
    on the parts derived from the humming layout (its bits, no humming call); the unbiased
    projection beside a biased one stays on humming."""
    from quads.ops import get_backend
    from quads.ops.experts_op import Routing

    g = torch.Generator().manual_seed(6)
    w = nvfp4_quantize(torch.randn(4, 128, 64, generator=g) * 0.1, "expert")
    wd = nvfp4_quantize(torch.randn(4, 64, 128, generator=g) * 0.1, "expert")
    x, idx = _x(m=5, k=64), torch.tensor([[0, 2], [1, 3], [3, 0], [2, 2], [1, 0]])
    bias = torch.randn(4, 128, generator=g).bfloat16()
    be, hopper, route = hb.HummingBackend(), get_backend("hopper"), Routing(idx, 4)
    prepared = be.prepare_weight(w)
    for act, b in ((ActivationQuant(), bias), (ActivationQuant(granularity="tensor"), None), (None, bias)):
        fake_humming.clear()
        y = be.grouped_linear(x, route.token_of_row, route.offsets, w, b, act, None, route.num_rows, prepared)
        want = hopper.grouped_linear(x, route.token_of_row, route.offsets, w, b, act, None, route.num_rows)
        assert torch.equal(y, want) and len(fake_humming) == 0
    kernel = be.experts_kernel(backend_mod.LinearArgs(w, ActivationQuant(), None, prepared),
                               backend_mod.LinearArgs(wd, ActivationQuant(), None, be.prepare_weight(wd)))
    fake_humming.clear()
    kernel.apply(x, idx, torch.full((5, 2), 0.5).bfloat16(), lambda h: h, (bias, None))
    assert len(fake_humming) == 1  # the down projection on humming


# -- selection and errors ------------------------------------------------------------------------------

def test_residual_layout_selection(monkeypatch):
    assert hb.humming_residual_layout(1) == "stacked"
    assert hb.humming_residual_layout(hb.SUMMED_FROM_ROWS) == "summed"
    assert hb.humming_residual_layout(512, "stacked") == "stacked"
    assert hb.humming_residual_layout(512, "auto", "batch_invariant") == "stacked"  # one layout at every M
    monkeypatch.setenv("QUADS_HUMMING_RESIDUAL", "summed")  # read once, when a backend is made
    layout = hb.HummingBackend().residual_layout
    assert layout == "summed" and hb.humming_residual_layout(1, layout) == "summed"
    assert hb.HummingBackend(residual_layout="stacked").residual_layout == "stacked"  # the argument wins
    monkeypatch.setenv("QUADS_HUMMING_RESIDUAL", "both")
    with pytest.raises(ValueError, match="QUADS_HUMMING_RESIDUAL"):
        hb.HummingBackend()
    with pytest.raises(ValueError, match="QUADS_HUMMING_MODE"):
        hb.HummingBackend(mode="fastest")


def test_missing_humming_names_the_requirement(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "humming", None)  # import fails as if not installed
    monkeypatch.delenv("HUMMING_CACHE_DIR", raising=False)
    monkeypatch.setenv("QUADS_CACHE", str(tmp_path))
    with pytest.raises(ImportError, match="pip install humming-kernels==0.1.19"):
        hg.import_humming()
    assert hg.humming_cache_root() == tmp_path / "humming"
    import os

    assert os.environ["HUMMING_CACHE_DIR"] == str(tmp_path / "humming" / "cache")


def test_humming_needs_cuda_sm90(monkeypatch):
    with pytest.raises(RuntimeError, match="CUDA sm_90"):
        hg.check_humming_device("cpu")
    monkeypatch.setattr(hg.torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(RuntimeError, match="sm_80"):
        hg.check_humming_device(torch.device("cuda", 0))
    monkeypatch.setattr(hg.torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    with pytest.raises(RuntimeError, match="sm_100"):
        hg.check_humming_device(torch.device("cuda", 0))


def test_kernel_preference_selects_humming_only_where_hopper_would_run(monkeypatch):
    assert quads.select_backend("cpu", "fast").name == "torch"  # no Hopper here: the reference
    with pytest.raises(ValueError, match="kernel preference"):
        quads.select_backend("cpu", "fastest")
    with pytest.raises(ValueError, match="QuadsPolicy.kernel"):
        quads.QuadsPolicy(side="rollout", kernel="fastest")
    assert quads.QuadsPolicy(side="rollout").kernel == "exact"
    monkeypatch.setattr(backend_mod, "_kernel_backend_for", lambda d: "hopper")  # as on an H200
    assert quads.select_backend(torch.device("cuda", 0)).name == "hopper"  # the default stays exact
    monkeypatch.setitem(sys.modules, "humming", None)
    with pytest.raises(ImportError, match="humming-kernels==0.1.19"):  # fast without humming: say so
        quads.select_backend(torch.device("cuda", 0), "fast")
    monkeypatch.setattr(hg, "import_humming", lambda: None)
    assert quads.select_backend(torch.device("cuda", 0), "fast").name == "humming"
    monkeypatch.setenv("QUADS_BACKEND", "hopper")  # the env var still overrides the preference
    assert quads.select_backend(torch.device("cuda", 0), "fast").name == "hopper"


def test_forced_humming_on_a_device_without_it_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with quads.use_backend("humming"), pytest.raises(RuntimeError, match="sm_90"):
        quads.select_backend("cpu")
    assert quads.ops.get_backend("humming").name == "humming"


def test_configuration_modes(fake_humming, monkeypatch):
    """no_stream_k: humming's own M-interval table with Stream-K off in every entry (JSON, as
    humming parses a user tuning config); batch_invariant: humming's compute flag."""
    import enum
    import json
    import types

    class Mma(enum.Enum):
        WGMMA = "wgmma"

    table = [[0, 8, {"block_shape": (16, 128, 64), "use_stream_k": True, "mma_type": Mma.WGMMA}],
             [8, 1 << 30, {"block_shape": (64, 128, 64), "use_stream_k": False}]]
    seen = []
    fake_tune = types.ModuleType("humming.tune")
    fake_tune.get_heuristics_config = (
        lambda config, shape_m=None, device=None, **kw: seen.append((shape_m, kw)) or table)
    monkeypatch.setitem(sys.modules, "humming.tune", fake_tune)
    layer = hb.HummingWeight(_weight(), "default").layer(torch.float16)
    assert _ORIG_CONFIGS(layer) == (None, None)
    nsk = layer.with_mode("no_stream_k")
    compute, tuning = _ORIG_CONFIGS(nsk)
    assert compute is None and seen == [(None, {"use_batch_invariant": False})]  # the whole table, not one M
    parsed = json.loads(tuning)
    assert [e[:2] for e in parsed] == [[0, 8], [8, 1 << 30]]
    assert all(e[2]["use_stream_k"] is False for e in parsed) and parsed[0][2]["mma_type"] == "wgmma"
    assert table[0][2]["use_stream_k"] is True  # humming's cached table is not modified
    bi = layer.with_mode("batch_invariant")
    assert _ORIG_CONFIGS(bi) == (json.dumps({"use_batch_invariant": True}), None)
    assert bi.ws2 is layer.ws2 and bi.layer is layer.layer  # a view: one layout, refreshed together
    with pytest.raises(ValueError, match="humming mode"):
        layer.with_mode("fast")
    # a benchmark's row hint: humming's table (batch-invariant one under that mode), pruned
    hinted = hb.HummingWeight(_weight(), "batch_invariant", rows_hint=(2, 4)).layer(torch.float16)
    compute, tuning = _ORIG_CONFIGS(hinted)
    assert json.loads(compute) == {"use_batch_invariant": True} and seen[-1] == (None, {"use_batch_invariant": True})
    assert json.loads(tuning) == [[0, 1 << 30, json.loads(json.dumps(table[0][2], default=hg._json_value))]]


def test_pruned_table_picks_humming_kernel_for_every_hinted_row_count():
    table = [[0, 1, "a"], [1, 8, "b"], [8, 64, "c"], [64, 512, "d"], [512, 1 << 30, "e"]]

    def pick(t, m):
        return next(cfg for lo, hi, cfg in t if lo < m <= hi)

    rows = (1, 2, 128, 4096)
    pruned = hg.prune_table(table, rows)
    assert [cfg for _, _, cfg in pruned] == ["a", "b", "d", "e"]
    assert all(pick(pruned, m) == pick(table, m) for m in rows)
    assert pruned[0][0] == 0 and pruned[-1][1] == 1 << 30  # every M still has a kernel
    assert all(a[1] == b[0] for a, b in zip(pruned, pruned[1:]))


# -- the shapes humming serves: every NVFP4 shape (padded where humming's tiles need it) -----------------

@pytest.mark.parametrize("n,k,served", [(576, 576, True), (192, 576, True), (960, 960, True), (2880, 2880, True),
                                        (1536, 576, True), (1408, 2048, True), (768, 1408, True), (5760, 2880, True),
                                        (48, 80, True), (256, 200, False), (256, 8, False), (0, 64, False)])
def test_humming_shape_rule(n, k, served):
    assert (hb.humming_shape_problem(n, k) is None) == served
    assert (backend_mod.get_backend("humming").shape_problem(n, k) is None) == served


def test_select_backend_gives_shapes_humming_cannot_serve_the_exact_kernels(monkeypatch):
    monkeypatch.setattr(backend_mod, "_kernel_backend_for", lambda d: "hopper")  # as on an H200
    monkeypatch.setattr(hg, "import_humming", lambda: None)
    cuda = torch.device("cuda", 0)
    assert quads.select_backend(cuda, "fast", [(576, 576), (192, 576), (2880, 2880)]).name == "humming"
    assert quads.select_backend(cuda, "fast", [(1536, 576), (256, 200)]).name == "hopper"  # any one: all exact
    assert quads.select_backend(cuda, "exact", [(576, 576)]).name == "hopper"


def _mixed_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 576, bias=False), torch.nn.Linear(576, 256, bias=False))


def _refuse_576(monkeypatch):
    """The shape rule refusing N = 576 (no NVFP4 shape is refused by the real one): the fallback's path."""
    real = hb.humming_shape_problem
    monkeypatch.setattr(hb, "humming_shape_problem", lambda n, k: "refused here" if n == 576 else real(n, k))


def test_fast_policy_serves_padded_widths_on_humming_without_a_warning(fake_humming):
    """``kernel="fast"``: the 576-output layer (N not a multiple of 128) runs humming in a padded
    layout, within the fast path's bound of the exact path; no layer keeps the exact kernels."""
    import warnings

    x = _x(m=3, k=128)
    exact = _mixed_model()
    with quads.use_backend("hopper"):
        quads.quantize_(exact, quads.QuadsPolicy(side="rollout"))
    fast = _mixed_model()
    with quads.use_backend("humming"), warnings.catch_warnings():
        warnings.simplefilter("error")
        quads.quantize_(fast, quads.QuadsPolicy(side="rollout", kernel="fast"))
    assert [m.quads_backend.name for m in fast] == ["humming", "humming"]
    assert fast[0].quads_prepared[0].layer(torch.float16).pad_n == 640
    with torch.no_grad():
        assert _rel(fast(x), exact(x)) <= 2**-6


def test_fast_policy_keeps_the_exact_kernels_where_the_rule_refuses(fake_humming, monkeypatch):
    """A shape the rule refuses gets the exact kernels (same bits as the exact path), the rest
    humming; one warning line for the model says how many and why."""
    _refuse_576(monkeypatch)
    x = _x(m=3, k=128)
    exact = _mixed_model()
    with quads.use_backend("hopper"):
        quads.quantize_(exact, quads.QuadsPolicy(side="rollout"))
    fast = _mixed_model()
    with quads.use_backend("humming"), pytest.warns(UserWarning) as caught:
        quads.quantize_(fast, quads.QuadsPolicy(side="rollout", kernel="fast"))
    lines = [str(w.message) for w in caught if "keep the exact kernels" in str(w.message)]
    assert len(lines) == 1 and "1 of 2 layers" in lines[0] and "576x128" in lines[0] and "'0'" not in lines[0]
    assert "K % 16 == 0" in lines[0] and lines[0].endswith("e.g. 0)")
    assert fast[0].quads_backend.name == "hopper" and fast[1].quads_backend.name == "humming"
    with torch.no_grad():
        assert torch.equal(fast[0](x), exact[0](x))  # the kept layer: the exact path's bits


def test_fast_policy_warns_on_any_device_and_exact_policy_never(monkeypatch):
    import warnings

    with pytest.warns(UserWarning, match=r"^quads: kernel='fast' has no effect here: all 2 layers run the torch "
                                         r"backend \(humming runs on Hopper GPUs\)$"):
        quads.quantize_(_mixed_model(), quads.QuadsPolicy(side="rollout", kernel="fast"))  # CPU: says what runs
    _refuse_576(monkeypatch)
    with pytest.warns(UserWarning, match=r"on a Hopper GPU 1 of them would keep the exact kernels$"):
        quads.quantize_(_mixed_model(), quads.QuadsPolicy(side="rollout", kernel="fast"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quads.quantize_(_mixed_model(), quads.QuadsPolicy(side="rollout"))


def test_warm_up_kernels_compiles_every_humming_weight_once_with_a_progress_line(fake_humming, monkeypatch):
    from quads.policies.warmup import warm_up_kernels

    warmed = []
    monkeypatch.setattr(hb.HummingWeight, "warmup", lambda self, dtypes=(torch.float16,), ms=(1,): warmed.append(dtypes))
    _refuse_576(monkeypatch)
    fast = _mixed_model()
    with quads.use_backend("humming"), pytest.warns(UserWarning, match="keep the exact kernels"):
        quads.quantize_(fast, quads.QuadsPolicy(side="rollout", kernel="fast"))
    lines = []
    assert warm_up_kernels(fast, log=lines.append) >= 0.0
    assert warmed == [(torch.float16,)]  # the one humming layer (W4A4: fp16 operands); the exact one needs none
    assert len(lines) == 2 and "1 weights" in lines[0] and "ready in" in lines[1]
    exact = _mixed_model()
    with quads.use_backend("hopper"):
        quads.quantize_(exact, quads.QuadsPolicy(side="rollout"))
    lines.clear()
    assert warm_up_kernels(exact, log=lines.append) == 0.0 and lines == []


def _grouped_model():
    """Five humming weights of three kernel groups: (N, K) = (256, 128) x2, (128, 256) x2, (384, 128)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False),
                                torch.nn.Linear(128, 256, bias=False), torch.nn.Linear(256, 128, bias=False),
                                torch.nn.Linear(128, 384, bias=False))
    with quads.use_backend("humming"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel="fast"))
    return model


def _stand_in_compiler(monkeypatch, barrier=None, fail_n=None):
    """HummingNVFP4.warmup as humming's JIT: a layer whose kernels are not compiled yet (key: what
    humming's in-process cache keys them by) compiles them, waiting on ``barrier`` meanwhile (so
    that it passes only when that many compile at once); ``fail_n``: the width whose compile fails."""
    import threading

    lock, done, rec = threading.Lock(), set(), {"warmed": [], "compiled": [], "threads": set()}

    def warmup(self, ms=(1,)):
        key = (self.num_experts, self.pad_n, self.pad_k, self.dtype, self.mode, self.rows_hint)
        with lock:
            rec["warmed"].append(id(self))
            compile_now = key not in done
        if compile_now:
            if self.pad_n == fail_n:
                raise RuntimeError(f"nvrtc failed for N={fail_n}")
            with lock:
                rec["compiled"].append(key)
                rec["threads"].add(threading.get_ident())
            if barrier is not None:
                barrier.wait()
            with lock:
                done.add(key)

    monkeypatch.setattr(hg.HummingNVFP4, "warmup", warmup)
    return rec


def test_warm_up_kernels_compiles_distinct_kernel_groups_concurrently_and_each_once(fake_humming, monkeypatch):
    """The three groups' first weights compile on three threads at once (the barrier breaks after
    5 s otherwise); every weight is warmed once; no group's kernels compile twice (the other members
    run after their group's compile finished)."""
    import threading

    from quads.policies.warmup import _jit_weights, warm_up_kernels

    model = _grouped_model()
    rec = _stand_in_compiler(monkeypatch, barrier=threading.Barrier(3, timeout=5))
    lines = []
    assert warm_up_kernels(model, log=lines.append, workers=3) >= 0.0
    layers = [id(p.layer(dtype)) for p, dtype in _jit_weights(model)]
    assert len(layers) == 5 and sorted(rec["warmed"]) == sorted(layers)  # each weight once
    assert len(rec["compiled"]) == len(set(rec["compiled"])) == 3  # each group's kernels once
    assert len(rec["threads"]) == 3 and threading.get_ident() not in rec["threads"]
    assert len(lines) == 2 and "5 weights" in lines[0] and "(3 distinct kernel groups)" in lines[1]


def test_warm_up_kernels_raises_a_compile_error_as_it_is(fake_humming, monkeypatch):
    from quads.policies.warmup import warm_up_kernels

    model = _grouped_model()
    rec = _stand_in_compiler(monkeypatch, fail_n=384)
    with pytest.raises(RuntimeError, match=r"^nvrtc failed for N=384$"):
        warm_up_kernels(model, log=lambda line: None, workers=3)
    assert 384 not in [key[1] for key in rec["compiled"]]
    with pytest.raises(ValueError, match=r"^workers must be a positive int, got 0$"):
        warm_up_kernels(model, log=lambda line: None, workers=0)


def test_fp32_activations_take_the_exact_kernel_without_a_humming_layout(fake_humming, monkeypatch):
    be, w, act = hb.HummingBackend(), _weight(), ActivationQuant()
    assert hb.HummingBackend.linear_kernel_class is hb.HummingLinearKernel
    assert hb.HummingBackend.experts_kernel_class is hb.HummingExpertsKernel

    def no_layout(*args, **kwargs):
        raise AssertionError("a humming layout built for fp32 activations")

    monkeypatch.setattr(be, "prepare_weight", no_layout)
    kernel = be.linear_kernel(backend_mod.LinearArgs(w, act))
    assert isinstance(kernel, hb.HummingLinearKernel)
    x = _x().float()
    assert torch.equal(kernel.apply(x), backend_mod.get_backend("hopper").linear(x, w, None, act))
    with pytest.raises(ValueError, match="K=96, the weight has K=128"):
        kernel.apply(_x(k=96))


def test_compiled_humming_experts_run_the_kernel_object(fake_humming, monkeypatch):
    """Inside a compiled graph a humming-prepared experts projection is one ``quads::experts_gemm``
    over the kernel object itself (its eager humming GEMM in the op's body: the eager bits); a
    torch without opaque custom-op objects (``quads::grouped_linear``, whose path over a humming
    layout has not run) raises instead."""
    import quads.ops.experts_op as experts_mod
    from quads.ops.backend_registry import LinearArgs
    from quads.ops.experts_op import Routing

    w = nvfp4_quantize(torch.randn(2, 128, 128, generator=torch.Generator().manual_seed(0)) * 0.05, "expert")
    be = hb.HummingBackend()
    prepared = be.prepare_weight(w)
    assert isinstance(prepared, hb.HummingWeight)
    kernel = be.experts_kernel(LinearArgs(w, None, None, prepared))
    x, route = torch.randn(4, 128).half(), Routing.of_rows(None, torch.tensor([0, 2, 4]), 4)
    eager = kernel.apply(x, route, None, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if experts_mod.KERNEL_OPS:
        assert torch.equal(kernel.apply(x, route, None, None), eager)
    monkeypatch.setattr(experts_mod, "KERNEL_OPS", False)
    with pytest.raises(NotImplementedError, match="humming-prepared experts"):
        kernel.apply(x, route, None, None)