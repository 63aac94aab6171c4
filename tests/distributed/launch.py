"""Run a function on N CPU processes joined by gloo (``torch.multiprocessing`` spawn).

``run_on_ranks("module:function", world=2, **kwargs)`` starts ``world`` processes; each joins
a gloo process group (file store in a fresh temporary directory, so parallel runs never share
a port), calls ``function(rank, world, **kwargs)`` and returns its JSON-able result. The
variables a launcher such as ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...)
are set too, so ``accelerate`` sees a 2-process CPU run and uses the group. The parent
gets the list of results in rank order; an exception on any rank fails the call with that
rank's traceback. Collectives time out after ``timeout_s`` so a hang becomes an error.

``QUADS_DIST_DEVICE=cuda`` runs the same on GPUs (one per rank, NCCL, deterministic algorithms,
NVLink multicast kept off); the default is CPU with gloo.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["device_type", "run_on_ranks"]


def device_type() -> str:
    """``cpu`` (gloo, the default) or ``cuda`` (NCCL), from ``QUADS_DIST_DEVICE``."""
    kind = os.environ.get("QUADS_DIST_DEVICE", "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"QUADS_DIST_DEVICE must be cpu or cuda, got {kind!r}")
    return kind


def _entry(rank: int, world: int, workdir: str, target: str, kwargs: dict, timeout_s: float) -> None:
    torch.set_num_threads(1)  # one core per rank: the CI machine has two
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
    )
    backend = "gloo"
    if device_type() == "cuda":
        backend = "nccl"
        torch.cuda.set_device(rank)
        torch.use_deterministic_algorithms(True, warn_only=True)  # bitwise comparisons need them
    dist.init_process_group(
        backend,
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    module_name, fn_name = target.split(":")
    result = getattr(importlib.import_module(module_name), fn_name)(rank, world, **kwargs)
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # every rank has written its result: no collective is pending anywhere
    # Exit without the C++ teardown: destroying the gloo group under a live DDP model (the TRL
    # test) occasionally ends in std::terminate (SIGABRT) after the work is done, which would
    # fail a run whose results are complete. On an exception, spawn reports it as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(target: str, world: int = 2, timeout_s: float = 120.0, **kwargs) -> list:
    """Results of ``target(rank, world, **kwargs)`` on every rank, in rank order."""
    if device_type() == "cuda":
        # NVLink multicast stays off on shared machines (see the device notes); deterministic cuBLAS
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with tempfile.TemporaryDirectory(prefix="quads-dist-") as workdir:
        mp.spawn(_entry, args=(world, workdir, target, kwargs, timeout_s), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(workdir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results
