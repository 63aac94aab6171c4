"""Grouped MoE W4A4 kernel vs the per-expert reference loop (quads.ops.rollout_experts)."""

import os

import pytest
import torch
import torch.nn.functional as F


triton = pytest.importorskip("triton")
# the interpreter evaluates 1/0 -> inf on purpose (E4M3 zero scales): numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from quads.kernels.hopper.weight_layout import HopperWeight, to_hopper_layout  # noqa: E402
from quads.kernels.hopper.moe_grouped_gemm import MoeConfig, moe_w4a4_gemm  # noqa: E402
from quads.kernels.hopper.w4a4_decode import decode_gemm  # noqa: E402
from quads.kernels.hopper.w4a4_gemm import w4a4_gemm  # noqa: E402
from quads.ops import ActivationQuant, get_backend, rollout_experts, use_backend  # noqa: E402
from quads.ops.activation_quant import activation_operands_triton  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
T, H, I, E, TOPK = 5, 64, 32, 6, 2


def _experts(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    gu = NVFP4Tensor.from_float((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype))
    dn = NVFP4Tensor.from_float((torch.randn(E, H, I, generator=g) * 0.1).to(dtype))
    hid = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, TOPK, generator=g), -1).to(dtype)
    return gu, dn, hid, idx, wts


def gate(h):
    return F.silu(h[:, :I]) * h[:, I:]


@pytest.mark.parametrize("act", [ActivationQuant(), ActivationQuant(residual_fraction=0.5),
                                 ActivationQuant(residual_fraction=0.0), ActivationQuant(granularity="tensor")],
                         ids=["res-all", "res-topk", "plain", "tensor"])
def test_experts_match_reference(act):
    gu, dn, hid, idx, wts = _experts()
    idx[0, 1] = E  # an expert-parallel sentinel: contributes nothing
    ref = rollout_experts(hid, idx, wts, gu, dn, gate, act)
    with use_backend("hopper"):
        got = rollout_experts(hid.to(DEV), idx.to(DEV), wts.to(DEV), gu.to(DEV), dn.to(DEV), gate, act)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    # bf16 intermediates: one rounding flip of the gate_up output can move a down-proj code
    err = (got.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < 2e-2, err
    if INTERP:
        assert torch.equal(got.cpu(), ref)  # numpy sums happen to follow the reference order here


def test_grouped_rows_equal_dense_kernel_bits():
    """Each grouped-GEMM row has the bits of the dense decode and prefill kernels on its expert."""
    gu, _, hid, idx, _ = _experts(seed=1, dtype=torch.float32)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    rows = (order // TOPK).to(torch.int32)
    q = activation_operands_triton(hid.to(DEV), ActivationQuant())
    p = gu.to(DEV).parts
    hw = to_hopper_layout(p.qdata, p.scale)
    mcfg = MoeConfig(64, 16, 1, 4, 1, False) if INTERP else MoeConfig(64, 16, 2, 4, 1)
    y = moe_w4a4_gemm(q.stacked, q.main_scale, rows.to(DEV), offsets.to(DEV), hw, p.global_encode_scale,
                      flat.numel(), T, True, config=mcfg)
    for e in range(E):
        sel = order[offsets[e]:offsets[e + 1]]
        if sel.numel() == 0:
            continue
        toks = (sel // TOPK).to(DEV)
        m = toks.numel()
        stacked = torch.cat([q.main[toks], q.residual[toks]])
        scales = q.main_scale[toks]
        he = HopperWeight(hw.values[e], hw.scales[e], hw.n, hw.k)
        dense = decode_gemm(stacked, scales, he, p.global_encode_scale[e], m, True)
        assert torch.equal(y[offsets[e]:offsets[e + 1]].cpu(), dense.cpu())
        if not INTERP:  # the interpreter's numpy dot sums in a tile-shape dependent order
            pre = w4a4_gemm(q.main[toks], q.main_scale[toks], p.qdata[e], p.scale[e], p.global_encode_scale[e],
                            q.residual[toks])
            assert torch.equal(pre.cpu(), dense.cpu())


def test_entry_point_no_tokens_for_most_experts():
    gu, dn, hid, idx, wts = _experts(seed=2)
    idx[:] = 3  # everyone routed to one expert (repeated: both choices)
    act = ActivationQuant()
    ref = rollout_experts(hid, idx, wts, gu, dn, gate, act)
    got = rollout_experts(hid.to(DEV), idx.to(DEV), wts.to(DEV), gu.to(DEV), dn.to(DEV), gate, act,
                          backend=get_backend("hopper"))
    err = (got.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < 2e-2


def test_weight_only_grouped_rows_equal_dense_w4a16_bits():
    """W4A16 experts (act=None) run on the grouped kernel (no host loop: graph-capturable), each
    row with the bits of the dense W4A16 Hopper path on its expert, close to the bf16 reference."""
    from quads.ops.backends.hopper import w4a16_linear_hopper

    gu, _, hid, idx, _ = _experts(seed=3, dtype=torch.float32)
    hid = hid.bfloat16().float()  # bf16 values (what a rollout feeds): exact as fp16 row operands
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0)
    rows = (order // TOPK).to(torch.int32)
    p = gu.to(DEV).parts
    y = get_backend("hopper").grouped_linear(hid.to(DEV), rows.to(DEV), offsets.to(DEV), p, None, None, None,
                                             flat.numel())
    ref = get_backend("torch").grouped_linear(hid, rows, offsets, gu.parts, None, None, None, flat.numel())
    assert (y.cpu() - ref).norm() / ref.norm() < 1e-5
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            continue
        dense = w4a16_linear_hopper(hid.to(DEV)[rows[lo:hi].long()], NVFP4Tensor(
            p.qdata[e], p.scale[e], p.global_encode_scale[e], torch.float32).parts, None)
        assert torch.equal(y[lo:hi].cpu(), dense.cpu())


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("gathered", [True, False])
def test_split_k_grouped_kernel_has_the_same_bits(residual, gathered):
    """The split-K grouped kernel (one program per tile, expert and K segment, then the
    segment-order reduction) gives the one-pass kernel's bits: K of three segments (the last
    partial), N not a multiple of the tile, rows routed to no expert left zero."""
    g = torch.Generator().manual_seed(4)
    e_, t_, top, k_, n_ = 5, 6, 2, 1088, 72
    w = NVFP4Tensor.from_float(torch.randn(e_, n_, k_, generator=g) * 0.1).to(DEV).parts
    hw = to_hopper_layout(w.qdata, w.scale)
    idx = torch.stack([torch.randperm(e_, generator=g)[:top] for _ in range(t_)])
    idx[1, 0] = e_  # a sentinel: sorts last, belongs to no expert
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(e_ + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=e_ + 1)[:e_], 0)
    num_rows = flat.numel()
    rows_x = t_ if gathered else num_rows
    x = torch.randn(rows_x, k_, generator=g)
    q = activation_operands_triton(x.to(DEV), ActivationQuant(residual_fraction=1.0 if residual else 0.0))
    rows = (order // top).to(torch.int32).to(DEV) if gathered else None
    kbi = 1 if INTERP else 2
    base = MoeConfig(64, 16, kbi, 4, 1, not INTERP)
    want = moe_w4a4_gemm(q.stacked, q.main_scale, rows, offsets.to(DEV), hw, w.global_encode_scale, num_rows, rows_x,
                         residual, config=base)
    cfg = MoeConfig(64, 16, kbi, 4, 1, not INTERP, split=True)
    got = moe_w4a4_gemm(q.stacked, q.main_scale, rows, offsets.to(DEV), hw, w.global_encode_scale, num_rows,
                        rows_x, residual, config=cfg)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.all(want[int(offsets[-1]):] == 0) and want[: int(offsets[-1])].abs().sum() > 0


@pytest.mark.parametrize("tokens", [T, pytest.param(200, marks=pytest.mark.skipif(
    INTERP, reason="the interpreter's prefill GEMM sums in another order than its decode and grouped kernels"))])
@pytest.mark.parametrize("act", [ActivationQuant(), ActivationQuant(granularity="tensor"), None],
                         ids=["row", "tensor", "w4a16"])
def test_biased_experts_rows_have_the_dense_linear_bits(act, tokens):
    """Expert biases on the grouped kernel (added to the fp32 rows before the one rounding) and
    ``"tensor"`` activation scales (each expert's rows one tensor): each row has the bits of the
    dense Hopper linear on its expert (the decode GEMM for few rows, the prefill GEMM for many);
    W4A16 with biases the reference's ``F.linear``."""
    from quads.ops.experts_op import Routing
    from quads.ops.backends.hopper import linear_hopper
    from quads.ops.linear_op import w4a16_linear
    from quads.tensor.nvfp4_math import NVFP4Parts

    gu, _, hid, idx, _ = _experts(seed=4)
    if tokens != T:
        g = torch.Generator().manual_seed(7)
        hid = torch.randn(tokens, H, generator=g).to(hid.dtype)
        idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(tokens)])
    idx[0, 1] = E  # an expert-parallel sentinel: its row stays zero
    bias = (torch.randn(E, 2 * I, generator=torch.Generator().manual_seed(5)) * 0.1).bfloat16().to(DEV)
    route = Routing(idx.to(DEV), E)
    p, x = gu.to(DEV).parts, hid.to(DEV)
    y = get_backend("hopper").grouped_linear(x, route.token_of_row, route.offsets, p, bias, act, None, route.num_rows)
    bounds = route.offsets.tolist()
    assert y.dtype == x.dtype and torch.all(y[bounds[-1]:] == 0)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        src, we = x[route.token_of_row[lo:hi]], NVFP4Parts(p.qdata[e], p.scale[e], p.global_encode_scale[e])
        dense = w4a16_linear(src, we, bias[e]) if act is None else linear_hopper(src, we, bias[e], act)
        assert torch.equal(y[lo:hi], dense), e
