"""Whether a model's decode step can be captured as a CUDA graph, decided before capturing.

A CUDA graph cannot hold a host synchronization: an op that reads a device value on the host
(``nonzero``, ``.item()``, ``.tolist()``) fails the capture with
``cudaErrorStreamCaptureUnsupported``. The rule (:func:`capture_plan`, pure Python, checked on
CPU) reads the model's modules:

* quads rollout modules capture by construction (their kernels and routing keep fixed shapes);
* transformers' MoE experts (the ``@use_experts_implementation`` interface) capture with the
  ``grouped_mm`` and ``batched_mm`` implementations; the ``eager`` one loops over the experts hit
  (``expert_mask.sum(...).nonzero()``, a sync), so the plan switches it to ``grouped_mm`` for the
  decoder's forwards (``batched_mm`` where torch's grouped GEMM cannot run on the device: its
  fallback loops over ``offs.tolist()``); an implementation it does not know is a blocker;
* a per-expert loop over an ``nn.ModuleList`` of experts (MoE blocks without the interface)
  indexes by data-dependent token sets: a blocker.

A blocker is a one-line reason: the decoder then decodes eagerly (same step, no graph) and says
so once, before any capture. What the rule cannot see (a sync in some other module's forward),
the decoder's warm-up catches: its last warm-up step runs with CUDA's sync debug mode set to
error, so a synchronizing op is refused there, before the capture (docs/engine.md).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from quads.policies.modules import RolloutModule
from quads.policies.quantize import quantized_modules

__all__ = ["CAPTURABLE_EXPERTS", "CapturePlan", "capture_plan", "captured_reads", "transformers_experts"]

#: transformers experts implementations whose forward has no host synchronization
CAPTURABLE_EXPERTS = ("grouped_mm", "batched_mm")


def transformers_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every transformers experts module (``@use_experts_implementation``)
    that quads has not converted."""
    from transformers.configuration_utils import PreTrainedConfig

    converted = set(quantized_modules(model))
    return {name: m for name, m in model.named_modules()
            if name not in converted and hasattr(m, "is_concatenated") and hasattr(m, "has_gate")
            and isinstance(getattr(m, "config", None), PreTrainedConfig)}


@dataclass(frozen=True)
class CapturePlan:
    """What :func:`capture_plan` decided: ``switch`` = (config, implementation) pairs set for the
    decoder's forwards; ``blocker`` = why the step cannot be captured (one line), or None."""

    switch: tuple = field(default=())
    blocker: str | None = None

    @contextlib.contextmanager
    def applied(self):
        """Inside the block the switched configs run their capturable implementation; each is
        restored on exit (exceptions included)."""
        saved = [(cfg, cfg._experts_implementation_internal) for cfg, _ in self.switch]
        try:
            for cfg, impl in self.switch:
                cfg._experts_implementation_internal = impl  # the internal one: no recursion into sub-configs
            yield
        finally:
            for cfg, impl in saved:
                cfg._experts_implementation_internal = impl


def capture_plan(model: nn.Module, grouped_mm_ok: bool) -> CapturePlan:
    """The capture decision for ``model``'s decode step (see the module doc).

    ``grouped_mm_ok``: torch's grouped GEMM runs on the model's device (``quads.policies.
    trainer_experts.grouped_mm_available``); it picks the implementation eager experts switch to.
    """
    converted = quantized_modules(model)
    for name, module in model.named_modules():
        if name in converted:
            continue
        if isinstance(getattr(module, "experts", None), nn.ModuleList):
            return CapturePlan(blocker=f"{name or type(module).__name__} ({type(module).__name__}) loops over an "
                                       "nn.ModuleList of experts with data-dependent token sets (host syncs)")
    target = "grouped_mm" if grouped_mm_ok else "batched_mm"
    switch = {}
    for name, module in transformers_experts(model).items():
        cfg = module.config
        impl = getattr(cfg, "_experts_implementation", None) or "eager"
        if impl == "grouped_mm" and not grouped_mm_ok:
            switch[id(cfg)] = (cfg, "batched_mm")  # transformers' fallback loops over offs.tolist()
        elif impl == "eager":
            switch[id(cfg)] = (cfg, target)
        elif impl not in CAPTURABLE_EXPERTS and id(cfg) not in switch:
            return CapturePlan(blocker=f"{name} ({type(module).__name__}): experts implementation {impl!r} is not "
                                       f"known to capture (capturable: {', '.join(CAPTURABLE_EXPERTS)})")
    return CapturePlan(switch=tuple(switch.values()))


def _addresses(t: torch.Tensor) -> tuple:
    """Where a captured step reads ``t``: a packed weight's stored or layout tensors, else its own."""
    held = t.written_storage() if hasattr(t, "written_storage") else (t,)
    return tuple((h.data_ptr(), h.dtype, tuple(h.shape), h.stride()) for h in held)


def captured_reads(model: nn.Module) -> list:
    """What a captured decode step of ``model`` reads, for a decoder to compare before replaying
    it: every parameter's and buffer's storage (address, dtype, shape, strides), and each quads
    rollout module's kernel and sibling set, by weak reference (a write in place keeps them; a
    refresh that replaced what a kernel reads makes a new kernel; fusing or dissolving makes or
    drops a set). Nothing is kept alive by it; a dead reference equals only itself."""
    reads = [_addresses(t) for t in (*model.parameters(), *model.buffers())]
    for module in model.modules():
        if isinstance(module, RolloutModule):
            group = getattr(module, "quads_group", None)
            held = (module.__dict__.get("_quads_kernel"), group, None if group is None else group.kernel())
            reads.append(tuple(None if o is None else weakref.ref(o) for o in held))
    return reads
