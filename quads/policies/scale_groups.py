"""One NVFP4 global weight scale per sibling group: ``QuadsPolicy(weight_global_scale="group")``.

Serving engines fuse the sibling projections of a decoder layer (``q/k/v_proj`` into
``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``: :data:`~quads.policies.fused_projections.
SIBLING_PROJECTIONS`, the one list of them) and give the fused layer *one* global weight scale
(vLLM's ``weight_scale_2``). A model whose siblings each carry their own scale cannot be served
so without re-quantizing them (1-4% weight error, ``docs/ecosystem.md`` section 2), i.e. the
served model would not be the trained one. In group mode every side quantizes the members of a
group with one ``S_enc`` from the group's largest amax
(:func:`~quads.tensor.nvfp4_math.shared_global_encode_scale`, what ModelOpt computes for a
fused layer), so trainer, rollout and export hold the same weights:

* ``quantize_`` forms the groups among the linears it converts (same parent, names of one
  sibling set, at least two members; :func:`sibling_groups`) and stores the
  :class:`ScaleGroup` on each member (``module.quads_scale_group``); rollout members are packed
  with the group's scale;
* the trainer's forward (``TrainerLinear``) takes the group's scale from the members' masters
  in every forward of the members' parent, computed once by a forward pre-hook on the parent
  and dropped after it, never cached (how and why: docs/design.md);
* ``sync_weights_`` and the sharded sync compute it from the masters of all members;
* ``quads export`` uses it for plain and trainer models, so no fused shard is re-quantized;
* a state dict whose group members carry different scales (saved in ``"tensor"`` mode) is
  refused by a group-mode rollout model before anything is loaded (:class:`GroupScaleLoadCheck`).

Fused MoE experts need nothing here: their ``gate_up_proj`` has one global scale per expert.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.nn as nn

from quads.ops.parent_call import SiblingMembers
from quads.policies.fused_projections import SIBLING_PROJECTIONS
from quads.policies.shards import is_dtensor
from quads.tensor.finite import check_finite
from quads.tensor.nvfp4_math import nvfp4_fake_quantize, nvfp4_quantize, shared_global_encode_scale
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["ScaleGroup", "GroupScaleLoadCheck", "sibling_groups", "check_group_scales", "group_scale_of",
           "trainer_forward_weight"]


class ScaleGroup(SiblingMembers):
    """Sibling linears (one parent, one sibling set) whose weights share one NVFP4 global scale.

    ``members``/``names``: the membership record (:class:`~quads.ops.parent_call.SiblingMembers`;
    names qualified in the model they were converted in), ``block_scaling`` the policy's
    ``weight_block_scaling`` (the shared ``S_enc``'s numerator depends on it).

    Trainer side: ``quantize_`` calls :meth:`attach` with the members' parent, whose forward
    then computes the scale once for all members (``forward_scale``, set only while that forward
    runs; :meth:`detach` removes the hooks).
    """

    #: the group's scale (:meth:`scale`'s form) while a forward of the members' parent runs (set
    #: when it starts, dropped when it ends), else None
    forward_scale = None
    #: :meth:`_masters_key` when ``forward_scale`` was computed (inference mode, then each master's
    #: ``(id, version, storage address)``)
    _forward_key: tuple = ()

    #: the members' ``QuadsPolicy.weight_block_scaling``
    block_scaling = "6"

    def __init__(self, members: Iterable[nn.Module], names: Iterable[str], block_scaling: str = "6"):
        super().__init__(members, names)
        self.block_scaling = block_scaling

    def __repr__(self) -> str:
        return f"ScaleGroup({', '.join(self.names)})"

    def encode_scale(self) -> torch.Tensor:
        """``S_enc`` of the members' current dense weights (the trainer's masters), shape ``()``:
        what sync, export and rollout quantize the members with."""
        return shared_global_encode_scale(self._masters(), self.block_scaling)

    def scale(self):
        """The global scale a member's forward quantizes with, in the form its backend's fake
        quantizer takes (``Backend.group_scale``: ``S_enc``, or the kernel backends' group amax
        bits, from which each member's fused pass derives the same ``S_enc``): the one its
        parent's forward computed (:meth:`attach`), or, outside such a forward, one computed now.
        The parent's scale is read only while the masters are the tensors it was computed from,
        version counters and storages unchanged, in the inference mode it was computed in: a
        forward interrupted by a ``BaseException`` (``KeyboardInterrupt``) skips the hook that
        drops it, and an optimizer step (or inference mode left) before the parent's next forward
        must not reach a member called alone with it."""
        scale = self.forward_scale
        if scale is None or not (torch.compiler.is_compiling() or self._forward_key == self._masters_key()):
            return self._forward_scale_now()
        return scale

    def _forward_scale_now(self):
        """The group's scale from the masters as they are now, by the members' backend (the
        trainer stores one per module; the members of a group share a device, hence one)."""
        return self.members[0].quads_trainer_backend().group_scale(self._masters(), self.block_scaling)

    def _masters(self) -> list[torch.Tensor]:
        """The members' dense weights; refuses a distributed one (the scale needs each whole)."""
        weights = [m.weight for m in self.members]
        for name, w in zip(self.names, weights):
            if is_dtensor(w):
                raise RuntimeError(
                    f"quads trainer layer: {name}.weight is a distributed (DTensor) weight when its group's scale "
                    f"is computed (in the forward of its parent or of a member); the group {list(self.names)} "
                    "shares one NVFP4 global scale, which needs every "
                    "member's whole weight. Apply fully_shard to the decoder layer (not to single linears), "
                    "or use QuadsPolicy(weight_global_scale='tensor')"
                )
        return weights

    def _masters_key(self) -> tuple:
        """What identifies the masters' current values short of reading them (writes through
        ``.data`` move no version counter: not seen), and whether inference mode is on (a scale
        computed in it is an inference tensor, which autograd refuses to save)."""
        return (torch.is_inference_mode_enabled(),
                *((id(w), w._version, w.data_ptr()) for w in (m.weight for m in self.members)))

    def _open_call(self, parent: nn.Module, args) -> None:
        self.forward_scale = self._forward_scale_now()
        if not torch.compiler.is_compiling():
            self._forward_key = self._masters_key()

    def _close_call(self, parent, args, output) -> None:
        self.forward_scale, self._forward_key = None, ()


def group_scale_of(module: nn.Module) -> torch.Tensor | None:
    """The module's sibling group's ``S_enc`` from its members' masters, or None (no group)."""
    group = getattr(module, "quads_scale_group", None)
    return None if group is None else group.encode_scale()


def trainer_forward_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The forward weight of the quantized parameter ``name`` of a quads trainer (or plain)
    ``model``: ``DQ(Q(master))`` by the recipe, with the sibling group's global scale where the
    module has one and the module policy's block scaling (a plain module: ``"6"``); what a
    synced rollout's ``param.dequantize(master.dtype)`` equals."""
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    scale = group_scale_of(module) if pname == "weight" else None
    policy = getattr(module, "quads_policy", None)
    block_scaling = "6" if policy is None else policy.weight_block_scaling
    return nvfp4_fake_quantize(getattr(module, pname).detach(), global_encode_scale=scale, block_scaling=block_scaling)


def sibling_groups(names: Iterable[str]) -> list[list[str]]:
    """Qualified names of linear modules grouped by parent and sibling set (members present, at
    least two of them), in the order of :data:`SIBLING_PROJECTIONS`."""
    present = set(names)
    parents = sorted({n.rpartition(".")[0] for n in present})
    groups = []
    for parent in parents:
        for siblings in SIBLING_PROJECTIONS:
            members = [f"{parent}.{s}" if parent else s for s in siblings]
            members = [m for m in members if m in present]
            if len(members) >= 2:
                groups.append(members)
    return groups


def check_group_scales(groups: Iterable[Iterable[str]], scales: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ValueError naming the first group whose members' global scales differ.

    ``scales`` maps a weight name to its ``global_encode_scale``; names it lacks are skipped."""
    for group in groups:
        found = {n: scales[n] for n in group if n in scales}
        values = {float(s.reshape(-1)[0]) if s.numel() == 1 else None for s in found.values()}
        if len(values) > 1:
            listed = ", ".join(f"{n}: {float(s):.6g}" for n, s in found.items())
            raise ValueError(
                f"{what}: the sibling group {list(found)} holds different NVFP4 global scales ({listed}): it was "
                "quantized with one global scale per weight (weight_global_scale='tensor'). This model shares one "
                "per group (weight_global_scale='group', the default); quantize it with "
                "QuadsPolicy(..., weight_global_scale='tensor') to load these weights. Nothing was loaded"
            )


class GroupScaleLoadCheck:
    """``load_state_dict`` pre-hook of a group-mode rollout model, run before any tensor is loaded.

    Packed entries: a state dict whose sibling groups carry different global scales (a
    ``"tensor"``-mode checkpoint) is refused; it would silently turn the model back into a
    per-tensor one. Dense entries (high-precision weights, which ``NVFP4Tensor.copy_`` would
    quantize one by one with their own scales): a whole group is quantized here with its shared
    scale (in the copy of the state dict ``load_state_dict`` hands its hooks); a group given
    partly dense, or partly at all, is refused."""

    def __init__(self, groups: Iterable[Iterable[str]], block_scaling: str = "6"):
        self.groups = [list(g) for g in groups]
        self.block_scaling = block_scaling

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        scales, groups = {}, []
        for group in self.groups:
            keys = [f"{prefix}{n}.weight" for n in group]
            groups.append(keys)
            present = {k: state_dict[k] for k in keys if k in state_dict}
            dense = [k for k, v in present.items() if not isinstance(v, NVFP4Tensor)]
            if dense and len(dense) != len(keys):
                raise ValueError(
                    f"load_state_dict: {dense} are high-precision weights but their sibling group {keys} is not "
                    "given whole in that form; its members share one NVFP4 global scale computed from all of "
                    "them. Give every member, or load packed weights. Nothing was loaded")
            if dense:
                for k in keys:
                    check_finite(present[k], f"load_state_dict {k}")
                block_scaling = getattr(self, "block_scaling", "6")
                scale = shared_global_encode_scale((present[k].detach() for k in keys), block_scaling)
                for k in keys:
                    w = present[k].detach()
                    parts = nvfp4_quantize(w, "tensor", scale.clone(), block_scaling, check_values=False)
                    state_dict[k] = NVFP4Tensor(*parts, orig_dtype=w.dtype, check_values=False)
                continue
            scales.update({k: v.global_encode_scale for k, v in present.items()})
        check_group_scales(groups, scales, "load_state_dict")
