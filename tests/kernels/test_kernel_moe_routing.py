"""The one-launch MoE routing kernel == Routing's torch ops, bit for bit (the interpreter on CPU)."""

from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from quads.kernels import moe_routing as mr  # noqa: E402
from quads.ops import experts_op as ex  # noqa: E402
from quads.ops.experts_op import Routing  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("order", "counts", "offsets", "token_of_row")


def _torch_routing(idx, num_experts):
    """Routing's torch ops (on CPU, the kernel's dispatch switched off)."""
    with mock.patch.object(ex, "_routing_kernel_applies", lambda flat, e: False):
        return Routing(idx.cpu(), num_experts)


def _assert_same(got: tuple, ref: Routing, num_experts):
    order, counts, offsets, token = got
    assert counts.shape == offsets.shape == (num_experts + 1,)
    for name, g in zip(FIELDS, (order, counts[:num_experts], offsets, token)):
        r = getattr(ref, name)
        assert g.dtype == r.dtype == torch.int64, name
        assert g.shape == r.shape and torch.equal(g.cpu(), r), name
    assert int(counts[num_experts]) == int(((ref.order.numel() - ref.offsets[-1]).item()))  # the sentinels


def _ids(t, k, e, seed):
    """Distinct experts per token (as top-k gives), some sentinels (-1, E, larger) mixed in."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(max(e, k), generator=g)[:k] for _ in range(t)])
    sentinel = torch.rand(t, k, generator=g) < 0.15
    bad = torch.tensor([-1, e, e + 7, 2 ** 40])[torch.randint(0, 4, (t, k), generator=g)]
    return torch.where(sentinel, bad, idx)


@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("k", [1, 2, 6, 8])
def test_kernel_equals_torch(t, k):
    e = (60, 64, 128)[(t + k) % 3]
    idx = _ids(t, k, e, seed=t * 10 + k)
    _assert_same(mr.moe_routing(idx.reshape(-1).to(DEV), e, k), _torch_routing(idx, e), e)


@pytest.mark.parametrize("case", ["one_expert", "all_sentinels", "empty_experts", "one_token_one_expert",
                                  "duplicates", "no_rows"])
def test_kernel_adversarial(case):
    t, k, e = 7, 6, 60
    g = torch.Generator().manual_seed(3)
    if case == "one_expert":  # every row to expert 59 (the last): stable order == row order
        idx = torch.full((t, k), e - 1)
    elif case == "all_sentinels":
        idx = torch.tensor([-1, e, e + 1, -5, 10 ** 6, e])[torch.randint(0, 6, (t, k), generator=g)]
    elif case == "empty_experts":  # two experts only, most bins empty, sentinel between
        idx = torch.tensor([3, 41, -1])[torch.randint(0, 3, (t, k), generator=g)]
    elif case == "one_token_one_expert":
        t, k, e = 1, 1, 1
        idx = torch.zeros(1, 1, dtype=torch.int64)
    elif case == "duplicates":  # the same expert many times, ties broken by row
        idx = torch.randint(0, 3, (t, k), generator=g)
    else:
        idx = torch.zeros(0, k, dtype=torch.int64)
    _assert_same(mr.moe_routing(idx.reshape(-1).to(DEV), e, k), _torch_routing(idx, e), e)


def test_size_limits():
    assert mr.routing_fits(mr.MAX_ROWS, 64) and not mr.routing_fits(mr.MAX_ROWS + 1, 64)
    assert mr.routing_fits(16, mr.MAX_BINS - 2) and not mr.routing_fits(16, mr.MAX_BINS - 1)
    with pytest.raises(ValueError, match="exceed one program"):
        mr.moe_routing(torch.zeros(mr.MAX_ROWS + 1, dtype=torch.int64, device=DEV), 64, 1)


@pytest.mark.parametrize("rows,e", [(mr.MAX_ROWS, 128), (mr.MAX_ROWS - 8, 60), (16, mr.MAX_BINS - 2)])
def test_kernel_at_the_limits(rows, e):
    """The largest problems one program takes: a full row block, the most experts."""
    k = 8
    idx = _ids(rows // k, k, e, seed=rows + e)
    _assert_same(mr.moe_routing(idx.reshape(-1).to(DEV), e, k), _torch_routing(idx, e), e)


@pytest.fixture
def kernel_on_any_device(monkeypatch):
    """Routing's dispatch with the device test lifted (CPU tensors run the interpreter); the
    launches counted."""
    calls = []
    launch = mr.moe_routing

    def counted(*a):
        calls.append(a[0].numel())
        return launch(*a)

    monkeypatch.setattr(ex, "_routing_kernel_applies",
                        lambda flat, e: flat.dtype == torch.int64 and mr.routing_fits(flat.numel(), e))
    monkeypatch.setattr(mr, "moe_routing", counted)
    return calls


def test_routing_takes_the_kernel_when_it_fits(kernel_on_any_device):
    t, k, e = 64, 6, 64
    idx = _ids(t, k, e, seed=5)
    got, ref = Routing(idx.to(DEV), e), _torch_routing(idx, e)
    assert kernel_on_any_device == [t * k]
    for name in FIELDS:
        assert getattr(got, name).dtype == getattr(ref, name).dtype
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    assert (got.num_rows, got.top_k) == (ref.num_rows, ref.top_k) == (t * k, k)


def test_routing_falls_back_above_the_limit(kernel_on_any_device):
    k, e = 1, 64
    idx = _ids(mr.MAX_ROWS + 1, k, e, seed=6)
    got, ref = Routing(idx.to(DEV), e), _torch_routing(idx, e)
    assert kernel_on_any_device == []  # the torch ops
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name


def test_routing_on_cpu_takes_torch_ops():
    flat = torch.zeros(12, dtype=torch.int64)
    assert not ex._routing_kernel_applies(flat, 8)
    if torch.cuda.is_available():
        assert ex._routing_kernel_applies(flat.cuda(), 8)
        assert not ex._routing_kernel_applies(flat.cuda().int(), 8)
        assert not ex._routing_kernel_applies(torch.zeros(mr.MAX_ROWS + 1, dtype=torch.int64, device="cuda"), 8)
