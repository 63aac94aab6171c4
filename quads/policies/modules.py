"""The quads layers: trainer (fake-quant QAT) and rollout (packed NVFP4) forwards.

`quantize_` converts modules in place by swapping their class for a subclass that mixes in
one of the forwards below, so parameter names, state_dict keys and model-specific
attributes (``act_fn``, ``_apply_gate``, ``config``) are untouched. Two module kinds:

* ``nn.Linear`` (and subclasses);
* transformers-5 fused MoE experts: 3-D ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``
  (Qwen3-MoE, Mixtral, OLMoE, ...). The trainer fake-quantizes each 3-D weight once per
  forward (one global scale per expert), not once per expert slice, and runs the experts with
  grouped GEMMs (:mod:`quads.policies.trainer_experts`) where torch has them.

Every converted module stores the :class:`~quads.ops.Backend` that runs its ops
(``quads_backend``), chosen when it is converted and again whenever it is moved to another
device: the rollout's kernels, the trainer's fake quantizer (the fused kernel on kernel
backends, the recipe on ``torch``; the same bits). A rollout module also holds one kernel object
made from that backend when its weights are set (:meth:`RolloutModule.quads_kernel`): its forward
is ``kernel.apply``, which calls the launchers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend, LinearArgs, LinearKernel, gemm_shape, select_backend
from quads.ops.experts_op import act_and_mul, experts_loop
from quads.ops.sibling_linear import SiblingMember
from quads.policies.policy import QuadsPolicy
from quads.policies.ste import fake_quant_linear, fake_quantize_activation, fake_quantize_weight
from quads.policies.trainer_experts import grouped_experts_forward, grouped_mm_available

__all__ = [
    "QuadsModule",
    "TrainerModule",
    "RolloutModule",
    "TrainerLinear",
    "RolloutLinear",
    "TrainerExperts",
    "RolloutExperts",
    "is_fused_experts",
    "apply_gate",
    "gate_of",
    "refresh_after_load",
    "rollout_owners",
]


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers-5 fused experts module (3-D gate_up_proj and down_proj parameters)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
    )


class QuadsModule:
    """Marker mixin of every converted module; ``quads_policy`` is the policy applied."""

    quads_policy: QuadsPolicy

    @property
    def quads_act(self) -> ActivationQuant | None:
        return self.quads_policy.activation_quant

    def extra_repr(self) -> str:
        base = super().extra_repr()
        p = self.quads_policy
        extra = f"quads={p.side}, activations={p.activations}"
        if p.weight_block_scaling != "6":
            extra += f", weight_block_scaling={p.weight_block_scaling}"
        if p.side == "rollout" and p.activations == "nvfp4":
            extra += f", residual={p.residual_fraction}/{p.residual_selection}"
        backend = self.__dict__.get("quads_backend")
        if backend is not None:
            extra += f", backend={backend.name}"
        return f"{base}, {extra}" if base else extra


class RolloutModule(QuadsModule):
    """Rollout mixin: owns packed parameters, the backend chosen for their device and one kernel.

    The kernel's lifecycle is vLLM's: made when the module is converted (create), remade or kept
    by :meth:`quads_weights_changed` after every write (process), and a forward is
    ``kernel.apply`` (apply), which reads no version and checks no source. Every write through
    the product API calls :meth:`quads_weights_changed`: ``quantize_``, ``sync_weights_`` (and the
    sharded sync, ``GraphedSync``), ``load_state_dict`` (a post-load hook), ``.to()`` / ``.cuda()``,
    ``calibrate_residual_channels``, ``fuse_projections_`` / ``unfuse_projections_``. A write that
    bypasses it (``module.weight.parts.copy_(...)``, a parameter or ``quads_backend`` /
    ``quads_policy`` / ``quads_static_mask`` replaced by hand) must be followed by a call of
    :meth:`quads_weights_changed`, else the forward keeps computing with what it had."""

    #: names of the packed NVFP4 parameters of this module kind
    quads_packed_names: tuple[str, ...] = ()
    quads_backend: Backend
    #: per packed parameter, what the backend's kernels read (``backend.prepare_weight``)
    quads_prepared: tuple = ()

    def quads_select_backend(self) -> None:
        """(Re)pick the backend for the device the packed weights are on, then refresh."""
        weights = [getattr(self, n) for n in self.quads_packed_names]
        self.quads_backend = select_backend(weights[0].device, getattr(self.quads_policy, "kernel", "exact"),
                                            [gemm_shape(w) for w in weights])
        self.quads_weights_changed()

    def quads_weights_changed(self) -> None:
        """The one refresh: call it after the packed weights (or the backend, the policy, a static
        mask) were written or replaced. Rebuilds what the backend derives from the packed parts
        (the Hopper kernel layout: as many bytes again as the packed weight), in place into the
        tensors it holds when their shapes still fit (captured graphs keep their addresses), then
        the module's kernel (kept when none of its sources was replaced, so compiled graphs and
        captured syncs keep the object they hold).

        Where the backend's layout converts back to the parts bit for bit (``prepared.can_hold_parts``:
        the humming backend), it becomes the weight's storage (``NVFP4Tensor.to_layout_``): every
        write then lands in it directly (``NVFP4Tensor.write_parts_``) and nothing is rebuilt here."""
        weights = [getattr(self, n) for n in self.quads_packed_names]
        held = self.quads_prepared if len(self.quads_prepared) == len(weights) else (None,) * len(weights)
        prepared = []
        for w, out in zip(weights, held):
            if w.kernel_layout is not None and w.kernel_layout is out and out.backend_name == self.quads_backend.name:
                prepared.append(out)  # the layout is the storage: written in place already
                continue
            w.to_parts_()  # (from another backend's layout, if one held them)
            out = self.quads_backend.prepare_weight(w.parts, out)
            if getattr(out, "can_hold_parts", False):
                w.to_layout_(out)
            prepared.append(out)
        self.quads_prepared = tuple(prepared)
        group = getattr(self, "quads_group", None)
        if group is not None:  # sibling projections (quads.ops.sibling_linear.SiblingSet)
            i = self.quads_group_index
            if group.backend is self.quads_backend and group.holds(i, self.quads_prepared[0]):
                group.write_scale(i, self.weight.global_encode_scale)
            else:  # another backend, or a layout not written in place (a device move): alone again
                group.dissolve(keep=i)  # this member keeps the layout it has just made
        if getattr(self, "quads_policy", None) is not None:
            self._quads_refresh_kernel()

    def quads_weights_rewritten(self) -> None:
        """The packed weights and what :meth:`quads_weights_changed` derives from them were rewritten in
        place by a replayed capture of it (:class:`quads.policies.graphed_sync.GraphedSync`): nothing
        to do, the kernel reads those tensors (a hook kept for the replay's bookkeeping)."""

    def _quads_kernel_sources(self) -> tuple:
        """What this module's kernel is made from, compared by identity at a refresh (any one replaced: remade)."""
        return (self.quads_backend, self.quads_policy, *self.quads_prepared,
                *(o for n in self.quads_packed_names for o in (getattr(self, n), *getattr(self, n).storage_objects())),
                *self._quads_masks())

    def _quads_refresh_kernel(self) -> None:
        sources = self._quads_kernel_sources()
        held = self.__dict__.get("_quads_kernel_sources_held")
        if (held is None or "_quads_kernel" not in self.__dict__ or len(held) != len(sources)
                or any(a is not b for a, b in zip(held, sources))):
            self._quads_kernel = self.quads_make_kernel()
            self._quads_kernel_sources_held = sources
        self._quads_forward_inputs()

    def _quads_masks(self) -> tuple:
        return ()

    def _quads_forward_inputs(self) -> None:
        """Set what the forward hands the kernel besides the input (an experts module's gate and
        biases), at every refresh."""

    def quads_make_kernel(self):
        raise NotImplementedError

    def quads_kernel(self):
        """This module's kernel (``kernel.apply`` runs its forward's GEMMs), as the last
        :meth:`quads_weights_changed` made it."""
        return self._quads_kernel

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.quads_select_backend()  # .to(device) / .cuda(): the backend follows the weights
        return out


def refresh_after_load(module: nn.Module, incompatible_keys) -> None:
    """``load_state_dict`` post-hook of every rollout module (registered by ``quantize_``): the
    loaded values were copied into the packed parts in place; refresh what is derived from them."""
    module.quads_weights_changed()


def rollout_owners(model: nn.Module) -> dict[int, list[RolloutModule]]:
    """id(packed parameter) -> the rollout module(s) of ``model`` holding it (tied weights: several);
    how both syncs (``sync.py``, ``sharded_sync.py``) find what to refresh after a write."""
    out: dict[int, list[RolloutModule]] = {}
    for module in model.modules():
        if isinstance(module, RolloutModule):
            for pname in module.quads_packed_names:
                out.setdefault(id(getattr(module, pname)), []).append(module)
    return out




class TrainerModule(QuadsModule):
    """Trainer mixin: the backend whose fake quantizer the forwards run, stored per device."""

    #: the first master weight's name (its device picks the backend)
    quads_master_name = "weight"

    def quads_select_backend(self) -> Backend:
        """(Re)pick the backend for the device the master weights are on."""
        self.quads_backend = select_backend(getattr(self, self.quads_master_name).device)
        return self.quads_backend

    def quads_trainer_backend(self) -> Backend:
        """The stored backend (picked now if the module predates it, e.g. unpickled)."""
        return self.__dict__.get("quads_backend") or self.quads_select_backend()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.quads_select_backend()  # .to(device) / .cuda() / to_empty(): the backend follows the weights
        return out


class TrainerLinear(TrainerModule):
    #: the sibling group sharing this weight's NVFP4 global scale
    #: (:class:`~quads.policies.scale_groups.ScaleGroup`; set by ``quantize_`` in group mode), or None
    quads_scale_group = None

    def quads_global_scale(self):
        """The global scale this forward quantizes the weight with when it is not the weight's
        own: the sibling group's, from every member's master (``S_enc``, or on kernel backends the
        group's amax bits the fused pass derives it from), or None. Computed once per forward of
        the members' parent and shared by the members (:meth:`ScaleGroup.scale`), never kept
        across forwards."""
        group = self.quads_scale_group
        return None if group is None else group.scale()

    def quads_forward_weight(self) -> torch.Tensor:
        """The weight this module's forward multiplies by (no gradient): ``DQ(Q(master))`` with
        the group's global scale in group mode."""
        with torch.no_grad():
            return fake_quantize_weight(self.weight, self.quads_trainer_backend(), None, self.quads_global_scale(),
                                        self.quads_policy.weight_block_scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.quads_trainer_backend()
        if self.quads_act is not None:
            x = fake_quantize_activation(x, self.quads_act, backend)
        return fake_quant_linear(x, self.weight, self.bias, backend, self.quads_global_scale(),
                                 self.quads_policy.weight_block_scaling)


class RolloutLinear(RolloutModule):
    quads_packed_names = ("weight",)
    #: calibrated channel mask (K,) for residual_selection="static", else None
    quads_static_mask: torch.Tensor | None = None
    #: the sibling set (:class:`~quads.ops.sibling_linear.SiblingSet`) this linear belongs to, if any
    quads_group = None
    quads_group_index = 0
    #: the siblings sharing this weight's NVFP4 global scale (group mode,
    #: :class:`~quads.policies.scale_groups.ScaleGroup`), or None
    quads_scale_group = None

    def _quads_masks(self) -> tuple:
        return (self.quads_static_mask,)

    def quads_make_kernel(self) -> LinearKernel:
        (prepared,) = self.quads_prepared
        return self.quads_backend.linear_kernel(LinearArgs(self.weight, self.quads_act, self.quads_static_mask,
                                                           prepared))

    def _quads_forward_inputs(self) -> None:
        # the forward's kernel: this linear's own, or in a sibling set (q/k/v, gate/up) that has
        # something for it its member kernel (its columns of the set's GEMM, or the set's operands
        # into its own kernel)
        group = self.quads_group
        self._quads_forward_kernel = (self._quads_kernel if group is None or not group.serves(self._quads_kernel)
                                      else SiblingMember(group, self.quads_group_index, self._quads_kernel))

    def quads_sibling_set_changed(self) -> None:
        """Called by a :class:`~quads.ops.sibling_linear.SiblingSet` after it made this linear a
        member or released it."""
        if "_quads_kernel" in self.__dict__:
            self._quads_forward_inputs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quads_forward_kernel.apply(x, self.bias)

    def quads_sibling_inputs(self) -> tuple:
        """(linear kernel, bias) as the sibling set computes with them."""
        return self._quads_kernel, self.bias

    def quads_unstack(self, view) -> None:
        """Leave a stacked layout: this linear's prepared weight becomes its own copy of ``view``."""
        self.quads_prepared = (type(view)(view.values.clone(), view.scales.clone(), view.n, view.k),)
        self._quads_refresh_kernel()  # remade now over its own layout


def apply_gate(module: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """A fused experts module's gate: its ``_apply_gate`` if it has one, else ``act(gate) * up``."""
    return gate_of(module)(gate_up_out)


def gate_of(module: nn.Module):
    """The callable a fused experts module's gate is: its ``_apply_gate`` (the model's own code),
    else ``act(gate) * up`` (:func:`~quads.ops.experts_op.act_and_mul` over its ``act_fn``)."""
    gate_fn = getattr(module, "_apply_gate", None)
    if gate_fn is not None:
        return gate_fn
    act = getattr(module, "act_fn", None)
    if act is None:  # (found when the gate runs, not when the kernel is made: a module may never run)
        return functools.partial(_missing_gate, type(module).__name__)
    return functools.partial(act_and_mul, act)


def _missing_gate(name: str, gate_up_out: torch.Tensor) -> torch.Tensor:
    raise AttributeError(f"{name} has neither _apply_gate nor act_fn: quads cannot run its experts' gate")


def _bias(module: nn.Module, name: str) -> torch.Tensor | None:
    if not getattr(module, "has_bias", False):
        return None
    return getattr(module, name, None)


class TrainerExperts(TrainerModule):
    quads_master_name = "gate_up_proj"
    #: False: always the per-expert loop (the reference the grouped path is tested against)
    quads_grouped = True

    def forward(self, hidden_states, top_k_index, top_k_weights):
        backend = self.quads_trainer_backend()
        gate_up_bias, down_bias = _bias(self, "gate_up_proj_bias"), _bias(self, "down_proj_bias")
        act = self.quads_act
        if (self.quads_grouped and gate_up_bias is None and down_bias is None
                and (act is None or act.granularity == "row") and grouped_mm_available(hidden_states.device)):
            return grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights, apply_gate, backend)
        # the per-expert loop (expert biases, per-tensor activation scales, no grouped GEMM)
        block_scaling = self.quads_policy.weight_block_scaling
        gate_up = fake_quantize_weight(self.gate_up_proj, backend, block_scaling=block_scaling)  # once, all experts
        down = fake_quantize_weight(self.down_proj, backend, block_scaling=block_scaling)

        def mlp(rows: torch.Tensor, e: int) -> torch.Tensor:
            if act is not None:
                rows = fake_quantize_activation(rows, act, backend)
            h = F.linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
            h = apply_gate(self, h)
            if act is not None:
                h = fake_quantize_activation(h, act, backend)
            return F.linear(h, down[e], None if down_bias is None else down_bias[e])

        return experts_loop(hidden_states, top_k_index, top_k_weights, gate_up.shape[0], mlp)


class RolloutExperts(RolloutModule):
    quads_packed_names = ("gate_up_proj", "down_proj")
    #: calibrated channel masks (H,) for gate_up's input and (I,) for down's input
    quads_static_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    #: set by calibration: called with (input_name, activation) for every quantized input
    quads_observer = None

    def _gate_and_observe(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        h = apply_gate(self, gate_up_out)
        if self.quads_observer is not None:
            self.quads_observer("down_proj", h)
        return h

    def _quads_masks(self) -> tuple:
        return tuple(self.quads_static_masks)

    def quads_make_kernel(self):
        act, masks, prepared = self.quads_act, self.quads_static_masks, self.quads_prepared
        return self.quads_backend.experts_kernel(LinearArgs(self.gate_up_proj, act, masks[0], prepared[0]),
                                                 LinearArgs(self.down_proj, act, masks[1], prepared[1]))

    def _quads_forward_inputs(self) -> None:
        # the model's gate called by the kernel directly (calibration: the observing one), the biases
        self._quads_gate = gate_of(self) if self.quads_observer is None else self._gate_and_observe
        self._quads_biases = (_bias(self, "gate_up_proj_bias"), _bias(self, "down_proj_bias"))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.quads_observer is not None:
            self.quads_observer("gate_up_proj", hidden_states)
        return self._quads_kernel.apply(hidden_states, top_k_index, top_k_weights, self._quads_gate,
                                        self._quads_biases)
