"""The derived-weight cache: same bits as recomputing, stale after any weight write, freed with
the weight, bounded, and the trainer's straight-through gradient unchanged."""

import gc

import pytest
import torch

import quads
from quads.ops import weight_cache
from quads.ops.weight_cache import cached_derived, dequantized_weight, weight_cache_info
from quads.policies.ste import fake_quantize_weight
from quads.tensor.nvfp4_math import nvfp4_dequantize, nvfp4_fake_quantize
from tests.tiny_models import build


@pytest.fixture(autouse=True)
def fresh_cache():
    """The cache is off by default; these tests turn it on (64 MB) and restore the default."""
    weight_cache.clear_weight_cache()
    budget = weight_cache_info()["budget_bytes"]
    weight_cache.set_weight_cache_budget(64)
    yield
    weight_cache.set_weight_cache_budget(budget / 2**20)
    weight_cache.clear_weight_cache()


def _counting(fn):
    calls = []

    def compute():
        calls.append(1)
        return fn()

    return compute, calls


def test_recomputes_after_in_place_write_and_data_replacement():
    w = torch.randn(32, 64)
    compute, calls = _counting(lambda: w * 2)
    a = cached_derived("double", (w,), compute)
    b = cached_derived("double", (w,), compute)
    assert a is b and len(calls) == 1
    w.add_(1.0)  # optimizer-style in-place write: version bump
    c = cached_derived("double", (w,), lambda: w * 2)
    assert torch.equal(c, w * 2) and not torch.equal(c, a)
    p = torch.nn.Parameter(torch.randn(32, 64))
    first = cached_derived("double", (p,), lambda: p.detach() * 2)
    p.data = torch.randn(32, 64)  # new storage, maybe the same version count
    assert torch.equal(cached_derived("double", (p,), lambda: p.detach() * 2), p.detach() * 2)
    assert not torch.equal(first, p.detach() * 2)


def test_entries_die_with_their_weight_and_budget_evicts_lru():
    w = torch.randn(64, 64)
    cached_derived("x", (w,), lambda: w.clone())
    assert weight_cache_info()["entries"] == 1
    del w
    gc.collect()
    assert weight_cache_info()["entries"] == 0
    weight_cache.set_weight_cache_budget(3 * 64 * 64 * 4 / 2**20)  # room for three float32 64x64
    ws = [torch.randn(64, 64) for _ in range(5)]
    for w in ws:
        cached_derived("x", (w,), lambda w=w: w.clone())
    info = weight_cache_info()
    assert info["entries"] == 3 and info["bytes"] <= info["budget_bytes"]
    weight_cache.set_weight_cache_budget(0)  # off: computes every time, stores nothing
    compute, calls = _counting(lambda: ws[0] * 3)
    cached_derived("y", (ws[0],), compute)
    cached_derived("y", (ws[0],), compute)
    assert len(calls) == 2


def test_expert_slices_are_cached_per_slice_and_follow_their_base():
    w = torch.randn(4, 32, 64)
    parts = quads.nvfp4_quantize(w)
    for e in range(4):
        from quads.tensor.nvfp4_math import NVFP4Parts

        pe = NVFP4Parts(parts.qdata[e], parts.scale[e], parts.global_encode_scale[e])
        got = dequantized_weight(pe, torch.float32)
        assert torch.equal(got, nvfp4_dequantize(*pe))
    assert weight_cache_info()["entries"] == 4
    parts.qdata.zero_()  # a write through the base invalidates every slice
    pe = NVFP4Parts(parts.qdata[1], parts.scale[1], parts.global_encode_scale[1])
    assert torch.equal(dequantized_weight(pe, torch.float32), torch.zeros(32, 64))
    del parts, pe
    gc.collect()
    assert weight_cache_info()["entries"] == 0  # slices' entries die with their base weight
    w = torch.nn.Parameter(torch.randn(16, 32))
    with torch.inference_mode():  # first computed inside inference mode ...
        cached_derived("fake_quantize", (w,), lambda: nvfp4_fake_quantize(w.detach()))
    hit = cached_derived("fake_quantize", (w,), lambda: pytest.fail("should be cached"))
    assert not hit.is_inference()  # ... the cached tensor is still a normal one


def test_trainer_forward_bits_and_straight_through_gradient_unchanged():
    w = torch.nn.Parameter(torch.randn(48, 64, dtype=torch.bfloat16))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    for _ in range(2):  # miss, then hit
        w.grad = None
        y = torch.nn.functional.linear(x, fake_quantize_weight(w))
        assert torch.equal(y, torch.nn.functional.linear(x, nvfp4_fake_quantize(w.detach())))
        y.float().square().sum().backward()
        expected = (2 * y.float()).to(torch.bfloat16).T @ x  # d/dW of sum(y^2), straight through
        assert torch.allclose(w.grad.float(), expected.float(), rtol=2e-2, atol=1e-1)
    with torch.no_grad():
        w.mul_(1.5)  # an optimizer step
    assert torch.equal(fake_quantize_weight(w), nvfp4_fake_quantize(w.detach()))


def test_trainer_and_rollout_stay_aligned_across_training_steps():
    trainer, rollout = build("llama"), build("llama")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations="bf16"))
    quads.sync_weights_(rollout, trainer)
    ids = torch.randint(0, 96, (2, 9))
    opt = torch.optim.SGD(trainer.parameters(), lr=1.0)
    hits = weight_cache_info()["hits"]
    for _ in range(2):
        with torch.no_grad():
            want = trainer(ids).logits
            assert torch.equal(want, rollout(ids).logits)  # W4A16 rollout == QAT trainer
            assert torch.equal(want, rollout(ids).logits)  # again, from the cached dequantized weights
        trainer(ids).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        quads.sync_weights_(rollout, trainer)
    assert weight_cache_info()["hits"] > hits


@pytest.mark.parametrize("write", ["fused_adamw", "foreach", "data_copy"])
def test_trainer_never_serves_a_stale_forward_weight(write):
    """Fused AdamW (and ``torch._foreach_*`` / ``p.data`` writes, as vLLM-style loaders do) update
    the master without bumping its version counter, so a version-keyed cache would hand the next
    forward the old fake-quantized weight. The trainer does not cache its forward weight (the
    fused kernel recomputes it for one read of the master): with the cache on (the fixture's
    64 MB), the next forward still sees the new master."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(3, 64)
    before = fake_quantize_weight(w)
    assert torch.equal(cached_derived("fake_quantize", (w,), lambda: before), before)  # a version-keyed entry
    version = w._version
    if write == "fused_adamw":
        w.grad = torch.randn_like(w)
        torch.optim.AdamW([w], lr=0.5, fused=True).step()
    elif write == "foreach":
        torch._foreach_add_([w.data], [torch.randn_like(w)])
    else:
        w.data.copy_(torch.randn_like(w))
    assert w._version == version  # what makes version-keyed caching unsafe in training
    stale = cached_derived("fake_quantize", (w,), lambda: pytest.fail("the version key saw the write"))
    assert torch.equal(stale, before)  # a version-keyed cache is stale here ...
    after = fake_quantize_weight(w)
    assert not torch.equal(after, before)  # ... the trainer's forward weight is not
    assert torch.equal(after, nvfp4_fake_quantize(w.detach()))
    assert torch.equal(torch.nn.functional.linear(x, after), torch.nn.functional.linear(x, nvfp4_fake_quantize(w.detach())))


def test_enabled_scope_restores_the_budget_and_drops_entries():
    weight_cache.set_weight_cache_budget(0)
    w = torch.randn(64, 64)
    with weight_cache.weight_cache_enabled(8):
        assert weight_cache_info()["budget_bytes"] == 8 * 2**20
        cached_derived("fake_quantize", (w,), lambda: nvfp4_fake_quantize(w))
        assert weight_cache_info()["entries"] == 1
    assert weight_cache_info() | {"hits": 0, "misses": 0} == {"entries": 0, "bytes": 0, "budget_bytes": 0,
                                                             "hits": 0, "misses": 0}
