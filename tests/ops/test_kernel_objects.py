"""Each rollout module's kernel object: input checks, a backend set by hand, third-party backends.

Kernels run under the Triton interpreter (tests/conftest.py)."""

import pytest
import torch
import torch.nn as nn

import quads
from quads.ops.backend_registry import Backend, LinearKernel, get_backend
from quads.ops.backends import HopperBackend
from quads.ops.experts_op import ExpertsKernel


def _rollout(backend: str, **policy) -> nn.Module:
    model = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    nn.init.normal_(model[0].weight, generator=g)
    nn.init.normal_(model[0].bias, generator=g)
    with quads.use_backend(backend):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout", **policy))
    return model


@pytest.mark.parametrize("backend", ["torch", "hopper"])
@pytest.mark.parametrize("activations", ["nvfp4", "bf16"])
def test_module_forward_refuses_a_wrong_k(backend, activations):
    model = _rollout(backend, activations=activations)
    assert model[0].quads_backend.name == backend
    assert model(torch.randn(3, 64, dtype=torch.bfloat16)).shape == (3, 32)
    for k in (80, 48):  # hopper's decode GEMM would read the first 64 columns of 80 silently
        with pytest.raises(ValueError, match=rf"K={k}, the weight has K=64"):
            model(torch.randn(3, k, dtype=torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "hopper"])
def test_experts_forward_refuses_a_wrong_hidden_size(backend):
    """Hopper's grouped GEMM would read only the first H columns of a wider input."""
    from tests.tiny_models import build

    model = build("qwen3_moe")
    with quads.use_backend(backend):
        quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    experts = model.model.layers[0].mlp.experts
    assert experts.quads_backend.name == backend
    idx, w = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    assert experts(torch.randn(3, 64, dtype=torch.bfloat16), idx, w).shape == (3, 64)
    for h in (80, 48):
        with pytest.raises(ValueError, match=rf"H={h}, the experts' weights have H=64"):
            experts(torch.randn(3, h, dtype=torch.bfloat16), idx, w)


def test_a_kernel_refuses_a_weight_that_is_not_2d_untransposed():
    model = _rollout("torch")
    w = model[0].weight
    from quads.ops.backend_registry import LinearArgs

    with pytest.raises(TypeError, match="2-D, untransposed"):
        get_backend("torch").linear_kernel(LinearArgs(w.t(), None))


@pytest.mark.parametrize("first,second", [("torch", "hopper"), ("hopper", "torch")])
def test_backend_set_by_hand_prepares_its_own_layout(first, second):
    """A backend set by hand is a write that bypasses the product API: it takes effect at the
    refresh call (``quads_weights_changed``), which prepares its layout and remakes the kernel."""
    x = torch.randn(5, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    model = _rollout(first)
    with torch.no_grad():
        model(x)  # a kernel made over the first backend's layout
        kernel = model[0].quads_kernel()
        model[0].quads_backend = get_backend(second)
        assert model[0].quads_kernel() is kernel  # nothing polled: the forward keeps its kernel until the refresh
        model[0].quads_weights_changed()
        got = model(x)
        want = _rollout(second)(x)
    assert type(model[0].quads_prepared[0]) is type(_rollout(second)[0].quads_prepared[0])
    assert torch.equal(got, want)


def test_a_backend_defining_linear_must_name_its_kernel_class():
    with pytest.raises(TypeError, match="linear_kernel_class"):
        class OnlyLinear(HopperBackend):  # noqa: F841
            name = "only-linear"

            def linear(self, x2d, weight, bias, act, static_mask=None, prepared=None, operands=None):
                raise AssertionError

    class WithKernel(HopperBackend):  # named: accepted
        name = "with-kernel"
        linear_kernel_class = LinearKernel

        def linear(self, x2d, weight, bias, act, static_mask=None, prepared=None, operands=None):
            raise AssertionError

    assert WithKernel.linear_kernel_class is LinearKernel


def test_a_backend_with_only_grouped_linear_runs_the_generic_experts_kernel():
    calls = []

    class GroupedOnly(Backend):
        name = "grouped-only"
        experts_kernel_class = ExpertsKernel

        def grouped_linear(self, x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared=None):
            calls.append(num_rows)
            return get_backend("torch").grouped_linear(x, rows, offsets, weight, bias, act, static_mask, num_rows)

    from quads.ops.backend_registry import LinearArgs

    kernel = GroupedOnly().experts_kernel(LinearArgs(None), LinearArgs(None))
    assert type(kernel) is ExpertsKernel


def test_each_backend_names_its_own_kernel_classes():
    """The base names none (no default set on it from elsewhere); a backend without a sibling
    kernel class serves no sibling set (a one-line error when one is made)."""
    from quads.ops.activation_quant import ActivationQuant
    from quads.ops.sibling_linear import SiblingSet

    assert Backend.experts_kernel_class is None and Backend.sibling_kernel_class is None
    for name in ("torch", "hopper", "blackwell"):
        backend = get_backend(name)
        assert backend.experts_kernel_class is not None and backend.sibling_kernel_class is not None, name

    class NoSiblings(Backend):
        name = "no-siblings"

    with pytest.raises(TypeError, match="'no-siblings' names no sibling_kernel_class"):
        SiblingSet(NoSiblings(), ActivationQuant(), [8, 8])
