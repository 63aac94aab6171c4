"""Sibling sets on the humming backend: one humming GEMM over the stacked weight (group mode).

The stacked layout is checked against humming's layout restated in torch (the concatenation
along N is the members' layouts side by side); the GEMM runs on the ``fake_humming`` stand-in
(humming's documented arithmetic on CPU). The GPU check ``humming_siblings`` times and compares
the real kernels.
"""

from __future__ import annotations

import pytest
import torch

import quads
from quads.kernels.humming.layout import repack_reference, scale_layout
from quads.ops.backends.humming import backend as hb
from quads.ops.linear_op import w4a4_linear_reference
from quads.policies.fused_projections import fuse_projections_, unfuse_projections_
from tests.ops.test_humming_backend import fake_humming  # noqa: F401  (fixture)
from tests.ops.test_humming_memory import _fast_rollout, _input, _linears, _llama

pytestmark = pytest.mark.usefixtures("memo_weight_kernel")


@pytest.mark.parametrize("apply_on_c", [False, True])
def test_the_layout_of_stacked_weights_is_the_members_layouts_side_by_side(apply_on_c):
    g = torch.Generator().manual_seed(0)
    sizes = (128, 64, 192)
    qs = [torch.randint(0, 256, (n, 64), dtype=torch.uint8, generator=g) for n in sizes]
    ss = [(torch.rand(n, 8, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn) for n in sizes]
    assert torch.equal(repack_reference(torch.cat(qs)), torch.cat([repack_reference(q) for q in qs], dim=-1))
    stacked = scale_layout(torch.cat(ss), apply_on_c).view(torch.uint8)
    assert torch.equal(stacked, torch.cat([scale_layout(s, apply_on_c) for s in ss], dim=-1).view(torch.uint8))
    assert not torch.equal(repack_reference(torch.cat(qs[::-1])), repack_reference(torch.cat(qs)))  # order matters


@pytest.fixture(autouse=True)
def _stacking_on(monkeypatch):
    """The stacked copy is on by default; these tests set it on for the backend whatever the env says."""
    from quads.ops.backend_registry import get_backend

    monkeypatch.setattr(get_backend("humming"), "stack_siblings", True)


def test_stacking_is_on_by_default(monkeypatch):
    """Default: a stacked copy per sibling set of one global scale; QUADS_HUMMING_STACK_SIBLINGS=0
    keeps one layout per weight, each member its own humming GEMM."""
    monkeypatch.delenv("QUADS_HUMMING_STACK_SIBLINGS", raising=False)
    assert hb.HummingBackend().stack_siblings is True
    monkeypatch.setenv("QUADS_HUMMING_STACK_SIBLINGS", "0")
    assert hb.HummingBackend().stack_siblings is False
    assert hb.HummingBackend(stack_siblings=True).stack_siblings is True


def test_unstacked_backend_keeps_one_layout_per_weight(fake_humming, monkeypatch):
    from quads.ops.backend_registry import get_backend

    monkeypatch.setattr(get_backend("humming"), "stack_siblings", False)
    model = _fast_rollout()
    fuse_projections_(model)
    sets = _sets(model)
    assert sets and all(s.stacked is None for s in sets)


def _sets(model):
    return list({id(m.quads_group): m.quads_group for m in _linears(model) if m.quads_group is not None}.values())


def _fused_against_alone(fake_humming, model, alone):
    """Fuse ``model``'s sibling sets (each stacked, on the humming sibling kernel) and run it and
    ``alone`` (unfused) on one input: ``(fused logits, unfused logits, the fused run's GEMM calls)``,
    the fused run 3 GEMMs short of the unfused one (q/k/v and gate/up: 2 instead of 5)."""
    assert fuse_projections_(model) == 2
    assert all(isinstance(s.stacked, hb.HummingStack) and isinstance(s.kernel(), hb.HummingSiblingKernel)
               for s in _sets(model))
    x = _input()
    with torch.no_grad():
        alone(x)
        n_alone = len(fake_humming)
        del fake_humming[:]
        y = model(x).logits
        calls = list(fake_humming)
        ya = alone(x).logits
    assert len(calls) == n_alone - 3
    return y, ya, calls


def test_one_humming_gemm_per_sibling_set_within_the_bound(fake_humming):
    model = _fast_rollout()
    y, ya, calls = _fused_against_alone(fake_humming, model, _fast_rollout())
    assert {a[0][1] for a in calls} == {128}
    assert (y.float() - ya.float()).abs().max() <= 2**-6 * ya.float().abs().max()
    # member by member: the stacked GEMM's columns against the exact path, within the documented bound
    attn = model.model.layers[0].self_attn
    h = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        outs = [m(h) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    for m, out in zip((attn.q_proj, attn.k_proj, attn.v_proj), outs):
        ref = w4a4_linear_reference(h.reshape(-1, 128), m.weight.parts, None, m.quads_act).reshape(out.shape)
        assert (out.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()


def test_warm_up_kernels_compiles_the_stacked_weights_of_fused_sets_once(fake_humming, monkeypatch):
    from quads.ops.backends.humming.library import HummingNVFP4
    from quads.policies.warmup import warm_up_kernels

    warmed = []
    monkeypatch.setattr(HummingNVFP4, "warmup", lambda self, ms=(1,): warmed.append(id(self)))
    model = _fast_rollout()
    assert fuse_projections_(model) == 2
    warm_up_kernels(model, log=lambda line: None, workers=2)
    stacks = [id(s.stacked.weight.layer(torch.float16)) for s in _sets(model)]
    members = [id(p.layer(torch.float16)) for m in _linears(model) for p in m.quads_prepared]
    assert len(stacks) == 2 and sorted(warmed) == sorted(stacks + members)  # each once, the stacks included


def test_a_sync_writes_through_the_members_into_the_stacked_gemm(fake_humming):
    trainer = _llama(seed=7)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    fused, alone = _fast_rollout(seed=1), _fast_rollout(seed=1)
    fuse_projections_(fused)
    x = _input()
    with torch.no_grad():
        before = fused(x).logits
    stacks = [s.stacked for s in _sets(fused)]
    ptrs = [s.weight.layer(torch.float16).layer.weight.data_ptr() for s in stacks]
    quads.sync_weights_(fused, trainer)
    quads.sync_weights_(alone, trainer)
    assert [s.stacked for s in _sets(fused)] == stacks and len(stacks) == 2  # still stacked, in place
    assert ptrs == [s.weight.layer(torch.float16).layer.weight.data_ptr() for s in stacks]
    for s in stacks:  # the stacked layout is the members' written layouts side by side
        lay = s.weight.layer(torch.float16)
        assert torch.equal(lay.layer.weight, torch.cat([m.layer(torch.float16).layer.weight for m in s.members], -1))
        assert float(lay.shift["w4a4"]) == max(float(m.layer(torch.float16).shift["w4a4"]) for m in s.members)
    with torch.no_grad():
        after, want = fused(x).logits, alone(x).logits
    assert not torch.equal(after, before)
    assert (after.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max()


def test_the_stacked_copy_is_the_sets_only_extra_layout_and_goes_with_it(fake_humming):
    model = _fast_rollout()
    own = {id(m): m.quads_prepared[0] for m in _linears(model)}
    fuse_projections_(model)
    assert all(m.quads_prepared[0] is own[id(m)] and m.weight.kernel_layout is own[id(m)] for m in _linears(model))
    for s in _sets(model):  # one more layout per set: the members' bytes once more
        assert s.stacked.nbytes == sum(v.nbytes for v in s.views)
    assert unfuse_projections_(model) == 2
    assert all(m.quads_prepared[0] is own[id(m)] and m.quads_group is None for m in _linears(model))


def test_per_weight_global_scales_keep_one_gemm_per_member(fake_humming):
    model = _llama()
    with quads.use_backend("humming"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel="fast", weight_global_scale="tensor"))
    fuse_projections_(model)
    sets = _sets(model)
    assert sets and all(s.stacked is None for s in sets)  # the operands once, each member its own GEMM


def test_launchers_are_three_calls_below_a_member_forward(fake_humming):
    """forward -> the member's kernel -> the set's kernel.apply -> quantize_rows / the humming layer /
    unscale_rows (-> the launch)."""
    import sys

    from quads.policies.modules import RolloutLinear

    model = _fast_rollout()
    fuse_projections_(model)
    forward, depths = RolloutLinear.forward.__code__, []
    launchers = {"quantize_rows", "unscale_rows", "call"}  # call: the stand-in for HummingNVFP4.__call__

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name not in launchers:
            return
        depth, f = 1, frame.f_back
        while f is not None and f.f_code is not forward:
            if f.f_code.co_name in launchers:
                return
            depth, f = depth + 1, f.f_back
        if f is not None:
            depths.append((frame.f_code.co_name, f.f_locals["self"].quads_group is not None, depth))

    sys.setprofile(profile)
    try:
        with torch.no_grad():
            model(_input())
    finally:
        sys.setprofile(None)
    assert {n for n, _, _ in depths} == launchers
    assert {(member, d) for _, member, d in depths} == {(True, 3), (False, 2)}  # o_proj / down_proj: 2


def test_an_interrupted_sync_leaves_the_stacked_copy_as_it_was(fake_humming, monkeypatch):
    """The rollback restores the members' layouts; the stacked copy (written from them while the
    modules were notified) follows them back, bit for bit, with the set's output-range scales."""
    from quads.policies.modules import RolloutModule

    trainer = _llama(seed=7)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    model = _fast_rollout(seed=1)
    fuse_projections_(model)
    stacks = [s.stacked for s in _sets(model)]
    assert len(stacks) == 2

    def held(s):
        lay = s.weight.layer(torch.float16)
        return [t.clone() for t in lay.written_tensors()]

    before = [held(s) for s in stacks]
    x = _input()
    with torch.no_grad():
        y0 = model(x).logits
    calls, orig = [], RolloutModule.quads_weights_changed

    def flaky(self):  # every member notified (its new layout copied into the stack) before the interrupt
        calls.append(self)
        if len(calls) == len(_linears(model)):
            raise KeyboardInterrupt
        return orig(self)

    monkeypatch.setattr(RolloutModule, "quads_weights_changed", flaky)
    with pytest.raises(KeyboardInterrupt):
        quads.sync_weights_(model, trainer)
    monkeypatch.setattr(RolloutModule, "quads_weights_changed", orig)
    assert [s.stacked for s in _sets(model)] == stacks  # still stacked
    for s, old in zip(stacks, before):
        now = held(s)
        assert len(now) == len(old) and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                            for a, b in zip(now, old))
    with torch.no_grad():
        assert torch.equal(model(x).logits, y0)


def _fast_w4a16_rollout(seed=0):
    model = _llama(seed)
    with quads.use_backend("humming"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel="fast", activations="bf16"))
    return model


def test_w4a16_sibling_sets_run_one_humming_gemm_with_each_members_arithmetic(fake_humming):
    """Weight-only siblings of one global scale: one GEMM over the stacked weight in the input's
    dtype, each member's columns its own kernel's arithmetic (fp32 sum of exact products x 1/S_w,
    rounded once): bit-equal to the members' own GEMMs on the stand-in (on the GPU, within the
    fast path's run-to-run spread: the GPU check ``humming_siblings``)."""
    y, ya, calls = _fused_against_alone(fake_humming, _fast_w4a16_rollout(), _fast_w4a16_rollout())
    assert {a[1] for a in calls} == {"unit"} and {a[0][1] for a in calls} == {128}
    assert torch.equal(y, ya)


def test_a_sync_writes_through_w4a16_members_into_the_stacked_gemm(fake_humming):
    """After a sync with new weights (a new shared global scale), the stacked W4A16 GEMM gives the
    members' own outputs: its layout and its ``1 / S_w`` follow the members."""
    trainer = _llama(seed=7)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(3.0)  # a different global scale than the rollout's
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", activations="bf16"))
    fused, alone = _fast_w4a16_rollout(seed=1), _fast_w4a16_rollout(seed=1)
    fuse_projections_(fused)
    x = _input()
    with torch.no_grad():
        before = fused(x).logits
    quads.sync_weights_(fused, trainer)
    quads.sync_weights_(alone, trainer)
    for s in _sets(fused):
        assert float(s.stacked.weight.layer(torch.bfloat16).ws2["unit"]) == float(
            s.stacked.members[0].layer(torch.bfloat16).ws2["unit"])
    with torch.no_grad():
        after, want = fused(x).logits, alone(x).logits
    assert not torch.equal(after, before)
    assert torch.equal(after, want)


def test_unstacked_w4a16_sets_on_humming_layouts_share_nothing(fake_humming, monkeypatch):
    """Weight-only siblings without a stacked weight (the decoder's dormant sets on an unfused
    model): each member's humming GEMM reads the input as it is, so the set computes no fp16
    operand rows for them (a launch per set whose result no member would read)."""
    import quads.kernels.hopper.fp16_operand as fp16_operand
    from quads.ops.sibling_linear import enabled_groups
    from quads.policies.fused_projections import sibling_groups_

    model = _fast_w4a16_rollout(seed=2)
    x = _input()
    with torch.no_grad():
        want = model(x).logits
    sets = sibling_groups_(model)
    assert sets and all(s.stacked is None for s in sets)
    assert all(m._quads_forward_kernel is m._quads_kernel for m in _linears(model))  # decided at the refresh
    made = []
    real = fp16_operand.scaled_fp16_rows
    monkeypatch.setattr(fp16_operand, "scaled_fp16_rows", lambda rows: made.append(rows.shape) or real(rows))
    del fake_humming[:]
    with torch.no_grad(), enabled_groups(sets):
        got = model(x).logits
    assert made == []
    assert len(fake_humming) == len(_linears(model))  # every member its own GEMM
    assert torch.equal(got, want)
