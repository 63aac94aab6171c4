"""Precision plans: a policy's scope (routed experts only) and boundary decoder layers, on both
sides, the sync, the export and the rollout copy; the W4A16 plan's exactness; the presets."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import quads
from quads.policies import POLICY_PRESETS, build_rollout_model, quantized_modules
from quads.policies.presets import preset_problem, weight_only_rollout
from quads.policies.scope import conversion_mismatch, decoder_layers
from quads.tensor import NVFP4Tensor
from tests.scale_reference import reference_forward_weight
from tests.tiny_models import COMMON

KINDS = ["llama", "qwen3", "qwen3_moe", "mixtral"]
MOE = ("qwen3_moe", "mixtral")


def build(kind: str, layers: int = 4, seed: int = 0) -> nn.Module:
    """A tiny random transformers model with ``layers`` decoder layers (no hub), built in BF16 the
    way ``from_pretrained(dtype=torch.bfloat16)`` and ``build_rollout_model`` build one (float32
    rotary buffers)."""
    torch.manual_seed(seed)
    common = {**COMMON, "num_hidden_layers": layers}
    if kind == "llama":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**common, intermediate_size=96)
    elif kind == "qwen3":
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(**common, intermediate_size=96)
    elif kind == "qwen3_moe":
        cls, cfg = Qwen3MoeForCausalLM, Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                                       norm_topk_prob=True)
    else:
        cls, cfg = MixtralForCausalLM, MixtralConfig(**common, intermediate_size=48, num_local_experts=4,
                                                     num_experts_per_tok=2)
    model = cls._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model.eval()


def _ids(seed=0, shape=(2, 10)):
    return torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))


def _layer(name: str) -> int:
    return int(name.split(".")[2])


def _policy(side, **kw):
    return quads.QuadsPolicy(side=side, **kw)


# -- which modules each plan converts -----------------------------------------------------------


@pytest.mark.parametrize("side", ["trainer", "rollout"])
@pytest.mark.parametrize("kind", KINDS)
def test_boundary_layers_stay_whole_in_high_precision(kind, side):
    model = build(kind, layers=5)
    assert decoder_layers(model) == ("model.layers", 5)
    everything = set(quantized_modules(quads.quantize_(build(kind, layers=5), _policy(side))))
    quads.quantize_(model, _policy(side, skip_first_layers=1, skip_last_layers=2))
    converted = set(quantized_modules(model))
    assert converted == {n for n in everything if _layer(n) in (1, 2)}
    assert any(".self_attn." in n for n in converted)  # scope "all": layers 1-2 keep attention quantized too


@pytest.mark.parametrize("side", ["trainer", "rollout"])
@pytest.mark.parametrize("kind", MOE)
def test_routed_experts_scope_converts_only_the_experts(kind, side):
    model = build(kind)
    quads.quantize_(model, _policy(side, scope="routed_experts", skip_last_layers=1))
    converted = set(quantized_modules(model))
    assert converted == {f"model.layers.{i}.mlp.experts" for i in range(3)}
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, torch.Tensor)
    assert type(model.model.layers[0].self_attn.q_proj) is type(build(kind).model.layers[0].self_attn.q_proj)


def test_routed_experts_scope_excludes_shared_experts():
    """Shared experts are plain MLPs every token runs: kept in high precision like attention."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = build("qwen3_moe", layers=1).model.layers[0].mlp.experts
            self.shared_expert = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64))
            self.listed = nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(64, 32) for _ in range(2)])})

    model = nn.Module()
    model.layers = nn.ModuleList([Block()])
    quads.quantize_(model, _policy("rollout", scope="routed_experts"))
    assert set(quantized_modules(model)) == {"layers.0.experts", "layers.0.listed.experts.0", "layers.0.listed.experts.1"}


@pytest.mark.parametrize("side", ["trainer", "rollout"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_routed_experts_scope_refuses_a_dense_model_unchanged(kind, side):
    model = build(kind)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"QuadsPolicy\.scope='routed_experts': \w+ForCausalLM has no routed experts"):
        quads.quantize_(model, _policy(side, scope="routed_experts"))
    assert [type(m) for m in model.modules()] == classes
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_boundary_refused_without_decoder_layers_or_covering_them_all():
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"skip_first_layers=1.*Sequential has no decoder-layer list"):
        quads.quantize_(plain, _policy("trainer", skip_first_layers=1))
    assert not quantized_modules(plain)
    model = build("llama", layers=3)
    with pytest.raises(ValueError, match=r"keeps all 3 decoder layers of LlamaForCausalLM"):
        quads.quantize_(model, _policy("rollout", skip_first_layers=1, skip_last_layers=2))
    assert not quantized_modules(model)
    two = nn.Module()
    two.a, two.b = nn.Module(), nn.Module()
    two.a.layers = nn.ModuleList([nn.Linear(32, 32)])
    two.b.layers = nn.ModuleList([nn.Linear(32, 32)])
    with pytest.raises(ValueError, match=r"2 decoder-layer lists \(a\.layers, b\.layers\)"):
        quads.quantize_(two, _policy("rollout", skip_last_layers=1))


@pytest.mark.parametrize("field, value", [("scope", "experts"), ("scope", None), ("skip_first_layers", -1),
                                          ("skip_first_layers", True), ("skip_last_layers", 1.0),
                                          ("skip_last_layers", "2")])
def test_scope_fields_are_validated_naming_the_field(field, value):
    for side in ("trainer", "rollout"):
        with pytest.raises(ValueError, match=rf"QuadsPolicy\.{field}"):
            quads.QuadsPolicy(side=side, **{field: value})


# -- both sides: sync, agreement, rollout copies --------------------------------------------------


@pytest.mark.parametrize("kind, scope", [("llama", {"skip_first_layers": 1, "skip_last_layers": 1}),
                                         ("qwen3_moe", {"scope": "routed_experts", "skip_first_layers": 1}),
                                         ("mixtral", {"skip_last_layers": 2})])
def test_sync_writes_packed_weights_exactly_and_bf16_layers_as_copies(kind, scope):
    trainer, rollout = build(kind, seed=1), build(kind, seed=2)
    quads.quantize_(trainer, _policy("trainer", **scope))
    quads.quantize_(rollout, _policy("rollout", activations="bf16", **scope))
    assert conversion_mismatch(rollout, trainer) is None
    quads.sync_weights_(rollout, trainer)
    masters = dict(trainer.named_parameters())
    packed = dense_layer_weights = 0
    for name, p in rollout.named_parameters():
        if isinstance(p, NVFP4Tensor):
            packed += 1
            want = reference_forward_weight(masters, name)
            assert torch.equal(p.dequantize(want.dtype).view(torch.int16), want.view(torch.int16)), name
        else:  # a layer the plan keeps in BF16: the trainer's master, copied as a BF16 rollout's would be
            dense_layer_weights += name.startswith("model.layers.") and p.dim() >= 2
            assert torch.equal(p, masters[name].to(p.dtype)), name
    assert packed > 0 and dense_layer_weights > 0
    with torch.no_grad():  # the W4A16 rollout is the trainer's forward
        assert torch.equal(rollout(_ids()).logits, trainer(_ids()).logits)


@pytest.mark.parametrize("trainer_kw, rollout_kw, culprit", [
    ({"skip_first_layers": 1}, {}, r"model\.layers\.1\.self_attn\.q_proj: the rollout was converted with scope='all', "
                                   r"skip_first_layers=0, .* the trainer with scope='all', skip_first_layers=1"),
    ({}, {"scope": "routed_experts"}, r"model\.layers\.0\.mlp\.experts: the rollout was converted with "
                                      r"scope='routed_experts'.*the trainer with scope='all'"),
])
def test_sync_refuses_sides_converted_with_different_plans(trainer_kw, rollout_kw, culprit):
    trainer, rollout = build("qwen3_moe", seed=1), build("qwen3_moe", seed=2)
    quads.quantize_(trainer, _policy("trainer", **trainer_kw))
    quads.quantize_(rollout, _policy("rollout", **rollout_kw))
    before = {n: t.clone() for n, p in rollout.named_parameters()
              for t in (p.parts if isinstance(p, NVFP4Tensor) else (p,))}
    with pytest.raises(ValueError, match=r"sync_weights_: nothing was written; .*" + culprit) as err:
        quads.sync_weights_(rollout, trainer)
    assert "\n" not in str(err.value)
    after = {n: t for n, p in rollout.named_parameters() for t in (p.parts if isinstance(p, NVFP4Tensor) else (p,))}
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_plain_trainer_syncs_into_a_scoped_rollout():
    """The BF16-trainer plans (``naive``) have no trainer conversion to agree with."""
    trainer, rollout = build("qwen3_moe", seed=1), build("qwen3_moe", seed=2)
    quads.quantize_(rollout, _policy("rollout", scope="routed_experts"))
    assert quads.sync_weights_(rollout, trainer, plain_trainer=True) > 0


@pytest.mark.parametrize("plan", ["quads-experts", "w4a16-experts", "quads-boundary"])
def test_build_rollout_model_follows_the_plan(plan):
    preset = POLICY_PRESETS[plan]
    trainer = build("qwen3_moe", layers=8)
    quads.quantize_(trainer, preset.trainer)
    rollout = build_rollout_model(trainer, preset.rollout)
    assert set(quantized_modules(rollout)) == set(quantized_modules(trainer))
    layers = {_layer(n) for n in quantized_modules(rollout)}
    assert layers == (set(range(8)) if "experts" in plan else {2, 3})
    with pytest.raises(ValueError, match="would quantize different modules"):
        build_rollout_model(trainer, quads.QuadsPolicy(side="rollout"))


# -- the W4A16 plan and the presets ---------------------------------------------------------------


@pytest.mark.parametrize("plan, kind", [("w4a16", "llama"), ("w4a16", "qwen3_moe"), ("w4a16", "mixtral"),
                                        ("w4a16-experts", "qwen3_moe")])
def test_w4a16_plan_rollout_logits_equal_the_trainers(plan, kind):
    """NVFP4 weights aligned exactly, BF16 activations on both sides: the rollout's logits are the
    trainer's bit for bit on the same forward (engine drift is all a W4A16 rollout engine adds)."""
    preset = POLICY_PRESETS[plan]
    trainer = build(kind, seed=3)
    quads.quantize_(trainer, preset.trainer)
    rollout = build_rollout_model(trainer, preset.rollout)
    with torch.no_grad():
        t, r = trainer(_ids(1, (3, 12))).logits, rollout(_ids(1, (3, 12))).logits
    assert torch.equal(t, r)
    plain = build(kind, seed=3)
    with torch.no_grad():
        assert not torch.equal(plain(_ids(1, (3, 12))).logits, t)  # the weights are quantized


def test_presets_and_their_problems():
    assert {"w4a16", "quads-experts", "w4a16-experts", "quads-boundary"} <= set(POLICY_PRESETS)
    w4a16 = POLICY_PRESETS["w4a16"]
    assert w4a16.rollout.activations == "bf16" and w4a16.trainer.activations == "bf16"
    assert w4a16.rollout.activation_quant is None
    for name in ("quads-experts", "w4a16-experts"):
        p = POLICY_PRESETS[name]
        assert p.trainer.scope == p.rollout.scope == "routed_experts"
    b = POLICY_PRESETS["quads-boundary"]
    assert (b.rollout.skip_first_layers, b.rollout.skip_last_layers) == (2, 4) == (b.trainer.skip_first_layers,
                                                                                   b.trainer.skip_last_layers)
    dense, moe = build("llama"), build("qwen3_moe", layers=8)
    assert "no routed experts" in preset_problem("quads-experts", dense)
    assert "keeps all 4 decoder layers" in preset_problem("quads-boundary", dense)
    assert all(preset_problem(n, moe) is None for n in POLICY_PRESETS)
    assert preset_problem("quads", dense) is None


def test_weight_only_rollout_keeps_the_modules_and_scales():
    trainer = _policy("trainer", scope="routed_experts", skip_first_layers=1, weight_global_scale="tensor",
                      activations="nvfp4")
    w16 = weight_only_rollout(trainer)
    assert (w16.side, w16.activations, w16.activation_quant) == ("rollout", "bf16", None)
    assert dataclasses.replace(w16, side="trainer", activations="nvfp4") == trainer


# -- quads export -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, scope", [("qwen3_moe", {"scope": "routed_experts", "skip_first_layers": 1}),
                                         ("mixtral", {"skip_last_layers": 1}),
                                         ("llama", {"skip_first_layers": 1, "skip_last_layers": 2})])
def test_export_writes_the_plans_weights_and_excludes_the_rest(kind, scope, tmp_path):
    from quads.integrations.modelopt import export_modelopt, load_exported
    from quads.tensor.modelopt_format import read_modelopt_checkpoint

    plain = build(kind, seed=4)
    trainer = build(kind, seed=4)
    quads.quantize_(trainer, _policy("trainer", **scope))
    report = export_modelopt(trainer, tmp_path / "ck", "w4a16")
    back = read_modelopt_checkpoint(tmp_path / "ck")
    packed = {k for k, v in back.items() if isinstance(v, NVFP4Tensor)}
    converted = set(quantized_modules(trainer))
    assert len(packed) == report.quantized_weights == report.exact_weights > 0
    kept = {n for n, m in trainer.named_modules() if n.startswith("model.layers.") and n.count(".") == 2
            and not any(c.startswith(n + ".") for c in converted)}  # decoder layers left wholly in BF16
    assert kept and not any(k.startswith(tuple(n + "." for n in kept)) for k in packed)
    for n in kept:  # vLLM's modelopt_fp4 keeps whatever exclude_modules names out of its NVFP4 layers
        assert any(e.startswith(n + ".") for e in report.exclude_modules), n
    if scope.get("scope") == "routed_experts":
        assert "model.layers.0.mlp.experts" in report.exclude_modules  # a BF16 experts module, by its prefix
        assert all(".experts." in k for k in packed)
    # a plain model exported with the plan's policy writes the same checkpoint
    again = export_modelopt(plain, tmp_path / "ck2", "w4a16", policy=_policy("trainer", **scope))
    assert again.exclude_modules == report.exclude_modules
    back2 = read_modelopt_checkpoint(tmp_path / "ck2")
    assert back2.keys() == back.keys()
    assert all(torch.equal(back2[k].qdata, back[k].qdata) for k in packed)
    # read back as the plan's rollout: the parts a sync from the trainer writes
    rollout = build_rollout_model(trainer, _policy("rollout", **scope))
    loaded = load_exported(tmp_path / "ck", side="rollout")
    assert set(quantized_modules(loaded)) == converted
    mine = dict(rollout.named_parameters())
    for name, p in loaded.named_parameters():
        if isinstance(p, NVFP4Tensor):
            assert torch.equal(p.qdata, mine[name].qdata) and torch.equal(p.global_encode_scale,
                                                                            mine[name].global_encode_scale), name


def test_cli_export_takes_the_plan(tmp_path, capsys):
    from quads.cli import main
    from quads.tasks.arithmetic import make_tokenizer
    from quads.tensor.modelopt_format import read_modelopt_checkpoint

    for kind in ("qwen3_moe", "llama"):
        build(kind).save_pretrained(tmp_path / kind)
        make_tokenizer().save_pretrained(tmp_path / kind)
    assert main(["export", "--model", str(tmp_path / "qwen3_moe"), "--out", str(tmp_path / "ck"),
                 "--scope", "routed_experts", "--skip-first-layers", "1", "--skip-last-layers", "1"]) == 0
    assert "W4A16_NVFP4: 24 NVFP4 weights" in capsys.readouterr().out  # layers 1-2: 4 experts x gate, up, down
    assert {k.split(".")[2] for k, v in read_modelopt_checkpoint(tmp_path / "ck").items()
            if isinstance(v, NVFP4Tensor)} == {"1", "2"}
    assert main(["export", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "ck2"),
                 "--scope", "routed_experts"]) == 2
    err = capsys.readouterr().err
    assert "no routed experts" in err and "Traceback" not in err and not (tmp_path / "ck2").exists()
    with pytest.raises(SystemExit) as exit_:  # argparse's own usage error
        main(["export", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "ck3"), "--skip-first-layers", "-1"])
    assert exit_.value.code == 2 and "--skip-first-layers: must be >= 0" in capsys.readouterr().err


# -- torchao ------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_torchao_quantize_applies_the_plan_as_quads_does(side):
    torchao = pytest.importorskip("torchao")
    from quads.integrations.torchao import linear_or_experts

    policy = _policy(side, scope="routed_experts", skip_last_layers=1)
    ours, theirs = build("qwen3_moe"), build("qwen3_moe")
    quads.quantize_(ours, policy)
    torchao.quantization.quantize_(theirs, policy, filter_fn=linear_or_experts)
    assert set(quantized_modules(theirs)) == set(quantized_modules(ours)) == {f"model.layers.{i}.mlp.experts"
                                                                              for i in range(3)}
    boundary = _policy(side, skip_first_layers=2)
    dense = build("llama")
    torchao.quantization.quantize_(dense, boundary)
    assert {_layer(n) for n in quantized_modules(dense)} == {2, 3}
    with pytest.raises(ValueError, match="no routed experts"):
        torchao.quantization.quantize_(build("llama"), _policy(side, scope="routed_experts"))


def test_torchao_config_loading_refuses_a_scoped_plan(tmp_path, capfd, caplog):
    """transformers collects the handler's error in its load report and raises; no model comes back."""
    pytest.importorskip("torchao")
    from transformers import AutoModelForCausalLM, TorchAoConfig

    import quads.integrations.torchao  # noqa: F401

    build("llama").save_pretrained(tmp_path / "src")
    with pytest.raises((RuntimeError, NotImplementedError)):
        AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16,
                                             quantization_config=TorchAoConfig(_policy("rollout", skip_first_layers=1)))
    out = capfd.readouterr()
    assert "TorchAoConfig loading with a scoped QuadsPolicy" in out.out + out.err + caplog.text


# -- the main example and the TRL trainer ---------------------------------------------------------


def _example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo_quads.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_refuses_a_plan_the_model_cannot_take(tmp_path):
    pytest.importorskip("trl")
    from quads.diagnostics.cli_inputs import UsageError

    with pytest.raises(UsageError, match=r"--policy quads-boundary: preset 'quads-boundary': .*keeps all 3 decoder "
                                         r"layers of Qwen3MoeForCausalLM"):
        _example().main(["--policy", "quads-boundary", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_scoped_plan_trains_through_quads_grpo_trainer_with_the_decomposition(tmp_path):
    """One GRPO step of ``quads-experts`` on the embedded MoE: the decomposition's probe rollouts
    follow the plan's scope (a probe of another scope would be refused by the sync), and both
    sides hold the same weights (delta_weight = 0)."""
    pytest.importorskip("trl")
    summary = _example().main(["--policy", "quads-experts", "--max-steps", "1", "--decompose", "--eval-n", "0",
                               "--prompts-per-step", "2", "--num-generations", "2", "--train-prompts", "32",
                               "--no-plot", "--output-dir", str(tmp_path / "out")])
    assert summary["complete"] and summary["policy"] == "quads-experts"
    assert summary["delta_weight_abs_mean"] == 0.0
