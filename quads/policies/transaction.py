"""Undo for in-place model conversions: a snapshot of a module tree that can be put back.

``quantize_`` changes a model in many small steps: module classes, parameters, attributes
(``quads_policy``, ``quads_backend``, ...), forward hooks on the parents of sibling groups (the
trainer's group scale), the ``load_state_dict`` pre-hooks of a rollout and its refused
``save_pretrained``. An exception at any of those steps, a Ctrl-C (``KeyboardInterrupt``)
included, must leave the model as it was, not half converted with no error on the next
forward. :class:`ModuleTreeSnapshot` records, for every module, its class, its ``__dict__``
and the contents of every dict, list and set in it (``_parameters``, ``_buffers``,
``_modules``, every hook table), and :meth:`~ModuleTreeSnapshot.restore` puts all of them
back in place (the same container objects, so hook handles and references stay valid), and
the autograd grad mode with them. Tensors are not copied: a conversion replaces parameters, it
never writes into them. Cost: one walk over the modules and a shallow copy of each one's
containers (a few milliseconds for a thousand modules).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["ModuleTreeSnapshot"]

_CONTAINERS = (dict, list, set)


def _copy(container):
    return dict(container) if isinstance(container, dict) else list(container)


def _refill(container, content) -> None:
    container.clear()
    if isinstance(container, dict):
        container.update(content)
    elif isinstance(container, list):
        container.extend(content)
    else:
        container.update(content)


class ModuleTreeSnapshot:
    """The state of ``model``'s module tree now (see the module doc); :meth:`restore` brings it back."""

    def __init__(self, model: nn.Module):
        self.grad_enabled = torch.is_grad_enabled()
        self.modules = []
        for module in model.modules():
            attrs = dict(vars(module))
            contents = {k: _copy(v) for k, v in attrs.items() if isinstance(v, _CONTAINERS)}
            self.modules.append((module, type(module), attrs, contents))

    def restore(self) -> None:
        """Every module's class, attributes and containers as recorded, and the grad mode."""
        for module, cls, attrs, contents in self.modules:
            if type(module) is not cls:
                module.__class__ = cls
            state = vars(module)
            for key in [k for k in state if k not in attrs]:
                del state[key]
            state.update(attrs)
            for key, content in contents.items():
                _refill(attrs[key], content)
        torch.set_grad_enabled(self.grad_enabled)
