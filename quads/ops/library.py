"""The rollout ops as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)`` and CUDA graphs.

Inside a compiled graph the quads modules call these ops (:mod:`quads.ops.functional` switches
when ``torch.compiler.is_compiling()``): each is opaque to the compiler, has a fake (meta)
implementation giving the output's shape and dtype, and runs the same backend method as the
eager path, so compiled and eager results are the same bits. No data-dependent Python control
flow reaches the graph (the reference experts loop, which synchronizes with the device, runs
inside the opaque op; on the GPU the grouped kernel has none).

Arguments are tensors and plain values (the backend by name, the activation quantizer as its
three fields, the Hopper layout as its two tensors and its logical shape). The ops' bodies
never share one activation quantization between sibling linears
(:mod:`quads.ops.activation_memo`: compiled code reuses buffers without version bumps).
"""

from __future__ import annotations

import torch

from quads.ops.activation_memo import sharing_suspended
from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend import get_backend
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["linear", "grouped_linear", "linear_op", "grouped_linear_op", "quantize_weight_op"]


def _act(quantize_activations: bool, residual_fraction: float, selection: str, granularity: str):
    return ActivationQuant(residual_fraction, selection, granularity) if quantize_activations else None


def _prepared(values, scales, n: int, k: int):
    if values is None:
        return None
    from quads.kernels.hopper_weight_layout import HopperWeight  # a kernel backend is in use: Triton is there

    return HopperWeight(values, scales, n, k)


@torch.library.custom_op("quads::linear", mutates_args=())
def linear_op(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    global_encode_scale: torch.Tensor,
    bias: torch.Tensor | None,
    prepared_values: torch.Tensor | None,
    prepared_scales: torch.Tensor | None,
    quantize_activations: bool,
    residual_fraction: float,
    selection: str,
    granularity: str,
    static_mask: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """(M, K) -> (M, N): the backend's rollout linear (W4A4 + residual, or W4A16)."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    with sharing_suspended():  # compiled code reuses buffers behind version counters' backs
        return get_backend(backend).linear(
            x, NVFP4Parts(qdata, scale, global_encode_scale), bias,
            _act(quantize_activations, residual_fraction, selection, granularity), static_mask,
            _prepared(prepared_values, prepared_scales, n, k),
        )


@linear_op.register_fake
def _(x, qdata, scale, global_encode_scale, bias, prepared_values, prepared_scales, quantize_activations,
      residual_fraction, selection, granularity, static_mask, backend):
    return x.new_empty(x.shape[0], qdata.shape[0])


@torch.library.custom_op("quads::grouped_linear", mutates_args=())
def grouped_linear_op(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    offsets: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    global_encode_scale: torch.Tensor,
    bias: torch.Tensor | None,
    prepared_values: torch.Tensor | None,
    prepared_scales: torch.Tensor | None,
    quantize_activations: bool,
    residual_fraction: float,
    selection: str,
    granularity: str,
    static_mask: torch.Tensor | None,
    num_rows: int,
    backend: str,
) -> torch.Tensor:
    """(num_rows, N): the backend's grouped expert linear (see :mod:`quads.ops.grouped_linear`)."""
    n, k = qdata.shape[1], qdata.shape[2] * 2
    with sharing_suspended():
        return get_backend(backend).grouped_linear(
            x, rows, offsets, NVFP4Parts(qdata, scale, global_encode_scale), bias,
            _act(quantize_activations, residual_fraction, selection, granularity), static_mask, num_rows,
            prepared=_prepared(prepared_values, prepared_scales, n, k),
        )


@grouped_linear_op.register_fake
def _(x, rows, offsets, qdata, scale, global_encode_scale, bias, prepared_values, prepared_scales,
      quantize_activations, residual_fraction, selection, granularity, static_mask, num_rows, backend):
    return x.new_empty(num_rows, qdata.shape[1])


@torch.library.custom_op("quads::quantize_weight", mutates_args=())
def quantize_weight_op(x: torch.Tensor, granularity: str, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight's NVFP4 parts (the sync op), through the backend (same bits on every backend)."""
    return tuple(get_backend(backend).quantize_weight(x, granularity))


@quantize_weight_op.register_fake
def _(x, granularity, backend):
    lead, k = x.shape[:-1], x.shape[-1]
    gs_shape = {"tensor": (), "expert": x.shape[:1], "row": lead}[granularity]
    return (x.new_empty(*lead, k // 2, dtype=torch.uint8), x.new_empty(*lead, k // 16, dtype=torch.float8_e4m3fn),
            x.new_empty(gs_shape, dtype=torch.float32))


def act_fields(act: ActivationQuant | None) -> tuple[bool, float, str, str]:
    """``ActivationQuant`` (or None: weight-only) as the ops' four plain arguments."""
    if act is None:
        return False, 0.0, "per_token", "row"
    return True, float(act.residual_fraction), act.selection, act.granularity


def prepared_fields(prepared) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if prepared is None else (prepared.values, prepared.scales)


def linear(backend, x2d, weight: NVFP4Parts, bias, act, static_mask=None, prepared=None) -> torch.Tensor:
    """``backend.linear``, through the custom op inside compiled graphs (same bits either way)."""
    if not torch.compiler.is_compiling():
        return backend.linear(x2d, weight, bias, act, static_mask, prepared)
    return torch.ops.quads.linear(x2d, weight.qdata, weight.scale, weight.global_encode_scale, bias,
                                  *prepared_fields(prepared), *act_fields(act), static_mask, backend.name)


def grouped_linear(backend, x, rows, offsets, weight: NVFP4Parts, bias, act, static_mask, num_rows,
                   prepared=None) -> torch.Tensor:
    """``backend.grouped_linear``, through the custom op inside compiled graphs."""
    if not torch.compiler.is_compiling():
        return backend.grouped_linear(x, rows, offsets, weight, bias, act, static_mask, num_rows, prepared=prepared)
    return torch.ops.quads.grouped_linear(x, rows, offsets, weight.qdata, weight.scale, weight.global_encode_scale,
                                          bias, *prepared_fields(prepared), *act_fields(act), static_mask, num_rows,
                                          backend.name)
