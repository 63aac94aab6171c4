"""vLLM merged layers (``qkv_proj``, ``gate_up_proj``) under the quads method: one SiblingSet, the
kernels made at loading (not per forward), one stacked GEMM on the Hopper backend with each
shard's own bits, and a vLLM-style reload (fresh parameters processed, the originals put back).

Runs on a bare layer (``create_weights`` + ``process_weights_after_loading``, no engine); the
Hopper kernels under the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import quads  # noqa: E402
import quads.kernels.hopper.w4a4_decode as w4a4_decode  # noqa: E402
from quads.integrations.vllm.quant_method import QuadsConfig, QuadsLinearMethod, shard_linear  # noqa: E402
from quads.ops.backend_registry import LinearKernel, get_backend  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

SIZES = (64, 64, 128)  # q, k, v rows: multiples of 64 (the stacked layout's row tile)


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    """vLLM's parameters read the tensor-parallel rank (no engine here: rank 0 of 1)."""
    import vllm.model_executor.parameter as parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


def _load(layer, method, weight, backend):
    with torch.no_grad():
        layer.weight.copy_(weight)
    with quads.use_backend(backend):
        method.process_weights_after_loading(layer)


def _layer(backend="hopper", mode="group", seed=0):
    method = QuadsLinearMethod(QuadsConfig(weight_global_scale=mode))
    layer = torch.nn.Module()
    method.create_weights(layer, 64, list(SIZES), 64, sum(SIZES), torch.bfloat16, weight_loader=lambda *a, **k: None)
    _load(layer, method, _weight(seed), backend)
    return method, layer


def _weight(seed):
    return (torch.randn(sum(SIZES), 64, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)


def _per_shard(method, layer, x, bias=None):
    """Each shard's own kernel on the shared operands (the bits of one linear per shard)."""
    return shard_linear(x, method.shards(layer), bias, method.config.activation_quant, layer.quads_backend)


def _counting(monkeypatch, module, name):
    calls, inside = [0], [False]
    real = getattr(module, name)

    def counted(*args, **kwargs):  # outermost calls only (the interpreter's decode calls itself for bf16)
        if inside[0]:
            return real(*args, **kwargs)
        calls[0], inside[0] = calls[0] + 1, True
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("mode", ["group", "tensor"])
@torch.no_grad()
def test_one_stacked_gemm_with_each_shards_bits(monkeypatch, mode):
    method, layer = _layer(mode=mode)
    assert layer.quads_siblings.stacked is not None
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want, want_biased = _per_shard(method, layer, x), _per_shard(method, layer, x, bias)
    calls = _counting(monkeypatch, w4a4_decode, "decode_gemm")
    got = method.apply(layer, x)
    assert calls[0] == 1 and got.shape == (2, 3, sum(SIZES)) and torch.equal(got, want)
    assert torch.equal(method.apply(layer, x, bias), want_biased)  # biased: each shard's kernel, its bias
    assert calls[0] == 1 + len(SIZES)
    monkeypatch.setattr(w4a4_decode, "max_decode_columns", lambda: 0)  # prefill: each shard's GEMM
    assert torch.equal(method.apply(layer, x), _per_shard(method, layer, x))


@pytest.mark.parametrize("backend", ["torch", "hopper"])
@torch.no_grad()
def test_kernels_are_made_at_loading_not_per_forward(monkeypatch, backend):
    method, layer = _layer(backend)
    kernels = method.kernels(layer)
    made = [0]
    real_init = LinearKernel.__init__

    def counted(self, *args, **kwargs):
        made[0] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LinearKernel, "__init__", counted)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    first = method.apply(layer, x)
    assert torch.equal(method.apply(layer, x), first)
    assert made[0] == 0 and method.kernels(layer) is kernels
    assert kernels[1] is layer.quads_siblings.kernel()


@torch.no_grad()
def test_reload_writes_the_stacked_layout_in_place_and_keeps_the_kernels(monkeypatch):
    """vLLM's reload: fresh parameters are loaded and processed, their values copied into the
    original ones, which are put back; the kernels made at loading read the originals, the new values."""
    method, layer = _layer()
    kernels = method.kernels(layer)
    stacked_ptr = layer.quads_siblings.stacked.values.data_ptr()
    originals = {n: p for n, p in layer.named_parameters()}
    layer.register_parameter("weight", torch.nn.Parameter(_weight(seed=5), requires_grad=False))
    with quads.use_backend("hopper"):
        method.process_weights_after_loading(layer)
    for name, param in originals.items():
        param.data.copy_(getattr(layer, name))
        delattr(layer, name)
        layer.register_parameter(name, param)
    assert layer.quads_siblings.stacked.values.data_ptr() == stacked_ptr
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    fresh_method, fresh = _layer(seed=5)
    got = method.apply(layer, x)
    assert torch.equal(got, fresh_method.apply(fresh, x))
    assert method.kernels(layer) is kernels
    assert all(k.args.weight.qdata.data_ptr() == layer.weight.data_ptr() + i
               for k, i in zip(kernels[0], (0, 64 * 32, 128 * 32)))  # the restored parameters' rows
    assert get_backend("hopper") is layer.quads_backend
