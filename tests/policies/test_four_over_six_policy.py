"""``QuadsPolicy(weight_block_scaling="4over6")``: trainer, rollout, sync, load and export quantize
with one recipe, so the rollout's dequantized weights stay the trainer's forward weights bit for
bit (dense, MoE experts, group and tensor global scales, the torch and the kernel backends)."""

import pytest
import torch

import quads
from quads.integrations.modelopt import export_modelopt
from quads.ops import use_backend
from quads.policies.ste import fake_quantize_weight
from quads.tensor import NVFP4Tensor, nvfp4_dequantize, nvfp4_quantize
from quads.tensor.modelopt_format import read_modelopt_checkpoint
from tests.model_state import assert_unchanged, snapshot
from tests.scale_reference import reference_forward_weight
from tests.integrations.test_modelopt_export import _forward_weights
from tests.tiny_models import build

FOS = "4over6"
IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))


def _policies(mode="group", block_scaling=FOS, **rollout):
    return (quads.QuadsPolicy(side="trainer", weight_global_scale=mode, weight_block_scaling=block_scaling),
            quads.QuadsPolicy(side="rollout", weight_global_scale=mode, weight_block_scaling=block_scaling, **rollout))


def _trainer_forward_weights(trainer) -> dict[str, torch.Tensor]:
    """Weight name -> what the trainer's modules multiply by (their own forward code path)."""
    out = {}
    for name, module in quads.quantized_modules(trainer).items():
        if isinstance(module, torch.nn.Linear):
            out[f"{name}.weight"] = module.quads_forward_weight()
        else:
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}"] = fake_quantize_weight(getattr(module, p).detach(), module.quads_trainer_backend(),
                                                          block_scaling=module.quads_policy.weight_block_scaling)
    return out


def test_policy_field_default_validation_and_preset():
    assert quads.QuadsPolicy(side="trainer").weight_block_scaling == "6"
    assert quads.QuadsPolicy(side="rollout", weight_block_scaling=FOS).weight_block_scaling == FOS
    for bad in ("4/6", "four_over_six", 6, None):
        with pytest.raises(ValueError, match="QuadsPolicy.weight_block_scaling must be one of"):
            quads.QuadsPolicy(side="rollout", weight_block_scaling=bad)
    preset = quads.POLICY_PRESETS["quads-4over6"]
    assert preset.trainer.weight_block_scaling == preset.rollout.weight_block_scaling == FOS
    assert "weight_block_scaling=4over6" in repr(build_and_quantize("rollout").model.layers[0].self_attn.q_proj)


def build_and_quantize(side, kind="llama"):
    model = build(kind)
    quads.quantize_(model, _policies()[0 if side == "trainer" else 1])
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["group", "tensor"])
def test_sync_after_training_steps_is_exact(kind, mode):
    trainer, rollout = build(kind, seed=1), build(kind, seed=2)
    t_policy, r_policy = _policies(mode, activations="bf16")
    quads.quantize_(trainer, t_policy)
    quads.quantize_(rollout, r_policy)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    for _ in range(2):
        trainer(IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
        quads.sync_weights_(rollout, trainer)
        masters = {n: p.detach() for n, p in trainer.named_parameters()}
        forward = _trainer_forward_weights(trainer)
        packed = {n: p for n, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)}
        assert packed.keys() == forward.keys()
        for name, p in packed.items():
            got = p.dequantize(torch.bfloat16)
            assert torch.equal(got, forward[name]), name
            assert torch.equal(got, reference_forward_weight(masters, name, mode, block_scaling=FOS)), name
    standard = reference_forward_weight(masters, "model.layers.0.self_attn.q_proj.weight", mode)
    assert not torch.equal(forward["model.layers.0.self_attn.q_proj.weight"], standard)  # 4over6 took effect
    if kind == "llama":
        with torch.no_grad():
            assert torch.equal(trainer(IDS).logits, rollout(IDS).logits)


@pytest.mark.usefixtures("memo_weight_kernel")
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_kernel_backend_trainer_and_sync_are_the_recipe(kind):
    """The hopper backend (Triton under the interpreter on CPU): the fused fake-quant pass in the
    trainer's forward (group scales from amax bits) and the weight quantizer in the sync give the
    torch reference's bits."""
    trainer, rollout = build(kind, seed=1), build(kind, seed=2)
    t_policy, r_policy = _policies()
    with use_backend("hopper"):
        quads.quantize_(trainer, t_policy)
        quads.quantize_(rollout, r_policy)
    assert {m.quads_backend.name for m in quads.quantized_modules(rollout).values()} == {"hopper"}
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    quads.sync_weights_(rollout, trainer)
    masters = {n: p.detach() for n, p in trainer.named_parameters()}
    forward = _trainer_forward_weights(trainer)
    for name, p in rollout.named_parameters():
        if isinstance(p, NVFP4Tensor):
            want = reference_forward_weight(masters, name, block_scaling=FOS)
            assert torch.equal(p.dequantize(torch.bfloat16), want), name
            assert torch.equal(forward[name], want), name


@pytest.mark.parametrize("trainer_bs,rollout_bs", [("6", FOS), (FOS, "6")])
def test_sync_refuses_different_block_scaling_and_writes_nothing(trainer_bs, rollout_bs):
    trainer, rollout = build("llama", seed=1), build("llama", seed=2)
    quads.quantize_(trainer, _policies(block_scaling=trainer_bs)[0])
    quads.quantize_(rollout, _policies(block_scaling=rollout_bs)[1])
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=rf"q_proj: the rollout quantizes with weight_block_scaling='{rollout_bs}', "
                                         rf"the trainer with '{trainer_bs}'"):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)


@pytest.mark.parametrize("mode", ["group", "tensor"])
def test_dense_state_dict_loads_with_the_rollout_block_scaling(mode):
    """load_state_dict of high-precision weights into a 4over6 rollout quantizes them with 4over6
    (group members with their group's scale, the rest through ``NVFP4Tensor.copy_``)."""
    source = build("llama", seed=3)
    rollout = build("llama", seed=2)
    quads.quantize_(rollout, _policies(mode)[1])
    rollout.load_state_dict(source.state_dict())
    masters = {n: p.detach() for n, p in source.named_parameters()}
    packed = {n: p for n, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)}
    assert packed and all(p.block_scaling == FOS for p in packed.values())
    for name, p in packed.items():
        assert torch.equal(p.dequantize(torch.bfloat16), reference_forward_weight(masters, name, mode, block_scaling=FOS)), name


def test_nvfp4_tensor_keeps_its_block_scaling_through_views_and_dense_copies():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    t = NVFP4Tensor.from_float(w, block_scaling=FOS)
    assert t.block_scaling == FOS and t.t().block_scaling == FOS
    assert NVFP4Tensor.from_float(w).block_scaling == "6"
    other = w * 2
    t.copy_(other)
    assert torch.equal(t.dequantize(), nvfp4_dequantize(*nvfp4_quantize(other, block_scaling=FOS)))
    with pytest.raises(ValueError, match="block scaling"):
        NVFP4Tensor.from_float(w, block_scaling="4/6")


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("quantized", [False, True])
def test_export_writes_the_trainer_forward_weights_as_standard_nvfp4(kind, quantized, tmp_path):
    """A 4over6 trainer (or a plain model exported with a 4over6 policy) exports standard
    ModelOpt NVFP4 that quads reads back as the trainer's forward weights, bit for bit."""
    model = build(kind)
    t_policy = _policies()[0]
    if quantized:
        quads.quantize_(model, t_policy)
    report = export_modelopt(model, tmp_path / "ck", "w4a16", policy=t_policy)
    assert report.requantized == {} and report.exact_weights == report.quantized_weights > 0
    config = (tmp_path / "ck" / "config.json").read_text()
    assert '"quant_algo": "W4A16_NVFP4"' in config and FOS not in config  # the format is the standard one
    back = read_modelopt_checkpoint(tmp_path / "ck")
    expected = _forward_weights(build(kind), "group", FOS)
    expected_6 = _forward_weights(build(kind), "group")
    packed = [k for k, v in back.items() if isinstance(v, NVFP4Tensor)]
    assert len(packed) == report.quantized_weights
    for name in packed:
        assert torch.equal(back[name].dequantize(torch.bfloat16), expected[name]), name
    assert any(not torch.equal(expected[n], expected_6[n]) for n in packed)  # 4over6 took effect
