"""Trainer group mode computes each sibling group's global scale once per forward of the members'
parent (a forward pre-hook on the attention / MLP module, ``ScaleGroup.attach``) instead of once
per member: the same bits as each member computing it, one amax pass per member instead of one
per member per member, never kept across forwards (optimizer steps, ``.data`` writes, exceptions,
activation checkpointing), and no hook left behind by copies or by undoing the conversion."""

import copy

import pytest
import torch

import quads
import quads.ops.backend_registry
import quads.policies.scale_groups as scale_groups
from quads.policies.scale_groups import ScaleGroup
from tests.scale_reference import reference_forward_weight
from tests.tiny_models import build

IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))
ATTN = "model.layers.0.self_attn"


def _trainer(dtype=torch.float32, **policy):
    return quads.quantize_(build("llama", dtype=dtype), quads.QuadsPolicy(side="trainer", **policy))


def _groups(model) -> list:
    found = {}
    for m in model.modules():
        g = getattr(m, "quads_scale_group", None)
        if g is not None:
            found[id(g)] = g
    return list(found.values())


def _hook_count(model) -> int:
    """Forward hooks of trainer scale groups (a rollout's sibling sets hook their parents too)."""
    return sum(isinstance(getattr(h, "__self__", None), ScaleGroup)
               for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))


@pytest.fixture
def amax_calls(monkeypatch):
    """The group scales computed (one ``shared_global_encode_scale`` per computation)."""
    calls = []
    real = scale_groups.shared_global_encode_scale

    def counted(weights, *args, **kwargs):
        weights = list(weights)
        calls.append(len(weights))
        return real(weights, *args, **kwargs)

    monkeypatch.setattr(scale_groups, "shared_global_encode_scale", counted)  # encode_scale (sync, export)
    monkeypatch.setattr(quads.ops.backend_registry, "shared_global_encode_scale", counted)  # Backend.group_scale (forward)
    return calls


def _step(model, autocast=False):
    """Logits and master gradients of one forward/backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(IDS, labels=IDS)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for n in a[1]:
        assert torch.equal(a[1][n], b[1][n]), n


def test_each_group_is_hooked_on_its_parent():
    model = _trainer()
    groups = _groups(model)
    assert len(groups) == 4  # q/k/v and gate/up of 2 layers
    for g in groups:
        parent = model.get_submodule(g.names[0].rpartition(".")[0])
        assert len(g.hooks) == 2 and g.forward_scale is None
        assert [h.__self__ for h in parent._forward_pre_hooks.values()] == [g]
        assert [h.__self__ for h in parent._forward_hooks.values()] == [g]
        assert set(parent._forward_hooks_always_called) == set(parent._forward_hooks)
    assert _hook_count(model) == 8
    # rollout models and per-tensor trainers compute no scale in their forwards: no hook
    assert _hook_count(quads.quantize_(build("llama"), quads.QuadsPolicy(side="rollout"))) == 0
    assert _hook_count(_trainer(weight_global_scale="tensor")) == 0


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)],
                         ids=["fp32-autocast", "fp32", "bf16"])
def test_hooked_forward_and_backward_are_the_per_member_bits(dtype, autocast):
    """Logits and master gradients, bit for bit, with the parent's hook and with each member
    computing the scale itself (the path before the hook, and the path outside a parent's forward)."""
    hooked, plain = _trainer(dtype), _trainer(dtype)
    for g in _groups(plain):
        g.detach()
    assert _hook_count(plain) == 0
    _assert_same(_step(hooked, autocast), _step(plain, autocast))


def test_one_scale_per_group_per_parent_forward(amax_calls):
    model = _trainer()
    with torch.no_grad():
        model(IDS)
    assert amax_calls == [3, 2, 3, 2]  # one per group (q/k/v, gate/up per layer), every member's master
    assert all(g.forward_scale is None for g in _groups(model))  # dropped after the parent's forward
    amax_calls.clear()
    for g in _groups(model):
        g.detach()
    with torch.no_grad():
        model(IDS)
    assert amax_calls == [3, 3, 3, 2, 2] * 2  # the unhooked path: one per member


def test_a_member_called_alone_computes_the_scale(amax_calls):
    """Outside its parent's forward (after one: nothing of it is kept) a member computes the
    scale from the masters as they are now."""
    model = _trainer()
    q = model.get_submodule(f"{ATTN}.q_proj")
    with torch.no_grad():
        model(IDS)
    model.get_parameter(f"{ATTN}.v_proj.weight").data.mul_(4.0)
    masters = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(3, 64)
    amax_calls.clear()
    with torch.no_grad():
        y = q(x)
    assert amax_calls == [3]
    assert torch.equal(y, torch.nn.functional.linear(x, reference_forward_weight(masters, f"{ATTN}.q_proj.weight")))


@pytest.mark.parametrize("write", ["no_grad_add_", "data", "optimizer"])
def test_the_scale_follows_weights_changed_between_forwards(write):
    """The group's amax member is rescaled in place between two forwards: the second forward
    quantizes with the new scale (the logits of a fresh trainer holding the new weights), whether
    or not the write moved the version counter."""
    model = _trainer()
    model(IDS).logits.sum().backward()
    w = model.get_parameter(f"{ATTN}.k_proj.weight")
    version = w._version
    if write == "no_grad_add_":
        with torch.no_grad():
            w.add_(w * 3.0)
    elif write == "data":
        w.data.mul_(4.0)  # .data: the parameter's version counter does not move
        assert w._version == version
    else:
        w.grad.fill_(-1.0)
        torch.optim.SGD([w], lr=10.0).step()
    fresh = _trainer()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        got, want = model(IDS).logits, fresh(IDS).logits
    assert torch.equal(got, want)
    masters = {n: p.detach() for n, p in model.named_parameters()}
    q = model.get_submodule(f"{ATTN}.q_proj")
    assert torch.equal(q.quads_forward_weight(), reference_forward_weight(masters, f"{ATTN}.q_proj.weight"))


def test_activation_checkpointing_recomputes_the_scale(amax_calls):
    """Recomputation reruns the parent's forward, hence its pre-hook: the same bits as without
    checkpointing, the scale computed again in the backward."""
    plain, ckpt = _trainer(), _trainer()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt.train(), plain.train()
    want = _step(plain)
    amax_calls.clear()
    got = _step(ckpt)
    _assert_same(got, want)
    assert sorted(amax_calls) == sorted([3, 2, 3, 2] * 2)  # forward, then the backward's recomputation
    assert all(g.forward_scale is None for g in _groups(ckpt))


def test_an_exception_in_the_parent_forward_drops_the_scale():
    model = _trainer()
    attn = model.get_submodule(ATTN)
    group = attn.q_proj.quads_scale_group

    def fail(module, args):
        assert group.forward_scale is not None  # set by the parent's pre-hook
        raise RuntimeError("injected")

    handle = attn.v_proj.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        model(IDS)
    assert group.forward_scale is None
    handle.remove()
    with torch.no_grad():
        model.get_parameter(f"{ATTN}.q_proj.weight").mul_(2.0)  # a stale scale would now show
    fresh = _trainer()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, fresh(IDS).logits)


@pytest.mark.parametrize("write", ["no_grad_mul_", "data_replaced", "optimizer"])
def test_a_keyboard_interrupt_leaves_no_stale_scale_for_a_member_called_alone(write):
    """torch skips the parent's forward hook after a ``KeyboardInterrupt``: the scale its pre-hook
    computed stays set. A master written after it (version counter or storage moved) and a member
    called alone before the parent's next forward: the member computes the scale from the masters
    as they are now (found by tests/ops/test_sibling_sharing_fuzz.py)."""
    model = _trainer()
    attn = model.get_submodule(ATTN)
    group = attn.q_proj.quads_scale_group

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = attn.v_proj.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(IDS)
    handle.remove()
    assert group.forward_scale is not None  # torch ran no forward hook
    k = model.get_parameter(f"{ATTN}.k_proj.weight")
    if write == "no_grad_mul_":
        with torch.no_grad():
            k.mul_(4.0)
    elif write == "data_replaced":
        k.data = k.data * 4.0
    else:
        k.grad = torch.full_like(k, -1.0)
        torch.optim.SGD([k], lr=10.0).step()
    masters = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    for name in ("q_proj", "v_proj"):  # served before the interrupt, and not
        with torch.no_grad():
            y = attn.get_submodule(name)(x)
        want = torch.nn.functional.linear(x, reference_forward_weight(masters, f"{ATTN}.{name}.weight"))
        assert torch.equal(y, want), name


def test_a_keyboard_interrupt_in_inference_mode_leaves_no_scale_for_autograd():
    """The scale a parent forward computed in inference mode is an inference tensor, which autograd
    refuses to save: a member called alone with gradients after that forward was interrupted
    computes its own (found by tests/ops/test_sibling_sharing_fuzz.py)."""
    model = _trainer()
    attn = model.get_submodule(ATTN)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = attn.q_proj.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.inference_mode():
        model(IDS)
    handle.remove()
    assert attn.q_proj.quads_scale_group.forward_scale.is_inference()  # torch ran no forward hook
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    y = attn.k_proj(x)
    y.sum().backward()
    masters = {n: p.detach() for n, p in model.named_parameters()}
    want = torch.nn.functional.linear(x, reference_forward_weight(masters, f"{ATTN}.k_proj.weight"))
    assert torch.equal(y.detach(), want) and attn.k_proj.weight.grad is not None


def test_a_distributed_member_is_still_refused_in_the_parent_forward(monkeypatch):
    model = _trainer()
    v = model.get_parameter(f"{ATTN}.v_proj.weight")
    monkeypatch.setattr(scale_groups, "is_dtensor", lambda w: w is v)
    with pytest.raises(RuntimeError, match=r"v_proj\.weight is a distributed \(DTensor\) weight.*whole weight"):
        model(IDS)
    assert all(g.forward_scale is None for g in _groups(model))


def test_deepcopy_hooks_its_own_groups_and_detach_removes_only_its_own():
    model = _trainer()
    clone = copy.deepcopy(model)
    for g in _groups(clone):
        parent = clone.get_submodule(g.names[0].rpartition(".")[0])
        assert all(m in list(clone.modules()) for m in g.members)
        assert [h.__self__ for h in parent._forward_pre_hooks.values()] == [g]
    assert not {id(g) for g in _groups(clone)} & {id(g) for g in _groups(model)}
    with torch.no_grad():
        assert torch.equal(clone(IDS).logits, model(IDS).logits)
        clone.get_parameter(f"{ATTN}.q_proj.weight").mul_(2.0)  # the clone's hooks read the clone's masters
        fresh = _trainer()
        fresh.load_state_dict(clone.state_dict())
        assert torch.equal(clone(IDS).logits, fresh(IDS).logits)
    for g in _groups(clone):
        g.detach()
    assert _hook_count(clone) == 0 and _hook_count(model) == 8
    assert not any(m._forward_hooks_always_called for m in clone.modules())


def test_copies_for_rollout_and_undone_conversions_carry_no_hook():
    from quads.integrations.trl.trainer import _model_snapshot

    model = build("llama", dtype=torch.float32)
    undo = _model_snapshot(model)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    assert _hook_count(quads.policies.copy_model(model)) == 0
    rollout = quads.policies.build_rollout_model(model, quads.QuadsPolicy(side="rollout", activations="bf16"))
    assert _hook_count(rollout) == 0
    hooked = {type(getattr(h, "__self__", None)).__name__ for m in rollout.modules() for h in m._forward_pre_hooks.values()}
    assert hooked == {"SiblingSet"}  # the rollout's own: its sibling sets share within their parents' forwards
    undo()
    assert _hook_count(model) == 0
    assert not any(isinstance(m, quads.policies.modules.QuadsModule) for m in model.modules())
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))  # a retry converts (and hooks) again
    assert _hook_count(model) == 8


def test_compiled_trainer_is_one_graph_and_the_eager_bits():
    """torch.compile(fullgraph=True) traces the hooks (no graph break); aot_eager keeps eager's
    ops, so logits and gradients are the eager bits."""
    torch._dynamo.reset()
    try:
        model = _trainer()
        want = _step(model)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        model.zero_grad(set_to_none=True)
        out = compiled(IDS, labels=IDS)
        out.loss.backward()
        got = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        _assert_same(got, want)
        assert all(g.forward_scale is None for g in _groups(model))
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel backend's compile path needs a CUDA GPU")
def test_compiled_trainer_on_the_kernel_backend_is_one_graph():
    """The same on the GPU's kernel backend: the pre-hook's amax-bits handle (``Backend.group_scale``)
    and the fused passes' Triton launches inside the autograd Functions traced by dynamo in one
    graph (``fullgraph=True``).

    What quads owns is checked bit for bit: a sibling group's forward weights from its amax bits,
    compiled, equal eager's. The whole step is checked to a tolerance only: on CUDA a compiled
    step is not eager's bits even without quads (measured on the H200, ``lab/compile_bits.py``:
    the plain tiny Llama compiled by dynamo alone is off by up to 6e-7 in its float32 logits and
    in every gradient, the same for quads' torch and kernel backends; the traced graph's cuBLAS
    calls differ), so bit equality there would test cuBLAS, not quads."""
    from quads.ops.backend_registry import get_backend
    from quads.policies.ste import fake_quantize_weight

    torch._dynamo.reset()
    try:
        hopper = get_backend("hopper")
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = [torch.randn(n, 64, device="cuda", generator=g) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.2))]

        def group(*ws):
            bits = hopper.group_scale(ws)
            return [fake_quantize_weight(w, hopper, torch.bfloat16, bits) for w in ws]

        want_w = group(*ws)
        got_w = torch.compile(group, backend="aot_eager", fullgraph=True)(*ws)
        for a, b in zip(want_w, got_w):
            assert torch.equal(a, b)

        model = _trainer().cuda()
        assert all(m.quads_backend.name == "hopper" for m in model.modules() if hasattr(m, "quads_backend"))
        ids = IDS.cuda()

        def step(fn):
            model.zero_grad(set_to_none=True)
            out = fn(ids, labels=ids)
            out.loss.backward()
            return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        want = step(model)
        got = step(torch.compile(model, backend="aot_eager", fullgraph=True))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert got[1].keys() == want[1].keys() and len(want[1]) > 0
        for n in want[1]:
            torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-4, atol=1e-6, msg=n)
        assert all(g.forward_scale is None for g in _groups(model))
    finally:
        torch._dynamo.reset()
