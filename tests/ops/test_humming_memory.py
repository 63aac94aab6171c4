"""Rollout weight memory on the humming backend: one layout per weight (<= 1.1x the packed bytes).

A rollout module on the humming backend holds only humming's layout: it is its ``NVFP4Tensor``'s
storage (``to_layout_``), every reader of the packed parts (state dicts, saving, ``dequantize``,
the exact-path fallbacks) derives them from it (the inverse repack of
:mod:`quads.kernels.humming.layout`) and every writer (a sync, ``load_state_dict``) writes it in
place (``write_parts_``). Tested with
the stand-in for humming's GEMM (``fake_humming``: humming's real layout through the torch
restatement of its repack), and at the real shapes with humming's own Python on CPU where it is
importable (``humming_on_cpu``).
"""

from __future__ import annotations

import pytest
import torch

import quads
from quads.ops.backends.humming import backend as hb
from quads.policies.modules import RolloutLinear, RolloutModule
from quads.tensor import NVFP4Tensor
from quads.tensor.nvfp4_math import nvfp4_quantize
from tests.model_state import assert_unchanged, snapshot
from tests.ops.test_humming_backend import fake_humming  # noqa: F401  (fixture)
from tests.tiny_models import square_llama

# the weight quantizer kernel runs once per distinct weight in the session (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("memo_weight_kernel")

LIMIT = 1.1  # rollout weight memory <= 1.1x the NVFP4 packed bytes


def _llama(seed=0):
    """Every linear's N a multiple of 128 and K of 64 (the shapes humming serves, as in real models),
    the smallest such shapes: the weight quantizer runs under the interpreter."""
    return square_llama(seed, width=128)


def _fast_rollout(seed=0):
    model = _llama(seed)
    with quads.use_backend("humming"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel="fast"))
    return model


def _linears(model):
    return [m for m in model.modules() if isinstance(m, RolloutLinear)]


def _packed_bytes(shape) -> int:
    """NVFP4 packed bytes of a (.., N, K) weight: qdata K/2 + e4m3 scales K/16 per row."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // 2 + shape[-1] // 16)


def _module_bytes(module) -> int:
    """Bytes a rollout module holds for its packed weights: stored parts (if any), the prepared layouts."""
    total = 0
    for name, prepared in zip(module.quads_packed_names, module.quads_prepared):
        w = getattr(module, name)
        if w.kernel_layout is None:
            total += sum(t.numel() * t.element_size() for t in w.stored_parts()[:2])
        total += prepared.nbytes
    return total


def _input(seed=3, t=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, t), generator=g)


def test_fast_rollout_holds_one_layout_per_weight(fake_humming):
    model = _fast_rollout()
    linears = _linears(model)
    assert linears and all(m.quads_backend.name == "humming" for m in linears)
    for m in linears:
        w, (prepared,) = m.weight, m.quads_prepared
        assert isinstance(prepared, hb.HummingWeight) and w.kernel_layout is prepared
        ratio = _module_bytes(m) / _packed_bytes(tuple(w.shape))
        assert ratio <= LIMIT, (m, ratio)


def test_held_parts_read_back_bit_exact_and_forward_unchanged(fake_humming):
    ref = _llama()
    quads.quantize_(ref, quads.QuadsPolicy(side="rollout"))  # the same policy on the exact path: parts stored
    parts = {n: p for n, p in ref.named_parameters() if isinstance(p, NVFP4Tensor)}
    model = _fast_rollout()
    x = _input()
    with torch.no_grad():
        y1 = model(x).logits
    for name, p in model.named_parameters():
        if isinstance(p, NVFP4Tensor):
            assert p.kernel_layout is not None
            want = parts[name]
            assert torch.equal(p.qdata, want.qdata) and torch.equal(p.scale.view(torch.uint8),
                                                                   want.scale.view(torch.uint8)), name
            assert torch.equal(p.global_encode_scale, want.global_encode_scale)
            torch.testing.assert_close(p.dequantize(), want.dequantize(), rtol=0, atol=0)
    with torch.no_grad():
        y2 = model(x).logits
    assert torch.equal(y1, y2)
    assert all(m.weight.kernel_layout is m.quads_prepared[0] for m in _linears(model))  # reads converted nothing


def test_state_dict_save_and_load_through_the_layout(fake_humming, tmp_path):
    a, b = _fast_rollout(seed=0), _fast_rollout(seed=1)
    x = _input()
    with torch.no_grad():
        ya, yb = a(x).logits, b(x).logits
    sd = a.state_dict()
    assert all(m.weight.kernel_layout is not None for m in _linears(a))  # state_dict's views derive nothing
    path = tmp_path / "a.safetensors"
    quads.tensor.save_safetensors(sd, str(path))
    loaded = quads.tensor.load_safetensors(str(path))
    ptrs = [[t.data_ptr() for t in m.quads_prepared[0].layers[torch.float16].layer.parameters()]
            for m in _linears(b)]
    b.load_state_dict(loaded)  # copy_ writes b's layouts in place
    with torch.no_grad():
        assert torch.equal(b(x).logits, ya) and not torch.equal(ya, yb)
    assert ptrs == [[t.data_ptr() for t in m.quads_prepared[0].layers[torch.float16].layer.parameters()]
                    for m in _linears(b)]  # in place: captured graphs stay valid
    assert all(m.weight.kernel_layout is m.quads_prepared[0] for m in _linears(b))
    blob = tmp_path / "b.pt"
    torch.save(b.state_dict(), blob)  # pickled with its parts, never with the layout
    back = torch.load(blob, weights_only=True)
    for name, p in back.items():
        if isinstance(p, NVFP4Tensor):
            assert p.kernel_layout is None and torch.equal(p.qdata, sd[name].qdata)


def test_sync_writes_through_the_layout_bit_exact_and_in_place(fake_humming):
    trainer = _llama(seed=7)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    rollout, reference = _fast_rollout(seed=1), _llama(seed=1)
    quads.quantize_(reference, quads.QuadsPolicy(side="rollout"))  # the exact backend: parts stored
    ptrs = [m.quads_prepared[0].layers[torch.float16].layer.weight.data_ptr() for m in _linears(rollout)]
    quads.sync_weights_(rollout, trainer)
    quads.sync_weights_(reference, trainer)
    for m, r in zip(_linears(rollout), _linears(reference)):
        assert m.weight.kernel_layout is m.quads_prepared[0]  # written in place, still the storage
        q, s = m.quads_prepared[0].packed_parts()
        assert torch.equal(q, r.weight.qdata) and torch.equal(s.view(torch.uint8), r.weight.scale.view(torch.uint8))
        assert torch.equal(m.weight.global_encode_scale, r.weight.global_encode_scale)
    assert ptrs == [m.quads_prepared[0].layers[torch.float16].layer.weight.data_ptr() for m in _linears(rollout)]


def test_sync_never_derives_the_parts_from_the_layout(fake_humming, monkeypatch):
    """A sync writes the layout and snapshots the layout's own tensors for its rollback: deriving the
    packed parts (the inverse repack, several passes over every weight) is not part of it."""
    from quads.ops.backends.humming import library as hg

    trainer = _llama(seed=7)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    rollout = _fast_rollout(seed=1)
    derived = []
    orig = hg.HummingNVFP4.packed_parts
    monkeypatch.setattr(hg.HummingNVFP4, "packed_parts", lambda self: derived.append(self) or orig(self))
    quads.sync_weights_(rollout, trainer)
    assert derived == []
    assert all(m.weight.kernel_layout is m.quads_prepared[0] for m in _linears(rollout))
    q, _ = _linears(rollout)[0].quads_prepared[0].packed_parts()  # the check itself sees a derivation
    assert len(derived) == 1 and q.dtype == torch.uint8


def test_sync_interrupted_after_the_write_leaves_the_layout_as_it_was(fake_humming, monkeypatch):
    """An exception while the modules are notified (some layouts already written) rolls every layout back."""
    trainer = _llama(seed=7)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    rollout = _fast_rollout(seed=1)
    before = snapshot(rollout)
    x = _input()
    with torch.no_grad():
        y0 = rollout(x).logits
    calls = []
    orig = RolloutModule.quads_weights_changed

    def flaky(self):
        calls.append(self)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return orig(self)

    monkeypatch.setattr(RolloutModule, "quads_weights_changed", flaky)
    with pytest.raises(KeyboardInterrupt):
        quads.sync_weights_(rollout, trainer)
    monkeypatch.setattr(RolloutModule, "quads_weights_changed", orig)
    with torch.no_grad():
        assert torch.equal(rollout(x).logits, y0)
    assert_unchanged(before, rollout)


def test_exact_path_fallback_reads_the_parts_from_the_layout(fake_humming):
    model = _fast_rollout()
    m = _linears(model)[0]
    x = torch.randn(3, m.in_features)  # fp32 activations: the exact path, which reads the packed parts
    y = m(x)
    m2 = _llama()
    quads.quantize_(m2, quads.QuadsPolicy(side="rollout"))
    assert torch.equal(y, _linears(m2)[0](x))
    assert m.weight.kernel_layout is m.quads_prepared[0]  # derived for the call, nothing converted


@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 2048), (2048, 4096), (14336, 4096), (4096, 14336)])
def test_real_shapes_bytes_with_humming_on_cpu(humming_on_cpu, shape):
    """humming's own layer (real configuration, Stream-K locks included) at the named linear shapes,
    on CPU: the layout alone is what the module keeps, <= 1.1x the packed bytes."""
    g = torch.Generator().manual_seed(0)
    w = nvfp4_quantize(torch.randn(*shape, generator=g) * 0.02, "tensor")
    held = hb.HummingWeight(w, "default")
    assert held.can_hold_parts and held._parts is None
    packed = _packed_bytes(shape)
    assert held.nbytes / packed <= LIMIT, held.nbytes / packed
    held.layer(torch.bfloat16)  # the W4A16 layer shares the layout
    assert held.nbytes / packed <= LIMIT
    q, s = held.packed_parts()
    assert torch.equal(q, w.qdata) and torch.equal(s.view(torch.uint8), w.scale.view(torch.uint8))


from tests.ops.test_humming_refresh import humming_on_cpu  # noqa: E402,F401  (fixture)


# -- torch.compile: quads::linear over the layout's tensors ---------------------------------------------

@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_fast_rollout_traces_to_the_eager_bits_and_follows_syncs(fake_humming, _fresh_dynamo):
    """fullgraph compile of a humming rollout model: each linear is one opaque ``quads::linear`` op
    over the held layout (no packed part is read: the weights stay dropped), eager bits; a sync
    writes the layout in place and the compiled model follows it without recompiling."""
    import torch._inductor.config as inductor_config

    model = _fast_rollout().eval()
    x = _input()
    counts = torch._dynamo.utils.counters
    with torch.no_grad(), inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(model, fullgraph=True)
        y0 = compiled(x).logits
        assert torch.equal(y0, model(x).logits)
        assert all(m.weight.kernel_layout is not None for m in _linears(model))
        trainer = _llama(seed=7)
        quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
        quads.sync_weights_(model, trainer)
        frames = counts["stats"]["unique_graphs"]
        y1 = compiled(x).logits
        assert torch.equal(y1, model(x).logits) and not torch.equal(y1, y0)
        assert counts["stats"]["unique_graphs"] == frames  # no recompile: the same layout, written in place


def _compiled_graph(model, x):
    """(the FX graph dynamo makes of ``model(x)``, fullgraph; its real input tensors in placeholder order)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    y = torch.compile(model, backend=backend, fullgraph=True)(x).logits
    assert len(seen) == 1 and torch.equal(y, model(x).logits)
    return seen[0]


@pytest.mark.parametrize("activations", ["nvfp4", "bf16"])
@pytest.mark.parametrize("kernel_ops", [True, False], ids=["kernel-objects", "plain-fields"])
def test_compiled_graph_calls_quads_linear_with_the_layout_tensors(fake_humming, _fresh_dynamo, activations,
                                                                   kernel_ops, monkeypatch):
    """The compiled graph of layout-held weights: one quads op per linear (no other quads op). With
    torch's opaque objects, ``quads::linear_kernel`` over the module's own kernel (its handle a graph
    input: nothing rebuilt per call); without them, ``quads::linear`` with its packed parts None and
    its prepared tensors the weight's humming layout itself (graph inputs: written in place by
    syncs). W4A16 (``bf16``) reads the layer of the activation dtype, made with the kernel so that
    its tensors are there."""
    import quads.ops.linear_op as linear_module

    if kernel_ops and not linear_module.KERNEL_OPS:
        pytest.skip("this torch has no opaque custom-op objects")
    monkeypatch.setattr(linear_module, "KERNEL_OPS", kernel_ops)
    model = _llama()
    with quads.use_backend("humming"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", kernel="fast", activations=activations))
    model.eval()
    with torch.no_grad():
        gm, inputs = _compiled_graph(model, _input())
    placeholders = {n: t for n, t in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs)}
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "quads" in str(n.target)]
    linears = _linears(model)
    op = torch.ops.quads.linear_kernel if kernel_ops else torch.ops.quads.linear
    assert len(calls) == len(linears) and all(n.target in (op, op.default) for n in calls)
    if kernel_ops:
        handles = {id(m.quads_kernel().op_handle) for m in linears}
        assert {id(placeholders[n.args[2]]) for n in calls} == handles
    else:
        layouts = {tuple(id(t) for t in m.quads_prepared[0].op_tensors) for m in linears}
        arg = {a.name: i for i, a in enumerate(torch.ops.quads.linear.default._schema.arguments)}
        for node in calls:
            assert node.args[arg["qdata"]] is None and node.args[arg["scale"]] is None  # the layout holds them
            passed = tuple(id(placeholders[a]) for a in node.args[arg["prepared"]])
            assert passed in layouts
    if activations == "bf16":
        assert all(set(m.quads_prepared[0].layers) == {torch.float16, torch.bfloat16} for m in linears)


def test_linear_op_makes_the_layout_back_from_its_arguments(fake_humming):
    """``quads::linear``'s body runs on the tensors it is given (copies here, the layout then
    rewritten): no registry, no handle, nothing looked up by identity."""
    import quads.ops.linear_op as linear_module
    from quads.ops.backend_registry import get_backend
    from quads.ops.linear_op import linear_op_args

    assert not hasattr(torch.ops.quads, "linear_held")
    assert not hasattr(linear_module, "register_held")
    model = _fast_rollout()
    m = _linears(model)[0]
    prepared, kernel = m.quads_prepared[0], m.quads_kernel()
    assert not hasattr(prepared, "held_handle")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        want = kernel.apply(x)
        args = list(linear_op_args(get_backend("humming"), x, None, None, prepared, m.quads_act, None))
        arg = {a.name: i for i, a in enumerate(torch.ops.quads.linear.default._schema.arguments)}
        args[arg["prepared"]] = [t.clone() for t in args[arg["prepared"]]]
        args[arg["global_encode_scale"]] = args[arg["global_encode_scale"]].clone()
        trainer = _llama(seed=7)
        quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
        quads.sync_weights_(model, trainer)  # the module's layout rewritten in place
        assert not torch.equal(kernel.apply(x), want)
        assert torch.equal(torch.ops.quads.linear(*args), want)


def test_reads_under_inference_mode(fake_humming):
    """Parts derived under ``torch.inference_mode`` (no version counters) are new tensors: the layout
    stays the storage and the forward's bits do not move."""
    model = _fast_rollout()
    m = _linears(model)[0]
    x = _input()
    with torch.inference_mode():
        y0 = model(x).logits
        dq = m.weight.dequantize()
        y1 = model(x).logits
    assert torch.equal(y0, y1) and m.weight.kernel_layout is m.quads_prepared[0]
    torch.testing.assert_close(dq, m.weight.dequantize(), rtol=0, atol=0)
