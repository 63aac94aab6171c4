"""torchao's own ``quantize_`` with a ``QuadsPolicy`` (real torchao, real transformers models), and
the conversions between ``quads.NVFP4Tensor`` and torchao's NVFP4 tensor: where the two NVFP4
recipes agree and where they do not."""

import re

import pytest
import torch
import torch.nn as nn

torchao = pytest.importorskip("torchao")

from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as TorchaoNVFP4  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale  # noqa: E402
from torchao.quantization import FqnToConfig, quantize_  # noqa: E402

import quads  # noqa: E402
from quads.integrations.torchao import from_torchao_nvfp4, linear_or_experts, to_torchao_nvfp4  # noqa: E402
from quads.policies.modules import QuadsModule, RolloutExperts, TrainerExperts  # noqa: E402
from tests.tiny_models import build  # noqa: E402

SIDES = ["trainer", "rollout"]


def _ids(seed=0):
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))


def _converted(model):
    return {n: (type(m).__name__, m.quads_policy) for n, m in model.named_modules() if isinstance(m, QuadsModule)}


def _assert_same_model(a, b):
    """Same converted modules (class, policy), same parameters bit for bit, same logits."""
    assert _converted(a) == _converted(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        assert type(x) is type(y), k
        if isinstance(x, quads.NVFP4Tensor):
            assert torch.equal(x.qdata, y.qdata) and torch.equal(x.global_encode_scale, y.global_encode_scale), k
            assert torch.equal(x.scale.view(torch.uint8), y.scale.view(torch.uint8)), k
        else:
            assert torch.equal(x, y), k
    with torch.no_grad():
        assert torch.equal(a(_ids()).logits, b(_ids()).logits)


# ---------------------------------------------------------------------------------------------
# torchao.quantization.quantize_(model, QuadsPolicy)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", SIDES)
def test_dense_default_call_equals_quads(side):
    policy = quads.QuadsPolicy(side=side)
    ours, theirs = build("llama"), build("llama")
    quads.quantize_(ours, policy)
    quantize_(theirs, policy)  # torchao's default filter: every nn.Linear; lm_head skipped by name
    assert "lm_head" not in _converted(theirs) and len(_converted(theirs)) == 14
    _assert_same_model(ours, theirs)


@pytest.mark.parametrize("side", SIDES)
def test_moe_with_experts_filter_equals_quads(side):
    policy = quads.QuadsPolicy(side=side)
    ours, theirs = build("qwen3_moe"), build("qwen3_moe")
    quads.quantize_(ours, policy)
    quantize_(theirs, policy, filter_fn=linear_or_experts)
    experts = TrainerExperts if side == "trainer" else RolloutExperts
    assert isinstance(theirs.model.layers[0].mlp.experts, experts)
    _assert_same_model(ours, theirs)


def test_moe_default_filter_leaves_experts_as_torchao_selects():
    """torchao's default filter selects nn.Linear only: the fused experts stay BF16, as
    ``quads.quantize_`` with the same selection leaves them."""
    policy = quads.QuadsPolicy(side="rollout")
    ours, theirs = build("qwen3_moe"), build("qwen3_moe")
    quads.quantize_(ours, policy, filter_fn=lambda m, n: isinstance(m, nn.Linear))
    quantize_(theirs, policy)
    assert not isinstance(theirs.model.layers[0].mlp.experts, QuadsModule)
    _assert_same_model(ours, theirs)


@pytest.mark.parametrize("side", SIDES)
def test_user_filter_equals_quads_with_the_same_filter(side):
    policy = quads.QuadsPolicy(side=side, extra_skip_patterns=(r"o_proj$",))

    def only_layer_1(module, fqn):
        return fqn.startswith("model.layers.1.") and linear_or_experts(module)

    ours, theirs = build("qwen3_moe"), build("qwen3_moe")
    quads.quantize_(ours, policy, filter_fn=only_layer_1)
    quantize_(theirs, policy, filter_fn=only_layer_1)
    names = set(_converted(theirs))
    assert names == {f"model.layers.1.self_attn.{p}_proj" for p in "qkv"} | {"model.layers.1.mlp.experts"}
    _assert_same_model(ours, theirs)


def test_selected_container_and_fqn_to_config_convert_their_subtree():
    """A selected container gets the policy applied to its whole subtree (skip patterns by full
    name); FqnToConfig hands over the container and then its children, which are left as done."""
    policy = quads.QuadsPolicy(side="rollout")
    ours = build("qwen3_moe")
    quads.quantize_(ours, policy, filter_fn=lambda m, n: n.startswith("model.layers.0."))
    by_filter, by_fqn = build("qwen3_moe"), build("qwen3_moe")
    quantize_(by_filter, policy, filter_fn=lambda m, fqn: fqn == "model.layers.0")
    modules_of_layer_0 = r"re:model\.layers\.0\.(self_attn|mlp)(\.[qkvo]_proj|\.experts)?"  # module names only
    quantize_(by_fqn, FqnToConfig({modules_of_layer_0: policy}), filter_fn=None)
    assert "model.layers.0.mlp.gate" not in _converted(by_filter)  # the router: skipped by name
    _assert_same_model(ours, by_filter)
    _assert_same_model(ours, by_fqn)


def test_errors_name_the_module_and_leave_the_model_unchanged():
    bad = nn.Sequential(nn.Linear(32, 16), nn.Linear(24, 16))
    with pytest.raises(ValueError, match=r"1\.weight.*multiple of 16"):
        quantize_(bad, quads.QuadsPolicy(side="rollout"))
    assert not any(isinstance(m, QuadsModule) for m in bad.modules())  # the first one too
    assert bad[0].weight.dtype == torch.float32 and not isinstance(bad[0].weight, quads.NVFP4Tensor)

    nonfinite = nn.Sequential(nn.Linear(32, 16), nn.Linear(32, 16))
    with torch.no_grad():
        nonfinite[1].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_(nonfinite, quads.QuadsPolicy(side="rollout"))
    assert not isinstance(nonfinite[0], QuadsModule)

    model = build("llama")
    quantize_(model, quads.QuadsPolicy(side="trainer"))
    before = _converted(model)
    quantize_(model, quads.QuadsPolicy(side="trainer"))  # same policy again: nothing left to do
    assert _converted(model) == before
    with pytest.raises(ValueError, match="another policy"):
        quantize_(model, quads.QuadsPolicy(side="rollout"))
    assert _converted(model) == before

    only_head = nn.Sequential()
    only_head.add_module("lm_head", nn.Linear(32, 16))
    with pytest.raises(ValueError, match="matched no module"):
        quantize_(only_head, quads.QuadsPolicy(side="rollout"))


# ---------------------------------------------------------------------------------------------
# transformers' from_pretrained(..., quantization_config=TorchAoConfig(QuadsPolicy)) on MoE models
# ---------------------------------------------------------------------------------------------


def _load(path, policy=None, **config):
    from transformers import AutoModelForCausalLM, TorchAoConfig

    q = None if policy is None else TorchAoConfig(policy, **config)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("side", SIDES)
def test_torchao_config_load_converts_fused_experts_and_round_trips(kind, side, tmp_path):
    """transformers hands torchao only nn.Linear weights; the fused experts (most of an MoE's
    parameters) are converted once every weight is loaded: the model equals quads.quantize_'s
    on the same checkpoint, bit for bit, and saving it the way of its side gives it back."""
    from quads.tensor import load_safetensors, save_safetensors

    policy = quads.QuadsPolicy(side=side)
    build(kind).save_pretrained(tmp_path / "src")
    loaded = _load(tmp_path / "src", policy)
    ours = _load(tmp_path / "src")
    quads.quantize_(ours, policy)
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts, TrainerExperts if side == "trainer" else RolloutExperts), type(experts)
    assert sum(isinstance(m, (TrainerExperts, RolloutExperts)) for m in loaded.modules()) == 2
    assert type(loaded.hf_quantizer)._process_model_after_weight_loading is not None
    assert "_process_model_after_weight_loading" not in vars(loaded.hf_quantizer)  # restored after the load
    _assert_same_model(ours, loaded)

    loaded.save_pretrained(tmp_path / "saved")  # quads' writer: masters or packed parts, and the policy
    from transformers import AutoModelForCausalLM

    _assert_same_model(loaded, AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16))
    # the low-level way for a rollout's packed state: save_safetensors, then load_state_dict
    if side == "rollout":
        save_safetensors(loaded.state_dict(), tmp_path / "r.safetensors")
        build(kind, seed=5).save_pretrained(tmp_path / "other")
        back = _load(tmp_path / "other", policy)
        back.load_state_dict(load_safetensors(tmp_path / "r.safetensors"))
        _assert_same_model(loaded, back)


def test_torchao_config_experts_honor_skip_patterns_and_modules_to_not_convert(tmp_path):
    build("qwen3_moe").save_pretrained(tmp_path / "src")
    skip_layer_1 = quads.QuadsPolicy(side="rollout", extra_skip_patterns=(r"layers\.1\.mlp\.experts$",))
    by_pattern = _load(tmp_path / "src", skip_layer_1)
    by_config = _load(tmp_path / "src", quads.QuadsPolicy(side="rollout"),
                      modules_to_not_convert=["model.layers.1.mlp.experts"])
    ours = _load(tmp_path / "src")
    quads.quantize_(ours, quads.QuadsPolicy(side="rollout"), filter_fn=lambda m, n: n != "model.layers.1.mlp.experts")
    for model in (by_pattern, by_config):
        assert isinstance(model.model.layers[0].mlp.experts, RolloutExperts)
        assert not isinstance(model.model.layers[1].mlp.experts, QuadsModule)
        sa, sb = ours.state_dict(), model.state_dict()
        for k in sa:
            x, y = sa[k], sb[k]
            assert type(x) is type(y), k
            assert torch.equal(x.qdata, y.qdata) if isinstance(x, quads.NVFP4Tensor) else torch.equal(x, y), k
        with torch.no_grad():
            assert torch.equal(model(_ids()).logits, ours(_ids()).logits)


# ---------------------------------------------------------------------------------------------
# quads.NVFP4Tensor <-> torchao NVFP4Tensor
# ---------------------------------------------------------------------------------------------


def _on_grid_scale(shape, amax=42.0, seed=0):
    """Random normal values with max|x| = 42 exactly: S_enc = 2688/42 = 64, a power of two."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if len(shape) == 3:
        return x / x.abs().amax(dim=(1, 2), keepdim=True) * torch.tensor([amax, amax / 4, amax * 2]).view(-1, 1, 1)
    return x / x.abs().max() * amax


def _torchao_quantize(x):
    amax = x.abs().amax(dim=(1, 2), keepdim=True) if x.dim() == 3 else x.abs().max()
    return TorchaoNVFP4.to_nvfp4(x.contiguous(), per_tensor_scale=per_tensor_amax_to_scale(amax))


def _same_parts(a: quads.NVFP4Tensor, b: quads.NVFP4Tensor):
    return (
        torch.equal(a.qdata, b.qdata)
        and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        and torch.equal(a.global_encode_scale, b.global_encode_scale)
    )


@pytest.mark.parametrize("shape", [(64, 256), (3, 32, 128)])
def test_recipes_agree_with_power_of_two_global_scales(shape):
    """Power-of-two S_enc, no block under torchao's floor: both recipes give the same parts and
    the same dequantized values, and the conversions are exact both ways."""
    x = _on_grid_scale(shape)
    ours = quads.NVFP4Tensor.from_float(x)
    theirs = _torchao_quantize(x)
    assert torch.equal(ours.global_encode_scale, torch.tensor([64.0, 256.0, 32.0]) if len(shape) == 3 else torch.tensor(64.0))

    back = from_torchao_nvfp4(theirs)  # torchao -> quads
    assert _same_parts(back, ours)
    assert torch.equal(back.dequantize(torch.float32), ours.dequantize(torch.float32))

    converted = to_torchao_nvfp4(ours)  # quads -> torchao
    assert torch.equal(converted.qdata, theirs.qdata)
    assert torch.equal(converted.scale.view(torch.uint8), theirs.scale.view(torch.uint8))
    assert torch.equal(converted.per_tensor_scale, theirs.per_tensor_scale)
    assert torch.equal(converted.dequantize(torch.float32), ours.dequantize(torch.float32))
    assert _same_parts(from_torchao_nvfp4(converted), ours)


def test_swizzled_and_single_level_torchao_tensors_convert():
    x = _on_grid_scale((128, 128))
    ours = quads.NVFP4Tensor.from_float(x)
    swizzled = TorchaoNVFP4.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()), is_swizzled_scales=True)
    assert _same_parts(from_torchao_nvfp4(swizzled), ours)
    single = TorchaoNVFP4.to_nvfp4(x / 64)  # no per-tensor scale: S_enc = 1
    back = from_torchao_nvfp4(single)
    assert torch.equal(back.global_encode_scale, torch.tensor(1.0))
    assert torch.equal(back.dequantize(torch.float32), single.dequantize(torch.float32))


def test_where_the_recipes_differ():
    # 1. torchao floors block scales at 2**-6; the recipe lets a small block's scale go subnormal.
    x = _on_grid_scale((16, 64))
    x[0, :16] = 1e-3 * torch.linspace(-1, 1, 16)  # block amax 1e-3: scale 1e-3*64/6 ~ 0.011 < 2**-6
    ours, theirs = quads.NVFP4Tensor.from_float(x), from_torchao_nvfp4(_torchao_quantize(x))
    assert theirs.scale[0, 0].float().item() == 2**-6 and ours.scale[0, 0].float().item() < 2**-6
    assert not torch.equal(ours.qdata[0, :8], theirs.qdata[0, :8])
    assert torch.equal(ours.qdata[1:], theirs.qdata[1:])  # other blocks agree

    # 2. Same parts, non-power-of-two S_enc: torchao's dequantize rounds P*s first.
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    ours = quads.NVFP4Tensor.from_float(w)
    ref, ao = ours.dequantize(torch.float32), to_torchao_nvfp4(ours).dequantize(torch.float32)
    differ = ref != ao
    assert 0.01 < differ.float().mean().item() < 0.5
    assert ((ref - ao).abs() <= ref.abs() * 2**-22).all()  # an ulp or so

    # 3. The global scale survives the round trip only where 1/(1/S) == S in float32.
    s = next(v for v in torch.linspace(1.5, 1.99, 200) if (1 / (1 / v.float())).item() != v.float().item())
    t = quads.NVFP4Tensor(ours.qdata, ours.scale, s.float().reshape(()))
    rt = from_torchao_nvfp4(to_torchao_nvfp4(t))
    assert torch.equal(rt.qdata, t.qdata) and torch.equal(rt.scale.view(torch.uint8), t.scale.view(torch.uint8))
    assert rt.global_encode_scale.item() != s.item()
    assert rt.global_encode_scale.item() in (torch.nextafter(s, torch.tensor(0.0)).item(), torch.nextafter(s, torch.tensor(9.0)).item())

    # 4. An all-zero tensor: the recipe's S_enc = 1; torchao's per_tensor_scale = 0 is refused.
    zeros = torch.zeros(16, 32)
    assert quads.NVFP4Tensor.from_float(zeros).global_encode_scale.item() == 1.0
    with pytest.raises(ValueError, match="finite and > 0"):
        from_torchao_nvfp4(TorchaoNVFP4(ours.qdata, ours.scale, 16, torch.bfloat16, per_tensor_scale=torch.tensor(0.0)))


def test_conversion_errors():
    w = quads.NVFP4Tensor.from_float(torch.randn(32, 64))
    with pytest.raises(NotImplementedError, match="transposed"):
        to_torchao_nvfp4(w.t())
    row = quads.NVFP4Tensor(*quads.nvfp4_quantize(torch.randn(32, 64), "row"))
    with pytest.raises(NotImplementedError, match=re.escape("(32,)")):
        to_torchao_nvfp4(row)
    with pytest.raises(TypeError):
        to_torchao_nvfp4(torch.randn(32, 64))
    with pytest.raises(TypeError):
        from_torchao_nvfp4(w)


def test_registration_is_idempotent_and_makes_the_policy_a_torchao_config():
    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER

    from quads.integrations.torchao import register
    from quads.integrations.torchao.config import apply_policy

    register()
    register()
    assert isinstance(quads.QuadsPolicy(side="rollout"), AOBaseConfig)
    assert _QUANTIZE_CONFIG_HANDLER[quads.QuadsPolicy] is apply_policy
    model = build("llama")
    torchao.quantize_(model, quads.QuadsPolicy(side="trainer"))  # the top-level alias too
    assert len(_converted(model)) == 14
