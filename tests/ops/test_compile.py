"""torch.compile(fullgraph=True) of rollout-quantized models: the quads ops are custom ops, no
data-dependent Python reaches the graph, and the compiled ops give the eager bits. A whole model
compiles to the eager bits with inductor's defaults: quads turns on inductor's
``emulate_precision_casts`` for the compile of every graph holding a quads op (without it,
inductor's re-fused BF16 norms, gates and sums move activations by BF16 ulps, which can move
NVFP4 codes), and only for those graphs."""

import dataclasses

import pytest
import torch
import torch._inductor.config as inductor_config

import quads
from quads.ops.compile_alignment import eager_casts
from quads.policies.modules import RolloutExperts
from tests.tiny_models import build


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled code is cached per code object and not guarded on inductor's config: start clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rollout(kind, fraction=1.0):
    m = build(kind)
    quads.quantize_(m, quads.QuadsPolicy(side="rollout", residual_fraction=fraction))
    return m.eval()


@pytest.mark.parametrize("act", [quads.ActivationQuant(residual_fraction=1.0), quads.ActivationQuant(0.5), None],
                         ids=["k100", "k50", "w4a16"])
def test_compiled_linear_is_eager_bits(act):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).bfloat16()
    policy = quads.QuadsPolicy(side="rollout", activations="bf16") if act is None else \
        quads.QuadsPolicy(side="rollout", residual_fraction=act.residual_fraction)
    quads.quantize_(lin, policy)
    x = torch.randn(2, 5, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, fullgraph=True)(x), lin(x))


def test_compiled_experts_are_eager_bits():
    m = _rollout("qwen3_moe")
    experts = next(mod for mod in m.modules() if isinstance(mod, RolloutExperts))
    g = torch.Generator().manual_seed(1)
    hid = torch.randn(7, 64, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    wts = torch.softmax(torch.randn(7, 2, generator=g), -1).bfloat16()
    with torch.no_grad():
        assert torch.equal(torch.compile(experts, fullgraph=True)(hid, idx, wts), experts(hid, idx, wts))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "llama"])
def test_whole_rollout_model_compiles_to_eager_bits(kind):
    """inductor's defaults (emulate_precision_casts off, as a user leaves it): still eager's bits."""
    assert not inductor_config.emulate_precision_casts
    m = _rollout(kind)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(torch.compile(m, fullgraph=True)(ids).logits, m(ids).logits)
    assert not inductor_config.emulate_precision_casts  # restored when the compile ended


def test_eager_casts_only_for_graphs_holding_quads_ops():
    """The setting inductor compiles each graph with: on for the rollout's graph, as configured
    (off) for a plain BF16 model's compiled after it."""
    from torch._inductor.compile_fx import compile_fx

    seen = []

    def inductor_spy(gm, example_inputs):
        seen.append(inductor_config.emulate_precision_casts)
        return compile_fx(gm, example_inputs)

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.compile(_rollout("llama"), backend=inductor_spy, fullgraph=True)(ids)
        torch.compile(build("llama").eval(), backend=inductor_spy, fullgraph=True)(ids)
    assert seen == [True, False]


@pytest.mark.parametrize("kind", ["qwen3_moe"])
def test_opt_out_drift_is_bounded(kind):
    """Opted out (``eager_casts(False)``, what ``QUADS_EAGER_CASTS=0`` sets at import): inductor's
    fused BF16 math, no graph break; the logits move about as much as inductor moves the BF16
    model's (bounded against that drift)."""
    m, base = _rollout(kind), build(kind).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), eager_casts(False):
        eager, compiled = m(ids).logits.float(), torch.compile(m, fullgraph=True)(ids).logits.float()
        drift_bf16 = (torch.compile(base, fullgraph=True)(ids).logits.float() - base(ids).logits.float()).norm()
    rel = ((compiled - eager).norm() / eager.norm()).item()
    assert rel < 5e-2, rel
    assert (compiled - eager).norm() <= 20 * drift_bf16 + 1e-3


def test_compiling_a_rollout_does_not_warn_about_the_cache_hash():
    """torch's AOT autograd cache asks every wrapper subclass for ``_stable_hash_for_caching``
    and warns for one without it: compiling a rollout warns nothing of the kind."""
    import warnings

    torch._dynamo.utils.warn_once_cache.clear()
    m = _rollout("llama")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(m, fullgraph=True)(ids)
    assert not [w for w in caught if "_stable_hash_for_caching" in str(w.message)]


def test_cache_hash_is_metadata_only_and_stable_across_processes():
    """Equal for two weights of one layout (values differ), different for another shape or
    transposition, and the same in a fresh interpreter (no ``hash()`` of Python objects)."""
    import subprocess
    import sys

    w = lambda seed, shape=(32, 64): quads.NVFP4Tensor.from_float(  # noqa: E731
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16())
    h = w(0)._stable_hash_for_caching()
    assert h == w(1)._stable_hash_for_caching()
    assert h != w(0, (48, 64))._stable_hash_for_caching() and h != w(0).t()._stable_hash_for_caching()
    code = ("import torch, quads; print(quads.NVFP4Tensor.from_float(torch.randn(32, 64).bfloat16())"
            "._stable_hash_for_caching())")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=300).stdout.split()[-1] == h


@pytest.fixture(params=[True, False], ids=["kernel-objects", "plain-fields"])
def kernel_ops(request, monkeypatch):
    """Both compiled paths: the kernel object as the op's argument (torch's opaque objects) and,
    for a torch without them, the kernel's plain fields (``quads::linear`` / ``quads::grouped_linear``)."""
    import quads.ops.experts_op as experts_module
    import quads.ops.linear_op as linear_module

    if request.param and not linear_module.KERNEL_OPS:
        pytest.skip("this torch has no opaque custom-op objects")
    monkeypatch.setattr(linear_module, "KERNEL_OPS", request.param)
    monkeypatch.setattr(experts_module, "KERNEL_OPS", request.param)
    return request.param


def test_compiled_ops_take_the_module_kernel(kernel_ops):
    """The graph's quads ops: the module's own kernel handle (nothing rebuilt per call) or its
    plain fields; eager bits either way."""
    m = _rollout("qwen3_moe")
    seen = []

    def spy(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(torch.compile(m, backend=spy, fullgraph=True)(ids).logits, m(ids).logits)
    targets = {str(n.target).removeprefix("quads.").split(".")[0] for gm in seen for n in gm.graph.nodes
               if n.op == "call_function" and "quads" in str(n.target)}
    assert targets == ({"linear_kernel", "experts_gemm"} if kernel_ops else {"linear", "grouped_linear"})


@pytest.mark.parametrize("backend", ["torch", "hopper"])
def test_plain_field_ops_make_the_kernel_back(backend):
    """``quads::linear`` and ``quads::grouped_linear`` over a kernel's fields (one record,
    ``KernelOpArgs``) make the kernel back in their bodies: its bits, the Hopper layouts of a 2-D
    and of a 3-D weight included; both ops' schemas end with the record's fields."""
    from quads.ops.experts_op import Routing
    from quads.ops.kernel_op_args import KernelOpArgs
    from quads.ops.linear_op import linear_op_args

    m = build("qwen3_moe")
    with quads.use_backend(backend):
        quads.quantize_(m, quads.QuadsPolicy(side="rollout"))
    layer = m.model.layers[0]
    linear, experts = layer.self_attn.q_proj._quads_kernel, layer.mlp.experts._quads_kernel
    assert {linear.prepared is None, experts.gate_up.prepared is None} == {backend == "torch"}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    route = Routing(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]), 4)
    down_in = torch.randn(route.num_rows, experts.parts[1].qdata.shape[-1] * 2, generator=g).bfloat16()
    with torch.no_grad():
        args = linear_op_args(linear.backend, x, linear.parts, None, linear.prepared, linear.act, linear.static_mask)
        assert torch.equal(torch.ops.quads.linear(*args), linear.apply(x))
        for i, (inp, rows) in enumerate([(x, route.token_of_row), (down_in, None)]):
            got = torch.ops.quads.grouped_linear(*experts.op_args(i, inp, rows, route, None))
            assert torch.equal(got, experts.gemm(i, inp, rows, route, None))
    fields = [f.name for f in dataclasses.fields(KernelOpArgs)]
    for op in (torch.ops.quads.linear.default, torch.ops.quads.grouped_linear.default):
        assert [a.name for a in op._schema.arguments][-len(fields):] == fields


def test_kernel_handles_survive_deep_copying_fake_objects(monkeypatch):
    """Some torch versions (2.11) deep-copy the object a fake script object wraps: the kernel
    handle is a reference, so the copy is the handle itself and the compiled graph still runs the
    module's kernel (a copy that is anything else fails inside aot_autograd)."""
    import copy

    from torch._library import fake_class_registry

    from quads.ops.backend_registry import KERNEL_OPS

    if not KERNEL_OPS:
        pytest.skip("this torch has no opaque custom-op objects")
    init = fake_class_registry.FakeScriptObject.__init__

    def deep_copying_init(self, wrapped_obj, script_class_name, x):
        init(self, wrapped_obj, script_class_name, x)
        object.__setattr__(self, "real_obj", copy.deepcopy(x))

    monkeypatch.setattr(fake_class_registry.FakeScriptObject, "__init__", deep_copying_init)
    m = _rollout("qwen3_moe")
    kernel = next(mod for mod in m.modules() if isinstance(mod, RolloutExperts))._quads_kernel
    assert copy.deepcopy(kernel.op_handle) is kernel.op_handle and copy.copy(kernel.op_handle) is kernel.op_handle
    twin = copy.deepcopy(kernel)
    assert twin.op_handle.kernel is twin  # a copied kernel gets its own handle
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(torch.compile(m, backend="aot_eager", fullgraph=True)(ids).logits, m(ids).logits)


def test_fused_rollout_compiles_once_per_shape_across_syncs():
    """A rollout with fused projections (sibling sets) compiled, run at two shapes, synced, run
    again: no recompile (each set's kernel exists before the first trace, so no graph guards on
    its absence)."""
    from quads.policies import build_rollout_model

    trainer = quads.quantize_(build("qwen3_moe", dtype=torch.float32), quads.QuadsPolicy(side="trainer"))
    rollout = build_rollout_model(trainer, quads.QuadsPolicy(side="rollout"))
    assert any(getattr(m, "quads_group", None) is not None for m in rollout.modules())
    compiled = torch.compile(rollout, backend="eager", fullgraph=True)
    counters = torch._dynamo.utils.counters
    shapes = [torch.randint(0, 96, s, generator=torch.Generator().manual_seed(3)) for s in ((1, 1), (2, 9), (3, 5))]
    with torch.no_grad():
        for ids in shapes:
            compiled(ids)
        graphs = counters["stats"]["unique_graphs"]
        for p_ in trainer.parameters():
            p_.add_(torch.randn_like(p_) * 0.02)
        quads.sync_weights_(rollout, trainer)
        for ids in shapes:
            assert torch.equal(compiled(ids).logits, rollout(ids).logits)
    assert counters["stats"]["unique_graphs"] == graphs
