"""The vLLM layers' kernels are refreshed by the writes, never compared per forward: ``apply`` reads
none of the kernels' sources (parameters, layouts, backend) and runs no refresh, and a weight
reload (vLLM's: fresh parameters processed, their values copied into the original ones, which are
put back; or a plain re-process) takes effect with the same kernel objects.

Bare layers (``create_weights`` + ``process_weights_after_loading``, no engine); the Hopper
kernels under the Triton interpreter (tests/conftest.py). The engine-level push is
tests/vllm/test_weight_push.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import quads  # noqa: E402
import quads.integrations.vllm.quant_method as quant_method  # noqa: E402
from quads.integrations.vllm.quant_method import QuadsConfig, QuadsFusedMoEMethod, QuadsLinearMethod  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

#: what the kernels are made from: a forward reads none of them
SOURCES = {"weight", "weight_scale", "weight_global_scale", "w13_weight", "w13_weight_scale",
           "w13_weight_global_scale", "w2_weight", "w2_weight_scale", "w2_weight_global_scale", "quads_prepared",
           "quads_backend", "quads_siblings", "quads_storage"}
E, H, I = 4, 64, 32  # noqa: E741


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    """vLLM's parameters read the tensor-parallel rank (no engine here: rank 0 of 1)."""
    import vllm.model_executor.parameter as parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


class Layer(torch.nn.Module):
    """A bare layer that records which of the kernels' sources are read while ``counting``."""

    def __init__(self):
        super().__init__()
        self.counting, self.reads = False, []

    def __getattribute__(self, name):
        if name in SOURCES and object.__getattribute__(self, "counting"):
            object.__getattribute__(self, "reads").append(name)
        return super().__getattribute__(name)

    def __getattr__(self, name):  # parameters
        if name in SOURCES and self.__dict__.get("counting"):
            self.reads.append(name)
        return super().__getattr__(name)


def _weights(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "moe":
        return {"w13_weight": torch.randn(E, 2 * I, H, generator=g), "w2_weight": torch.randn(E, H, I, generator=g)}
    rows = (64, 64, 128) if kind == "merged" else (96,)
    return {"weight": torch.randn(sum(rows), H, generator=g) * 3}


def _layer(kind, backend, seed=0):
    layer = Layer()
    if kind == "moe":
        method = QuadsFusedMoEMethod.__new__(QuadsFusedMoEMethod)  # no engine: no FusedMoEConfig
        method.config, method._act_fn, method.moe = QuadsConfig(), F.silu, SimpleNamespace(has_bias=False)
        method.create_weights(layer, E, H, I, torch.bfloat16)
        layer.apply_router_weight_on_input = False
    else:
        method = QuadsLinearMethod(QuadsConfig())
        rows = [64, 64, 128] if kind == "merged" else [96]
        method.create_weights(layer, H, rows, H, sum(rows), torch.bfloat16, weight_loader=lambda *a, **k: None)
    _load(layer, method, _weights(kind, seed), backend)
    return method, layer


def _load(layer, method, weights, backend):
    with torch.no_grad():
        for name, value in weights.items():
            getattr(layer, name).copy_(value)
    with quads.use_backend(backend):
        method.process_weights_after_loading(layer)


def _apply(method, layer, kind):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    if kind != "moe":
        return method.apply(layer, x)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(3)])
    return method.apply(layer, x, torch.softmax(torch.randn(3, 2, generator=g), -1), ids)


def _kernels(method, layer):
    return method.experts_kernel(layer) if isinstance(method, QuadsFusedMoEMethod) else method.kernels(layer)


def _counting_refreshes(monkeypatch):
    calls = []
    real = quant_method._refresh_kernels
    monkeypatch.setattr(quant_method, "_refresh_kernels", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


KINDS = ["single", "merged", "moe"]


@pytest.mark.parametrize("backend", ["torch", "hopper"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_apply_compares_no_source(monkeypatch, kind, backend):
    """A forward is the kernel's apply: no source of the kernels read, no refresh run."""
    method, layer = _layer(kind, backend)
    refreshes = _counting_refreshes(monkeypatch)
    first = _apply(method, layer, kind)
    layer.counting = True
    for _ in range(3):
        assert torch.equal(_apply(method, layer, kind), first)
    layer.counting = False
    assert layer.reads == [] and refreshes == []
    _reprocess(layer, method, _weights(kind, 1), backend)  # the write refreshes (compares its sources), once
    assert len(refreshes) == 1


def _reprocess(layer, method, weights, backend):
    """New parameters in checkpoint form, processed; they stay (no reload machinery)."""
    for name, value in weights.items():
        layer.register_parameter(name, torch.nn.Parameter(value.to(torch.bfloat16), requires_grad=False))
    with quads.use_backend(backend):
        method.process_weights_after_loading(layer)


def _vllm_reload(layer, method, weights, backend):
    """What vLLM's layerwise reload does to a layer: fresh parameters in checkpoint form, loaded
    and processed, then their values copied into the original parameters, which are put back."""
    originals = dict(layer.named_parameters())
    _reprocess(layer, method, weights, backend)
    for name, param in originals.items():
        param.data.copy_(getattr(layer, name))
        delattr(layer, name)
        layer.register_parameter(name, param)


@pytest.mark.parametrize("restore", [True, False], ids=["vllm-reload", "reprocess"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_a_reload_takes_effect_with_the_same_kernels(kind, restore):
    """After a reload the layer computes what a layer loaded with the new weights computes, with
    the kernel objects it had (they read the parameters the reload wrote into)."""
    method, layer = _layer(kind, "hopper")
    kernels, before = _kernels(method, layer), _apply(method, layer, kind)
    fresh_method, fresh = _layer(kind, "hopper", seed=1)
    (_vllm_reload if restore else _reprocess)(layer, method, _weights(kind, 1), "hopper")
    after = _apply(method, layer, kind)
    assert not torch.equal(after, before)
    assert torch.equal(after, _apply(fresh_method, fresh, kind))
    assert _kernels(method, layer) is kernels
