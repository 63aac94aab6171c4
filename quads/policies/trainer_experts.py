"""The trainer's MoE experts through grouped GEMMs (the BF16 model's ``grouped_mm`` path).

transformers 5 runs fused experts with ``grouped_mm`` (``experts_implementation="grouped_mm"``):
the (token, choice) rows sorted by expert, one grouped GEMM for ``gate_up``, the gate, one for
``down``. The quads trainer does the same on the fake-quantized 3-D weights, so a QAT step costs
what a BF16 step costs instead of a Python loop over experts:

* the rows are grouped by :class:`~quads.ops.experts_op.Routing` (the order the rollout uses);
* each grouped GEMM is :class:`_FakeQuantGroupedMM`: forward ``x @ DQ(Q(W_e))^T`` per group;
  backward recomputes ``DQ(Q(W))`` from the master (with the saved global scales: no amax pass)
  instead of keeping the (E, N, K) forward weight alive between forward and backward, and
  passes the weight gradient straight through to the master;
* ``module.quads_keep_forward_weight = True`` (an option, off by default; measured by
  ``benchmarks/ops/bench_trainer.py``'s ``quads-keep`` variant) keeps the forward weight for the
  backward instead of recomputing it: one fused pass less per micro-step, a forward-weight copy
  of every expert alive from forward to backward (what the BF16 peer with BF16 expert casts
  keeps too);
* the combine is :func:`~quads.ops.experts_op.experts_loop`'s (flat row order, weighted sum over
  the k choices), so per row this computes what the per-expert loop computes (tested).

Dtypes follow F.linear under autocast (the loop's semantics): a float32 master under autocast
gives forward weights and GEMMs in the autocast dtype (transformers' own ``grouped_mm`` path
ignores autocast and multiplies float32 masters in float32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from quads.ops.backend_registry import Backend
from quads.ops.experts_op import Routing
from quads.policies.ste import fake_quantize_activation, fake_quantizer, forward_weight_dtype

__all__ = ["grouped_mm_available", "grouped_experts_forward"]


def _grouped_mm_fn():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


#: torch's grouped GEMM (or None), looked up once: the forward and backward call it every step
_GROUPED_MM = _grouped_mm_fn()


def grouped_mm_available(device: torch.device) -> bool:
    """torch has a grouped GEMM for this device (CUDA: sm_80+; CPU: torch >= 2.9's kernel)."""
    if _GROUPED_MM is None:
        return False
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_capability(index) >= (8, 0)
    return device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    """A CUDA device's compute capability (it never changes; the experts' forward asks every call)."""
    return torch.cuda.get_device_capability(index)


class _FakeQuantGroupedMM(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ DQ(Q(master))[e]^T``; ``ends`` (E,) int32 cumulative row
    counts. Saves ``x``, the master (a parameter: no new memory) and its (E,) global scales; with
    ``keep``, the forward weight instead (no recomputation in the backward)."""

    @staticmethod
    def forward(ctx, x, master, ends, backend: Backend, dtype: torch.dtype, keep: bool = False,
                block_scaling: str = "6"):
        quantize = fake_quantizer(backend)
        w, scale = quantize(master, dtype, None, block_scaling)
        y = _GROUPED_MM(x, w.transpose(-2, -1), offs=ends)
        ctx.save_for_backward(x, w if keep else master, scale, ends)
        ctx.state = (quantize, dtype, keep, master.dtype, block_scaling)  # one ctx attribute: host time per call
        return y

    @staticmethod
    def backward(ctx, grad):
        x, saved_w, scale, ends = ctx.saved_tensors
        quantize, dtype, keep, master_dtype, block_scaling = ctx.state
        grad = grad.contiguous()
        grad_x = grad_w = None
        needs = ctx.needs_input_grad
        if needs[0]:
            if keep:
                w = saved_w
            else:
                w, _ = quantize(saved_w, dtype, scale, block_scaling)  # the forward's bits again
            grad_x = _GROUPED_MM(grad, w, offs=ends)
        if needs[1]:  # straight through: d/dW of the forward weight, to the master
            # grad^T @ x per group gives (E, N, K) in the master's layout: a transposed result
            # ((x^T @ grad)^T) would reach AccumulateGrad non-contiguous and be copied again there
            # (a FP32 pass over every expert weight), which the BF16 peer's grouped_mm backward
            # does not pay
            grad_w = _GROUPED_MM(grad.t(), x, offs=ends).to(master_dtype)
        return grad_x, grad_w, None, None, None, None, None


def grouped_experts_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    apply_gate,
    backend: Backend,
) -> torch.Tensor:
    """A trainer experts module's forward with grouped GEMMs (no expert biases; activation
    quantization per row only: the caller falls back to the loop otherwise)."""
    act = module.quads_policy.activation_quant
    block_scaling = module.quads_policy.weight_block_scaling
    gate_up, down = module.gate_up_proj, module.down_proj
    dtype = forward_weight_dtype(gate_up)
    keep = bool(getattr(module, "quads_keep_forward_weight", False))
    num_tokens, hidden_dim = hidden.shape
    route = Routing(top_k_index, gate_up.shape[0])
    ends = route.offsets[1:].to(torch.int32)
    # rows routed to no expert (expert-parallel sentinels, sorted last) are skipped by the grouped
    # GEMMs, which leave them unwritten: zero them on the way in (their gradient too) and out.
    # Only an expert-parallel module gets sentinels (transformers sets ``_is_expert_parallel``
    # when it shards the experts and masks under the same condition); a module without the flag
    # is masked (safe); the others skip four passes over the (rows, hidden) activations
    outside = None
    positions = torch.arange(route.num_rows, device=hidden.device, dtype=route.order.dtype)  # also `inv`'s source
    if getattr(module, "_is_expert_parallel", True):
        outside = (positions >= route.offsets[-1]).unsqueeze(-1)
    x = hidden[route.token_of_row]
    if act is not None:
        x = fake_quantize_activation(x, act, backend)
    if x.dtype != dtype:  # (Tensor.to of the same dtype is a no-op, at a microsecond's dispatch)
        x = x.to(dtype)
    if outside is not None:
        x = x.masked_fill(outside, 0)
    h = _FakeQuantGroupedMM.apply(x, gate_up, ends, backend, dtype, keep, block_scaling)
    h = apply_gate(module, h)
    if act is not None:
        h = fake_quantize_activation(h, act, backend)
    y = _FakeQuantGroupedMM.apply(h if h.dtype == dtype else h.to(dtype), down, ends, backend, dtype, keep,
                                  block_scaling)
    if outside is not None:
        y = y.masked_fill(outside, 0)
    # back to the flat (token, choice) order: one gather each way (not zeros + index_copy)
    inv = torch.empty_like(route.order).scatter_(0, route.order, positions)
    out = _PermuteRows.apply(y if y.dtype == hidden.dtype else y.to(hidden.dtype), route.order, inv)
    weighted = out.view(num_tokens, route.top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


class _PermuteRows(torch.autograd.Function):
    """``out[order[i]] = src[i]`` (``order`` a permutation of the rows, ``inv`` its inverse) as a
    gather, and its backward as the gather by ``order``: exact, no atomics (``index_copy`` into
    zeros costs a zero fill and a copy of the result more; ``src[inv]``'s backward accumulates)."""

    @staticmethod
    def forward(ctx, src, order, inv):
        ctx.save_for_backward(order)
        return src.index_select(0, inv)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None
