"""Push a trainer model's BF16 masters into a running vLLM engine (in place, every RL step).

    from quads.integrations.vllm.weight_push import push_weights
    push_weights(llm, trainer_model)      # after each optimizer step, before generating

What it does, and why (docs/background.md section 3 lists the traps):

* **Names.** A transformers-5 model holds fused MoE experts (``experts.gate_up_proj (E, 2I, H)``,
  ``experts.down_proj (E, H, I)``); vLLM's ``load_weights`` takes checkpoint names
  (``experts.{e}.gate_proj.weight`` ...). :func:`checkpoint_weights` produces the checkpoint
  view of the parameters with transformers' own save-time conversion
  (``revert_weight_conversion``); no copy beyond the expert slices.
* **All shards together, through ``reload_weights``.** ``llm.collective_rpc("reload_weights",
  kwargs={"weights_iterator": ...})`` restores each layer's checkpoint layout, loads the tensors
  and re-runs ``process_weights_after_loading`` (for the ``quads`` method: re-quantization with
  the trainer's quantizer) into the existing storage. A layer is processed once *all* its
  checkpoint tensors have arrived, so a fused layer (``qkv_proj``, ``gate_up_proj``, the MoE
  ``w13``/``w2``) must receive every shard in the same call: a partial push leaves the rest of
  the layer uninitialised (NaNs that poison the KV cache). :func:`push_weights` therefore sends
  the whole model, and refuses a ``weights`` subset unless ``allow_partial=True``.
* **vLLM's own unquantized CPU MoE**: its stale prepack is re-run after a reload (docs/vllm.md).
* **Prefix cache.** ``llm.reset_prefix_cache()`` after every push (cached KV blocks are stale).

Exact alignment needs the masters in the engine's dtype (BF16 both sides): vLLM casts pushed
tensors to its parameter dtype before quantizing.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from quads.policies.modules import is_fused_experts

__all__ = ["checkpoint_weights", "push_weights", "engine_model", "split_fused_experts"]

# Wrapper components that never exist in vLLM's names (torch.compile, FSDP1, activation
# checkpointing; DDP's leading "module.").
_WRAPPER_COMPONENTS = re.compile(r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")


def _clean(name: str) -> str:
    name = _WRAPPER_COMPONENTS.sub(r"\1", name)
    return name.removeprefix("module.")


def _unwrap(model: nn.Module) -> nn.Module:
    while True:
        inner = getattr(model, "_orig_mod", None) or (
            getattr(model, "module", None) if type(model).__name__ in ("DistributedDataParallel", "DataParallel") else None
        )
        if inner is None:
            return model
        model = inner


def split_fused_experts(prefix: str, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``{prefix}.{e}.gate_proj/up_proj/down_proj.weight`` views of a fused experts module
    (``gate_up_proj`` rows are ``[gate; up]``, transformers 5's concatenation order)."""
    if getattr(module, "is_transposed", False):
        raise NotImplementedError(f"{prefix}: transposed fused experts (E, K, N) are not supported")
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", gate_up[e, :inter]
        yield f"{prefix}.{e}.up_proj.weight", gate_up[e, inter:]
        yield f"{prefix}.{e}.down_proj.weight", down[e]
    for pname, tensor in module.named_parameters(recurse=False):
        if pname not in ("gate_up_proj", "down_proj"):
            raise NotImplementedError(f"{prefix}.{pname}: fused-expert parameters other than the weights are not supported")


def _revert(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    try:
        return revert_weight_conversion(model, state)
    except Exception as exc:  # pragma: no cover - defensive: fall back to the plain split
        warnings.warn(f"transformers' revert_weight_conversion failed ({exc!r}); using the plain expert split")
        return None


def checkpoint_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under checkpoint (``save_pretrained``) names, in module order.

    Fused 3-D experts are split per expert; everything else keeps its name (wrapper prefixes
    such as ``_orig_mod.`` and ``module.`` removed). Tensors are detached views, not copies
    (the expert splits are views too), except where transformers' reverse conversion copies.
    """
    model = _unwrap(model)
    seen: set[int] = set()  # tied parameters (lm_head <- embed_tokens) go once, as named_parameters does
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if is_fused_experts(module):
                state = {f"{mod_name}.{n}": p.detach() for n, p in module.named_parameters(recurse=False)}
                reverted = _revert(model, state)
                if reverted is None or any(t.dim() == 3 for t in reverted.values()):
                    yield from split_fused_experts(_clean(mod_name), module)
                else:
                    for name, t in reverted.items():
                        yield _clean(name), t
                continue
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield _clean(f"{mod_name}.{pname}" if mod_name else pname), p.detach()


def engine_model(llm: Any) -> nn.Module:
    """The ``nn.Module`` of an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError as exc:
        raise RuntimeError(
            "cannot reach the vLLM model in this process: run the engine in process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode does)"
        ) from exc


def _refresh_cpu_moe_prepack(worker) -> int:
    """Re-run the CPU prepack of vLLM's *unquantized* MoE layers after a reload (worker side)."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    model = worker.model_runner.model
    refreshed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if (
            isinstance(method, UnquantizedFusedMoEMethod)
            and getattr(method, "moe_kernel", None) is not None
            and module.w13_weight.device.type == "cpu"
        ):
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


_EXPECTED_DTYPE_WARNED = False


def push_weights(
    llm: Any,
    trainer_model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    *,
    allow_partial: bool = False,
    reset_prefix_cache: bool = True,
) -> int:
    """Load ``trainer_model``'s current weights into the running engine ``llm``, in place.

    Args:
        llm: a ``vllm.LLM``.
        trainer_model: the transformers model (any quads trainer policy) whose BF16 masters are
            pushed. Ignored when ``weights`` is given.
        weights: explicit ``(checkpoint_name, tensor)`` pairs instead of the whole model.
        allow_partial: accept ``weights`` that do not cover the engine (see the module doc: a
            fused layer missing a shard ends up with uninitialised memory).
        reset_prefix_cache: drop KV blocks cached with the old weights (default True).

    Returns the number of tensors pushed.
    """
    global _EXPECTED_DTYPE_WARNED
    if weights is None:
        pairs = list(checkpoint_weights(trainer_model))
    else:
        if not allow_partial:
            raise ValueError(
                "push_weights(weights=...) pushes a subset; pass allow_partial=True if it covers every "
                "shard of each layer it touches (partial fused layers are left uninitialised by vLLM)"
            )
        pairs = list(weights)
    engine_dtype = getattr(getattr(llm.llm_engine, "model_config", None), "dtype", None)
    if engine_dtype is not None and not _EXPECTED_DTYPE_WARNED:
        odd = sorted({str(t.dtype) for _, t in pairs if t.is_floating_point() and t.dtype != engine_dtype})
        if odd:
            _EXPECTED_DTYPE_WARNED = True
            warnings.warn(
                f"push_weights: masters in {odd} are cast to the engine dtype {engine_dtype} before NVFP4 "
                "quantization; the engine's weights can then differ from the trainer's fake-quant weights"
            )
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
    llm.collective_rpc(_refresh_cpu_moe_prepack)
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    return len(pairs)
