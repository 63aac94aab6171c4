"""Straight-through fake quantization for the trainer side.

Forward: the NVFP4 round trip ``DQ(Q(w))``, computed by the recipe of
:mod:`quads.tensor.nvfp4_math` (torch backend) or by its fused kernel twin
(:mod:`quads.kernels.fake_quantize_nvfp4`, kernel backends): the same bits, so the rollout's
dequantized weight is the trainer's forward weight. Backward: the gradient passes to the master
unchanged (straight-through estimator). The Functions here save nothing for the backward.

**Dtype of the forward weight.** The master's dtype, except for a float32 master under autocast:
then the forward weight is written directly in the autocast dtype. That is the tensor autocast
would have made (``DQ`` in float32 rounded once to bfloat16/float16: the same bits), without the
float32 round trip through memory; F.linear then casts nothing.

**No cache.** The forward weight is recomputed in every forward (no :mod:`quads.ops.weight_cache`):
a version-keyed cache goes stale under fused AdamW and vLLM-style ``.data`` writes, and a cache
keyed on optimizer steps would keep a forward copy of every weight alive for the whole step
(bfloat16: half the float32 masters), against a recomputation that costs one read of the master
and one write (docs/trainer.md).

A custom autograd.Function, not ``w + (fq - w).detach()``: the latter re-rounds in BF16 and
would break bit-exact alignment.
"""

from __future__ import annotations

import torch

from quads.ops.activation_quant import (ActivationQuant, activation_operands_triton, dequantize_activation,
                                        quantize_activation)
from quads.ops.backend_registry import Backend, select_backend
from quads.ops.weight_quant import fake_quantize_weight_reference, fake_quantize_weight_triton
from quads.policies.shards import is_dtensor

__all__ = ["fake_quantize_weight", "fake_quantize_weight_parts", "fake_quantize_activation", "forward_weight_dtype",
           "fake_quantizer", "fake_quant_linear"]


def fake_quantizer(backend: Backend):
    """The weight fake quantizer a backend runs: the recipe (``torch``) or the fused kernel."""
    return fake_quantize_weight_reference if backend.name == "torch" else fake_quantize_weight_triton


def forward_weight_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of the forward weight: the autocast dtype for a float32 master under autocast on
    its device (what F.linear would cast it to), else the master's dtype."""
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


class _FakeQuantWeightSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, backend: Backend, dtype: torch.dtype, global_scale: torch.Tensor | None,
                block_scaling: str):
        ctx.master_dtype = weight.dtype
        out, scale = fake_quantizer(backend)(weight, dtype, global_scale, block_scaling)
        ctx.mark_non_differentiable(scale)
        return out, scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_scale):
        return grad.to(ctx.master_dtype), None, None, None, None


class _FakeQuantLinear(torch.autograd.Function):
    """``F.linear(x, DQ(Q(w)), b)`` with the operands in ``dtype`` (F.linear's autocast casts),
    saving ``x`` (in ``dtype``, as F.linear under autocast saves it), the master (a parameter: no
    new memory) and its global scale: the backward recomputes the forward weight instead of
    keeping it alive; the weight gradient goes straight through to the master.

    Host time matters here (the GPU waits for it when the step is host-bound): the
    casts are skipped where the dtype already matches (``Tensor.to`` of the same dtype returns the
    tensor, at a microsecond's dispatch), and the backward's non-tensor state is one ``ctx``
    attribute (the quantizer, not the backend: no lookup per backward)."""

    @staticmethod
    def forward(ctx, x, master, bias, backend: Backend, dtype: torch.dtype, global_scale: torch.Tensor | None,
                block_scaling: str):
        quantize = fake_quantizer(backend)
        w, scale = quantize(master, dtype, global_scale, block_scaling)
        x_dtype, bias_dtype = x.dtype, None if bias is None else bias.dtype
        x2 = x.reshape(-1, x.shape[-1])
        if x_dtype != dtype:
            x2 = x2.to(dtype)
        if bias_dtype is not None and bias_dtype != dtype:
            bias = bias.to(dtype)
        y = torch.nn.functional.linear(x2, w, bias)
        ctx.save_for_backward(x2, master, scale)
        ctx.state = (quantize, dtype, x_dtype, bias_dtype, block_scaling)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, master, scale = ctx.saved_tensors
        quantize, dtype, x_dtype, bias_dtype, block_scaling = ctx.state
        g2 = grad.reshape(-1, grad.shape[-1])
        if g2.dtype != dtype:
            g2 = g2.to(dtype)
        grad_x = grad_w = grad_b = None
        needs = ctx.needs_input_grad
        if needs[0]:
            w, _ = quantize(master, dtype, scale, block_scaling)  # the forward's bits again
            grad_x = g2.mm(w).reshape(*grad.shape[:-1], w.shape[-1]).to(x_dtype)
        if needs[1]:
            grad_w = g2.t().mm(x2).to(master.dtype)
        if bias_dtype is not None and needs[2]:
            grad_b = g2.sum(0).to(bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class _FakeQuantActivationSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, config: ActivationQuant, backend: Backend):
        x2 = x.reshape(-1, x.shape[-1])
        if backend.name == "torch" or config.selection == "static":
            out = dequantize_activation(quantize_activation(x2, config, backend=backend))
        else:
            # the kernel writes e2m1 * f32(scale) (exact in fp16); dividing by the rows' S_enc in
            # float32 is the reference's dequantization, bit for bit
            ops = activation_operands_triton(x2, config)
            scale = ops.main_scale.reshape(-1, 1)
            out = ops.main.float() / scale
            if ops.residual is not None:
                out = out + ops.residual.float() / scale
        return out.to(x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def _check_whole(weight: torch.Tensor) -> None:
    if is_dtensor(weight):
        raise RuntimeError(
            f"quads trainer layer got a distributed (DTensor) weight of shape {tuple(weight.shape)} with "
            f"placements {tuple(weight.placements)}: NVFP4 fake quantization needs the whole weight for its "
            "global scale. Under FSDP2, call the model through its fully_shard root (which unshards "
            "parameters before each forward); tensor-parallel quads trainer layers are not supported."
        )


def fake_quantize_weight_parts(
    weight: torch.Tensor, backend: Backend | None = None, dtype: torch.dtype | None = None,
    global_encode_scale: torch.Tensor | None = None, block_scaling: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(forward weight, global encode scale)``: :func:`fake_quantize_weight` plus the scale
    (``()`` or ``(E,)``), which lets a backward recompute the forward weight without an amax."""
    _check_whole(weight)
    backend = backend or select_backend(weight.device)
    return _FakeQuantWeightSTE.apply(weight, backend, dtype or forward_weight_dtype(weight), global_encode_scale,
                                     block_scaling)


def fake_quantize_weight(
    weight: torch.Tensor, backend: Backend | None = None, dtype: torch.dtype | None = None,
    global_encode_scale: torch.Tensor | None = None, block_scaling: str = "6",
) -> torch.Tensor:
    """NVFP4 fake-quant of a 2-D weight (one global scale) or 3-D experts (one per expert),
    straight-through; in ``dtype`` (default :func:`forward_weight_dtype`), by ``backend`` (default:
    :func:`~quads.ops.select_backend` for the weight's device; trainer modules pass the one they
    stored).

    ``weight`` must be the whole weight: under FSDP2 it is (``fully_shard`` unshards parameters
    into plain tensors before a module's forward). A DTensor here means a module was called
    outside its FSDP root's forward, or a tensor-parallel weight: its global scale would need a
    collective the forward must not issue, so this refuses. ``global_encode_scale``: quantize
    with this ``S_enc`` (a sibling group's: ``Backend.group_scale``, whose kernel form is the
    group's amax bits) instead of the weight's own. ``block_scaling``: ``"6"`` or ``"4over6"``
    (``QuadsPolicy.weight_block_scaling``).
    """
    return fake_quantize_weight_parts(weight, backend, dtype, global_encode_scale, block_scaling)[0]


def fake_quant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: Backend | None = None,
    global_encode_scale: torch.Tensor | None = None, block_scaling: str = "6",
) -> torch.Tensor:
    """``F.linear(x, fake_quantize_weight(weight), bias)`` (same values and gradients) without
    keeping the forward weight alive for the backward: a transient, recomputed there.
    ``global_encode_scale`` (shape ``()``): quantize with this ``S_enc`` instead of the weight's
    own, e.g. its sibling group's (:mod:`quads.policies.scale_groups`; on kernel backends given
    as the group's amax bits, ``Backend.group_scale``: the fused pass derives ``S_enc``, and the
    backward reuses the ``S_enc`` it returned)."""
    _check_whole(weight)
    device_type = weight.device.type
    w_dtype = weight.dtype
    if torch.is_autocast_enabled(device_type):  # forward_weight_dtype's rule, autocast looked up once
        dtype = torch.get_autocast_dtype(device_type) if w_dtype == torch.float32 else w_dtype
    else:  # F.linear's rule: no implicit casts
        dtype = w_dtype
        if x.dtype != w_dtype:
            raise TypeError(f"quads trainer linear: input dtype {x.dtype} differs from the weight's {w_dtype}")
        if bias is not None and bias.dtype != w_dtype:
            raise TypeError(f"quads trainer linear: bias dtype {bias.dtype} differs from the weight's {w_dtype}")
    return _FakeQuantLinear.apply(x, weight, bias, backend or select_backend(weight.device), dtype, global_encode_scale,
                                  block_scaling)


def fake_quantize_activation(x: torch.Tensor, config: ActivationQuant, backend: Backend | None = None) -> torch.Tensor:
    """NVFP4 fake-quant of activations (symmetric-QAT ablation), straight-through; the Triton row
    quantizer on kernel backends, the reference on ``torch`` (same bits)."""
    return _FakeQuantActivationSTE.apply(x, config, backend or select_backend(x.device))
