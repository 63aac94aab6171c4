"""QuadsPolicy / quantize_ / sync_weights_ on real transformers models (dense and MoE)."""

import pytest
import torch
import torch.nn as nn

import quads
from quads.policies.modules import RolloutExperts, RolloutLinear, TrainerExperts
from quads.tensor import NVFP4Tensor, nvfp4_fake_quantize
from tests.scale_reference import reference_forward_weight
from tests.tiny_models import build, twin

KINDS = ["qwen3_moe", "mixtral", "llama"]


def _ids(seed=0, shape=(2, 10)):
    return torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))


def test_policy_defaults_and_validation():
    assert quads.QuadsPolicy(side="trainer").activations == "bf16"
    assert quads.QuadsPolicy(side="rollout").activations == "nvfp4"
    assert quads.QuadsPolicy(side="rollout").activation_quant.residual_fraction == 1.0
    assert quads.QuadsPolicy(side="trainer", activations="nvfp4").activation_quant.residual_fraction == 0.0
    with pytest.raises(ValueError):
        quads.QuadsPolicy(side="both")
    with pytest.raises(ValueError):
        quads.QuadsPolicy(side="rollout", residual_fraction=1.5)
    with pytest.raises(ValueError):
        quads.QuadsPolicy(side="rollout", residual_selection="random")
    p = quads.QuadsPolicy(side="rollout")
    assert p.skips("lm_head") and p.skips("model.layers.0.mlp.gate") and p.skips("model.embed_tokens")
    assert not p.skips("model.layers.0.mlp.gate_proj") and not p.skips("model.layers.0.mlp.experts")


@pytest.mark.parametrize("kind", KINDS)
def test_both_sides_convert_forward_backward(kind):
    trainer, rollout = twin(kind)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    names = quads.quantized_modules(rollout)
    assert "lm_head" not in names and not any(n.endswith(".gate") for n in names)
    if kind != "llama":
        assert any(isinstance(m, RolloutExperts) for m in names.values())
        assert any(isinstance(m, TrainerExperts) for m in quads.quantized_modules(trainer).values())
    assert all(isinstance(m, (RolloutLinear, RolloutExperts)) for m in names.values())
    ids = _ids()
    out = trainer(ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in trainer.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    with torch.no_grad():
        logits = rollout(ids).logits
    assert torch.isfinite(logits.float()).all()
    assert isinstance(rollout.model.layers[0].self_attn.q_proj.weight, NVFP4Tensor)
    assert not isinstance(rollout.lm_head.weight, NVFP4Tensor)


def test_straight_through_gradient_reaches_master():
    lin = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    ref = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    ref.weight.data.copy_(nvfp4_fake_quantize(lin.weight.detach()))
    wrapper = nn.Sequential(lin)
    quads.quantize_(wrapper, quads.QuadsPolicy(side="trainer"))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    g = torch.randn(8, 32, dtype=torch.bfloat16)
    y = wrapper(x)
    assert torch.equal(y, ref(x))  # forward uses DQ(Q(W))
    y.backward(g)
    ref(x).backward(g)
    assert torch.equal(lin.weight.grad, ref.weight.grad)  # d/dW passes straight through


def test_experts_fake_quant_runs_once_per_forward(monkeypatch):
    """Each 3-D weight is fake-quantized once per forward (all experts at once), and once more in
    the backward (the grouped path recomputes it instead of keeping it alive), without an amax."""
    model = build("qwen3_moe")
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    calls = []
    import quads.policies.ste as ste

    original = ste.fake_quantize_weight_reference

    def counting(w, dtype=None, global_encode_scale=None, block_scaling="6"):
        calls.append((tuple(w.shape), global_encode_scale is not None))
        return original(w, dtype, global_encode_scale, block_scaling)

    monkeypatch.setattr(ste, "fake_quantize_weight_reference", counting)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        model(_ids())
    assert [c for c in calls if len(c[0]) == 3] == [(c[0], False) for c in calls if len(c[0]) == 3]
    assert len([c for c in calls if len(c[0]) == 3]) == 2 * layers  # gate_up + down per layer
    calls.clear()
    model(_ids()).logits.float().square().mean().backward()
    expert_calls = [c for c in calls if len(c[0]) == 3]
    assert sum(not given for _, given in expert_calls) == 2 * layers  # the forward's, with the amax
    assert sum(given for _, given in expert_calls) == 2 * layers  # the backward's, with the saved scales


@pytest.mark.parametrize("mode", ["group", "tensor"])
@pytest.mark.parametrize("kind", KINDS)
def test_sync_is_bit_exact_and_bf16_activations_agree(kind, mode):
    trainer, rollout = build(kind, seed=1), build(kind, seed=2)  # different initial weights
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale=mode))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations="bf16", weight_global_scale=mode))
    quads.sync_weights_(rollout, trainer)
    masters = dict(trainer.named_parameters())
    n_packed, scales = 0, {}
    for name, p in rollout.named_parameters():
        if isinstance(p, NVFP4Tensor):
            n_packed += 1
            want = reference_forward_weight(masters, name, mode)
            assert torch.equal(p.dequantize(want.dtype).view(torch.int16), want.view(torch.int16)), name
            scales[name] = p.global_encode_scale
        else:
            assert torch.equal(p, masters[name]), name
    assert n_packed > 0
    qkv = [scales[f"model.layers.0.self_attn.{x}_proj.weight"].item() for x in "qkv"]
    assert (len(set(qkv)) == 1) == (mode == "group")  # random weights: three amaxes differ
    if kind == "llama":
        gate_up = [scales[f"model.layers.1.mlp.{x}_proj.weight"].item() for x in ("gate", "up")]
        assert (gate_up[0] == gate_up[1]) == (mode == "group")
    ids = _ids(3)
    with torch.no_grad():
        a = trainer(ids).logits.float()
        b = rollout(ids).logits.float()
    assert torch.equal(a, b)  # same weights, same BF16 activations, same kernels


def test_sync_after_optimizer_step_tracks_masters():
    trainer, rollout = twin("qwen3_moe")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    quads.sync_weights_(rollout, trainer)
    before = rollout.model.layers[0].mlp.experts.gate_up_proj.qdata.clone()
    opt = torch.optim.SGD(trainer.parameters(), lr=1.0)
    ids = _ids()
    trainer(ids, labels=ids).loss.backward()
    opt.step()
    quads.sync_weights_(rollout, trainer)
    after = rollout.model.layers[0].mlp.experts
    assert not torch.equal(before, after.gate_up_proj.qdata)
    master = trainer.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert torch.equal(after.gate_up_proj.dequantize(torch.bfloat16), nvfp4_fake_quantize(master))


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_residual_reduces_rollout_error(fraction):
    trainer, naive = twin("qwen3_moe")
    comp = build("qwen3_moe")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(naive, quads.QuadsPolicy(side="rollout", residual_fraction=0.0))
    quads.quantize_(comp, quads.QuadsPolicy(side="rollout", residual_fraction=fraction))
    ids = _ids(4, (4, 16))
    with torch.no_grad():
        ref = trainer(ids).logits.float()
        e_naive = (naive(ids).logits.float() - ref).norm() / ref.norm()
        e_comp = (comp(ids).logits.float() - ref).norm() / ref.norm()
    assert e_comp < e_naive


def test_static_selection_needs_and_uses_calibration():
    model = build("qwen3_moe")
    quads.quantize_(model, quads.QuadsPolicy(side="rollout", residual_selection="static", residual_fraction=0.5))
    with pytest.raises(ValueError, match="calibrate"):
        model(_ids())
    n = quads.calibrate_residual_channels(model, [_ids(s, (4, 16)) for s in range(3)])
    assert n == len(quads.quantized_modules(model))
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.quads_static_mask.sum() == 32  # 50% of K=64
    assert torch.isfinite(model(_ids()).logits.float()).all()


def test_quantize_errors():
    model = build("llama")
    with pytest.raises(ValueError, match="matched no module"):
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"), filter_fn=lambda m, n: False)
    quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    with pytest.raises(ValueError, match="already quantized"):
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    odd = nn.Sequential(nn.Linear(32, 16), nn.Linear(24, 16))
    with pytest.raises(ValueError, match=r"1\.weight.*multiple of 16"):
        quads.quantize_(odd, quads.QuadsPolicy(side="rollout"))
    assert not quads.quantized_modules(odd)  # all targets are checked before any is converted
    assert not isinstance(odd[0].weight, NVFP4Tensor)
    bad = nn.Sequential(nn.Linear(32, 16))
    with torch.no_grad():
        bad[0].weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quads.quantize_(bad, quads.QuadsPolicy(side="rollout"))
    with pytest.raises(TypeError):
        quads.quantize_(nn.Sequential(nn.Linear(32, 16)), {"side": "rollout"})
    # skip patterns can be extended by the user
    m = nn.Sequential()
    m.add_module("keep", nn.Linear(32, 16))
    m.add_module("skipme", nn.Linear(32, 16))
    quads.quantize_(m, quads.QuadsPolicy(side="rollout", extra_skip_patterns=(r"skipme$",)))
    assert set(quads.quantized_modules(m)) == {"keep"}


def test_calibration_remakes_the_kernels_at_once():
    """The kernels hold the new masks right after calibration (not remade at a later forward,
    which may run inside a compiled trace)."""
    model = build("qwen3_moe")
    quads.quantize_(model, quads.QuadsPolicy(side="rollout", residual_selection="static", residual_fraction=0.5))
    quads.calibrate_residual_channels(model, [_ids(s, (2, 8)) for s in range(2)])
    for module in quads.quantized_modules(model).values():
        kernel = module.quads_kernel()
        if isinstance(module, RolloutLinear):
            assert kernel.args.static_mask is module.quads_static_mask is not None
        else:
            masks = (kernel.gate_up.static_mask, kernel.down.static_mask)
            assert all(a is b is not None for a, b in zip(masks, module.quads_static_masks))
