"""Trainer -> rollout weight sync: re-quantize the BF16 masters into the rollout in place.

A sync is a transaction (an RL run syncs thousands of times; one bad step must never leave the
rollout half-updated while it still produces plausible numbers):

1. **plan** (metadata only): match every rollout parameter to a trainer parameter by name, ties
   included; unmatched names, shape or dtype mismatches, packed trainer parameters and ties the
   trainer does not share are errors, all listed in one message;
2. **stage**: packed parameters are re-quantized through their module's backend into new parts,
   dense ones cast / moved to the rollout parameter;
3. **check**: every tensor to be written is finite (one fused reduction per tensor, one host sync
   per device: :func:`quads.tensor.finite.nonfinite_names`), and no packed weight dequantizes
   beyond its rollout dtype (:func:`quads.tensor.finite.check_dequantized_range`);
4. **write**: in place, into the existing storage, then ``quads_weights_changed()`` on every
   rollout module whose packed weights were written.

Any error in 1-3 leaves the rollout bit for bit as it was and names the parameter(s); an
exception in 4, KeyboardInterrupt included, restores every tensor already written from a
per-tensor snapshot (:func:`_write`), so no weight is ever left torn.

Two syncs into one rollout never interleave: each holds the rollout's lock
(:func:`quads.policies.sync_lock.rollout_write_lock`) from plan to write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from quads.ops.backend_registry import Backend, select_backend
from quads.policies.modules import QuadsModule, rollout_owners
from quads.policies.scope import conversion_mismatch
from quads.policies.shards import has_sharded_parameters
from quads.policies.sync_lock import rollout_write_lock
from quads.tensor.finite import FiniteProbe
from quads.tensor.nvfp4_math import NVFP4Parts, shared_global_encode_scale
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["SyncMismatch", "sync_weights_"]

_SHOWN = 5  # names listed per problem in an error message
_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)
NOTHING_WRITTEN = "sync_weights_ (nothing was written)"


class SyncMismatch(ValueError):
    """The two models of a sync do not match; nothing was written. The message is one line (how
    many problems, the first one); ``problems`` lists every one."""

    def __init__(self, what: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"sync_weights_: nothing was written; {what}: {_summary(self.problems)}")


def _summary(problems: list[str]) -> str:
    """One line for a list of problems: the only one, or how many share the first one's reason
    (the text after the first name), that one, and how many others; the list is on the error."""
    if len(problems) == 1:
        return problems[0]
    first = problems[0]
    reason = first.partition(" ")[2] if " " in first else first
    same = sum(1 for p in problems if p.partition(" ")[2] == reason)
    line = f"{len(problems)} problems, first: {first}"
    if same == len(problems):
        line = f"{same} differ the same way, first: {first}"
    elif same > 1:
        line += f" ({same} alike)"
    return line + " (every one: the exception's .problems)"


def _side_of(model: nn.Module) -> set[str]:
    return {m.quads_policy.side for m in model.modules() if isinstance(m, QuadsModule)}


def _has_packed(model: nn.Module) -> bool:
    return any(isinstance(p, NVFP4Tensor) for p in model.parameters())


def _check_roles(rollout_model: nn.Module, trainer_model: nn.Module, plain_trainer: bool) -> None:
    """One line before any planning: the arguments swapped, a rollout given as the trainer, two
    architectures, or a never-quantized trainer syncing into a quads rollout (unless asked for)."""
    rollout_sides, trainer_sides = _side_of(rollout_model), _side_of(trainer_model)
    if "rollout" in trainer_sides or _has_packed(trainer_model):
        if "trainer" in rollout_sides or (not rollout_sides and not _has_packed(rollout_model)):
            raise ValueError("sync_weights_: nothing was written; the arguments look swapped: it is "
                             "sync_weights_(rollout, trainer), and the first model is a trainer, the second a rollout")
        raise ValueError("sync_weights_: nothing was written; trainer_model holds packed NVFP4 weights (a rollout); "
                         "sync from the trainer's high-precision masters")
    kinds = [getattr(getattr(m, "config", None), "model_type", None) for m in (rollout_model, trainer_model)]
    if None not in kinds and kinds[0] != kinds[1]:
        raise ValueError(f"sync_weights_: nothing was written; the rollout is a {kinds[0]!r} model, the trainer a "
                         f"{kinds[1]!r} one: build the rollout from its trainer (quads.policies.build_rollout_model)")
    if rollout_sides and not trainer_sides and not plain_trainer:
        raise ValueError("sync_weights_: nothing was written; trainer_model has no quads layers (never quantized): "
                         "quantize_(trainer, QuadsPolicy(side='trainer')) first, or pass plain_trainer=True to sync "
                         "BF16 masters (the BF16-trainer plans such as naive)")


@dataclass
class _Write:
    """One rollout parameter (all its tied names) and the trainer tensor it receives."""

    names: list[str]  # rollout names of the parameter (ties: several)
    param: torch.Tensor  # the rollout parameter (NVFP4Tensor for packed ones)
    source: torch.Tensor  # the trainer's master, detached
    backend: Backend | None = None  # packed only: the owning module's backend
    block_scaling: str = "6"  # packed only: the owning module policy's weight_block_scaling
    staged: NVFP4Parts | torch.Tensor | None = None
    group: tuple["_Write", ...] | None = None  # group mode: the writes of its sibling group (itself included)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def packed(self) -> bool:
        return isinstance(self.param, NVFP4Tensor)


def _grouped(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """id(parameter) -> (parameter, every name it has): tied parameters appear once."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(param), (param, []))[1].append(name)
    return out


def _listing(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _problem(param: torch.Tensor, source: torch.Tensor) -> str | None:
    """Why ``source`` cannot be synced into ``param`` (metadata only), or None."""
    if isinstance(source, NVFP4Tensor):
        return "is packed (NVFP4Tensor) in the trainer; sync from high-precision masters"
    if source.device.type == "meta":
        return "is on the meta device in the trainer (no values to sync); load the trainer's weights first"
    if tuple(source.shape) != tuple(param.shape):
        return f"has shape {tuple(source.shape)} in the trainer, {tuple(param.shape)} in the rollout"
    if not source.dtype.is_floating_point:
        return f"is {source.dtype} in the trainer; masters must be floating point"
    if isinstance(param, NVFP4Tensor) and source.dtype not in _QUANTIZABLE:
        return f"is {source.dtype} in the trainer; NVFP4 quantizes float32/bfloat16/float16 masters"
    if not isinstance(param, NVFP4Tensor) and not param.dtype.is_floating_point:
        return f"is {param.dtype} in the rollout; only floating-point parameters are synced"
    return None


def _plan(rollout_model: nn.Module, trainer_model: nn.Module, strict: bool) -> list[_Write]:
    """Match parameters and check names, ties, shapes and dtypes; no device work."""
    masters = dict(trainer_model.named_parameters(remove_duplicate=False))
    owners = rollout_owners(rollout_model)
    writes, missing, problems = [], [], []
    rollout_names: set[str] = set()
    for param, names in _grouped(rollout_model).values():
        rollout_names.update(names)
        found = [n for n in names if n in masters]
        missing += [n for n in names if n not in masters]
        if not found:
            continue
        if len({id(masters[n]) for n in found}) > 1:
            problems.append(f"{' / '.join(found)}: tied in the rollout, separate parameters in the trainer")
            continue
        source = masters[found[0]].detach()
        why = _problem(param, source)
        if why:
            problems.append(f"{names[0]} {why}")
            continue
        write = _Write(names, param, source)
        if write.packed:
            holders = owners.get(id(param))
            write.backend = holders[0].quads_backend if holders else select_backend(param.device)
            write.block_scaling = holders[0].quads_policy.weight_block_scaling if holders else param.block_scaling
        writes.append(write)
    unexpected = [n for n in masters if n not in rollout_names]
    if strict and missing:
        problems.append(f"{len(missing)} rollout parameter(s) have no trainer counterpart: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} trainer parameter(s) have no rollout counterpart: {_listing(unexpected)}")
    if problems:
        hint = " (pass strict=False to sync only the parameters both models have)" if missing or unexpected else ""
        raise SyncMismatch("the models do not match" + hint, problems)
    if not writes:
        raise ValueError("sync_weights_: the two models have no parameter name in common; nothing to sync")
    problems = _plan_scale_groups(writes, rollout_model, trainer_model)
    if problems:
        raise SyncMismatch("the global-scale groups do not match", problems)
    return writes


def _group_names(module, names: dict[int, str]) -> tuple[str, ...] | None:
    group = getattr(module, "quads_scale_group", None)
    return None if group is None else tuple(names.get(id(m), "?") for m in group.members)


def _plan_scale_groups(writes: list[_Write], rollout_model: nn.Module, trainer_model: nn.Module) -> list[str]:
    """Give each packed write of a sibling group the writes of its group (group mode, see
    :mod:`quads.policies.scale_groups`) and check that the trainer's modules quantize with the
    same global scales (mode and groups); returns the problems found."""
    by_param = {id(w.param): w for w in writes if w.packed}
    rollout_names = {id(m): n for n, m in rollout_model.named_modules()}
    trainer_modules = dict(trainer_model.named_modules())
    trainer_names = {id(m): n for n, m in trainer_modules.items()}
    problems, done = [], set()
    for name, module in rollout_model.named_modules():
        if not isinstance(module, QuadsModule):
            continue
        trainer = trainer_modules.get(name)
        if isinstance(trainer, QuadsModule):
            mismatch = module.quads_policy.weight_mismatch(trainer.quads_policy)
            if mismatch:
                problems.append(f"{name}: {mismatch}")
                continue
            if _group_names(module, rollout_names) != _group_names(trainer, trainer_names):
                problems.append(f"{name}: shares its global scale with {_group_names(module, rollout_names)} in the "
                                f"rollout, {_group_names(trainer, trainer_names)} in the trainer")
                continue
        group = getattr(module, "quads_scale_group", None)
        if group is None or id(group) in done:
            continue
        done.add(id(group))
        members = [by_param.get(id(m.weight)) for m in group.members]
        left_out = [rollout_names.get(id(m), "?") for m, w in zip(group.members, members) if w is None]
        if left_out:
            problems.append(f"{', '.join(left_out)}: not synced, but its sibling group {list(group.names)} shares "
                            "one global scale computed from every member's master; sync the whole group")
            continue
        for w in members:
            w.group = tuple(members)
    return problems


def _stage(writes: list[_Write]) -> None:
    """Compute every new value (quantized parts, dense copies on the rollout's device and dtype)."""
    group_scales: dict[int, torch.Tensor] = {}
    for w in writes:
        if w.packed:
            dense = w.source.to(w.param.device)
            granularity, scale = w.param.granularity, None
            if w.group is not None:  # one S_enc from every member's master
                key = id(w.group[0])
                if key not in group_scales:
                    group_scales[key] = shared_global_encode_scale((m.source.to(w.param.device) for m in w.group),
                                                                   w.block_scaling)
                granularity, scale = "tensor", group_scales[key].to(w.param.device)
            parts = w.backend.quantize_weight(dense.transpose(-2, -1) if w.param.transposed else dense,
                                              granularity, scale, w.block_scaling)
            for part, new, old in zip(NVFP4Parts._fields, parts, w.param.stored_parts()):  # shapes only
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise ValueError(
                        f"sync_weights_: nothing was written; re-quantizing {w.name} gave {part} "
                        f"{tuple(new.shape)} {new.dtype}, the rollout holds {tuple(old.shape)} {old.dtype}"
                    )
            w.staged = NVFP4Parts(*parts)
        else:
            w.staged = w.source.to(device=w.param.device, dtype=w.param.dtype)


def _probe(writes: list[_Write]) -> FiniteProbe:
    """The checks' reductions, launched (read by ``FiniteProbe.check``): every master of a packed
    weight and every dense value to be written is finite, no packed weight dequantizes beyond its
    rollout dtype."""
    return FiniteProbe([(w.name, w.source if w.packed else w.staged) for w in writes],
                       [(w.name, w.staged, w.param.orig_dtype) for w in writes if w.packed])


def _check_finite(writes: list[_Write]) -> None:
    """Every tensor that will be written is finite: one reduction each, one host sync per device."""
    _probe(writes).check(NOTHING_WRITTEN)


def _written_modules(writes: list[_Write], rollout_model: nn.Module) -> list:
    """The rollout modules holding a written packed weight (each once), to be notified."""
    owners = rollout_owners(rollout_model)
    modules: dict[int, object] = {}
    for w in writes:
        for module in owners.get(id(w.param), []) if w.packed else []:
            modules.setdefault(id(module), module)
    return list(modules.values())


def _write(writes: list[_Write], rollout_model: nn.Module) -> None:
    """Copy the staged values into the rollout's storage and notify the modules written.

    In place (captured CUDA graphs read these addresses), and undone on *any* exception,
    KeyboardInterrupt included: each tensor's old value is cloned just before it is
    overwritten, and the staged value it replaces is released, so the snapshot costs one
    extra copy per tensor and, where the staged values are new tensors (every packed weight,
    and dense ones cast or moved), no memory beyond one tensor; a dense parameter whose master
    already has the rollout's dtype and device is staged as the master itself, and its
    snapshot adds its bytes until the sync returns (docs/validation.md). On a BaseException every tensor written so far gets its old value
    back and the modules are notified again, so the rollout is what it was, bit for bit.
    """
    done: list[tuple[_Write, object]] = []
    try:
        for w in writes:
            done.append((w, _snapshot(w)))  # before the first byte is written
            _put(w, w.staged)
            w.staged = None  # the snapshot replaces the staged copy: memory stays flat
        for module in _written_modules(writes, rollout_model):
            module.quads_weights_changed()
    except BaseException:
        for w, old in reversed(done):
            _restore(w, old)
        for module in _written_modules(writes, rollout_model):
            module.quads_weights_changed()  # derived layouts follow the restored parts
        raise


def _snapshot(w: _Write):
    """A copy of what ``w`` overwrites: the packed weight's storage (its parts, or the kernel layout
    holding them: ``NVFP4Tensor.storage_snapshot``), or the dense parameter."""
    return w.param.storage_snapshot() if w.packed else w.param.clone()


def _restore(w: _Write, old) -> None:
    """Undo ``w``'s write from its :func:`_snapshot`."""
    if w.packed:
        w.param.restore_storage_(old)
    else:
        w.param.copy_(old)


def _put(w: _Write, value) -> None:
    """Write ``value`` into ``w``'s storage in place: packed parts through ``NVFP4Tensor.write_parts_``
    (into the kernel layout when it holds them), a dense parameter by ``copy_``."""
    if w.packed:
        w.param.write_parts_(value)
    else:
        w.param.copy_(value)


@torch.no_grad()
def sync_weights_(rollout_model: nn.Module, trainer_model: nn.Module, *, strict: bool = True,
                  plain_trainer: bool = False) -> int:
    """Copy every parameter of ``trainer_model`` into ``rollout_model`` (same architecture), all or nothing.

    Packed NVFP4 rollout parameters are re-quantized from the trainer's masters with the
    recipe the trainer's fake quantizer uses (through the rollout module's backend: kernels on
    the GPU, same bits), into their existing storage, so afterwards
    ``rollout_param.dequantize(w.dtype)`` equals the trainer's forward weight bit for bit.
    Other parameters (embeddings, norms, routers, lm_head) are copied, cast to the rollout's dtype.

    Every parameter name of either model must exist in the other (``strict=False``: only the
    common names are synced), and a quads trainer and its rollout must convert the same modules
    (one plan's scope and boundary layers on both sides; a plain trainer agrees with any
    rollout); a mismatch, a shape or dtype error, a tie the trainer does not
    share or a NaN/Inf in any tensor to be written raises ValueError naming the parameters, with
    nothing written (see the module doc); several problems are one line, every one in the
    :class:`SyncMismatch`'s ``problems``. Refused in one line first: the arguments swapped, a
    rollout as ``trainer_model``, two architectures (``config.model_type``), and a trainer
    without quads layers syncing into a quads rollout unless ``plain_trainer=True`` (the
    BF16-trainer plans, ``naive``: its masters are then the forward weights). Returns the number of rollout parameters written
    (tied names count once).

    A sharded trainer (FSDP2 / DTensor parameters) makes this a collective: every rank calls it
    with its own full rollout replica (:func:`quads.policies.sharded_sync.sync_sharded_weights_`).

    Concurrent syncs into one rollout (two trainer threads) take turns: each holds the
    rollout's lock for the whole transaction (see the module doc).
    """
    for what, model in (("rollout_model", rollout_model), ("trainer_model", trainer_model)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"sync_weights_: {what} must be an nn.Module, got {type(model).__name__}"
                            + (" (to sync from a state dict, load it into a trainer model first)"
                               if isinstance(model, dict) else ""))
    for what, flag in (("strict", strict), ("plain_trainer", plain_trainer)):
        if not isinstance(flag, bool):
            raise TypeError(f"sync_weights_: {what} must be True or False, got {flag!r}")
    _check_roles(rollout_model, trainer_model, plain_trainer)
    with rollout_write_lock(rollout_model):
        return _sync(rollout_model, trainer_model, strict)


def _sync(rollout_model: nn.Module, trainer_model: nn.Module, strict: bool) -> int:
    """The transaction of :func:`sync_weights_`, under the rollout's lock."""
    mismatch = conversion_mismatch(rollout_model, trainer_model)
    if mismatch:
        raise ValueError(f"sync_weights_: nothing was written; {mismatch}")
    if has_sharded_parameters(trainer_model):
        from quads.policies.sharded_sync import sync_sharded_weights_  # it imports this module

        return sync_sharded_weights_(rollout_model, trainer_model)
    writes = _plan(rollout_model, trainer_model, strict)
    _stage(writes)
    _check_finite(writes)
    _write(writes, rollout_model)
    return len(writes)
