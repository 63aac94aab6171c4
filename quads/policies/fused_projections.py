"""Sibling rollout projections served by one stacked decode GEMM (``fuse_projections_``).

In a transformers decoder layer ``q_proj``, ``k_proj`` and ``v_proj`` read the same hidden
states, and so do ``gate_proj`` and ``up_proj``. :func:`fuse_projections_` groups such rollout
linears (Hopper backend, W4A4, no bias, no calibrated mask, rows a multiple of 64) and gives
each group one Hopper layout of the stacked weights: each member's own layout is a view into it,
so ``quantize_``/``sync_weights_`` keep writing the members' layouts in place (CUDA graphs keep
their addresses) and the group's stays current with no extra copy. The members' global scales
are mirrored into one per-row scale vector at every weight write.

The first member called with an input runs :func:`quads.ops.stacked_linear.stacked_linear_hopper`
(one activation quantization, one GEMM) and keeps the other members' outputs; each of them,
called next with the same input (same storage, shape, strides, dtype and, outside inference
mode, version counter), takes its output once. Any other call computes as before, alone, so a
member's result never depends on whether its siblings ran: every column has its own linear's
bits. Many-token calls (prefill) and traced (compiled) code always run each member alone.
The one assumption (as every fused-QKV engine makes): an inference-mode input is not written in
place between its siblings' calls (inference tensors have no version counter to check it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from typing import TYPE_CHECKING

from quads.ops.stacked_linear import stacked_fits_decode, stacked_linear_hopper

if TYPE_CHECKING:  # the kernels import Triton: only the Hopper backend, which fusing requires, loads them
    from quads.kernels.hopper_weight_layout import HopperWeight


def _hopper_weight():
    from quads.kernels.hopper_weight_layout import HopperWeight

    return HopperWeight

__all__ = ["SIBLING_PROJECTIONS", "ProjectionGroup", "fuse_projections_", "unfuse_projections_"]

#: child-name sets of one module that read the same input (transformers decoder layers)
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _input_key(x: torch.Tensor) -> tuple:
    version = None if x.is_inference() else x._version
    return (x.data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device, version)


class ProjectionGroup:
    """Rollout linears reading one input, their stacked Hopper layout and per-row scales."""

    def __init__(self, members: list[nn.Module]):
        first = members[0]
        self.members = members
        self.act = first.quads_act
        k = first.weight.shape[-1]
        sizes = [m.weight.shape[0] for m in members]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        held = first.quads_prepared[0]
        n = self.offsets[-1]
        HopperWeight = _hopper_weight()
        self.prepared = HopperWeight(
            torch.empty((n // 16, *held.values.shape[1:]), dtype=torch.uint8, device=held.values.device),
            torch.empty((n // 16, *held.scales.shape[1:]), dtype=torch.uint8, device=held.scales.device), n, k)
        self.row_scales = torch.empty(n, dtype=torch.float32, device=held.values.device)
        self._pending: tuple | None = None  # (input key, input alias, outputs, members not served yet)
        for i, m in enumerate(members):
            m.quads_group, m.quads_group_index = self, i
            view = self.member_view(i)
            view.values.copy_(m.quads_prepared[0].values)
            view.scales.copy_(m.quads_prepared[0].scales)
            m.quads_prepared = (view,)  # later weight writes land in the stacked layout directly
            self.write_scales(i)

    def member_view(self, i: int) -> HopperWeight:
        lo, hi = self.offsets[i] // 16, self.offsets[i + 1] // 16
        return _hopper_weight()(self.prepared.values[lo:hi], self.prepared.scales[lo:hi],
                            self.offsets[i + 1] - self.offsets[i], self.prepared.k)

    def write_scales(self, i: int) -> None:
        """Mirror member ``i``'s global weight scale into its rows of the per-row vector."""
        gs = self.members[i].weight.parts.global_encode_scale
        self.row_scales[self.offsets[i]:self.offsets[i + 1]].copy_(gs.reshape(1).float().expand(self.offsets[i + 1]
                                                                                                 - self.offsets[i]))

    def holds(self, i: int, prepared: HopperWeight) -> bool:
        return prepared.values.data_ptr() == self.member_view(i).values.data_ptr()

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``i``'s output through the group, or None (the member computes alone)."""
        x2 = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling() or not stacked_fits_decode(x2.shape[0]):
            return None
        key = _input_key(x)
        pending = self._pending
        if pending is not None and pending[0] == key and i in pending[3]:
            pending[3].discard(i)
            if not pending[3]:
                self._pending = None
            return pending[2][i]
        for m in self.members:  # weights written in place since (load_state_dict) are re-laid out first
            m.quads_prepared_weights()
        if self.members[i].quads_group is not self:  # that refresh dissolved the group
            return None
        y = stacked_linear_hopper(x2, self.prepared, self.row_scales, self.act)
        outs = [y[:, self.offsets[j]:self.offsets[j + 1]].reshape(*x.shape[:-1], -1) for j in range(len(self.members))]
        rest = set(range(len(self.members))) - {i}
        self._pending = (key, x.detach(), outs, rest) if rest else None  # the alias keeps the storage alive
        return outs[i]

    def dissolve(self) -> None:
        """Members compute alone again (each gets its own layout back)."""
        self._pending = None
        for m in self.members:
            view = m.quads_prepared[0]
            m.quads_prepared = (_hopper_weight()(view.values.clone(), view.scales.clone(), view.n, view.k),)
            del m.quads_group, m.quads_group_index


def _fusable(modules: list[nn.Module]) -> bool:
    from quads.policies.modules import RolloutLinear

    if not all(isinstance(m, RolloutLinear) and m.quads_backend.name == "hopper" for m in modules):
        return False
    from quads.kernels.hopper_weight_layout import ROW_PAD, HopperWeight  # the Hopper backend: Triton is there

    first = modules[0]
    act = first.quads_act
    return (act is not None and all(
        getattr(m, "quads_group", None) is None and m.quads_backend.name == "hopper" and m.bias is None
        and m.quads_static_mask is None and m.quads_act == act and m.weight.shape[-1] == first.weight.shape[-1]
        and m.weight.shape[0] % ROW_PAD == 0 and m.weight.device == first.weight.device
        and isinstance(m.quads_prepared[0], HopperWeight) for m in modules))


def fuse_projections_(model: nn.Module) -> int:
    """Group the sibling projections of every module of ``model`` (see module doc); returns the
    number of groups. Modules that do not qualify (not rollout W4A4 on the Hopper backend, a
    bias, a calibrated residual mask, rows not a multiple of 64) are left as they are."""
    groups = 0
    for parent in model.modules():
        for names in SIBLING_PROJECTIONS:
            members = [getattr(parent, n, None) for n in names]
            if all(m is not None for m in members) and _fusable(members):
                ProjectionGroup(members)
                groups += 1
    return groups


def unfuse_projections_(model: nn.Module) -> int:
    """Undo :func:`fuse_projections_`; returns the number of groups dissolved."""
    seen = {id(m.quads_group): m.quads_group for m in model.modules() if getattr(m, "quads_group", None) is not None}
    for g in seen.values():
        g.dissolve()
    return len(seen)
