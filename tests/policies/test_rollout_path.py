"""The rollout forward's path as short in code as on paper: a module's forward is its kernel's
``apply`` (made once, refreshed by writes), which reaches the NVFP4 math in a few calls, never
calls back up a layer and reads no version; every write path refreshes the kernel.

Hops are counted with ``sys.setprofile``: Python calls in quads' own files from the module's
``forward`` (counted) to the first call into the NVFP4 math (counted): the recipe
(``quads/tensor/nvfp4_math.py``, the torch backend) or a launcher (``quads/kernels/``, the
Hopper kernels under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import quads
from quads.policies.modules import RolloutExperts, RolloutLinear
from quads.tensor.nvfp4_tensor import NVFP4Tensor
from tests.tiny_models import build

_QUADS = os.path.dirname(quads.__file__) + os.sep
_MATH = (os.path.join(_QUADS, "tensor", "nvfp4_math.py"), os.path.join(_QUADS, "kernels") + os.sep)


def _path(module, call) -> tuple[list[str], list[str]]:
    """(the quads calls from ``module.forward`` to the first NVFP4 math, both included; every
    quads/policies call under the forward but the forward itself)."""
    calls, policies, state = [], [], {"on": False, "math": False}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(_QUADS):
            return
        if not state["on"]:
            if code.co_name == "forward" and frame.f_locals.get("self") is module:
                state["on"] = True
                calls.append(code.co_qualname)
            return
        if code.co_filename.startswith(os.path.join(_QUADS, "policies")):
            policies.append(code.co_qualname)
        if state["math"]:
            return
        if code.co_filename.startswith(_MATH):
            state["math"] = True
            calls.append("MATH")
        else:
            calls.append(code.co_qualname)

    with torch.no_grad():
        call()  # imports and first-use work done before counting
    sys.setprofile(profile)
    try:
        with torch.no_grad():
            call()
    finally:
        sys.setprofile(None)
    first_math = calls.index("MATH")
    return calls[:first_math], policies


def _rollout(kind, backend):
    m = build(kind)
    with quads.use_backend(backend):
        quads.quantize_(m, quads.QuadsPolicy(side="rollout", residual_fraction=0.5))
    return m.eval()


def _experts_call(model):
    experts = next(m for m in model.modules() if isinstance(m, RolloutExperts))
    g = torch.Generator().manual_seed(1)
    hid = torch.randn(3, 64, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3)])
    wts = torch.softmax(torch.randn(3, 2, generator=g), -1).bfloat16()
    return experts, lambda: experts(hid, idx, wts)


def _linear_call(model):
    linear = next(m for m in model.modules() if isinstance(m, RolloutLinear))
    x = torch.randn(2, linear.weight.shape[-1], generator=torch.Generator().manual_seed(2)).bfloat16()
    return linear, lambda: linear(x)


@pytest.mark.parametrize("backend", ["torch", "hopper"])
@pytest.mark.parametrize("what,most", [("linear", 6), ("experts", 8)])
def test_forward_reaches_the_math_in_few_calls(backend, what, most):
    model = _rollout("qwen3_moe", backend)
    module, call = (_linear_call if what == "linear" else _experts_call)(model)
    calls, policies = _path(module, call)
    hops = len(calls) + 1  # + the math's first call
    assert hops <= most, f"{hops} calls: {' > '.join(calls)} > the math"
    assert policies == [], f"called back up into quads/policies: {policies}"


@pytest.mark.parametrize("what", ["linear", "experts"])
def test_forward_reads_no_version(what, monkeypatch):
    """No forward polls the packed weights' versions (``NVFP4Tensor.parts_version``)."""
    model = _rollout("qwen3_moe", "torch")
    module, call = (_linear_call if what == "linear" else _experts_call)(model)
    polls = []
    real = NVFP4Tensor.parts_version
    monkeypatch.setattr(NVFP4Tensor, "parts_version", lambda self: polls.append(self) or real(self))
    with torch.no_grad():
        call()
        model(torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(3)))
    assert polls == []


def _logits(model, seed=4):
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("backend", ["torch", "hopper"])
def test_load_state_dict_refreshes_the_kernels(backend):
    """``load_state_dict`` copies into the packed parts in place; its post-load hook refreshes what
    is derived from them (the Hopper layout) and the next forward has the loaded model's bits."""
    model, other = _rollout("qwen3_moe", backend), build("qwen3_moe", seed=1)
    with quads.use_backend(backend):
        quads.quantize_(other, quads.QuadsPolicy(side="rollout", residual_fraction=0.5))
    before, want = _logits(model), _logits(other)
    assert not torch.equal(before, want)
    kernels = {n: m.quads_kernel() for n, m in quads.quantized_modules(model).items()}
    model.load_state_dict(other.state_dict())
    assert torch.equal(_logits(model), want)
    assert all(m.quads_kernel() is kernels[n] for n, m in quads.quantized_modules(model).items())  # refreshed in place


def test_a_write_bypassing_the_api_needs_the_refresh_call():
    """``module.weight.parts``' tensors written by hand: the Hopper layout the kernel reads is derived
    from them, so the forward keeps the old bits until ``quads_weights_changed()`` (documented)."""
    model, other = _rollout("qwen3_moe", "hopper"), _rollout("qwen3_moe", "hopper")
    linear = next(m for m in model.modules() if isinstance(m, RolloutLinear))
    donor = dict(other.named_modules())[next(n for n, m in model.named_modules() if m is linear)]
    with torch.no_grad():
        donor.weight.qdata.copy_(torch.flip(donor.weight.qdata, (0,)))
        donor.quads_weights_changed()
        x = torch.randn(3, linear.weight.shape[-1], generator=torch.Generator().manual_seed(5)).bfloat16()
        old, want = linear(x), donor(x)
        for mine, theirs in zip(linear.weight.parts, donor.weight.parts):
            mine.copy_(theirs)
        assert torch.equal(linear(x), old)  # nothing polled
        linear.quads_weights_changed()
        assert torch.equal(linear(x), want)


@pytest.mark.parametrize("backend", ["torch", "hopper"])
def test_a_device_move_refreshes_the_kernels(backend):
    """``.to()`` (here to the same device: ``_apply`` runs all the same) picks the backend again and refreshes."""
    model = _rollout("qwen3_moe", backend)
    want = _logits(model)
    model.to("cpu")
    assert torch.equal(_logits(model), want)
