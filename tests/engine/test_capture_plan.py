"""The rule that decides, before any capture, whether a model's decode step can be a CUDA graph
(:mod:`quads.engine.capture`), and the decoder's use of it; CPU only (the capture itself and
the warm-up's sync check run in tests/gpu)."""

import warnings

import pytest
import torch
import torch.nn as nn

import quads
import quads.engine.decoder as decoder_mod
from quads.engine import GraphedDecoder
from quads.engine.capture import capture_plan, transformers_experts
from tests.tiny_models import build

pytestmark = pytest.mark.usefixtures("memo_weight_kernel")


def _moe(impl):
    model = build("qwen3_moe", dtype=torch.float32)
    model.config._experts_implementation = impl
    return model


@pytest.mark.parametrize("grouped_mm_ok,target", [(True, "grouped_mm"), (False, "batched_mm")])
def test_eager_experts_are_switched_for_the_decoders_forwards(grouped_mm_ok, target):
    model = _moe("eager")
    plan = capture_plan(model, grouped_mm_ok)
    assert plan.blocker is None and [impl for _, impl in plan.switch] == [target]
    experts = list(transformers_experts(model).values())
    assert len(experts) == model.config.num_hidden_layers
    ids = torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        eager = model(ids).logits
        with plan.applied():
            assert {e.config._experts_implementation for e in experts} == {target}
            switched = model(ids).logits
    assert model.config._experts_implementation == "eager"  # restored
    torch.testing.assert_close(switched, eager, rtol=1e-5, atol=1e-5)  # the same function, another kernel
    with pytest.raises(RuntimeError, match="boom"), plan.applied():
        raise RuntimeError("boom")
    assert model.config._experts_implementation == "eager"  # restored on an exception too


def test_capturable_and_converted_models_need_nothing():
    assert capture_plan(_moe("grouped_mm"), True).switch == ()
    assert capture_plan(_moe("batched_mm"), True).switch == ()
    assert capture_plan(build("llama"), True) == capture_plan(build("llama"), False)
    assert capture_plan(build("llama"), True).switch == () and capture_plan(build("llama"), True).blocker is None
    rollout = quads.quantize_(_moe("eager").to(torch.bfloat16), quads.QuadsPolicy(side="rollout"))
    plan = capture_plan(rollout, True)  # quads' experts replace the loop
    assert plan.switch == () and plan.blocker is None and not transformers_experts(rollout)
    # grouped_mm asked for where torch's grouped GEMM cannot run: transformers' fallback loops over offs.tolist()
    assert [impl for _, impl in capture_plan(_moe("grouped_mm"), False).switch] == ["batched_mm"]


def test_blockers_are_one_line_and_name_the_module():
    plan = capture_plan(_moe("my_kernel"), True)
    assert plan.switch == () and "\n" not in plan.blocker
    assert "model.layers.0.mlp.experts" in plan.blocker and "'my_kernel'" in plan.blocker

    class LoopMoE(nn.Module):  # a MoE block without transformers' experts interface
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    model = build("llama")
    model.model.layers[1].mlp = LoopMoE()
    plan = capture_plan(model, True)
    assert "model.layers.1.mlp (LoopMoE)" in plan.blocker and "\n" not in plan.blocker


def test_decoder_refuses_up_front_and_decodes_eagerly(monkeypatch):
    """The decision wiring: a blocked model is refused before any capture, once, with the
    reason; a switchable one gets the switch for the call's forwards (prefill included)."""
    monkeypatch.setattr(decoder_mod, "grouped_mm_available", lambda device: True)
    cuda = torch.device("cuda")
    blocked = GraphedDecoder(_moe("my_kernel"))
    with pytest.warns(RuntimeWarning, match=r"not capturing .*'my_kernel'.*decoding eagerly"):
        assert blocked._graphs_on(cuda) is False
    assert "'my_kernel'" in blocked.capture_blocker
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blocked._graphs_on(cuda) is False  # said once
    switchable = GraphedDecoder(_moe("eager"))
    assert switchable._graphs_on(cuda) is True and switchable.capture_blocker is None
    assert [impl for _, impl in switchable._plan.switch] == ["grouped_mm"]
    # on CPU nothing is switched: the eager decoder runs the model's own experts, as before
    cpu = GraphedDecoder(_moe("eager"))
    assert cpu._graphs_on(torch.device("cpu")) is False and cpu._plan is None and cpu.capture_blocker is None
