"""Bytes autograd keeps alive between forward and backward under FSDP2: plain vs quads QAT.

    torchrun --nproc-per-node 2 -m benchmarks.studies.fsdp_saved_bytes [--device cpu|cuda] [--out DIR]

A tiny Llama (tests/tiny_models.py), ``fully_shard`` on each layer and the root, in the two
precision set-ups of docs/distributed.md: fp32 masters under bf16 autocast (TRL's), and FSDP's
``MixedPrecisionPolicy(param_dtype=bf16)`` (accelerate's FSDP2). Counts the storages of every
tensor saved for backward that are still allocated when the forward returns (FSDP frees the
unsharded parameters it saved by resizing their storage to 0, so they count 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402


import quads  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402
from tests.tiny_models import build  # noqa: E402


def saved_bytes(device, precision: str, quantize: bool) -> dict:
    model = build("llama", dtype=torch.float32).to(device)
    if quantize:
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if precision == "fsdp-bf16" else {}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s
        return t

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = model(input_ids=ids, labels=ids).loss
    alive = sum(s.nbytes() for s in storages.values())
    loss.backward()
    weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    return {"saved_bytes_alive_after_forward": alive, "linear_weight_elements": weights}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    results = {}
    for precision in ("autocast", "fsdp-bf16"):
        for quantize in (False, True):
            results[f"{precision}/{'quads' if quantize else 'plain'}"] = saved_bytes(device, precision, quantize)
    if dist.get_rank() == 0:
        print(json.dumps(results, indent=1))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            write_atomically(os.path.join(args.out, "fsdp_saved_bytes.json"), json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
