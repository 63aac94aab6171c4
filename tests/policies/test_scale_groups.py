"""One NVFP4 global weight scale per sibling group (``QuadsPolicy(weight_global_scale="group")``):
the groups formed, the trainer's forward, syncs after training steps, the checks that keep
trainer and rollout on the same scales, and loading state saved in either mode."""


import pytest
import torch

import quads
from quads.ops import use_backend
from quads.policies.scale_groups import sibling_groups
from quads.tensor import NVFP4Tensor, load_safetensors, save_safetensors
from tests.model_state import assert_unchanged, snapshot
from tests.scale_reference import group_encode_scale, reference_forward_weight
from tests.tiny_models import build

IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))


def test_policy_field_default_and_validation():
    assert quads.QuadsPolicy(side="trainer").weight_global_scale == "group"
    assert quads.QuadsPolicy(side="rollout", weight_global_scale="tensor").weight_global_scale == "tensor"
    with pytest.raises(ValueError, match="weight_global_scale must be one of"):
        quads.QuadsPolicy(side="rollout", weight_global_scale="fused")


def test_sibling_groups_by_parent_and_set():
    names = ["a.q_proj", "a.k_proj", "a.v_proj", "a.o_proj", "b.gate_proj", "b.up_proj", "b.down_proj",
             "c.q_proj", "c.o_proj", "gate_proj", "up_proj"]
    assert sibling_groups(names) == [["gate_proj", "up_proj"], ["a.q_proj", "a.k_proj", "a.v_proj"],
                                     ["b.gate_proj", "b.up_proj"]]  # a lone c.q_proj has no group


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_groups_are_the_sibling_linears_and_experts_keep_per_expert_scales(kind):
    model = build(kind)
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    groups = {id(m.quads_scale_group): m.quads_scale_group for m in model.modules()
              if getattr(m, "quads_scale_group", None) is not None}
    expected = 2 * (2 if kind == "llama" else 1)  # q/k/v per layer (+ gate/up of the dense MLPs)
    assert len(groups) == expected
    for group in groups.values():
        scales = {m.weight.global_encode_scale.item() for m in group.members}
        assert len(scales) == 1
        want = group_encode_scale([build(kind).get_parameter(f"{n}.weight") for n in group.names])
        assert scales == {want.item()}
    if kind == "qwen3_moe":
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.global_encode_scale.shape == (4,)  # one per expert, gate and up rows
        assert getattr(experts, "quads_scale_group", None) is None


@pytest.mark.parametrize("backend", ["torch", "hopper"])
def test_trainer_forward_and_gradient_with_group_scales(backend):
    """The trainer's forward multiplies by DQ(Q(w)) with the group's scale (the fused kernel on
    the hopper backend, the recipe on torch: same bits); the gradient goes straight to its own
    master only."""
    model = build("llama", dtype=torch.float32)
    with use_backend(backend):
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    attn = model.model.layers[0].self_attn
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(3, 64, requires_grad=True)
    y = attn.k_proj(x)
    w_hat = reference_forward_weight(masters, "model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(y, torch.nn.functional.linear(x, w_hat))
    assert torch.equal(attn.k_proj.quads_forward_weight(), w_hat)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(attn.k_proj.weight.grad, g.t() @ x)
    assert attn.q_proj.weight.grad is None and attn.v_proj.weight.grad is None


@pytest.mark.parametrize("mode", ["group", "tensor"])
def test_sync_after_training_steps_keeps_the_rollout_the_trainer_forward(mode):
    trainer, rollout = build("llama", seed=1), build("llama", seed=2)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale=mode))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations="bf16", weight_global_scale=mode))
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    for step in range(2):
        trainer(IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
        quads.sync_weights_(rollout, trainer)
        masters = {n: p.detach() for n, p in trainer.named_parameters()}
        for name, p in rollout.named_parameters():
            if isinstance(p, NVFP4Tensor):
                assert torch.equal(p.dequantize(torch.bfloat16), reference_forward_weight(masters, name, mode)), name
        with torch.no_grad():
            assert torch.equal(trainer(IDS).logits, rollout(IDS).logits)


def test_build_rollout_model_uses_group_scales():
    trainer = build("llama")
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    rollout = quads.policies.build_rollout_model(trainer, quads.QuadsPolicy(side="rollout", activations="bf16"))
    masters = {n: p.detach() for n, p in trainer.named_parameters()}
    packed = {n: p for n, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)}
    assert len(packed) == 14
    for name, p in packed.items():
        assert torch.equal(p.dequantize(torch.bfloat16), reference_forward_weight(masters, name)), name
    assert len({packed[f"model.layers.1.self_attn.{x}_proj.weight"].global_encode_scale.item() for x in "qkv"}) == 1


@pytest.mark.parametrize("trainer_mode,rollout_mode", [("group", "tensor"), ("tensor", "group")])
def test_sync_refuses_different_modes_and_writes_nothing(trainer_mode, rollout_mode):
    trainer, rollout = build("llama", seed=1), build("llama", seed=2)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale=trainer_mode))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", weight_global_scale=rollout_mode))
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=rf"q_proj: the rollout quantizes with weight_global_scale='{rollout_mode}', "
                                         rf"the trainer with '{trainer_mode}'"):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)


def test_sync_refuses_a_partial_group_and_writes_nothing():
    trainer, rollout = build("llama", seed=1), build("llama", seed=2)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    del trainer.model.layers[0].self_attn.v_proj  # a plain trainer lacking one member of a group
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=r"v_proj: not synced, but its sibling group .* sync the whole group"):
        quads.sync_weights_(rollout, trainer, strict=False, plain_trainer=True)
    assert_unchanged(before, rollout)


def test_a_skipped_sibling_leaves_the_others_grouped():
    trainer, rollout = build("llama", seed=1), build("llama", seed=2)
    skip = (r"\.v_proj$",)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", extra_skip_patterns=skip))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations="bf16", extra_skip_patterns=skip))
    quads.sync_weights_(rollout, trainer)
    attn = rollout.model.layers[0].self_attn
    assert attn.q_proj.quads_scale_group.names == ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj")
    masters = {n: p.detach() for n, p in trainer.named_parameters() if "v_proj" not in n}
    for x in "qk":
        name = f"model.layers.0.self_attn.{x}_proj.weight"
        assert torch.equal(rollout.get_parameter(name).dequantize(torch.bfloat16), reference_forward_weight(masters, name))
    with torch.no_grad():
        assert torch.equal(trainer(IDS).logits, rollout(IDS).logits)


def test_state_saved_in_either_mode_loads_where_it_fits(tmp_path):
    """A group-mode state dict loads into both modes; a tensor-mode one into a tensor-mode model
    only: a group-mode model refuses it before loading anything, naming the group and the fix."""
    saved = {}
    for mode in ("group", "tensor"):
        m = build("llama", seed=3)
        quads.quantize_(m, quads.QuadsPolicy(side="rollout", weight_global_scale=mode))
        save_safetensors(m.state_dict(), tmp_path / f"{mode}.safetensors")
        with torch.no_grad():
            saved[mode] = m(IDS).logits
    for mode, file in (("group", "group"), ("tensor", "group"), ("tensor", "tensor")):
        fresh = build("llama", seed=9)
        quads.quantize_(fresh, quads.QuadsPolicy(side="rollout", weight_global_scale=mode))
        fresh.load_state_dict(load_safetensors(tmp_path / f"{file}.safetensors"))
        with torch.no_grad():
            assert torch.equal(fresh(IDS).logits, saved[file]), (mode, file)
    fresh = build("llama", seed=9)
    quads.quantize_(fresh, quads.QuadsPolicy(side="rollout"))
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"load_state_dict: the sibling group .*_proj.weight.*"
                                         r"weight_global_scale='tensor'.*Nothing was loaded"):
        fresh.load_state_dict(load_safetensors(tmp_path / "tensor.safetensors"))
    assert_unchanged(before, fresh)


def test_torchao_converts_a_sibling_set_together():
    """torchao hands the linears over one by one; the handler converts each sibling set as a
    whole, so the scales are the group's, as with quads.quantize_ (FqnToConfig too)."""
    pytest.importorskip("torchao")
    from torchao.quantization import FqnToConfig
    from torchao.quantization import quantize_ as ao_quantize_

    import quads.integrations.torchao  # noqa: F401

    policy = quads.QuadsPolicy(side="rollout")
    ours = build("llama")
    quads.quantize_(ours, policy)
    for how in ("default", "fqn"):
        theirs = build("llama")
        if how == "default":
            ao_quantize_(theirs, policy)
        else:
            ao_quantize_(theirs, FqnToConfig({"model.layers.0.self_attn.k_proj": policy}), filter_fn=None)
        mine = {n: p for n, p in ours.named_parameters() if isinstance(p, NVFP4Tensor)}
        got = {n: p for n, p in theirs.named_parameters() if isinstance(p, NVFP4Tensor)}
        if how == "fqn":  # k_proj was named; its siblings came with it
            assert sorted(got) == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "kqv"]
        for n, p in got.items():
            assert torch.equal(p.qdata, mine[n].qdata) and torch.equal(p.global_encode_scale, mine[n].global_encode_scale), n


def test_export_cli_tensor_mode_reports_the_requantized_shards(tmp_path, capsys):
    from quads.cli import main

    build("llama").save_pretrained(tmp_path / "m")
    for mode, want in (("group", 0), ("tensor", 6)):
        rc = main(["export", "--model", str(tmp_path / "m"), "--out", str(tmp_path / mode), "--weight-global-scale", mode])
        assert rc == 0
        import json

        report = json.loads((tmp_path / mode / "quads_export.json").read_text())
        assert len(report["requantized"]) == want, mode
    out = capsys.readouterr().out
    assert "0 fused-layer shards re-quantized" in out and "6 fused-layer shards re-quantized" in out


def test_torchao_config_loading_converts_each_sibling_set_when_complete(tmp_path):
    """transformers' TorchAoConfig loading quantizes each linear right after loading its weight;
    the handler waits for the last member of a sibling set and converts the set together, so the
    packed weights are quads.quantize_'s (group scales) bit for bit."""
    pytest.importorskip("torchao")
    from transformers import AutoModelForCausalLM, TorchAoConfig

    import quads.integrations.torchao  # noqa: F401

    build("llama").save_pretrained(tmp_path / "src")
    policy = quads.QuadsPolicy(side="rollout")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16,
                                                  quantization_config=TorchAoConfig(policy))
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16)
    quads.quantize_(ours, policy)
    mine = {n: p for n, p in ours.named_parameters() if isinstance(p, NVFP4Tensor)}
    got = {n: p for n, p in loaded.named_parameters() if isinstance(p, NVFP4Tensor)}
    assert got.keys() == mine.keys() and len(got) == 14
    for n, p in got.items():
        assert torch.equal(p.qdata, mine[n].qdata) and torch.equal(p.global_encode_scale, mine[n].global_encode_scale), n
    assert not any(hasattr(m, "_quads_awaits_siblings") for m in loaded.modules())
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, ours(IDS).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shared_global_encode_scale_is_the_recipe_on_the_largest_amax(dtype):
    from quads.tensor.nvfp4_math import global_amax, global_encode_scale_from_amax, shared_global_encode_scale

    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(8, 32, generator=g) * s).to(dtype) for s in (0.5, 3.0, 1.0)]
    want = global_encode_scale_from_amax(torch.stack([global_amax(w, "tensor") for w in ws]).amax())
    assert torch.equal(shared_global_encode_scale(ws), want)
    assert torch.equal(shared_global_encode_scale(ws), group_encode_scale(ws))  # the tests' reference
    assert torch.equal(shared_global_encode_scale(ws[:1] + [ws[0][:0]]), shared_global_encode_scale(ws[:1]))
    ws[2][1, 1] = float("nan")
    assert shared_global_encode_scale(ws).isnan()


def test_dense_state_dict_loads_with_group_scales_and_a_partial_group_is_refused():
    """load_state_dict of high-precision weights into a group-mode rollout quantizes each sibling
    group with its shared scale (= what sync_weights_ writes); a group given partly is refused."""
    trainer = build("llama", seed=1)
    synced, loaded = build("llama", seed=2), build("llama", seed=3)
    for m in (synced, loaded):
        quads.quantize_(m, quads.QuadsPolicy(side="rollout"))
    quads.sync_weights_(synced, trainer, plain_trainer=True)
    state = trainer.state_dict()
    loaded.load_state_dict(state)
    assert not isinstance(state["model.layers.0.self_attn.q_proj.weight"], NVFP4Tensor)  # the caller's dict untouched
    for (n, a), (_, b) in zip(synced.named_parameters(), loaded.named_parameters()):
        if isinstance(a, NVFP4Tensor):
            assert torch.equal(a.qdata, b.qdata) and torch.equal(a.global_encode_scale, b.global_encode_scale), n
    fresh = build("llama", seed=4)
    quads.quantize_(fresh, quads.QuadsPolicy(side="rollout"))
    before = snapshot(fresh)
    partial = {k: v for k, v in state.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"sibling group .*layers\.1\.self_attn\.q_proj.* is not given whole"):
        fresh.load_state_dict(partial, strict=False)
    assert_unchanged(before, fresh)
