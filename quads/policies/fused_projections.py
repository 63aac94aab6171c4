"""Sibling rollout projections, one :class:`~quads.ops.sibling_linear.SiblingSet` per parent.

In a transformers decoder layer ``q_proj``, ``k_proj`` and ``v_proj`` read the same hidden
states, and so do ``gate_proj`` and ``up_proj`` (:data:`SIBLING_PROJECTIONS`, the one list of
them; the ModelOpt export uses it too). :func:`fuse_projections_` gives each such set of rollout
linears (one backend, one activation configuration, one K, one device, no calibrated mask) one
:class:`SiblingSet`, attached to their parent (its members share within each of the parent's
forwards): one activation quantization per input and, where the backend has a stacked GEMM (Hopper,
W4A4, no bias, rows a multiple of 64), one Hopper layout of the stacked weights of which each
member's own layout is a view, so ``quantize_``/``sync_weights_`` keep writing the members'
layouts in place (CUDA graphs keep their addresses) and the set's stays current with no copy.
The members' global scales are mirrored into one per-row scale vector at every weight write.

:func:`sibling_groups_` makes *dormant* sets (quantization sharing only, switched on by
:func:`~quads.ops.sibling_linear.enabled_groups`): the graphed decoder's ``share_quantization``.
Every output has its own linear's bits either way (tests/policies/test_fused_projections.py,
tests/ops/test_activation_sharing.py).
"""

from __future__ import annotations

import torch.nn as nn

from quads.ops.sibling_linear import SiblingSet, enabled_groups

__all__ = ["SIBLING_PROJECTIONS", "fuse_projections_", "unfuse_projections_", "sibling_groups_", "share_quantization"]

#: child-name sets of one module that read the same input (transformers decoder layers)
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _groupable(modules: list[nn.Module]) -> bool:
    from quads.policies.modules import RolloutLinear

    if not all(isinstance(m, RolloutLinear) for m in modules):
        return False
    first = modules[0]
    return all(
        m.quads_backend is first.quads_backend and m.quads_act == first.quads_act
        and m.quads_static_mask is None and m.weight.shape[-1] == first.weight.shape[-1]
        and m.weight.device == first.weight.device for m in modules)


def _sibling_sets(model: nn.Module):
    """``(parent, qualified member names, members)`` of every sibling set present in ``model``."""
    for prefix, parent in model.named_modules():
        for names in SIBLING_PROJECTIONS:
            members = [getattr(parent, n, None) for n in names]
            if all(m is not None for m in members):
                yield parent, [f"{prefix}.{n}" if prefix else n for n in names], members


def _group(parent: nn.Module, names: list[str], members: list[nn.Module], stack: bool, enabled: bool) -> SiblingSet:
    for m in members:  # a dormant set of these members makes way
        if m.quads_group is not None:
            m.quads_group.dissolve()
    first = members[0]
    group = SiblingSet(first.quads_backend, first.quads_act, [m.weight.shape[0] for m in members], members,
                       enabled=enabled, names=names)
    group.attach(parent)  # members share within each forward of their parent
    if stack and all(m.bias is None for m in members):
        shared = members[0].quads_scale_group  # group mode: one global scale for all members
        views = group.stack([m.quads_prepared[0] for m in members],
                            [m.weight.parts.global_encode_scale for m in members],
                            shared_scale=shared is not None and all(m.quads_scale_group is shared for m in members))
        for m, view in zip(members, views or ()):
            m.quads_prepared = (view,)  # later weight writes land in the stacked layout directly
            m.quads_weights_changed()  # the kernel remade now over the view
    return group


def fuse_projections_(model: nn.Module) -> int:
    """One :class:`SiblingSet` for the sibling projections of every module of ``model`` (see the
    module doc): one activation quantization per input, and one stacked GEMM where the backend has
    one. Returns the number of sets made (sets already made are left as they are; dormant ones of
    :func:`sibling_groups_` are replaced). Modules that do not qualify (not rollout linears, a
    calibrated residual mask, different backends or configurations) are left as they are."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_projections_ takes an nn.Module (a quads rollout model), got {type(model).__name__}")
    groups = 0
    for parent, names, members in _sibling_sets(model):
        if _groupable(members) and not all(m.quads_group is not None and m.quads_group.enabled for m in members):
            _group(parent, names, members, stack=True, enabled=True)
            groups += 1
    return groups


def unfuse_projections_(model: nn.Module) -> int:
    """Undo :func:`fuse_projections_` (and :func:`sibling_groups_`); returns the number of sets dissolved."""
    seen = {id(m.quads_group): m.quads_group for m in model.modules() if getattr(m, "quads_group", None) is not None}
    for g in seen.values():
        g.dissolve()
    return len(seen)


def sibling_groups_(model: nn.Module) -> list[SiblingSet]:
    """Every sibling set of ``model``, making dormant ones (quantization sharing, no stacked
    layout, off until :func:`~quads.ops.sibling_linear.enabled_groups`) for sibling sets not
    grouped yet."""
    groups = {}
    for parent, names, members in _sibling_sets(model):
        if all(getattr(m, "quads_group", None) is None for m in members) and _groupable(members):
            _group(parent, names, members, stack=False, enabled=False)
        group = getattr(members[0], "quads_group", None)
        if group is not None:
            groups[id(group)] = group
    return list(groups.values())


def share_quantization(model: nn.Module):
    """A ``with`` block in which the sibling linears of ``model`` share one activation quantization
    (:func:`sibling_groups_`, switched on for the block)."""
    return enabled_groups(sibling_groups_(model))
