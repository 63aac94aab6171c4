"""One activation quantization for sibling linears (quads.ops.sibling_linear.SiblingSet).

Kernels run under the Triton interpreter (tests/conftest.py). Counted: calls of the fused row
quantizer (one launch each on the GPU) per forward; checked: outputs bit-identical to no sharing.
"""

import contextlib

import pytest
import torch

import quads
import quads.kernels.quantize_activations as quantize_activations
import quads.kernels.hopper.fp16_operand as fp16_operand
import quads.kernels.hopper.w4a4_decode as w4a4_decode
from quads.engine import GraphedDecoder, SamplingSpec
from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend, LinearArgs, LinearKernel, get_backend
from quads.ops.linear_op import linear_op_args
from quads.ops.sibling_linear import SiblingKernel, SiblingSet, enabled_groups
from quads.policies.fused_projections import share_quantization
from quads.tensor.nvfp4_math import NVFP4Parts
from tests.tiny_models import build

# the weight quantizer kernel runs once per distinct weight in the session (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("memo_weight_kernel")


@pytest.fixture
def launches(monkeypatch):
    """Counts the row quantizer's calls (the wrapped function still runs)."""
    count = {"quantize_rows": 0}
    real = quantize_activations.quantize_rows

    def counted(*args, **kwargs):
        count["quantize_rows"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize_activations, "quantize_rows", counted)
    return count


def _rollout(kind: str, **policy):
    model = build(kind).eval()
    with quads.use_backend("hopper"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", **policy))
    return model


def _forward(model, ids, launches, share: bool):
    launches["quantize_rows"] = 0
    with torch.no_grad(), share_quantization(model) if share else contextlib.nullcontext():
        logits = model(ids).logits
    return logits, launches["quantize_rows"]


# per decoder layer: llama q,k,v,o,gate,up,down -> {q,k,v},o,{gate,up},down; the MoE's
# attention q,k,v,o -> {q,k,v},o, its fused experts (gate_up, down) have no siblings
PER_LAYER = {"llama": (7, 4), "qwen3_moe": (6, 4)}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("gemm", ["decode", "prefill"])
def test_siblings_quantize_once_and_outputs_are_bit_identical(kind, gemm, launches, monkeypatch):
    """Both GEMMs read the shared operands: ``prefill`` routes every call to the many-token GEMM
    (its threshold set to 0: the interpreter would take minutes for > 64 real tokens)."""
    if gemm == "prefill":
        monkeypatch.setattr(w4a4_decode, "max_decode_columns", lambda: 0)
    model = _rollout(kind)
    ids = torch.randint(0, 96, (2, 3), generator=torch.Generator().manual_seed(0))
    plain, n_plain = _forward(model, ids, launches, share=False)
    shared, n_shared = _forward(model, ids, launches, share=True)
    layers = model.config.num_hidden_layers
    assert (n_plain, n_shared) == tuple(layers * n for n in PER_LAYER[kind])
    assert torch.equal(plain, shared)


def test_naive_w4a4_shares_too(launches):
    model = _rollout("llama", residual_fraction=0.0)
    ids = torch.randint(0, 96, (2, 1))
    plain, n_plain = _forward(model, ids, launches, share=False)
    shared, n_shared = _forward(model, ids, launches, share=True)
    assert (n_plain, n_shared) == (14, 8) and torch.equal(plain, shared)


def test_w4a16_fp16_operand_is_shared(monkeypatch, launches):
    count = [0]
    real = fp16_operand.scaled_fp16_rows

    def counted(x):
        count[0] += 1
        return real(x)

    monkeypatch.setattr(fp16_operand, "scaled_fp16_rows", counted)
    model = _rollout("llama", activations="bf16")
    ids = torch.randint(0, 96, (2, 1))
    with torch.no_grad():
        plain = model(ids).logits
        n_plain = count[0]
        with share_quantization(model):
            shared = model(ids).logits
    assert (n_plain, count[0] - n_plain) == (14, 8) and torch.equal(plain, shared)


def test_inference_mode_does_not_share(launches):
    """Inference tensors have no version counter: an in-place write between two linears could
    not be seen, so they are never shared (same count as without sharing, same bits)."""
    model = _rollout("llama")
    ids = torch.randint(0, 96, (2, 1))
    plain, n_plain = _forward(model, ids, launches, share=False)
    launches["quantize_rows"] = 0
    with torch.inference_mode(), share_quantization(model):
        got = model(ids).logits
    assert launches["quantize_rows"] == n_plain and torch.equal(got, plain)


def test_decoder_shares_by_default_with_identical_samples(launches):
    """The graphed decoder's default: fewer quantizations, the same tokens and log-prob bits."""
    model = _rollout("llama")
    ids = torch.randint(8, 96, (2, 4), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[0, :2] = 0
    spec = SamplingSpec(max_new_tokens=2, eos_token_ids=(), pad_token_id=0, do_sample=False)
    runs = {}
    for share in (True, False):  # the sharing decoder's dormant groups stay off outside its forwards
        launches["quantize_rows"] = 0
        out = GraphedDecoder(model, use_cuda_graph=False, share_quantization=share).generate(ids, am, spec)
        runs[share] = (*out, launches["quantize_rows"])
    (t1, l1, n1), (t0, l0, n0) = runs[True], runs[False]
    forwards, layers = 2, model.config.num_hidden_layers
    assert (n0, n1) == (forwards * layers * 7, forwards * layers * 4)
    assert torch.equal(t1, t0) and torch.equal(l1, l0)


# -- the group's rules, on a counting backend ------------------------------------------------


class _Counting(Backend):
    """Counts activation quantizations; each member's output is a fresh tensor (N_i columns)."""

    name = "counting"
    sibling_kernel_class = SiblingKernel

    def __init__(self):
        self.calls = 0

    def activation_operands(self, x2d, act, static_mask=None):
        self.calls += 1
        return object()

    class linear_kernel_class(LinearKernel):
        def apply(self, x, bias=None, operands=None):
            return x.new_zeros(x.shape[0], self.args.weight.qdata.shape[0])


class _Member:
    """A stand-in sibling module: what a SiblingSet asks of its members."""

    quads_group = None
    quads_group_index = 0

    def __init__(self, backend, n, k):
        parts = NVFP4Parts(torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 16), torch.ones(()))
        self.kernel = backend.linear_kernel(LinearArgs(parts))

    def quads_sibling_inputs(self):
        return self.kernel, None

    def quads_sibling_set_changed(self):
        pass


class _Parent(torch.nn.Module):
    """A stand-in parent: its forward runs ``body`` (the members' calls) inside one parent call."""

    def forward(self, body):
        return body()


def _group(k, enabled=True):
    backend = _Counting()
    members = [_Member(backend, 8, k), _Member(backend, 8, k)]
    group = SiblingSet(backend, ActivationQuant(), [8, 8], members, enabled=enabled)
    parent = _Parent()
    group.attach(parent)
    return backend, group, parent


def test_members_share_within_one_parent_call_for_the_same_tensor():
    backend, g, parent = _group(32)
    x = torch.randn(4, 32)
    assert g.forward(0, x) is None and g.forward(1, x) is None and backend.calls == 0  # outside: alone

    def body():
        a = g.forward(0, x)
        assert g.forward(1, x) is not None and backend.calls == 1  # shared
        g.forward(0, x)  # member 0 served already (its output may have been written since): anew
        assert backend.calls == 2
        x.add_(1.0)  # an in-place write bumps the version counter: computed anew
        g.forward(1, x)
        assert backend.calls == 3
        g.forward(0, x.clone())  # equal values, another tensor: computed anew
        g.forward(1, x.view(4, 32))  # a view is another tensor object: computed anew
        assert backend.calls == 5
        _, other, _ = _group(32)
        other.forward(0, x)  # another set (not attached to this parent) never serves this one
        return a

    assert parent(body).shape == (4, 8)
    assert g._slot is None  # emptied when the parent's forward ended
    parent(lambda: g.forward(1, x))  # a new parent call starts empty
    assert backend.calls == 6


def test_the_slot_is_emptied_when_the_parent_raises_or_a_weight_is_written():
    """An exception ends the call (the forward hook runs); a ``KeyboardInterrupt`` skips torch's
    forward hooks, and the next weight write (every sync notifies the set) empties the slot."""
    backend, g, parent = _group(16)
    x = torch.randn(2, 16)

    def body(error):
        g.forward(0, x)
        raise error

    with pytest.raises(RuntimeError):
        parent(lambda: body(RuntimeError("boom")))
    assert g._slot is None and not g._call_open
    with pytest.raises(KeyboardInterrupt):
        parent(lambda: body(KeyboardInterrupt))
    assert g._slot is not None and g._call_open  # torch ran no forward hook
    g.write_scale(0, torch.ones(()))
    assert g._slot is None and not g._call_open
    assert g.forward(1, x) is None and backend.calls == 2  # outside a parent call: alone


def test_dissolve_removes_the_parent_hooks():
    backend, g, parent = _group(16)
    g.dissolve()
    assert not parent._forward_pre_hooks and not parent._forward_hooks and g.hooks == ()


def test_dormant_groups_share_only_inside_the_block():
    backend, g, parent = _group(16, enabled=False)
    x = torch.randn(2, 16)
    assert parent(lambda: g.forward(0, x)) is None and backend.calls == 0  # dormant: the member computes alone
    with enabled_groups([g]):
        with enabled_groups([g]):
            parent(lambda: g.forward(0, x))
        parent(lambda: (g.forward(0, x), g.forward(1, x)))  # the inner exit left it on (the outer block switched it on)
        assert backend.calls == 2
    assert g._slot is None and not g.enabled  # nothing kept after the block
    assert parent(lambda: g.forward(1, x)) is None and backend.calls == 2


def test_inference_tensors_and_compiled_code_never_share(monkeypatch):
    backend, g, parent = _group(16)
    with torch.inference_mode():
        xi = torch.randn(2, 16)
    assert parent(lambda: (g.forward(0, xi), g.forward(1, xi))) == (None, None)  # no version counter: alone
    x = torch.randn(2, 16)

    def compiled_member():  # a member compiled under an eager parent: the slot is open, the member traced
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        return g.forward(0, x)

    assert parent(compiled_member) is None  # traced code never shares
    assert parent(lambda: g.forward(0, x)) is None  # a parent traced: no slot opened
    assert backend.calls == 0


def test_custom_op_bodies_do_not_share(launches):
    """Compiled graphs run the ``quads::linear`` op's body with ``is_compiling()`` False; inductor
    reuses buffers without version bumps, so the body must not share."""
    model = _rollout("llama")
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    (prepared,) = layer.quads_prepared
    w = layer.weight.parts
    args = linear_op_args(get_backend("hopper"), x, w, None, prepared, ActivationQuant(1.0), None)
    with share_quantization(model), torch.no_grad():
        a = torch.ops.quads.linear(*args)
        b = torch.ops.quads.linear(*args)
    assert launches["quantize_rows"] == 2 and torch.equal(a, b)
