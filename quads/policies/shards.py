"""Sharded trainer parameters as the weight sync sees them (FSDP2 ``fully_shard`` / DTensor).

FSDP2 keeps each parameter as a ``DTensor`` sharded on dim 0 over a 1-D device mesh
(placement ``Shard(0)``): rank ``r`` holds the rows ``torch.chunk`` gives it (chunks of
``ceil(rows / world)``, the last ones shorter or empty). Since NVFP4 blocks run along the last
dim, a dim-0 shard holds whole blocks, and for 3-D experts ``(E, N, K)`` whole experts.

Inside a forward FSDP2 presents the *unsharded* parameter (a plain tensor of the full shape,
in its ``MixedPrecisionPolicy.param_dtype`` when one is set), so the trainer's fake quantizer
sees the whole weight there. Outside a forward, the registered parameters may be DTensors or, for
modules that keep their parameters unsharded after a forward (``reshard_after_forward=False``),
the unsharded copies. :func:`trainer_masters` therefore reads FSDP's own record of every
parameter: the sharded master the optimizer updates and the dtype the forward computes in.

This module reads FSDP2 internals (``FSDPModule._get_fsdp_state()``, its parameter groups,
``FSDPParam.sharded_param`` / ``_module_info``, the group's ``mp_policy``), checked against torch 2.13;
where they are missing it raises instead of guessing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["Master", "has_sharded_parameters", "is_dtensor", "shard_rows", "trainer_masters"]

def _loaded(module: str, name: str):
    """``module.name`` if ``module`` is already imported, else None.

    A DTensor or an FSDP2 module can only exist once its module has been imported, so the sync
    asks ``sys.modules`` instead of importing ``torch.distributed.tensor`` (~0.4 s) itself:
    ``import quads`` stays light for the single-process user.
    """
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_dtensor(t) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (a sharded or replicated distributed tensor)."""
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(t, dtensor)


def has_sharded_parameters(model: nn.Module) -> bool:
    """True when ``model`` holds FSDP2 modules or DTensor parameters (its sync must be collective)."""
    fsdp_module = _loaded("torch.distributed.fsdp", "FSDPModule")
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        return True
    return any(is_dtensor(p) for p in model.parameters())


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the dim-0 rows rank ``rank`` holds under ``Shard(0)`` (torch.chunk)."""
    chunk = -(-rows // world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


@dataclass(frozen=True)
class Master:
    """One trainer parameter as this rank holds it.

    ``local``: this rank's rows (all of them when ``sharded`` is False); ``shape``: the global
    shape; ``forward_dtype``: the dtype the trainer's forward computes with (FSDP's
    ``param_dtype`` when set, else the master's dtype); ``mesh``: the 1-D device mesh of a
    sharded master, else None.
    """

    name: str
    local: torch.Tensor
    shape: tuple[int, ...]
    forward_dtype: torch.dtype
    mesh: object | None = None

    @property
    def sharded(self) -> bool:
        return self.mesh is not None


def _fsdp_param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12: one group per state
        if not hasattr(state, "_fsdp_param_group"):
            raise NotImplementedError(
                f"quads cannot read this torch's FSDP2 state (torch {torch.__version__}: no parameter groups)"
            )
        group = state._fsdp_param_group
        groups = [group] if group is not None else []
    return list(groups)


def _fsdp_records(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """Qualified name -> (sharded master DTensor, forward dtype) for every FSDP2-managed parameter."""
    fsdp_module = _loaded("torch.distributed.fsdp", "FSDPModule")
    if fsdp_module is None:
        return {}
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out: dict[str, tuple[torch.Tensor, torch.dtype]] = {}
    seen_states = set()
    for module in model.modules():
        if not isinstance(module, fsdp_module):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen_states:
            continue
        seen_states.add(id(state))
        for group in _fsdp_param_groups(state):
            for fp in group.fsdp_params:
                try:
                    info, sharded = fp._module_info, fp.sharded_param
                    param_dtype = group.mp_policy.param_dtype
                except AttributeError as err:
                    raise NotImplementedError(
                        f"quads cannot read this torch's FSDP2 parameters (torch {torch.__version__}): {err}"
                    ) from err
                # FSDP's own rule (FSDPParam.init_dtype_attrs, which runs only at the first forward)
                cast = param_dtype is not None and sharded.dtype.is_floating_point
                dtype = param_dtype if cast else sharded.dtype
                owners = [(info.module, info.param_name)]
                owners += list(zip(info.shared_modules, info.shared_param_names))
                for owner, pname in owners:
                    prefix = module_names.get(id(owner))
                    if prefix is not None:
                        out[f"{prefix}.{pname}" if prefix else pname] = (sharded, dtype)
    return out


def _master(name: str, tensor: torch.Tensor, forward_dtype: torch.dtype) -> Master:
    """Describe one parameter; raise NotImplementedError for layouts the sync cannot reassemble."""
    tensor = tensor.detach()
    if not is_dtensor(tensor):
        return Master(name, tensor, tuple(tensor.shape), forward_dtype)
    from torch.distributed.tensor import Replicate, Shard  # loaded: tensor is a DTensor

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{name}: a DTensor on a {mesh.ndim}-D device mesh ({placements}); the quads sync supports "
            "FSDP2 on a 1-D mesh (Shard(0)) and replicated parameters"
        )
    if placements == (Replicate(),):
        return Master(name, tensor.to_local(), tuple(tensor.shape), forward_dtype)
    if placements != (Shard(0),):
        raise NotImplementedError(
            f"{name}: DTensor placement {placements}; the quads sync supports Shard(0) (FSDP2's) and Replicate()"
        )
    local = tensor.to_local()
    start, stop = shard_rows(tensor.shape[0], mesh.size(), mesh.get_local_rank())
    if tuple(local.shape) != (stop - start, *tensor.shape[1:]):
        raise NotImplementedError(
            f"{name}: local shard {tuple(local.shape)} is not the torch.chunk rows [{start}, {stop}) of "
            f"{tuple(tensor.shape)}; uneven DTensor layouts other than torch.chunk's are not supported"
        )
    return Master(name, local, tuple(tensor.shape), forward_dtype, mesh)


def trainer_masters(model: nn.Module) -> dict[str, Master]:
    """Every parameter of ``model`` (``named_parameters`` names) as this rank holds its master."""
    records = _fsdp_records(model)
    out = {}
    for name, param in model.named_parameters():
        tensor, dtype = records.get(name, (param, param.dtype))
        out[name] = _master(name, tensor, dtype)
    return out
