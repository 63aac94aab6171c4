"""The trainer path: grouped experts vs the per-expert loop, the recomputing linear vs F.linear,
saved-for-backward bytes vs the BF16 model, the stored backend, the W4A4 ablation's kernel."""

import copy

import pytest
import torch
import torch.nn.functional as F

import quads
from quads.ops import use_backend
from quads.policies.modules import TrainerExperts, TrainerLinear
from quads.policies.ste import fake_quant_linear, fake_quantize_activation, fake_quantize_weight
from quads.tensor.nvfp4_math import nvfp4_fake_quantize
from tests.tiny_models import build

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
MOE = ("qwen3_moe", "mixtral")


def _ids(batch=2, seq=9, seed=0):
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loop_copy(model):
    other = copy.deepcopy(model)
    n = 0
    for m in other.modules():
        if isinstance(m, TrainerExperts):
            m.quads_grouped = False
            n += 1
    assert n == other.config.num_hidden_layers
    return other


def _step(model, ids, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids).logits
    loss = logits.float().logsumexp(-1).mean() + (logits.float() ** 2).mean() * 1e-3
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", MOE)
@pytest.mark.parametrize("masters", ["bf16", "fp32-autocast"])
@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_grouped_experts_equal_the_loop(kind, masters, activations):
    """Logits and every gradient of the grouped-GEMM experts equal the per-expert loop's, bit for
    bit on CPU (torch's grouped GEMM multiplies each group like mm); the weight gradient reaches
    the masters straight through."""
    dtype = torch.bfloat16 if masters == "bf16" else torch.float32
    model = build(kind, seed=3, dtype=dtype)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer", activations=activations))
    loop = _loop_copy(model)
    ids = _ids(batch=3, seq=11)
    autocast = masters != "bf16"
    logits, grads = _step(model, ids, autocast)
    logits_loop, grads_loop = _step(loop, ids, autocast)
    assert torch.equal(logits, logits_loop)
    assert grads.keys() == grads_loop.keys()
    assert any(".experts.gate_up_proj" in n for n in grads)
    for n in grads:
        assert grads[n].dtype == dtype, n
        assert torch.equal(grads[n], grads_loop[n]), n


@pytest.mark.parametrize("masters", ["bf16", "fp32-autocast"])
def test_grouped_experts_keep_forward_weight_option(masters):
    """``quads_keep_forward_weight`` (the benchmark's quads-keep option): the backward uses the
    kept forward weight instead of recomputing it: the same logits and gradients, bit for bit."""
    dtype = torch.bfloat16 if masters == "bf16" else torch.float32
    model = build("qwen3_moe", seed=4, dtype=dtype)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    keep = copy.deepcopy(model)
    for m in keep.modules():
        if isinstance(m, TrainerExperts):
            m.quads_keep_forward_weight = True
    ids = _ids(batch=2, seq=13, seed=1)
    logits, grads = _step(model, ids, masters != "bf16")
    logits_keep, grads_keep = _step(keep, ids, masters != "bf16")
    assert torch.equal(logits, logits_keep) and grads.keys() == grads_keep.keys()
    for n in grads:
        assert grads_keep[n].dtype == dtype and torch.equal(grads[n], grads_keep[n]), n


@pytest.mark.parametrize("keep", [False, True])
def test_grouped_experts_weight_gradient_in_the_master_layout(keep):
    """The experts' weight gradients reach AccumulateGrad in the masters' (contiguous) layout, as
    the BF16 peer's grouped_mm backward hands them: a transposed gradient would be copied again
    there (a FP32 pass over every expert weight per step, measured as part of the H200 gap)."""
    model = build("qwen3_moe", seed=6, dtype=torch.float32)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    seen = {}
    for name, p in model.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")):
            p.register_hook(lambda g, name=name: seen.update({name: (g.is_contiguous(), g.stride())}))
    for m in model.modules():
        if isinstance(m, TrainerExperts):
            m.quads_keep_forward_weight = keep
    _step(model, _ids(batch=2, seq=7, seed=2), True)
    assert len(seen) == 2 * model.config.num_hidden_layers
    assert all(c for c, _ in seen.values()), seen


@pytest.mark.parametrize("flag", ["expert-parallel", "no-flag"])
def test_grouped_experts_handle_idle_experts_and_sentinels(flag):
    """Experts that receive no row, and expert-parallel sentinel ids (routed nowhere), give what
    the loop gives: zero contributions, zero gradients, no uninitialized rows. The grouped path
    masks sentinel rows on modules transformers flags expert-parallel, and on modules without
    the flag (unknown: masked to be safe)."""
    model = build("qwen3_moe", seed=5, dtype=torch.float32)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    experts = model.model.layers[0].mlp.experts
    assert experts._is_expert_parallel is False  # transformers' flag: sentinels come with expert parallelism
    if flag == "expert-parallel":
        experts._is_expert_parallel = True
    else:
        del experts._is_expert_parallel
    loop = copy.deepcopy(experts)
    loop.quads_grouped = False
    hidden = torch.randn(6, 64)
    index = torch.tensor([[0, 2], [2, 0], [0, 4], [4, 2], [2, 2], [9, 0]])  # 1 and 3 idle; 4, 9 sentinels
    weights = torch.rand(6, 2)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    y1, y2 = experts(h1, index, weights), loop(h2, index, weights)
    assert torch.equal(y1, y2) and torch.isfinite(y1).all()
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(h1.grad, h2.grad)
    assert torch.equal(experts.gate_up_proj.grad, loop.gate_up_proj.grad)
    assert experts.gate_up_proj.grad[1].abs().sum() == 0 and experts.gate_up_proj.grad[3].abs().sum() == 0


@pytest.mark.parametrize("master", [torch.bfloat16, torch.float32])
def test_recomputing_linear_equals_f_linear_on_the_forward_weight(master):
    """fake_quant_linear == F.linear(x, fake_quantize_weight(w), b): outputs and gradients bit for
    bit, with and without autocast; the forward weight under autocast is the autocast dtype."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 64, dtype=master))
    b = torch.nn.Parameter(torch.randn(48, dtype=master))
    x = torch.randn(2, 5, 64, dtype=master)
    g = torch.randn(2, 5, 48)
    for autocast in (False, True):
        outs = []
        for fn in (lambda xx: fake_quant_linear(xx, w, b), lambda xx: F.linear(xx, fake_quantize_weight(w), b)):
            w.grad = b.grad = None
            xx = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = fn(xx)
            y.backward(g.to(y.dtype))
            outs.append((y, xx.grad, w.grad, b.grad))
        for a, c in zip(*outs):
            assert a.dtype == c.dtype and torch.equal(a, c)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            fw = fake_quantize_weight(w)
        assert fw.dtype == (torch.bfloat16 if autocast else master)
        assert torch.equal(fw, nvfp4_fake_quantize(w.detach(), dtype=fw.dtype))
    with pytest.raises(TypeError, match="input dtype"):
        fake_quant_linear(x.to(torch.float16), w)


class _SavedBytes:
    """Bytes saved for backward, counting each storage once and not counting parameters (alive
    anyway); and the saved tensors equal to a forward weight (``forward_weights``, transposes too)."""

    def __init__(self, model, forward_weights=()):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen, self.bytes, self.forward_weight_copies = set(), 0, []
        self.forward_weights = [f for w in forward_weights for f in ((w, w.t()) if w.dim() == 2 else (w,))]

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
            if any(f.shape == t.shape and f.dtype == t.dtype and torch.equal(f, t) for f in self.forward_weights):
                self.forward_weight_copies.append(tuple(t.shape))
        return t


def _saved(model, ids, forward_weights=()):
    counter = _SavedBytes(model, forward_weights)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids).logits.float().mean()
    loss.backward()
    return counter


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "llama"])
def test_no_forward_weight_is_saved_for_backward(kind):
    """FP32 masters under BF16 autocast: the QUADS trainer saves no copy of a forward weight (they
    are recomputed in backward) and no more bytes than the BF16 model, which keeps autocast's
    BF16 copies of its linear weights for the backward. (The check itself is checked: a plain
    F.linear on the forward weight is caught saving them.)"""
    bf16, qat = build(kind, seed=1, dtype=torch.float32), build(kind, seed=1, dtype=torch.float32)
    quads.quantize_(qat, quads.QuadsPolicy(side="trainer"))
    masters = [m.weight for m in qat.modules() if isinstance(m, TrainerLinear)]
    masters += [getattr(m, n) for m in qat.modules() if isinstance(m, TrainerExperts) for n in ("gate_up_proj", "down_proj")]
    forward_weights = [nvfp4_fake_quantize(w.detach(), dtype=torch.bfloat16) for w in masters]
    ids = _ids(batch=3, seq=7)
    base, ours = _saved(bf16, ids), _saved(qat, ids, forward_weights)
    assert ours.forward_weight_copies == []
    assert ours.bytes <= base.bytes, (ours.bytes, base.bytes)
    # a plain F.linear on the fake-quantized weight keeps it: the check sees that
    lin = next(m for m in qat.modules() if isinstance(m, TrainerLinear))
    counter = _SavedBytes(qat, forward_weights)
    x = torch.randn(5, lin.weight.shape[1], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        F.linear(x, fake_quantize_weight(lin.weight))
    assert counter.forward_weight_copies


def test_backend_is_stored_and_follows_the_device():
    model = build("qwen3_moe")
    with use_backend("hopper"):  # the interpreter runs the kernels on CPU tensors
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    mods = [m for m in model.modules() if isinstance(m, (TrainerLinear, TrainerExperts))]
    assert mods and all(m.quads_backend.name == "hopper" for m in mods)
    assert "backend=hopper" in repr(mods[0])
    model.to(torch.float32)  # _apply: picked again (no forcing now: the CPU gets the reference)
    assert all(m.quads_backend.name == "torch" for m in mods)


def test_kernel_backend_trainer_equals_the_reference_trainer():
    """The fused fake-quant kernel (and the activation row kernel of the W4A4 ablation) give the
    trainer the reference trainer's logits and gradients, bit for bit (interpreter on CPU)."""
    ref = build("qwen3_moe", seed=2, dtype=torch.float32)
    for activations in ("bf16", "nvfp4"):
        a, b = copy.deepcopy(ref), copy.deepcopy(ref)
        policy = quads.QuadsPolicy(side="trainer", activations=activations)
        quads.quantize_(a, policy)
        with use_backend("hopper"):
            quads.quantize_(b, policy)
        ids = _ids(batch=1, seq=7)
        la, ga = _step(a, ids, autocast=True)
        lb, gb = _step(b, ids, autocast=True)
        assert torch.equal(la, lb)
        assert all(torch.equal(ga[n], gb[n]) for n in ga)


def test_activation_fake_quant_kernel_equals_reference():
    from tests.kernels.test_kernel_quantize import adversarial
    from quads.ops.activation_quant import ActivationQuant
    from quads.ops.backend_registry import get_backend

    x = adversarial(m=9, k=48, dtype=torch.float32)
    for cfg in (ActivationQuant(0.0), ActivationQuant(0.0, granularity="tensor"), ActivationQuant(1.0)):
        ref = fake_quantize_activation(x, cfg, get_backend("torch"))
        got = fake_quantize_activation(x, cfg, get_backend("hopper"))
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32)), cfg
