"""Run a function on N CPU processes joined by gloo (``torch.multiprocessing`` spawn).

``run_on_ranks("module:function", world=2, **kwargs)`` starts ``world`` processes; each joins
a gloo process group (file store in a fresh temporary directory, so parallel runs never share
a port), calls ``function(rank, world, **kwargs)`` and returns its JSON-able result. The parent
gets the list of results in rank order; an exception on any rank fails the call with that
rank's traceback. Collectives time out after ``timeout_s`` so a hang becomes an error.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_on_ranks"]


def _entry(rank: int, world: int, workdir: str, target: str, kwargs: dict, timeout_s: float) -> None:
    torch.set_num_threads(1)  # one core per rank: the CI machine has two
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        module_name, fn_name = target.split(":")
        result = getattr(importlib.import_module(module_name), fn_name)(rank, world, **kwargs)
        with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_on_ranks(target: str, world: int = 2, timeout_s: float = 120.0, **kwargs) -> list:
    """Results of ``target(rank, world, **kwargs)`` on every rank, in rank order."""
    with tempfile.TemporaryDirectory(prefix="quads-dist-") as workdir:
        mp.spawn(_entry, args=(world, workdir, target, kwargs, timeout_s), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(workdir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results
