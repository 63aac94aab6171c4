"""sync_weights_ is all or nothing: a refused sync names the parameter and writes nothing."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quads
from quads.policies.modules import RolloutModule
from quads.tensor import NVFP4Tensor
from tests.scale_reference import reference_forward_weight
from quads.tensor.finite import nonfinite_names
from tests.model_state import assert_unchanged, snapshot
from tests.tiny_models import COMMON, build


def _pair(kind="qwen3_moe", rollout_policy=None):
    trainer, rollout = build(kind, seed=1), build(kind, seed=2)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, rollout_policy or quads.QuadsPolicy(side="rollout"))
    return trainer, rollout


def _llama(layers=2, tie=False, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**COMMON, "num_hidden_layers": layers, "tie_word_embeddings": tie}, intermediate_size=96, **kw)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_nan_in_last_layer_master_writes_nothing():
    trainer, rollout = _pair()
    before = snapshot(rollout)
    last = trainer.model.layers[-1].mlp.experts.down_proj
    with torch.no_grad():
        last[-1, -1, -1] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj.*nothing was written|"
                                         r"nothing was written.*model\.layers\.1\.mlp\.experts\.down_proj"):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)  # earlier layers were not overwritten either


@pytest.mark.parametrize("name", ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight",
                                  "model.layers.0.mlp.gate.weight", "model.layers.1.input_layernorm.weight"])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_nonfinite_unpacked_parameter_is_refused(name, value):
    trainer, rollout = _pair()
    before = snapshot(rollout)
    with torch.no_grad():
        dict(trainer.named_parameters())[name].view(-1)[3] = value
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)
    with torch.no_grad():
        assert torch.isfinite(rollout(torch.zeros(1, 4, dtype=torch.long)).logits.float()).all()


def test_master_that_overflows_the_rollout_dtype_is_refused():
    """A finite float32 master beyond float16's range would be written as Inf: the staged copy is checked."""
    trainer = _llama().float()
    rollout = _llama(seed=1).half()
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    before = snapshot(rollout)
    with torch.no_grad():
        trainer.model.norm.weight[0] = 1e6
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)


def test_deeper_trainer_is_an_error_unless_strict_false():
    trainer, rollout = _llama(layers=4), _llama(layers=2, seed=1)
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=r"18 trainer parameter\(s\) have no rollout counterpart: model\.layers\.2\."):
        quads.sync_weights_(rollout, trainer, plain_trainer=True)
    assert_unchanged(before, rollout)
    n = quads.sync_weights_(rollout, trainer, strict=False, plain_trainer=True)
    assert n == len(list(rollout.parameters()))
    masters = dict(trainer.named_parameters())
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(rollout.get_parameter(name).dequantize(torch.bfloat16), reference_forward_weight(masters, name))
    # the other way round: rollout parameters the trainer lacks
    deep_rollout = _llama(layers=4, seed=2)
    quads.quantize_(deep_rollout, quads.QuadsPolicy(side="rollout"))
    with pytest.raises(ValueError, match=r"rollout parameter\(s\) have no trainer counterpart"):
        quads.sync_weights_(deep_rollout, _llama(layers=2), plain_trainer=True)


def test_shape_mismatch_lists_every_parameter_and_writes_nothing():
    trainer = _llama()
    torch.manual_seed(3)
    wide = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=128)).to(torch.bfloat16)
    quads.quantize_(wide, quads.QuadsPolicy(side="rollout"))
    before = snapshot(wide)
    with pytest.raises(ValueError) as err:
        quads.sync_weights_(wide, trainer, plain_trainer=True)
    msg = str(err.value)
    assert "nothing was written" in msg and "\n" not in msg and "6 problems" in msg  # one line; the list on the error
    listed = "\n".join(err.value.problems)
    for layer in (0, 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.{layer}.mlp.{proj}.weight has shape" in listed
    assert_unchanged(before, wide)


def test_packed_or_unquantizable_trainer_is_refused():
    _, rollout = _pair("llama")
    _, other = _pair("llama")
    before = snapshot(rollout)
    with pytest.raises(ValueError, match=r"trainer_model holds packed NVFP4 weights \(a rollout\)"):
        quads.sync_weights_(rollout, other)
    with pytest.raises(ValueError, match=r"q_proj\.weight is torch\.float64 in the trainer"):
        quads.sync_weights_(rollout, build("llama").double(), plain_trainer=True)
    assert_unchanged(before, rollout)


def test_ties_are_kept_and_checked():
    trainer, rollout = _llama(tie=True), _llama(tie=True, seed=1)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    n = quads.sync_weights_(rollout, trainer)
    assert n == len(list(rollout.parameters()))  # the tied weight counts once
    assert rollout.lm_head.weight is rollout.model.embed_tokens.weight
    assert torch.equal(rollout.lm_head.weight, trainer.lm_head.weight)
    # tied trainer -> untied rollout: both rollout parameters receive the one master
    untied = _llama(seed=2)
    quads.quantize_(untied, quads.QuadsPolicy(side="rollout"))
    quads.sync_weights_(untied, trainer)
    assert torch.equal(untied.lm_head.weight, trainer.model.embed_tokens.weight)
    assert torch.equal(untied.model.embed_tokens.weight, trainer.model.embed_tokens.weight)
    # untied trainer -> tied rollout: one of the two masters would be lost
    before = snapshot(rollout)
    with pytest.raises(ValueError, match="tied in the rollout, separate parameters in the trainer"):
        quads.sync_weights_(rollout, _llama(seed=3), plain_trainer=True)
    assert_unchanged(before, rollout)


def test_weights_changed_hook_runs_once_per_written_module_and_never_on_refusal(monkeypatch):
    trainer, rollout = _pair()
    calls = []
    monkeypatch.setattr(RolloutModule, "quads_weights_changed", lambda self: calls.append(self))
    quads.sync_weights_(rollout, trainer)
    modules = list(quads.quantized_modules(rollout).values())
    assert len(calls) == len(modules) and {id(m) for m in calls} == {id(m) for m in modules}
    calls.clear()
    with torch.no_grad():
        trainer.model.layers[0].self_attn.q_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError):
        quads.sync_weights_(rollout, trainer)
    assert calls == []


def test_nonfinite_names_one_pass_over_many_tensors():
    ok = torch.randn(100)
    named = [("ok", ok), ("nan", torch.tensor([1.0, float("nan")])), ("inf", torch.tensor([float("inf"), 0.0])),
             ("ninf_bf16", torch.tensor([0.0, float("-inf")], dtype=torch.bfloat16)), ("empty", torch.zeros(0)),
             ("ints", torch.arange(4)), ("meta", torch.empty(3, device="meta")),
             ("strided_nan", torch.randn(8, 8).t()), ("huge_finite", torch.tensor([3e38, 3e38]))]
    named[7][1][3, 5] = float("nan")
    assert nonfinite_names(named) == ["nan", "inf", "ninf_bf16", "strided_nan"]


def test_sync_into_user_made_nvfp4_parameter_uses_the_recipe():
    """A packed parameter outside a quads module (hand-made) is re-quantized with its own granularity."""
    src, dst = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
    dst.weight = torch.nn.Parameter(NVFP4Tensor.from_float(dst.weight.detach(), "row"), requires_grad=False)
    quads.sync_weights_(dst, src)
    assert dst.weight.granularity == "row"
    assert torch.equal(dst.weight.dequantize(), NVFP4Tensor.from_float(src.weight.detach(), "row").dequantize())


class _InterruptAtCopy(torch.overrides.TorchFunctionMode):
    """Raises KeyboardInterrupt at the n-th in-place ``Tensor.copy_`` (once), as a Ctrl-C would."""

    def __init__(self, n):
        super().__init__()
        self.n, self.calls = n, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.calls += 1
            if self.calls == self.n:
                raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def _count_copies(rollout, trainer):
    counter = _InterruptAtCopy(0)
    with counter:
        quads.sync_weights_(rollout, trainer)
    return counter.calls


def test_ctrl_c_in_the_write_phase_restores_every_tensor(monkeypatch):
    """A KeyboardInterrupt in the write phase leaves no parameter rewritten and no weight torn
    (new packed codes, old scales): every written tensor gets its old value back, whichever copy
    the interrupt hits, and the rollout still works."""
    trainer, rollout = _pair()
    probe_trainer, probe_rollout = _pair()
    total = _count_copies(probe_rollout, probe_trainer)
    assert total > 20
    with torch.no_grad():
        ids = torch.arange(8).view(1, 8)
        logits = rollout(ids).logits
    before = snapshot(rollout)
    for n in sorted({1, 2, 3, total // 3, total // 2 + 1, total - 1, total}):
        with pytest.raises(KeyboardInterrupt), _InterruptAtCopy(n):
            quads.sync_weights_(rollout, trainer)
        assert_unchanged(before, rollout)
    with torch.no_grad():
        assert torch.equal(rollout(ids).logits, logits)

    calls = []

    def interrupted_hook(self):  # the interrupt lands while the modules are being notified
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt

    real_hook = RolloutModule.quads_weights_changed
    monkeypatch.setattr(RolloutModule, "quads_weights_changed",
                        lambda self: interrupted_hook(self) if len(calls) < 2 else real_hook(self))
    with pytest.raises(KeyboardInterrupt):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(rollout(ids).logits, logits)
    quads.sync_weights_(rollout, trainer)  # and a later sync goes through


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_sync_that_would_dequantize_to_inf_in_float16_is_refused(activations):
    """A float16 rollout synced from a trainer with one weight at 1e6 would go silently NaN
    (W4A16: every logit NaN; W4A4: dequantize(float16) holds Inf): the sync refuses, naming the
    weight, and writes nothing; a weight at float16's edge still syncs."""
    trainer = _llama().float()
    rollout = _llama(seed=1).half()
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", activations=activations))
    before = snapshot(rollout)
    name = "model.layers.1.self_attn.o_proj.weight"
    with torch.no_grad():
        dict(trainer.named_parameters())[name][3, 5] = 1e6
    with pytest.raises(ValueError, match=r"dequantize to Inf.*model\.layers\.1\.self_attn\.o_proj\.weight"):
        quads.sync_weights_(rollout, trainer)
    assert_unchanged(before, rollout)
    with torch.no_grad():
        dict(trainer.named_parameters())[name][3, 5] = 65504.0  # float16's max: rounds to itself, fine
    quads.sync_weights_(rollout, trainer)
    packed = dict(rollout.named_parameters())[name]
    assert torch.isfinite(packed.dequantize(torch.float16)).all()


def test_small_misuses_name_the_culprit():
    """A module registered twice (s.b = s.a) converts and syncs (not refused as 'tied'); a state
    dict as the trainer, a meta-device trainer and device='cuda' without a GPU are refused with
    an error that names the cause."""
    import torch.nn as nn

    torch.manual_seed(0)
    trainer, rollout = nn.Sequential(nn.Linear(32, 32)), nn.Sequential(nn.Linear(32, 32))
    trainer.add_module("again", trainer[0])
    rollout.add_module("again", rollout[0])
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    assert rollout.again is rollout[0] and isinstance(rollout[0].weight, NVFP4Tensor)
    assert quads.sync_weights_(rollout, trainer) == 2
    with pytest.raises(TypeError, match="trainer_model must be an nn.Module, got OrderedDict.*load it into a trainer"):
        quads.sync_weights_(rollout, trainer.state_dict())
    meta = nn.Sequential(nn.Linear(32, 32, device="meta"))
    meta.add_module("again", meta[0])
    quads.quantize_(meta, quads.QuadsPolicy(side="trainer"))
    with pytest.raises(ValueError, match=r"0\.weight is on the meta device in the trainer"):
        quads.sync_weights_(rollout, meta)
    if not torch.cuda.is_available():
        from quads.policies.rollout_copy import copy_model

        with pytest.raises(ValueError, match="'cuda' requested, but this machine has no usable CUDA"):
            copy_model(_llama(layers=1), device="cuda")
