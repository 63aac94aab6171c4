"""Sibling modules of one parent, with state that lives for exactly one forward of that parent.

The trainer's sibling scale group computes its global scale once per forward of the members'
parent (:class:`~quads.policies.scale_groups.ScaleGroup`); the rollout's sibling set runs its
stacked GEMM once per forward of it (:class:`~quads.ops.sibling_linear.SiblingSet`). Both are a
:class:`SiblingMembers` record: the members, their names, and two hooks on the parent: a
forward pre-hook opens the call's state, a forward hook closes it (``always_call``: after an
exception too), so nothing computed for one call is seen by another.
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

__all__ = ["SiblingMembers"]


class SiblingMembers:
    """Modules of one parent that share per-call state (module doc).

    ``members``: the modules (a plain attribute, not registered submodules: no module-tree
    cycle); ``names``: their qualified names, for messages; ``hooks``: the parent's two hook
    handles while attached. The hooks are bound methods of the record, so a ``copy.deepcopy`` of
    the model gets its own record, hooked on its own parent."""

    hooks: tuple = ()

    def __init__(self, members: Iterable = (), names: Iterable[str] = ()):
        self.members = tuple(members)
        self.names = tuple(names)
        self.hooks = ()

    def attach(self, parent: nn.Module) -> None:
        """Open the state at every forward of ``parent`` and close it when that forward ends
        (replaces the hooks of an earlier call)."""
        self.detach()
        self.hooks = (parent.register_forward_pre_hook(self._open_call),
                      parent.register_forward_hook(self._close_call, always_call=True))

    def detach(self) -> None:
        """Remove the parent's hooks (if any) and drop any open state."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = ()
        self._close_call(None, None, None)

    def _open_call(self, parent: nn.Module, args) -> None:
        raise NotImplementedError

    def _close_call(self, parent: nn.Module | None, args, output) -> None:
        raise NotImplementedError
