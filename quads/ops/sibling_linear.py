"""Sibling linears reading one input (q/k/v, gate/up): one activation quantization, one stacked GEMM.

A :class:`SiblingSet` (one per parent) owns its members' stacked prepared weight (Hopper: each
member's own layout a view of it, written in place by every sync; humming: a copy each member
write refreshes, ``stacked.write_member_``), the per-row weight global scales and one kernel
(:class:`SiblingKernel`, the backend's ``sibling_kernel_class``), made when the members' weights
are set. A member's forward runs its :class:`SiblingMember` kernel, which calls the set's
``kernel.apply(x, i)``: the input's GEMM operands once, then the stacked GEMM (Hopper: few
tokens, no biases, each column with its own linear's bits; humming: one global scale for all
members) or the operands for each member's own kernel. A vLLM merged layer is a set without
members (``apply(x)``: every column at once).

Members share within one forward of their parent (the set is attached to it,
:class:`~quads.ops.parent_call.SiblingMembers`): the first member computes for all and keeps the
result in the call's slot; a member called next with the same tensor object, version unchanged,
takes its columns or the operands; the parent's forward hook empties the slot. Outside the
parent's forward, or with another input, a member computes alone. Never shared: inference-mode
tensors (no version counter), tensor subclasses, meta tensors, traced code (the hooks open no
slot there). In a CUDA-graph capture the sharing is decided at capture time.

Sets are made by :func:`quads.fuse_projections_` (stacked) and the graphed decoder (dormant sets,
switched on by :func:`enabled_groups`). Members are objects with ``quads_sibling_inputs()``
(``(LinearKernel, bias)``), ``quads_group``/``quads_group_index`` and ``quads_sibling_set_changed()``.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend
from quads.ops.parent_call import SiblingMembers

__all__ = ["SiblingSet", "SiblingKernel", "SiblingMember", "enabled_groups"]


class SiblingSet(SiblingMembers):
    """Linears of one backend and one activation configuration reading one input (module doc).

    ``sizes``: the members' output rows; ``members``: the modules served one by one (none for a
    vLLM merged layer), ``names`` their names; ``enabled``: whether :meth:`kernel` serves (dormant
    sets are switched on by :func:`enabled_groups`). Members share only once the set is attached
    to their parent (:meth:`attach`)."""

    #: the current parent call's ``(input, its version, (outputs, operands), members served)``, or None
    _slot: tuple | None = None
    #: inside a forward of the members' parent (its pre-hook ran, its forward hook not yet)
    _call_open = False

    def __init__(self, backend: Backend, act: ActivationQuant | None, sizes: Sequence[int],
                 members: Sequence = (), enabled: bool = True, names: Sequence[str] = ()):
        super().__init__(members, names)
        self.backend, self.act, self.enabled = backend, act, enabled
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.stacked = None  # the stacked weights as the backend's sibling kernel reads them
        self.views: list = []  # member i's prepared weight: a view into ``stacked``
        self.row_scales: torch.Tensor | None = None  # (N,) fp32: each output row's weight global scale
        self._kernel: tuple | None = None  # (sources, kernel)
        self.refresh_kernel()  # made now (before any member joins), never inside a forward
        for i, m in enumerate(self.members):
            m.quads_group, m.quads_group_index = self, i
            m.quads_sibling_set_changed()

    # -- the stacked layout ----------------------------------------------------------------------

    def stack(self, prepared: Sequence, global_scales: Sequence[torch.Tensor],
              shared_scale: bool = False) -> list | None:
        """Build the stacked layout from the members' prepared weights (copied in) and return
        the members' views of it (their prepared weights from now on, written in place by every
        sync), or None where the backend has no stacked GEMM for them. ``shared_scale``: the
        members' weights share one global scale by construction (group mode), which a stacked
        GEMM with one scale for all (humming's) needs."""
        if len(prepared) < 2:
            return None
        made = self.backend.stack_prepared(prepared, shared_scale, weight_only=self.act is None)
        if made is None:
            return None
        self.stacked, self.views = made
        self.row_scales = torch.empty(self.offsets[-1], dtype=torch.float32, device=global_scales[0].device)
        for i, gs in enumerate(global_scales):
            self.write_scale(i, gs)
        self.refresh_kernel()  # made now over the stacked layout
        return self.views

    def write_scale(self, i: int, global_encode_scale: torch.Tensor) -> None:
        """Member ``i``'s weight was written: mirror its global scale into its rows of the per-row
        vector and, where the stacked layout is a copy (``stacked.write_member_``), its layout.
        Drops the call's slot (a parent forward interrupted by a ``BaseException``, which skips its
        forward hook, leaves it open until the parent's next forward or this)."""
        self._close_call(None, None, None)
        if self.row_scales is not None:
            lo, hi = self.offsets[i], self.offsets[i + 1]
            self.row_scales[lo:hi].copy_(global_encode_scale.reshape(1).float().expand(hi - lo))
        write_member = getattr(self.stacked, "write_member_", None)
        if write_member is not None:
            write_member(i)

    def holds(self, i: int, prepared) -> bool:
        """Whether ``prepared`` is still member ``i``'s view of the stacked layout (a sync wrote it
        in place) or the set has no stacked layout."""
        if self.stacked is None:
            return True
        view = self.views[i]
        if prepared is view:
            return True
        return (prepared is not None and hasattr(view, "values") and hasattr(prepared, "values")
                and prepared.values.data_ptr() == view.values.data_ptr())

    # -- the kernel ------------------------------------------------------------------------------

    def kernel(self) -> "SiblingKernel | None":
        """The set's kernel (None while dormant), as the last :meth:`refresh_kernel` made it."""
        return self._kernel[1] if self.enabled else None

    def refresh_kernel(self) -> "SiblingKernel":
        """Make the kernel again if one of its sources (backend, configuration, stacked layout, row
        scales) was replaced since, compared by identity: called when the set is made and when its
        stacked layout is set; a source replaced by hand must be followed by a call of it."""
        sources = (self.backend, self.act, self.stacked, self.row_scales)
        held = self._kernel
        if held is None or any(a is not b for a, b in zip(held[0], sources)):
            if self.backend.sibling_kernel_class is None:
                raise TypeError(f"backend {self.backend.name!r} names no sibling_kernel_class: it serves no sibling set")
            held = self._kernel = (sources, self.backend.sibling_kernel_class(self))
        return held[1]

    def serves(self, own) -> bool:
        """Whether the set's kernel gives anything to a member whose own kernel is ``own`` (its
        columns, or operands ``own`` reads): decided when the member's forward kernel is set, so a
        member with nothing to gain runs ``own`` directly."""
        return self._kernel[1].serves(own)

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``i``'s output through the set, or None (the member computes alone): one call
        for callers that hold no kernel (a member's forward calls :meth:`kernel` itself)."""
        kernel = self.kernel()
        if kernel is None:
            return None
        y, operands = kernel.apply(x, i)
        if y is not None or operands is None:
            return y
        k, bias = self.members[i].quads_sibling_inputs()
        return k.apply(x, bias, operands)

    # -- one parent call (members called one by one) --------------------------------------------

    def _open_call(self, parent, args) -> None:
        self._slot, self._call_open = None, self.enabled and not torch.compiler.is_compiling()

    def _close_call(self, parent, args, output) -> None:
        self._slot, self._call_open = None, False

    def begin(self, i: int | None, x: torch.Tensor, bias=None) -> tuple:
        """``(hit, biased)`` before a kernel computes for member ``i`` (None: every output, no
        slot): ``hit`` the ``(output, operands)`` to return now (``(None, None)``: the member
        computes alone), else None (compute, then :meth:`keep`); ``biased`` whether an output has
        a bias (no stacked GEMM then). Each member is served once per slot: a member called again
        computes anew (its first output may have been written in place since)."""
        if i is None:
            return None, bias is not None
        if (not self._call_open or torch.compiler.is_compiling() or type(x) is not torch.Tensor
                or x.is_inference() or x.device.type == "meta"):
            return (None, None), False
        slot = self._slot
        if slot is not None and slot[0] is x and slot[1] == x._version and i not in slot[3]:
            slot[3].add(i)
            outs, operands = slot[2]
            return (None if outs is None else outs[i], operands), False
        self._slot = None  # freed before the new input is quantized (no growth of prefill peaks)
        return None, any(m.quads_sibling_inputs()[1] is not None for m in self.members)

    def keep(self, i: int | None, x: torch.Tensor, y: torch.Tensor | None, operands) -> tuple:
        """Member ``i``'s ``(output, operands)`` from a kernel's ``y (M, N)`` (or None) and
        ``operands``, kept in the call's slot for its siblings; ``i`` None: ``y`` whole."""
        lead = x.shape[:-1]
        if i is None:
            return (None if y is None else y.reshape(*lead, y.shape[-1])), (operands if y is None else None)
        outs = None
        if y is not None:
            y = y.reshape(*lead, y.shape[-1])
            o = self.offsets
            outs = [y[..., o[j]:o[j + 1]] for j in range(len(o) - 1)]
            operands = None
        if self._call_open:
            self._slot = (x, x._version, (outs, operands), {i})
        return (None if outs is None else outs[i]), operands

    def dissolve(self, keep: int | None = None) -> None:
        """Members compute alone again (each gets its own copy of its stacked view, but member
        ``keep``, which holds a new layout of its own already; a stacked copy
        (``stacked.write_member_``) is dropped, the members' own layouts kept); the parent's hooks
        are removed."""
        self.detach()
        for i, m in enumerate(self.members):
            if self.stacked is not None and not hasattr(self.stacked, "write_member_") and i != keep:
                m.quads_unstack(self.views[i])
            m.quads_group, m.quads_group_index = None, 0
            m.quads_sibling_set_changed()
        self.members = ()


class SiblingKernel:
    """One sibling set's kernel on a backend with no stacked GEMM: the input's operands once
    (``backend.activation_operands``), which each member's own kernel then reads."""

    def __init__(self, siblings: SiblingSet):
        self.siblings = siblings
        self.backend, self.act = siblings.backend, siblings.act
        self.stacked, self.row_scales = siblings.stacked, siblings.row_scales

    def serves(self, own) -> bool:
        """Whether a member with its own kernel ``own`` gains from this kernel (:meth:`SiblingSet.serves`)."""
        return True

    def apply(self, x: torch.Tensor, i: int | None = None, bias: torch.Tensor | None = None) -> tuple:
        """``(y, operands)`` for ``x (..., K)``: ``y`` the stacked GEMM's output (member ``i``'s
        columns; ``i`` None: all of them, ``bias`` their concatenated bias) where it ran, else None
        and ``operands``, the input's operands for each member's kernel (None: each computes alone)."""
        hit, _ = self.siblings.begin(i, x, bias)
        if hit is not None:
            return hit
        operands = self.backend.activation_operands(x.reshape(-1, x.shape[-1]), self.act)
        return self.siblings.keep(i, x, None, operands)


class SiblingMember:
    """A member's kernel while it is in a set (its forward's ``kernel.apply``): its columns of the
    set's output, or the set's operands into its own kernel ``own``, within its parent's forward
    (:meth:`SiblingSet.begin`); else, and while the set is dormant, ``own`` alone."""

    def __init__(self, siblings: SiblingSet, i: int, own):
        self.siblings, self.i, self.own = siblings, i, own

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel = self.siblings.kernel()
        if kernel is None:
            return self.own.apply(x, bias)
        y, operands = kernel.apply(x, self.i)
        return y if y is not None else self.own.apply(x, bias, operands)


@contextlib.contextmanager
def enabled_groups(sets: Sequence[SiblingSet]):
    """Dormant sets serve their members inside the block; on exit they are dormant again (their
    slots are emptied by their parents' forwards: no graph-pool tensor, no activation kept)."""
    switched = [g for g in sets if not g.enabled]
    for g in switched:
        g.enabled = True
    try:
        yield
    finally:
        for g in switched:
            g.enabled = False
            g._close_call(None, None, None)


