"""A kernel's fields as a custom op's plain arguments, and back: the one record both flat ops take.

Where this torch has no opaque custom-op objects (``KERNEL_OPS`` False), compiled code cannot pass
a kernel object to an op; ``quads::linear`` and ``quads::grouped_linear`` take its fields instead
(the backend by name, the packed weight's tensors, the prepared layout as its tensors and a static
description, the activation quantizer's fields, the static mask) and make the kernel's
:class:`~quads.ops.backend_registry.LinearArgs` back in their bodies. :class:`KernelOpArgs` is that
record: :meth:`KernelOpArgs.of` flattens, :meth:`to_op_args` gives the op's arguments in
:data:`KernelOpArgs.SCHEMA`'s order, :meth:`from_op_args` and :meth:`kernel_args` rebuild.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend, LinearArgs, get_backend
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["KernelOpArgs"]

#: the custom-op schema type of each field annotation below
_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "list[torch.Tensor]": "Tensor[]",
                 "str": "str", "bool": "bool", "float": "float"}


@dataclasses.dataclass(frozen=True)
class KernelOpArgs:
    """One kernel's :class:`LinearArgs` and backend as plain values (tensors, scalars, strings).

    ``qdata`` / ``scale`` None: the prepared layout holds the packed parts (``holds_parts``, the
    humming layout); ``global_encode_scale`` stands for them with the layout's shapes. ``prepared``
    / ``prepared_config``: :meth:`Backend.op_prepared`'s tensors and static description. The five
    ``act_*`` fields: the ``ActivationQuant`` (``quantize_activations`` False: weight-only W4A16)."""

    qdata: torch.Tensor | None
    scale: torch.Tensor | None
    global_encode_scale: torch.Tensor
    prepared: list[torch.Tensor]
    prepared_config: str
    quantize_activations: bool
    residual_fraction: float
    selection: str
    granularity: str
    act_block_scaling: str
    static_mask: torch.Tensor | None
    backend: str

    #: the fields as a custom-op schema fragment (the ops' signatures end with it)
    SCHEMA: ClassVar[str]

    @classmethod
    def of(cls, backend: Backend, weight: NVFP4Parts | None, act: ActivationQuant | None, static_mask,
           prepared) -> "KernelOpArgs":
        """The record of one kernel's arguments; ``weight`` None: ``prepared`` holds the parts."""
        tensors, config = backend.op_prepared(prepared)
        if weight is None:
            q = s = None
            gs = prepared.global_encode_scale
        else:
            q, s, gs = weight.qdata, weight.scale, weight.global_encode_scale
        if act is None:
            act_values = (False, 0.0, "per_token", "row", "6")
        else:
            act_values = (True, float(act.residual_fraction), act.selection, act.granularity, act.block_scaling)
        return cls(q, s, gs, list(tensors), config, *act_values, static_mask, backend.name)

    def to_op_args(self) -> tuple:
        """The fields in declaration order (:data:`SCHEMA`'s), as an op call passes them."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_op_args(cls, *fields) -> "KernelOpArgs":
        """The record of an op body's trailing arguments (:meth:`to_op_args`'s order)."""
        return cls(*fields)

    @property
    def act(self) -> ActivationQuant | None:
        if not self.quantize_activations:
            return None
        return ActivationQuant(self.residual_fraction, self.selection, self.granularity, self.act_block_scaling)

    def kernel_args(self) -> tuple[Backend, LinearArgs]:
        """The backend and the :class:`LinearArgs` a kernel is made from (inside the op's body):
        the prepared layout made back by the backend (:meth:`Backend.prepared_from_op`)."""
        backend = get_backend(self.backend)
        gs = self.global_encode_scale
        weight = None if self.qdata is None else NVFP4Parts(self.qdata, self.scale, gs)
        prepared = backend.prepared_from_op(self.prepared, self.prepared_config, weight, gs)
        if weight is None:  # the layout holds the parts: their shapes (meta) and the global scale
            weight = NVFP4Parts(*prepared.shape_parts[:2], gs)
        return backend, LinearArgs(weight, self.act, self.static_mask, prepared)


KernelOpArgs.SCHEMA = ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(KernelOpArgs))
