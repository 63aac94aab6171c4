"""Sibling linears reading one input: one activation quantization, one stacked GEMM where possible.

``q_proj``/``k_proj``/``v_proj`` read the same hidden states, and so do ``gate_proj``/``up_proj``
(a vLLM merged layer holds them as shards of one weight): quantized one by one that is 7
activation quantizations per layer where 4 inputs exist, and few-token GEMMs are launch-bound.

A :class:`SiblingGroup` serves such linears, called one by one (:meth:`~SiblingGroup.forward`):
the first member called with an input computes the backend's ``activation_operands`` once, then
every member's output: one stacked GEMM over the members' weights (each row keeping its weight's
global scale) where the backend has one (few tokens, no biases), else each member's kernel on the
shared operands (every output column has its own linear's bits); each other member, called next with the same input tensor (same
storage, offset, shape, strides, dtype and version counter), takes its output once; any other
call returns None (the member computes alone), so a result never depends on whether its
siblings ran.

Never shared: inference-mode tensors (no version counter), tensor subclasses, meta tensors, code
traced by ``torch.compile`` (compiled code reuses buffers without version bumps). Writes that
bypass the dispatcher are invisible to the check (transformers' decoder layers have none between
siblings). Inside a CUDA-graph capture the hit is decided at capture time: replays recompute.

Groups are made by :func:`quads.fuse_projections_` (stacked) and by the graphed decoder (dormant
groups switched on inside its forwards). Members are any objects with ``quads_sibling_inputs()``
returning ``(LinearKernel, bias)`` and ``quads_group``/``quads_group_index``. Also here: the
stacked GEMM's reference and its Hopper glue.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend, LinearKernel
from quads.ops.linear import hopper_operands, linear_reference
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["SiblingGroup", "enabled_groups", "stacked_linear_reference", "stacked_linear_hopper",
           "stack_prepared_hopper", "stacked_fits_hopper"]


def _input_key(x: torch.Tensor) -> tuple | None:
    """Identity of an input tensor (None: never shared, see the module doc)."""
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_inference() or x.device.type == "meta":
        return None
    return (x.untyped_storage()._cdata, x.data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()),
            x.dtype, x.device, x._version)


class SiblingGroup:
    """Linears of one backend and one activation configuration reading one input (module doc).

    ``sizes``: the members' output rows; ``members``: the modules served one by one; ``enabled``:
    whether :meth:`forward` serves (dormant groups are switched on by :func:`enabled_groups`)."""

    def __init__(self, backend: Backend, act: ActivationQuant | None, sizes: Sequence[int],
                 members: Sequence = (), enabled: bool = True):
        self.backend, self.act, self.enabled = backend, act, enabled
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.members = list(members)
        self.stacked = None  # the stacked weights as the backend's stacked GEMM reads them
        self.views: list = []  # member i's prepared weight: a view into ``stacked``
        self.row_scales: torch.Tensor | None = None  # (N,) fp32: each output row's weight global scale
        self._pending: tuple | None = None  # (input key, input alias, outputs, members not served yet)
        for i, m in enumerate(self.members):
            m.quads_group, m.quads_group_index = self, i

    # -- the stacked layout ----------------------------------------------------------------------

    def stack(self, prepared: Sequence, global_scales: Sequence[torch.Tensor]) -> list | None:
        """Build the stacked layout from the members' prepared weights (copied in) and return
        the members' views of it (their prepared weights from now on, written in place by every
        sync), or None where the backend has no stacked GEMM for them."""
        if self.act is None or len(prepared) < 2:
            return None
        made = self.backend.stack_prepared(prepared)
        if made is None:
            return None
        self.stacked, self.views = made
        self.row_scales = torch.empty(self.offsets[-1], dtype=torch.float32, device=global_scales[0].device)
        for i, gs in enumerate(global_scales):
            self.write_scale(i, gs)
        return self.views

    def write_scale(self, i: int, global_encode_scale: torch.Tensor) -> None:
        """Mirror member ``i``'s weight global scale into its rows of the per-row vector."""
        if self.row_scales is not None:
            lo, hi = self.offsets[i], self.offsets[i + 1]
            self.row_scales[lo:hi].copy_(global_encode_scale.reshape(1).float().expand(hi - lo))

    def holds(self, i: int, prepared) -> bool:
        """Whether ``prepared`` is still member ``i``'s view of the stacked layout (a sync wrote it
        in place) or the group has no stacked layout."""
        if self.stacked is None:
            return True
        return prepared is not None and prepared.values.data_ptr() == self.views[i].values.data_ptr()

    # -- outputs ---------------------------------------------------------------------------------

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``i``'s output through the group, or None (the member computes alone)."""
        if not self.enabled:
            return None
        key = _input_key(x)
        if key is None:
            return None
        pending = self._pending
        if pending is not None and pending[0] == key and i in pending[3]:
            pending[3].discard(i)
            if not pending[3]:
                self._pending = None
            return pending[2][i]
        inputs = [m.quads_sibling_inputs() for m in self.members]  # re-lays out weights written since
        if any(m.quads_group is not self for m in self.members):  # that refresh dissolved the group
            return None
        # every member's output: one quantization, then the stacked GEMM (no biases, few tokens) or
        # each member's kernel on the shared operands
        kernels, biases = zip(*inputs)
        backend, act, x2 = self.backend, self.act, x.reshape(-1, x.shape[-1])
        operands = backend.activation_operands(x2, act)
        if (self.stacked is not None and all(b is None for b in biases)
                and backend.stacked_fits(x2.shape[0], act)):
            y = backend.stacked_linear(x2, self.stacked, self.row_scales, act, operands)
            outs = [y[:, self.offsets[j]:self.offsets[j + 1]] for j in range(len(kernels))]
        else:
            outs = [k.apply(x2, b, operands) for k, b in zip(kernels, biases)]
        outs = [y.reshape(*x.shape[:-1], -1) for y in outs]
        rest = set(range(len(self.members))) - {i}
        self._pending = (key, x.detach(), outs, rest) if rest else None  # the alias keeps the storage alive
        return outs[i]

    def drop_pending(self) -> None:
        self._pending = None

    def dissolve(self) -> None:
        """Members compute alone again (each gets its own copy of its stacked view)."""
        self._pending = None
        for i, m in enumerate(self.members):
            if self.stacked is not None:
                m.quads_unstack(self.views[i])
            m.quads_group, m.quads_group_index = None, 0
        self.members = []


@contextlib.contextmanager
def enabled_groups(groups: Sequence[SiblingGroup]):
    """Dormant groups serve their members inside the block; on exit they are dormant again and
    hold no outputs (nothing outlives a forward: no graph-pool tensor, no activation kept)."""
    switched = [g for g in groups if not g.enabled]
    for g in switched:
        g.enabled = True
    try:
        yield
    finally:
        for g in switched:
            g.enabled = False
            g.drop_pending()


# ---------------------------------------------------------------------------------------------
# The stacked GEMM: reference and Hopper glue
# ---------------------------------------------------------------------------------------------


def stacked_linear_reference(x2: torch.Tensor, weights: Sequence[NVFP4Parts], act: ActivationQuant) -> torch.Tensor:
    """(M, K) -> (M, sum N_i): each weight's reference W4A4 linear, concatenated (the spec)."""
    return torch.cat([linear_reference(x2, w, None, act) for w in weights], dim=-1)


def stack_prepared_hopper(prepared: Sequence):
    """The Hopper layouts of sibling weights (each N a multiple of 64, one K, one device) as one
    layout stacked along N, and each member's view of it; None when they do not qualify."""
    from quads.kernels.hopper_weight_layout import ROW_PAD, HopperWeight

    if not all(isinstance(p, HopperWeight) and p.values.dim() == 4 for p in prepared):
        return None
    first = prepared[0]
    if any(p.n % ROW_PAD or p.k != first.k or p.values.device != first.values.device for p in prepared):
        return None
    n = sum(p.n for p in prepared)
    stacked = HopperWeight(
        torch.empty((n // 16, *first.values.shape[1:]), dtype=torch.uint8, device=first.values.device),
        torch.empty((n // 16, *first.scales.shape[1:]), dtype=torch.uint8, device=first.scales.device), n, first.k)
    views, lo = [], 0
    for p in prepared:
        hi = lo + p.n // 16
        view = HopperWeight(stacked.values[lo:hi], stacked.scales[lo:hi], p.n, p.k)
        view.values.copy_(p.values)
        view.scales.copy_(p.scales)
        views.append(view)
        lo = hi
    return stacked, views


def stacked_fits_hopper(rows: int, act: ActivationQuant | None) -> bool:
    """Whether ``rows`` tokens (with their residual rows) fit one decode-GEMM launch."""
    from quads.kernels.w4a4_decode_hopper import max_decode_columns

    return act is not None and 2 * rows <= max_decode_columns()


def stacked_linear_hopper(x2: torch.Tensor, prepared, row_scales: torch.Tensor, act: ActivationQuant,
                          operands=None) -> torch.Tensor:
    """(M, K) -> (M, N) in ``x2.dtype``: one decode GEMM over ``prepared`` (the stacked weights'
    Hopper layout, N = sum of theirs) with ``row_scales`` (N,) fp32, each row's weight's global
    scale; ``operands``: :func:`~quads.ops.linear.hopper_operands` of ``x2`` (computed if None)."""
    from quads.kernels.w4a4_decode_hopper import decode_gemm

    ops = operands if operands is not None else hopper_operands(x2, act)
    return decode_gemm(ops.stacked, ops.main_scale, prepared, row_scales, x2.shape[0], ops.residual is not None,
                       None, x2.dtype)
