"""humming serves every NVFP4 shape: a weight humming cannot tile as it is is held padded.

humming's sm_90 tiles need N % 128 == 0 and K % 64 == 0; quads holds other weights in the humming
layout of their padded shape (zero codes and zero block scales: padded outputs exactly 0, padded K
adds exactly 0), pads activations in K where K needs it and reads the first N output columns. On
CPU with the ``fake_humming`` stand-in (humming's arithmetic on its layout, restated in torch), at
the real widths that needed the exact kernels before: SmolLM2 (576, k/v 192, MLP 1536), GPT-OSS's
2880, Qwen2.5-0.5B-like 960, 1408.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quads
from quads.kernels.humming.layout import humming_padded_shape, humming_padding_cost, scale_unlayout, \
    unrepack_reference
from quads.kernels.humming.operands import unscale_rows
from quads.ops import backend_registry as backend_mod
from quads.ops.backends.humming import backend as hb
from quads.ops.backends.humming import library as hg
from quads.ops.activation_quant import ActivationQuant, activation_operands_triton
from quads.ops.linear_op import unscaled_values, w4a4_linear_reference, w4a16_linear
from quads.policies.fused_projections import fuse_projections_
from quads.policies.modules import RolloutLinear
from quads.tensor.nvfp4_math import NVFP4Parts, nvfp4_quantize
from tests.ops.test_humming_backend import _rel, _x, fake_humming  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("memo_weight_kernel")

#: (N, K) -> the padded layout's (N, K) and its bytes / the unpadded bytes (docs/humming.md's table)
PADDED = {(576, 576): ((640, 576), 640 / 576), (192, 576): ((256, 576), 256 / 192),
          (1536, 576): ((1536, 576), 1.0), (576, 1536): ((640, 1536), 640 / 576),
          (2880, 2880): ((2944, 2880), 2944 / 2880), (960, 960): ((1024, 960), 1024 / 960),
          (1408, 2048): ((1408, 2048), 1.0), (48, 80): ((128, 128), 128 * 128 / (48 * 80))}
SHAPES = [s for s in PADDED if s != (48, 80)] + [(48, 80)]  # (48, 80): K padded too


def _w(n, k, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return nvfp4_quantize(torch.randn(n, k, generator=g) * scale)


def _held(prepared):
    return prepared.layer(torch.float16)


def _padding_is_zero(layer) -> bool:
    """The held layout read back in its padded shape: every code and block scale outside the weight's N x K is 0."""
    q = unrepack_reference(layer.layer.weight.data)
    s = scale_unlayout(layer.layer.weight_scale.data, False).view(torch.uint8)
    n, k = layer.shape_n, layer.shape_k
    assert q.shape[-2:] == (layer.pad_n, layer.pad_k // 2) and s.shape[-2:] == (layer.pad_n, layer.pad_k // 16)
    return bool((q[..., n:, :] == 0).all() and (q[..., :, k // 2:] == 0).all()
                and (s[..., n:, :] == 0).all() and (s[..., :, k // 16:] == 0).all())


@pytest.mark.parametrize("n,k", SHAPES)
def test_padded_shape_and_its_memory_cost(n, k):
    shape, cost = PADDED[(n, k)]
    assert humming_padded_shape(n, k) == shape and hb.humming_padded_shape is humming_padded_shape
    assert humming_padding_cost(n, k) == pytest.approx(cost, rel=1e-12)
    assert hb.humming_shape_problem(n, k) is None


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_width_runs_humming_in_a_padded_layout(fake_humming, monkeypatch, n, k):
    """(a) humming serves the shape (no fallback) and holds its padded layout; (d) the bytes held are
    :func:`humming_padding_cost` x the packed bytes; (b) the GEMM's output on the padded operands
    equals the stand-in's on the unpadded ones bit for bit, and every path is within the fast
    path's bound of the exact path."""
    monkeypatch.setattr(backend_mod, "_kernel_backend_for", lambda d: "hopper")  # as on an H200
    monkeypatch.setattr(hg, "import_humming", lambda: None)
    assert quads.select_backend(torch.device("cuda", 0), "fast", [(n, k)]).name == "humming"
    w, be = _w(n, k), hb.HummingBackend(residual_layout="stacked")
    prepared = be.prepare_weight(w)
    assert isinstance(prepared, hb.HummingWeight) and hb.humming_serves(backend_mod.LinearArgs(w, None, None, prepared))
    layer = _held(prepared)
    (n_pad, k_pad), cost = PADDED[(n, k)]
    assert (layer.shape_n, layer.shape_k, layer.pad_n, layer.pad_k) == (n, k, n_pad, k_pad)
    assert prepared.padded_shape == (n_pad, k_pad)
    assert tuple(layer.layer.weight.shape) == (k_pad // 16, 2 * n_pad) and _padding_is_zero(layer)
    packed = n * (k // 2 + k // 16)
    assert prepared.nbytes == pytest.approx(cost * packed, rel=1e-12)
    q, s = prepared.packed_parts()
    assert torch.equal(q, w.qdata) and torch.equal(s.view(torch.uint8), w.scale.view(torch.uint8))

    x, act = _x(m=5, k=k), ActivationQuant()
    ops = activation_operands_triton(x, act)
    o = layer(ops.stacked, "w4a4")  # the padded GEMM: (2M, N) columns of the (2M, N_pad) output
    assert o.shape == (10, n) and o.stride(0) == n_pad
    plain = ((ops.stacked.float() @ unscaled_values(w).T) * layer.ws2["w4a4"]).half()  # unpadded operands
    if k_pad == k:
        assert torch.equal(o, plain)
    else:  # padded K: the same products, zeros added, fp32 sums of another blocking
        torch.testing.assert_close(o, plain, rtol=2**-10, atol=0)
    y = be.linear(x, w, None, act, prepared=prepared)
    assert y.shape == (5, n) and y.is_contiguous() and _rel(y, w4a4_linear_reference(x, w, None, act)) <= 2**-7
    summed = hb.HummingBackend(residual_layout="summed").linear(x, w, None, act, prepared=prepared)
    assert _rel(summed, w4a4_linear_reference(x, w, None, act)) <= 2**-7
    y16 = be.linear(x, w, None, None, prepared=prepared)  # W4A16: the padded output's columns, one copy
    assert y16.shape == (5, n) and y16.is_contiguous() and _rel(y16, w4a16_linear(x, w, None)) <= 2**-7
    assert fake_humming[-1] == ((5, k), "unit")


@pytest.mark.parametrize("n,k", [(576, 576), (2880, 2880), (48, 80)])
def test_a_sync_rewrites_the_padded_layout_in_place(fake_humming, n, k):
    """(c) a sync writes the padded layout at the same addresses; the padding stays zero."""
    be = hb.HummingBackend()
    held = be.prepare_weight(_w(n, k, seed=0))
    held.layer(torch.bfloat16)  # the W4A16 layer too: one layout, shared
    layers = list(held.layers.values())
    ptrs = [[t.data_ptr() for t in lay.written_tensors()] for lay in layers]
    new = _w(n, k, seed=5, scale=3.0)
    (again,) = be.refresh_prepared((held,), [new])
    assert again is held and ptrs == [[t.data_ptr() for t in lay.written_tensors()] for lay in layers]
    assert all(_padding_is_zero(lay) for lay in layers)
    q, s = held.packed_parts()
    assert torch.equal(q, new.qdata) and torch.equal(s.view(torch.uint8), new.scale.view(torch.uint8))
    x, act = _x(m=3, k=k), ActivationQuant()
    assert _rel(be.linear(x, new, None, act, prepared=held), w4a4_linear_reference(x, new, None, act)) <= 2**-7


def test_unscale_reads_the_padded_output_through_its_row_stride():
    """The epilogue reads the first N columns of the (M, N_pad) GEMM output in place: no copy."""
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(6, 640, generator=g) * 100).half()
    view, u = wide[:, :576], torch.tensor([4.0])
    for m, stacked in ((6, False), (3, True)):
        sc = torch.rand(m, generator=g) + 1
        want = unscale_rows(view.contiguous(), m, u, sc, None, torch.float32, stacked)
        assert torch.equal(unscale_rows(view, m, u, sc, None, torch.float32, stacked), want)


@pytest.mark.parametrize("act", [None, ActivationQuant()])
def test_grouped_experts_of_padded_widths(fake_humming, act):
    """Experts (3-D, grouped GEMM): N = 192 padded to 256 (gate_up-like) and K = 96 padded to 128
    (down: its K the intermediate width), within the bound of the exact path; a sync in place."""
    from quads.ops import get_backend
    from quads.ops.experts_op import Routing

    g = torch.Generator().manual_seed(3)
    w = nvfp4_quantize(torch.randn(3, 192, 576, generator=g) * torch.tensor([0.01, 0.1, 1.0])[:, None, None], "expert")
    wd = nvfp4_quantize(torch.randn(3, 576, 96, generator=g) * 0.05, "expert")
    x = _x(m=5, k=576)
    route = Routing(torch.tensor([[0, 2], [1, 2], [2, 0], [1, 1], [0, 1]]), 3)
    be, torch_be = hb.HummingBackend(), get_backend("torch")
    for weight, inp, rows in ((w, x, route.token_of_row), (wd, _x(m=route.num_rows, k=96, seed=4), None)):
        prepared = be.prepare_weight(weight)
        layer = _held(prepared)
        assert (layer.pad_n, layer.pad_k) == humming_padded_shape(weight.qdata.shape[-2], weight.qdata.shape[-1] * 2)
        assert _padding_is_zero(layer)
        y = be.grouped_linear(inp, rows, route.offsets, weight, None, act, None, route.num_rows, prepared)
        ref = torch_be.grouped_linear(inp, rows, route.offsets, weight, None, act, None, route.num_rows)
        assert y.shape == ref.shape and y.is_contiguous()
        for e in range(3):
            lo, hi = int(route.offsets[e]), int(route.offsets[e + 1])
            if hi > lo:
                assert _rel(y[lo:hi], ref[lo:hi]) <= 2**-7, e
        ptrs = [t.data_ptr() for t in layer.written_tensors()]
        new = NVFP4Parts(weight.qdata.flip(0).contiguous(), weight.scale.flip(0).contiguous(),
                         weight.global_encode_scale.flip(0).contiguous())
        prepared.write_parts_(new)
        assert ptrs == [t.data_ptr() for t in layer.written_tensors()] and _padding_is_zero(layer)
        assert torch.equal(prepared.packed_parts()[0], new.qdata)


def _smollm2_attention(seed=0):
    """SmolLM2-135M's attention widths in one decoder layer (hidden 576, 9 heads of 64, k/v 192),
    its MLP narrowed to 192 (N = 192 and K = 192 padded; the interpreter quantizes every weight)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=576, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=192, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_smollm2_widths_run_humming_whole_stacked_and_synced(fake_humming, monkeypatch):
    """Every linear of a SmolLM2-width model on humming (no warning: none keeps the exact kernels),
    q/k/v (N = 960 stacked, padded to 1024) and gate/up (384) stacked into one GEMM each, the
    logits within the bound of the exact path (the torch reference); a sync writes every padded
    layout in place, the stacked copies through their members, the padding zero."""
    from quads.ops.backend_registry import get_backend

    monkeypatch.setattr(get_backend("humming"), "stack_siblings", True)
    exact, fast = _smollm2_attention(), _smollm2_attention()
    with quads.use_backend("torch"):
        quads.quantize_(exact, quads.QuadsPolicy(side="rollout"))
    with quads.use_backend("humming"), warnings.catch_warnings():
        warnings.filterwarnings("error", message="quads")
        quads.quantize_(fast, quads.QuadsPolicy(side="rollout", kernel="fast"))
    linears = [m for m in fast.modules() if isinstance(m, RolloutLinear)]
    assert len(linears) == 7 and all(isinstance(m.quads_prepared[0], hb.HummingWeight) for m in linears)
    assert fuse_projections_(fast) == 2
    stacks = {id(m.quads_group): m.quads_group.stacked for m in linears if m.quads_group is not None}
    assert sorted(_held(s.weight).pad_n for s in stacks.values()) == [384, 1024]
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, want = fast(ids).logits, exact(ids).logits
    assert _rel(y, want) <= 2**-5
    trainer = _smollm2_attention(seed=7)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    layers = [_held(m.quads_prepared[0]) for m in linears] + [_held(s.weight) for s in stacks.values()]
    ptrs = [lay.layer.weight.data_ptr() for lay in layers]
    quads.sync_weights_(fast, trainer)
    with quads.use_backend("torch"):
        quads.sync_weights_(exact, trainer)
    assert ptrs == [lay.layer.weight.data_ptr() for lay in layers] and all(_padding_is_zero(lay) for lay in layers)
    for s in stacks.values():  # the stacked layout: the members' written rows side by side, then zeros
        lay, n = _held(s.weight), s.offsets[-1]
        members = torch.cat([_held(m).layer.weight[:, :2 * m.shape[0]] for m in s.members], -1)
        assert torch.equal(lay.layer.weight[:, :2 * n], members)
    with torch.no_grad():
        y2, want2 = fast(ids).logits, exact(ids).logits
    assert not torch.equal(y2, y) and _rel(y2, want2) <= 2**-5


@pytest.mark.parametrize("act", [None, ActivationQuant()])
def test_the_linear_op_runs_a_padded_layout_from_its_arguments(fake_humming, act):
    """``quads::linear`` (what compiled code calls) makes a padded layer back from its tensors
    (N = 192 and K = 80 padded) and gives the eager kernel's bits, contiguous (its fake's strides)."""
    from quads.ops.linear_op import linear_op_args

    w, be = _w(192, 80), backend_mod.get_backend("humming")
    prepared = be.prepare_weight(w)
    kernel = be.linear_kernel(backend_mod.LinearArgs(prepared.shape_parts, act, None, prepared))
    x = _x(m=3, k=80)
    want = kernel.apply(x)
    got = torch.ops.quads.linear(*linear_op_args(be, x, None, None, prepared, act, None))
    assert got.shape == (3, 192) and got.is_contiguous() and torch.equal(got, want)
