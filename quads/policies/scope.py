"""Which part of a model a policy quantizes: its ``scope`` and its boundary decoder layers.

* ``scope="all"`` (default): every ``nn.Linear`` and fused MoE experts module outside the skip
  patterns.
* ``scope="routed_experts"``: only the routed experts: transformers-5 fused experts modules
  (3-D ``gate_up_proj`` / ``down_proj``) and the linears of a per-expert module list
  (``experts.N.*``). Attention, shared experts (``shared_expert``, ``shared_experts``: plain
  MLPs every token runs), routers and ``lm_head`` stay in high precision. A model without
  routed experts (a dense model) is **refused**: the plan would quantize nothing, i.e. a BF16
  run under a quantized plan's name.
* **Boundary layers** (``skip_first_layers`` / ``skip_last_layers``): the decoder layers are the
  children of the model's one ``nn.ModuleList`` named ``layers`` (transformers' Llama, Qwen3,
  Qwen3-MoE, Mixtral, ...: ``model.layers.N``); layer ``N`` of ``L`` stays wholly in high
  precision when ``N < first`` or ``N >= L - last``. Whole layers, attention included: with
  ``scope="routed_experts"`` that is exactly the layer's experts, verl's recipe (the first 2
  and last 4 MLP layers in BF16); with ``scope="all"`` the attention of those layers stays
  BF16 too, so a layer is either all NVFP4 or all high precision. A boundary on a model without
  a (single) decoder-layer list, or one covering every layer, is refused, naming the model.

One rule serves every side: :func:`policy_skips` is the name rule of ``quantize_``'s walk
(:func:`quads.policies.walk.policy_targets`), of ``quads export`` and of the torchao handler
(names in the root model); the vLLM method applies :func:`boundary_layer` to its own prefixes
(``model.layers.N...``, ``L`` from the model's config). :func:`conversion_mismatch` is
``sync_weights_``'s check that a quads trainer and its rollout were converted with one plan
(scope and boundary layers), like its ``weight_global_scale`` check.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import torch.nn as nn

from quads.policies.modules import QuadsModule, is_fused_experts
from quads.policies.policy import QuadsPolicy

__all__ = ["DecoderLayers", "decoder_layers", "boundary_layer", "layer_index", "routed_expert_names",
           "scope_problem", "policy_skips", "conversion_mismatch"]

#: a linear of a per-expert module list (``...experts.3.gate_proj``): a routed expert's
_PER_EXPERT = re.compile(r"(^|\.)experts\.\d+(\.|$)")
#: the layer index in a module name or vLLM prefix (``model.layers.7.mlp``)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_SHOWN = 3


class DecoderLayers(NamedTuple):
    """The decoder-layer list of a model: its qualified name (``model.layers``) and length."""

    name: str
    count: int


def decoder_layers(model: nn.Module) -> DecoderLayers | None:
    """The model's decoder-layer list (the one ``nn.ModuleList`` named ``layers``), or None.

    Raises ValueError when there are several (a vision tower's and a text model's): which one
    the boundary counts would be a guess."""
    found = [DecoderLayers(name, len(m)) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers" and len(m)]
    if len(found) > 1:
        raise ValueError(f"{type(model).__name__} has {len(found)} decoder-layer lists "
                         f"({', '.join(f.name for f in found)}); boundary layers would be ambiguous")
    return found[0] if found else None


def layer_index(name: str, layers: str | None = None) -> int | None:
    """The decoder-layer index in a module name (under ``layers``, e.g. ``model.layers``; any
    ``...layers.N...`` without it), or None outside the decoder layers."""
    if layers is not None:
        head = f"{layers}." if layers else ""
        if not name.startswith(head):
            return None
        first = name[len(head):].partition(".")[0]
        return int(first) if first.isdigit() else None
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def boundary_layer(index: int | None, count: int, policy: QuadsPolicy) -> bool:
    """Whether decoder layer ``index`` (of ``count``) stays in high precision under ``policy``."""
    if index is None:
        return False
    return index < policy.skip_first_layers or index >= count - policy.skip_last_layers


def routed_expert_names(model: nn.Module) -> set[str]:
    """Qualified names of the routed-expert modules of ``model`` (fused experts modules and
    the linears of per-expert module lists)."""
    return {name for name, m in model.named_modules()
            if is_fused_experts(m) or (isinstance(m, nn.Linear) and _PER_EXPERT.search(name))}


def _fields(policy: QuadsPolicy) -> str:
    return f"skip_first_layers={policy.skip_first_layers}, skip_last_layers={policy.skip_last_layers}"


def scope_problem(model: nn.Module, policy: QuadsPolicy) -> str | None:
    """Why ``policy``'s scope or boundary layers cannot apply to ``model`` (one line), or None."""
    name = type(model).__name__
    if policy.scope == "routed_experts" and not routed_expert_names(model):
        return (f"QuadsPolicy.scope='routed_experts': {name} has no routed experts (a dense model), so nothing "
                "would be quantized; use scope='all'")
    if policy.skips_boundary_layers:
        try:
            layers = decoder_layers(model)
        except ValueError as err:
            return f"QuadsPolicy({_fields(policy)}): {err}"
        if layers is None:
            return (f"QuadsPolicy({_fields(policy)}): {name} has no decoder-layer list (an nn.ModuleList named "
                    "'layers', as transformers' decoder models have), so boundary layers cannot be numbered")
        if policy.skip_first_layers + policy.skip_last_layers >= layers.count:
            return (f"QuadsPolicy({_fields(policy)}) keeps all {layers.count} decoder layers of {name} in high "
                    "precision: nothing in them would be quantized")
    return None


def policy_skips(model: nn.Module, policy: QuadsPolicy) -> Callable[[str], bool]:
    """The name rule of what ``policy`` leaves in high precision in ``model`` (the root model:
    names are its qualified names): the skip patterns, the scope and the boundary layers.

    Raises ValueError (:func:`scope_problem`) when the scope or boundary cannot apply."""
    if not policy.is_scoped:
        return policy.skips
    problem = scope_problem(model, policy)
    if problem:
        raise ValueError(problem)
    experts = routed_expert_names(model) if policy.scope == "routed_experts" else None
    layers = decoder_layers(model) if policy.skips_boundary_layers else None

    def skips(name: str) -> bool:
        if policy.skips(name):
            return True
        if experts is not None and name not in experts:
            return True
        return layers is not None and boundary_layer(layer_index(name, layers.name), layers.count, policy)

    return skips


def _plan(policy: QuadsPolicy) -> str:
    return f"scope={policy.scope!r}, {_fields(policy)}"


def conversion_mismatch(rollout_model: nn.Module, trainer_model: nn.Module) -> str | None:
    """Why a quads trainer and its rollout would not convert the same modules (one line), or None:
    a module converted on both sides under policies with another scope or other boundary layers
    (or, with no module converted on both, the two sides' first policies differing so).

    A plain (unconverted) trainer is the BF16-trainer plans' (``naive``) and always agrees.
    Differing skip patterns are the caller's to choose and are not checked here."""
    trainer = {n: m.quads_policy for n, m in trainer_model.named_modules() if isinstance(m, QuadsModule)}
    rollout = {n: m.quads_policy for n, m in rollout_model.named_modules() if isinstance(m, QuadsModule)}
    if not trainer or not rollout:
        return None
    pairs = [(n, rollout[n], trainer[n]) for n in rollout if n in trainer]
    if not pairs:
        first_r, first_t = next(iter(rollout)), next(iter(trainer))
        pairs = [(f"{first_r} (rollout) / {first_t} (trainer)", rollout[first_r], trainer[first_t])]
    for name, mine, theirs in pairs:
        if _plan(mine) != _plan(theirs):
            return (f"{name}: the rollout was converted with {_plan(mine)}, the trainer with {_plan(theirs)}; the "
                    "two sides would quantize different modules (use one plan on both sides)")
    return None
