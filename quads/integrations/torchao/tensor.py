"""Conversions between ``quads.NVFP4Tensor`` and torchao's ``NVFP4Tensor`` (torchao 0.18).

Both store the same two packed parts: ``qdata`` uint8 ``(..., K/2)`` with the even element in
the low nibble, and ``scale`` float8_e4m3fn ``(..., K/16)`` (torchao optionally swizzled). The
global scale is the one difference in layout: quads keeps the *encode* scale
``S_enc = 448*6/amax`` (one per tensor, or per expert of a 3-D weight) and dequantizes with
``e2m1 * s / S_enc``; torchao keeps the *decode* scale ``per_tensor_scale = amax/(448*6)``
(shape ``()`` or ``(E, 1, 1)``) and dequantizes with ``e2m1 * (per_tensor_scale * s)``.

The conversions move the parts unchanged (shared storage, no copy) and the global scale as
its float32 reciprocal. What agrees and what does not (``tests/integrations/test_torchao.py`` shows each):

* **Packed parts**: always carried over bit for bit, both ways.
* **Global scale**: ``from_torchao_nvfp4(to_torchao_nvfp4(t))`` gives back ``S_enc`` exactly only
  when ``1/(1/S_enc)`` rounds back to ``S_enc`` in float32 (always for a power of two; about
  89% of random amaxes); otherwise it is one ulp off.
* **Dequantized values of the same parts** differ unless ``S_enc`` is a power of two: torchao
  rounds ``per_tensor_scale * s`` before multiplying by the E2M1 value, quads divides the exact
  product ``e2m1 * s`` by ``S_enc``; in float32 they differ by about an ulp in 3-59% of the
  elements of a random weight (docs/ecosystem.md). The trainer's forward weight is quads' value.
* **Quantizing the same tensor** (``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=amax/2688)`` vs
  ``quads.NVFP4Tensor.from_float(x)``): the parts are equal with a power-of-two ``S_enc`` and
  every block scale above ``2**-6``; otherwise a few differ (why and how many: docs/ecosystem.md).

quads' per-row global scales (activations) have no torchao weight counterpart and are refused.
"""

from __future__ import annotations

import math

import torch

from quads.tensor.nvfp4_math import BLOCK_SIZE
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["from_torchao_nvfp4", "to_torchao_nvfp4"]


def _torchao_nvfp4_class():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as TorchaoNVFP4Tensor

    return TorchaoNVFP4Tensor


def to_torchao_nvfp4(t: NVFP4Tensor):
    """The torchao ``NVFP4Tensor`` holding ``t``'s packed parts (shared) and ``1/S_enc``.

    2-D weights get a scalar ``per_tensor_scale``; 3-D expert weights one per expert
    ``(E, 1, 1)``. Scales are plain (not swizzled). ``t`` must not be a transposed view.
    """
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"to_torchao_nvfp4 takes a quads.NVFP4Tensor, got {type(t).__name__}")
    if t.transposed:
        raise NotImplementedError("to_torchao_nvfp4: convert the weight itself, not a transposed view of it")
    gs = t.global_encode_scale.to(torch.float32)
    dims = t.qdata.dim()
    if gs.dim() == 0:
        per_tensor = torch.ones((), dtype=torch.float32, device=gs.device) / gs
        if dims == 3:  # torchao's 3-D tensors carry one scale per expert
            per_tensor = per_tensor.expand(t.qdata.shape[0]).reshape(-1, 1, 1).clone()
    elif dims == 3 and tuple(gs.shape) == tuple(t.qdata.shape[:1]):
        per_tensor = (torch.ones_like(gs) / gs).reshape(-1, 1, 1)
    else:
        raise NotImplementedError(
            f"to_torchao_nvfp4: global scales of shape {tuple(gs.shape)} (per row) have no torchao weight layout"
        )
    cls = _torchao_nvfp4_class()
    return cls(t.qdata, t.scale, BLOCK_SIZE, t.orig_dtype, per_tensor_scale=per_tensor, is_swizzled_scales=False)


def _plain_scale(ao) -> torch.Tensor:
    """torchao's block scales in quads' plain (..., rows, K/16) layout."""
    lead, rows, k = tuple(ao.shape[:-2]), ao.shape[-2], ao.shape[-1]
    if not ao.is_swizzled_scales:
        return ao.scale.reshape(*lead, rows, k // BLOCK_SIZE)
    from torchao.prototype.mx_formats.utils import from_blocked

    plain = from_blocked(ao.scale.reshape(-1), math.prod(lead) * rows, k // BLOCK_SIZE)
    return plain.reshape(*lead, rows, k // BLOCK_SIZE).contiguous()


def from_torchao_nvfp4(ao) -> NVFP4Tensor:
    """The quads ``NVFP4Tensor`` of a torchao ``NVFP4Tensor`` (weight parts only).

    ``S_enc = 1/per_tensor_scale`` (1 without a per-tensor scale, torchao's single-level
    scaling); swizzled scales are unswizzled. Activation settings of the torchao tensor
    (``act_per_tensor_scale``, ``act_quant_kwargs``) are not part of a quads weight and are dropped.
    """
    cls = _torchao_nvfp4_class()
    if not isinstance(ao, cls):
        raise TypeError(f"from_torchao_nvfp4 takes a torchao NVFP4Tensor, got {type(ao).__name__}")
    if ao.block_size != BLOCK_SIZE:
        raise ValueError(f"from_torchao_nvfp4: block size {ao.block_size}, NVFP4 needs {BLOCK_SIZE}")
    if ao.qdata.dim() not in (2, 3) or ao.qdata.stride(-2) < ao.qdata.stride(-1):
        raise NotImplementedError("from_torchao_nvfp4: convert a 2-D or 3-D weight, not a transposed view of it")
    qdata = ao.qdata.view(torch.uint8)
    scale = _plain_scale(ao)
    p = ao.per_tensor_scale
    if p is None:
        shape = qdata.shape[:1] if qdata.dim() == 3 else ()
        gs = torch.ones(shape, dtype=torch.float32, device=qdata.device)
    else:
        p = p.to(torch.float32)
        if not bool(torch.isfinite(p).all()) or not bool((p > 0).all()):
            raise ValueError(f"from_torchao_nvfp4: per_tensor_scale must be finite and > 0, got {p.flatten()[:4].tolist()}")
        gs = torch.ones_like(p) / p
        gs = gs.reshape(-1) if qdata.dim() == 3 else gs.reshape(())
        if qdata.dim() == 3 and gs.numel() == 1:
            gs = gs.expand(qdata.shape[0]).clone()
    return NVFP4Tensor(qdata, scale, gs, ao.orig_dtype)
