"""Trainer -> rollout weight sync from sharded (FSDP2) masters, all or nothing, collective.

Every rank holds a full rollout replica (see ``docs/distributed.md`` for why) and calls
:func:`sync_sharded_weights_` with it at the same point (``quads.sync_weights_`` dispatches
here when the trainer is sharded). Packed NVFP4 parameters are never gathered in high
precision: each rank quantizes its own dim-0 shard with the global scale of the *whole*
weight (``S_enc`` from an all-reduced max of the local amaxes: one value per tensor, one per
expert for 3-D experts), which gives those rows the very bits a single-process quantization
of the whole weight gives them (NVFP4 blocks run along the last dim, so a dim-0 shard holds
whole blocks), and the packed parts (0.5625 byte per weight) are all-gathered, about 3.6x less
traffic than BF16 and 7.1x less than FP32 masters. Other parameters (embeddings, norms,
routers, ``lm_head``) are gathered in the rollout's dtype.

All or nothing, in stages, so a failure anywhere leaves every rank's rollout as it was:

1. *plan* (local): match every rollout parameter to a master by name, check shapes and layouts;
2. *agree* (one small all-reduce): every rank learns whether any rank's plan failed, and that
   all ranks planned the same parameters, so a mismatch raises everywhere instead of hanging;
3. *validate* (two small all-reduces): non-finite counts (summed) and amaxes (max) of the
   packed parameters' shards; any non-finite value raises on every rank, naming the parameter;
4. *stage*: quantize local shards into new tensors, agree once more that every rank staged,
   all-gather (bucketed, one collective per bucket) and assemble full parts, still in new tensors;
5. *write*: only now copy into the rollout's parameters, then ``quads_weights_changed()``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from quads.ops.weight_quant import quantize_weight_reference
from quads.policies.modules import RolloutModule, rollout_owners
from quads.policies.shards import Master, is_dtensor, shard_rows, trainer_masters
from quads.tensor.nvfp4_math import (BLOCK_SIZE, NVFP4Parts, default_granularity, global_amax,
                                     global_encode_scale_from_amax)
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["DEFAULT_BUCKET_BYTES", "ShardedSyncError", "sync_sharded_weights_"]

#: all-gather bucket: the most bytes one rank contributes to one collective
DEFAULT_BUCKET_BYTES = 128 << 20


class ShardedSyncError(RuntimeError):
    """Raised on the ranks whose own plan was fine when another rank rejected the sync."""


@dataclass
class _Entry:
    """One rollout parameter and the master it is synced from."""

    name: str
    param: torch.Tensor  # the rollout parameter (NVFP4Tensor or dense)
    master: Master
    holders: list[RolloutModule] = field(default_factory=list)  # rollout modules holding it (ties: several)
    granularity: str | None = None  # packed entries: "tensor" or "expert"
    block_scaling: str = "6"  # packed entries: the holders' QuadsPolicy.weight_block_scaling
    group: int | None = None  # group mode: id of the sibling group sharing its global scale
    # filled while validating / staging
    global_scale: torch.Tensor | None = None
    local_parts: list[torch.Tensor] = field(default_factory=list)  # byte views this rank sends
    full: list[torch.Tensor] | None = None  # staged full tensors, written last

    @property
    def packed(self) -> bool:
        return isinstance(self.param, NVFP4Tensor)

    def groups(self) -> int:
        """Number of global-scale groups (amax slots): 1 per tensor, E for 3-D experts."""
        return self.master.shape[0] if self.granularity == "expert" else 1

    def source(self) -> torch.Tensor:
        """This rank's rows as the trainer's forward sees them, on the rollout's device."""
        return self.master.local.to(device=self.param.device, dtype=self.master.forward_dtype)

    def bytes_per_row(self) -> int:
        """Bytes one dim-0 row of this parameter takes in the gathered stream."""
        if not self.packed:
            return math.prod(self.master.shape[1:]) * self.param.dtype.itemsize
        inner, k = math.prod(self.master.shape[1:-1]), self.master.shape[-1]
        return inner * (k // 2 + k // BLOCK_SIZE)

    def rows_of(self, rank: int, world: int) -> tuple[int, int]:
        return shard_rows(self.master.shape[0], world, rank)


# -- 1. plan ---------------------------------------------------------------------------------


def plan_sharded_sync(rollout_model: nn.Module, trainer_model: nn.Module) -> tuple[list[_Entry], object]:
    """Match rollout parameters to trainer masters; returns (entries, device mesh). Local only."""
    masters = trainer_masters(trainer_model)
    owners = rollout_owners(rollout_model)
    entries, mesh = [], None
    grouped: dict[int, tuple[object, list[str]]] = {}
    for name, param in rollout_model.named_parameters():
        if is_dtensor(param):
            raise NotImplementedError(f"sync_weights_: the rollout's {name} is a DTensor; each rank needs a full rollout replica")
        master = masters.get(name)
        if master is None:
            raise KeyError(f"sync_weights_: trainer model has no parameter {name!r} (architectures differ?)")
        if master.shape != tuple(param.shape):
            raise ValueError(f"sync_weights_: {name} has shape {master.shape} in the trainer, {tuple(param.shape)} in the rollout")
        if master.sharded:
            if mesh is None:
                mesh = master.mesh
            elif master.mesh != mesh:
                raise NotImplementedError(f"sync_weights_: {name} lives on another device mesh than the other sharded parameters")
        entry = _Entry(name, param, master, owners.get(id(param), []))
        if entry.packed:
            if param.transposed:
                raise NotImplementedError(f"sync_weights_: {name} is a transposed NVFP4 parameter; a dim-0 shard would split its blocks")
            if not master.forward_dtype.is_floating_point:
                raise TypeError(f"sync_weights_: cannot quantize the {master.forward_dtype} master {name}")
            entry.granularity = default_granularity(param)
            entry.block_scaling = (entry.holders[0].quads_policy.weight_block_scaling if entry.holders
                                   else param.block_scaling)
            scale_group = next((getattr(m, "quads_scale_group", None) for m in entry.holders), None)
            if scale_group is not None:
                entry.group = id(scale_group)
                grouped.setdefault(id(scale_group), (scale_group, []))[1].append(name)
        entries.append(entry)
    if mesh is None:
        raise ValueError("sync_sharded_weights_: the trainer model has no sharded (FSDP2/DTensor) parameter; use quads.sync_weights_")
    trainer_modules = dict(trainer_model.named_modules())
    for name, module in rollout_model.named_modules():
        trainer = trainer_modules.get(name)
        if isinstance(module, RolloutModule) and hasattr(trainer, "quads_policy"):
            mismatch = module.quads_policy.weight_mismatch(trainer.quads_policy)
            if mismatch:
                raise ValueError(f"sync_weights_: nothing was written; {name}: {mismatch}")
    for group, names in grouped.values():
        if len(names) != len(group.members):
            raise ValueError(f"sync_weights_: only {names} of the sibling group {list(group.names)} are synced; its "
                             "members share one global scale, computed from every member's master")
    return entries, mesh


def _plan_signature(entries: list[_Entry]) -> int:
    """A checksum of what this rank plans to sync (names, shapes, kinds, dtypes): ranks must agree."""
    text = ";".join(
        f"{e.name}:{e.master.shape}:{e.packed}:{e.master.sharded}:{e.param.dtype}:{e.master.forward_dtype}:"
        f"{e.block_scaling}" for e in entries
    )
    return zlib.crc32(text.encode())


# -- collectives -----------------------------------------------------------------------------


class _Comm:
    """The process group of the trainer's mesh and the device its collectives run on."""

    def __init__(self, mesh):
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        if mesh.device_type == "cpu":
            self.device = torch.device("cpu")
        else:
            index = torch.accelerator.current_device_index() if hasattr(torch, "accelerator") else None
            self.device = torch.device(mesh.device_type, index)

    def all_reduce(self, values: torch.Tensor, op) -> torch.Tensor:
        buf = values.to(self.device, torch.float64)
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.cpu()

    def all_gather_bytes(self, local: torch.Tensor, size: int) -> torch.Tensor:
        """Gather a uint8 buffer (padded to ``size``) from every rank: (world, size) on self.device."""
        send = torch.zeros(size, dtype=torch.uint8, device=self.device)
        send[: local.numel()] = local.to(self.device)
        out = torch.empty(self.world * size, dtype=torch.uint8, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, send, group=self.group)
        return out.view(self.world, size)

    def agree(self, failed: bool, what: str, extra: list[float] | None = None) -> torch.Tensor:
        """All-reduce one row per rank (failed flag + ``extra``); raise on the others if any failed."""
        extra = extra or []
        table = torch.zeros(self.world, 1 + len(extra), dtype=torch.float64)
        table[self.rank, 0] = float(failed)
        table[self.rank, 1:] = torch.tensor(extra, dtype=torch.float64)
        table = self.all_reduce(table, dist.ReduceOp.SUM)
        bad = [r for r in range(self.world) if table[r, 0] > 0]
        if bad and not failed:
            raise ShardedSyncError(
                f"sync_weights_: rank(s) {bad} rejected the sync while {what} (see their error); "
                "no rollout weight was written on any rank"
            )
        return table


# -- 3. validate -----------------------------------------------------------------------------


def _local_stats(entries: list[_Entry], comm: _Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """(non-finite count per packed entry, amax per global-scale group) of this rank's rows."""
    counts, amaxes = [], []
    for e in (e for e in entries if e.packed):
        local = e.master.local.to(e.master.forward_dtype)  # what the forward quantizes
        replica_elsewhere = not e.master.sharded and comm.rank != 0  # count replicated masters once
        counts.append(torch.zeros((), device=comm.device) if replica_elsewhere else (~torch.isfinite(local)).sum().to(comm.device))
        groups = torch.zeros(e.groups(), dtype=torch.float32, device=comm.device)
        if local.numel():
            amax = global_amax(local, e.granularity).to(comm.device)
            amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))  # rejected by its count
            start, stop = e.rows_of(comm.rank, comm.world) if e.granularity == "expert" and e.master.sharded else (0, e.groups())
            groups[start:stop] = amax
        amaxes.append(groups)
    if not counts:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.stack(counts).to(torch.float64), torch.cat(amaxes).to(torch.float64)


def validate_sharded_sync(entries: list[_Entry], comm: _Comm) -> None:
    """Reject non-finite packed masters on every rank; set each packed entry's global scale."""
    counts, amaxes = _local_stats(entries, comm)
    counts = comm.all_reduce(counts, dist.ReduceOp.SUM)
    packed = [e for e in entries if e.packed]
    bad = [(e.name, int(c)) for e, c in zip(packed, counts.tolist(), strict=True) if c > 0]
    if bad:
        name, n = bad[0]
        more = f" (and {len(bad) - 1} more parameter(s))" if len(bad) > 1 else ""
        raise ValueError(
            f"sync_weights_: {name}: {n} non-finite value(s) (NaN/Inf) in a weight{more}; NVFP4 quantization of "
            "non-finite weights would silently poison or saturate whole blocks, refusing (no rollout weight written)"
        )
    amaxes = comm.all_reduce(amaxes, dist.ReduceOp.MAX)
    offset, per_entry, group_amax = 0, [], {}
    for e in packed:
        n = e.groups()
        per_entry.append(amaxes[offset : offset + n].to(torch.float32))
        offset += n
        if e.group is not None:  # sibling group: the largest amax of its members (scale_groups.py)
            group_amax[e.group] = torch.maximum(group_amax.get(e.group, per_entry[-1]), per_entry[-1])
    for e, amax in zip(packed, per_entry):
        if e.group is not None:
            amax = group_amax[e.group]
        scale = global_encode_scale_from_amax(amax, e.block_scaling)
        e.global_scale = (scale if e.granularity == "expert" else scale.reshape(())).to(e.param.device)


# -- 4. stage --------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _stage_local(e: _Entry, comm: _Comm) -> None:
    """This rank's contribution: packed parts of its rows (or its dense rows), as byte views."""
    src = e.source()
    if e.packed:
        scale = e.global_scale
        if e.granularity == "expert" and e.master.sharded:
            start, stop = e.rows_of(comm.rank, comm.world)
            scale = scale[start:stop]
        if e.holders:
            qdata, block_scale, _ = e.holders[0].quads_backend.quantize_weight(src, e.granularity, scale,
                                                                               e.block_scaling)
        else:  # an NVFP4Tensor outside a quads rollout module: the recipe itself
            qdata, block_scale, _ = quantize_weight_reference(src, e.granularity, scale, e.block_scaling)
        parts = [qdata, block_scale]
    else:
        parts = [src.to(e.param.dtype)]
    if e.master.sharded:
        e.local_parts = [_bytes(p) for p in parts]
    else:  # replicated master: every rank already has the whole parameter
        e.full = parts


def _rank_bytes(e: _Entry, rank: int, world: int) -> int:
    start, stop = e.rows_of(rank, world)
    return (stop - start) * e.bytes_per_row()


def _buckets(entries: list[_Entry], world: int, cap: int) -> list[list[_Entry]]:
    """Consecutive sharded entries whose largest per-rank contribution stays under ``cap`` bytes."""
    buckets, current, size = [], [], 0
    for e in entries:
        if not e.master.sharded:
            continue
        biggest = max(_rank_bytes(e, r, world) for r in range(world))
        if current and size + biggest > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(e)
        size += biggest
    if current:
        buckets.append(current)
    return buckets


def _gather_bucket(bucket: list[_Entry], comm: _Comm) -> None:
    """One all-gather for a bucket; assemble each entry's full parts in new tensors."""
    world = comm.world
    sizes = [[_rank_bytes(e, r, world) for e in bucket] for r in range(world)]
    local = torch.cat([b.to(comm.device) for e in bucket for b in e.local_parts])
    gathered = comm.all_gather_bytes(local, max(sum(row) for row in sizes))
    offsets = [0] * world
    for i, e in enumerate(bucket):
        pieces = []
        for r in range(world):
            pieces.append(gathered[r, offsets[r] : offsets[r] + sizes[r][i]])
            offsets[r] += sizes[r][i]
        e.full = _assemble(e, pieces, world)
        e.local_parts = []


def _assemble(e: _Entry, pieces: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Full parts of an entry from every rank's bytes (rank order is row order), on the rollout's device."""
    shape, device = e.master.shape, e.param.device
    if not e.packed:
        return [torch.cat(pieces).view(e.param.dtype).view(shape).to(device)]
    k, inner = shape[-1], shape[1:-1]
    qdata, scales = [], []
    for r, piece in enumerate(pieces):
        start, stop = e.rows_of(r, world)
        n_q = (stop - start) * math.prod(inner) * (k // 2)
        qdata.append(piece[:n_q])
        scales.append(piece[n_q:])
    qdata = torch.cat(qdata).view(shape[0], *inner, k // 2)
    scales = torch.cat(scales).view(torch.float8_e4m3fn).view(shape[0], *inner, k // BLOCK_SIZE)
    return [qdata.to(device), scales.to(device)]


def stage_sharded_sync(entries: list[_Entry], comm: _Comm, bucket_bytes: int) -> None:
    """Every entry's full new value in ``entry.full`` (nothing written to the rollout yet)."""
    failed, error = False, None
    try:
        for e in entries:
            _stage_local(e, comm)
    except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
        failed, error = True, err
    comm.agree(failed, "quantizing its shards")
    if error is not None:
        raise error
    for bucket in _buckets(entries, comm.world, bucket_bytes):
        _gather_bucket(bucket, comm)


# -- 5. write --------------------------------------------------------------------------------


@torch.no_grad()
def _write(entries: list[_Entry]) -> None:
    """In place, undone on any exception (KeyboardInterrupt included) from per-tensor snapshots,
    as :func:`quads.policies.sync._write` does: no replica is left with a torn weight."""
    done = []
    try:
        for e in entries:
            done.append((e, e.param.storage_snapshot() if e.packed else e.param.clone()))
            if e.packed:
                qdata, block_scale = e.full
                e.param.copy_(NVFP4Tensor(qdata, block_scale, e.global_scale, orig_dtype=e.param.orig_dtype))
            else:
                e.param.copy_(e.full[0])
            e.full = None
        for module in {id(m): m for e in entries for m in e.holders}.values():
            module.quads_weights_changed()
    except BaseException:
        for e, old in reversed(done):
            if e.packed:
                e.param.restore_storage_(old)  # into the kernel layout when it holds the parts
            else:
                e.param.copy_(old)
        for module in {id(m): m for e in entries for m in e.holders}.values():
            module.quads_weights_changed()
        raise


@torch.no_grad()
def sync_sharded_weights_(
    rollout_model: nn.Module, trainer_model: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> int:
    """Sync a full rollout replica on every rank from a sharded (FSDP2) trainer; collective.

    Every rank of the trainer's device mesh must call it with its own rollout replica (same
    architecture as the trainer, e.g. from :func:`quads.build_rollout_model`). Afterwards each
    replica is what ``quads.sync_weights_`` gives on one process from the unsharded masters, bit
    for bit, with FSDP's ``param_dtype`` cast applied first when the trainer's forward uses one (so
    ``rollout_param.dequantize()`` is the trainer's forward weight). Raises on every rank, leaving
    every replica untouched, on a name/shape mismatch, an unsupported layout, non-finite masters,
    or a failure on any rank. Returns the number of parameters synced.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    error, entries, mesh = None, [], None
    try:
        entries, mesh = plan_sharded_sync(rollout_model, trainer_model)
    except (KeyError, ValueError, TypeError, NotImplementedError) as err:
        # Tell the other ranks before raising, over the mesh of the trainer's sharded parameters.
        # Without one (not sharded, or a layout error: the same on every rank) there is nobody to tell.
        error, mesh = err, _one_dim_mesh(trainer_model)
        if mesh is None:
            raise
    comm = _Comm(mesh)
    table = comm.agree(error is not None, "planning", [float(len(entries)), float(_plan_signature(entries))])
    if error is not None:
        raise error
    if len({(row[1].item(), row[2].item()) for row in table}) != 1:
        raise ShardedSyncError(
            "sync_weights_: the ranks hold different models (parameter names, shapes or dtypes differ "
            "between ranks); no rollout weight was written"
        )
    validate_sharded_sync(entries, comm)
    stage_sharded_sync(entries, comm, bucket_bytes)
    _write(entries)
    return len(entries)


def _one_dim_mesh(model: nn.Module):
    """The 1-D device mesh of the first sharded parameter of ``model``, else None."""
    for p in model.parameters():
        if is_dtensor(p):
            return p.device_mesh if p.device_mesh.ndim == 1 else None
    return None
