"""quantize_ is all or nothing: a refused conversion names the module and leaves the model as it was."""

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import quads
from quads.policies.modules import RolloutModule, TrainerLinear
from quads.tensor import NVFP4Tensor
from tests.model_state import assert_unchanged, snapshot
from tests.tiny_models import COMMON, build

SIDES = ["trainer", "rollout"]


def _llama(tie=False, **kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**COMMON, "tie_word_embeddings": tie, **kw})
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("side", SIDES)
def test_bad_k_in_a_late_module_converts_nothing_and_a_retry_works(side):
    model = _llama(intermediate_size=72)  # down_proj has K=72; q/k/v/o/gate/up come first
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: input dim K=72"):
        quads.quantize_(model, quads.QuadsPolicy(side=side))
    assert_unchanged(before, model)
    assert quads.quantized_modules(model) == {}
    quads.quantize_(model, quads.QuadsPolicy(side=side, extra_skip_patterns=(r"down_proj$",)))
    names = quads.quantized_modules(model)
    assert "model.layers.0.mlp.gate_proj" in names and "model.layers.0.mlp.down_proj" not in names


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_nonfinite_weight_is_refused_on_both_sides(side, kind):
    model = build(kind)
    last = [p for n, p in model.named_parameters() if n.endswith(("down_proj.weight", "experts.down_proj"))][-1]
    with torch.no_grad():
        last.view(-1)[-1] = float("nan")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\..*down_proj.*1 NaN/Inf"):
        quads.quantize_(model, quads.QuadsPolicy(side=side))
    assert_unchanged(before, model)


def test_tied_lm_head_on_the_rollout_is_refused_clearly():
    model = _llama(tie=True, intermediate_size=96)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight.*untie"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", skip_patterns=()))
    assert_unchanged(before, model)
    # the default policy leaves lm_head dense: the tie stays and the rollout works
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not isinstance(model.lm_head.weight, NVFP4Tensor)


def test_tied_lm_head_on_the_trainer_keeps_its_tie_and_syncs():
    trainer = _llama(tie=True, intermediate_size=96)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", skip_patterns=()))
    assert isinstance(trainer.lm_head, TrainerLinear)
    assert trainer.lm_head.weight is trainer.model.embed_tokens.weight
    rollout = _llama(tie=True, intermediate_size=96)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    assert quads.sync_weights_(rollout, trainer) == len(list(rollout.parameters()))


def test_weight_shared_by_two_converted_linears_is_packed_once():
    shared = nn.Linear(32, 16, bias=False)
    model = nn.Sequential(shared, nn.ReLU(), nn.Linear(16, 32, bias=False))
    model.append(nn.Linear(32, 16, bias=False))
    model[3].weight = model[0].weight
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    assert isinstance(model[0].weight, NVFP4Tensor) and model[3].weight is model[0].weight
    trainer = nn.Sequential(nn.Linear(32, 16, bias=False), nn.ReLU(), nn.Linear(16, 32, bias=False))
    trainer.append(nn.Linear(32, 16, bias=False))
    trainer[3].weight = trainer[0].weight
    assert quads.sync_weights_(model, trainer, plain_trainer=True) == 2


def test_meta_model_rollout_is_refused_trainer_is_accepted():
    with torch.device("meta"):
        rollout = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=96))
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight is on the meta device"):
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    assert_unchanged(before, rollout)
    with torch.device("meta"):
        trainer = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=96))
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))  # class swap only; no values to check
    assert isinstance(trainer.model.layers[0].self_attn.q_proj, TrainerLinear)


def test_failure_while_swapping_is_rolled_back(monkeypatch):
    model = build("qwen3_moe")
    before = snapshot(model)
    calls = []

    def failing_hook(self):
        calls.append(self)
        if len(calls) == 5:
            raise RuntimeError("layout build failed")

    monkeypatch.setattr(RolloutModule, "quads_weights_changed", failing_hook)
    with pytest.raises(RuntimeError, match="layout build failed"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    assert len(calls) == 5
    assert_unchanged(before, model)
    monkeypatch.undo()
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))  # and the model can still be converted
    assert len(quads.quantized_modules(model)) > 5


def test_unsupported_weight_dtype_and_prepacked_weight():
    lin = nn.Sequential(nn.Linear(32, 16).double())
    with pytest.raises(TypeError, match=r"0\.weight: cannot quantize a torch\.float64 weight"):
        quads.quantize_(lin, quads.QuadsPolicy(side="trainer"))
    packed = nn.Sequential(nn.Linear(32, 16))
    packed[0].weight = nn.Parameter(NVFP4Tensor.from_float(packed[0].weight.detach()), requires_grad=False)
    with pytest.raises(ValueError, match="already a packed NVFP4Tensor"):
        quads.quantize_(packed, quads.QuadsPolicy(side="rollout"))


class _Affine(nn.Linear):
    """An nn.Linear subclass with its own forward (what quads must not silently replace)."""

    def forward(self, x):
        return super().forward(x) * 2 + 1


class _Plain(nn.Linear):
    """A subclass that keeps nn.Linear's forward: converted as before."""


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_linear_subclass_with_its_own_forward_is_refused_by_name(side):
    """An nn.Linear subclass with its own forward (x*2+1; DeepseekV4GroupedLinear, whose output
    (2,3,4,16) a plain linear would make (2,3,4,64)) is refused, naming the module, the model
    unchanged; skipping it keeps its forward; plain subclasses convert."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Affine(32, 32), _Plain(32, 32))
    before = snapshot(model)
    policy = quads.QuadsPolicy(side=side)
    with pytest.raises(TypeError, match=r"^1 is a .*_Affine, an nn.Linear subclass with its own forward"):
        quads.quantize_(model, policy)
    assert_unchanged(before, model)
    assert type(model[1]) is _Affine and type(model[0]) is nn.Linear
    x = torch.randn(3, 32)
    quads.quantize_(model, quads.QuadsPolicy(side=side, extra_skip_patterns=(r"^1$",)))
    assert type(model[1]) is _Affine and isinstance(model[2], _Plain) and model[2].quads_policy.side == side
    with torch.no_grad():
        y = model[1](x)
        assert torch.allclose(y, nn.functional.linear(x, model[1].weight, model[1].bias) * 2 + 1)


def test_deepseek_v4_grouped_linear_is_refused():
    mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    model = nn.Sequential(mod.DeepseekV4GroupedLinear(16, 64, n_groups=4))
    with pytest.raises(TypeError, match="DeepseekV4GroupedLinear"):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout"))


@pytest.mark.parametrize("side", ["trainer", "rollout"])
def test_empty_or_missing_weight_is_refused(side):
    """Linear(0, 16) and weight=None are refused at conversion, naming the module (not a crash in
    the forward or a raw AttributeError)."""
    with pytest.raises(ValueError, match=r"0\.weight has shape \(16, 0\)"):
        quads.quantize_(nn.Sequential(nn.Linear(0, 16)), quads.QuadsPolicy(side=side))
    no_weight = nn.Linear(16, 16)
    no_weight.weight = None
    with pytest.raises(TypeError, match=r"0\.weight is NoneType"):
        quads.quantize_(nn.Sequential(no_weight), quads.QuadsPolicy(side=side))
