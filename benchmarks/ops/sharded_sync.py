"""Sharded trainer -> rollout sync: time, traffic and memory of the two ways to do it.

    torchrun --nproc-per-node 2 -m benchmarks.ops.sharded_sync --device cpu --model small --model small-moe
    torchrun --nproc-per-node 2 -m benchmarks.ops.sharded_sync --device cuda --model llama-1b --model qwen3-moe-1b --train-step

The trainer is a transformers model built from config (random weights, nothing downloaded),
converted with the quads trainer policy and sharded with FSDP2 (``fully_shard`` on every
decoder layer and the root, ``MixedPrecisionPolicy(param_dtype=bf16)`` as accelerate sets it);
every rank holds a full rollout replica (quads rollout policy). Methods, per sync:

* ``packed`` (the library, ``quads.sync_weights_``): each rank quantizes its shards with the
  all-reduced global scales and the packed parts (0.5625 B/weight) are all-gathered in buckets;
* ``gather``: every parameter gathered in BF16 (``DTensor.full_tensor()``) into a plain copy of
  the trainer, then the single-process ``quads.sync_weights_`` (needs that full BF16 copy too).

Both must give the same bits (checked). Reported per method: median / min wall time of a sync
(the slowest rank), bytes each rank sends, peak extra GPU memory. ``--train-step`` also times
one FSDP training step (forward + backward + AdamW) for scale. NVLink multicast stays off.
Rank 0 appends the median times (µs) to ``results/kernels.csv`` (``--csv``,
:func:`benchmarks.timing.append_results`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import quads  # noqa: E402
from benchmarks.timing import add_csv_argument, append_results  # noqa: E402
from quads.policies.shards import trainer_masters  # noqa: E402
from quads.tensor import NVFP4Tensor  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402

MODELS = {
    # name: (transformers config class name, kwargs)
    "small": ("LlamaConfig", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4, vocab_size=8192)),
    "small-moe": ("Qwen3MoeConfig", dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                                         num_experts=16, num_experts_per_tok=2, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                         vocab_size=8192, decoder_sparse_step=1)),
    "llama-1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)),
    "qwen3-moe-1b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                            num_experts=64, num_experts_per_tok=8, num_hidden_layers=4,
                                            num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                            vocab_size=32000, decoder_sparse_step=1)),
}


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def build(name: str, dtype, device):
    import transformers

    cls_name, kwargs = MODELS[name]
    cfg = getattr(transformers, cls_name)(**kwargs, tie_word_embeddings=False, max_position_embeddings=1024)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> list[float]:
    """Wall seconds of each call, the slowest rank's (all-reduced max)."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append(dt.item())
    return out


def peak_extra_bytes(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def same_bits(a, b) -> list[str]:
    pb = dict(b.named_parameters())
    bad = []
    for name, p in a.named_parameters():
        q = pb[name]
        if isinstance(p, NVFP4Tensor):
            ok = (torch.equal(p.qdata, q.qdata) and torch.equal(p.scale.view(torch.uint8), q.scale.view(torch.uint8))
                  and torch.equal(p.global_encode_scale, q.global_encode_scale))
        else:
            ok = torch.equal(p, q)
        if not ok:
            bad.append(name)
    return bad


def train_step_seconds(trainer, device, repeats: int) -> list[float]:
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    ids = torch.randint(0, trainer.config.vocab_size, (4, 512), device=device, generator=None)

    def step():
        trainer(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (lazy init, kernel compilation)
    return timed(step, device, repeats)


def bench_model(name: str, device, repeats: int, train_step: bool) -> dict:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    trainer = quads.quantize_(build(name, torch.float32, device), quads.QuadsPolicy(side="trainer"))
    n_params = sum(p.numel() for p in trainer.parameters())
    for layer in trainer.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(trainer, mp_policy=mp)
    rollout_policy = quads.QuadsPolicy(side="rollout")
    packed_rollout = quads.quantize_(build(name, torch.bfloat16, device), rollout_policy)
    gather_rollout = quads.quantize_(build(name, torch.bfloat16, device), rollout_policy)
    gathered = quads.quantize_(build(name, torch.bfloat16, device), quads.QuadsPolicy(side="trainer"))
    masters = trainer_masters(trainer)
    gathered_params = dict(gathered.named_parameters())
    records = {}

    def packed():
        quads.sync_weights_(packed_rollout, trainer)

    @torch.no_grad()
    def gather():
        for pname, master in masters.items():
            full = master.local.to(master.forward_dtype)
            if master.sharded:
                full = DTensor.from_local(full, master.mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size(master.shape),
                                          stride=torch.empty(master.shape, device="meta").stride()).full_tensor()
            gathered_params[pname].copy_(full)
        quads.sync_weights_(gather_rollout, gathered)

    packed()  # warm-up both (kernel compilation), then check they agree
    gather()
    differ = same_bits(packed_rollout, gather_rollout)
    bytes_packed = bytes_gather = 0
    for pname, master in masters.items():
        if not master.sharded:
            continue
        p = dict(packed_rollout.named_parameters())[pname]
        n = master.local.numel()
        bytes_gather += n * 2
        k = master.shape[-1]
        bytes_packed += n * (k // 2 + k // 16) // k if isinstance(p, NVFP4Tensor) else n * p.dtype.itemsize
    for label, fn, sent in (("packed", packed, bytes_packed), ("gather", gather, bytes_gather)):
        times = timed(fn, device, repeats)
        records[label] = {
            "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "repeats": repeats,
            "bytes_sent_per_rank": sent, "peak_extra_gpu_bytes": peak_extra_bytes(fn, device),
        }
        log(f"  {name} {label}: median {records[label]['median_ms']:.1f} ms, min {records[label]['min_ms']:.1f} ms, "
            f"sends {sent / 2**20:.1f} MiB/rank, peak extra GPU {records[label]['peak_extra_gpu_bytes']}")
    out = {"model": name, "params": n_params, "world": dist.get_world_size(), "device": str(device),
           "methods": records, "packed_equals_gather": not differ, "differing_params": differ[:10]}
    if train_step:
        steps = train_step_seconds(trainer, device, 3)
        out["train_step_median_ms"] = 1e3 * statistics.median(steps)
        log(f"  {name} FSDP train step (4 x 512 tokens): median {out['train_step_median_ms']:.1f} ms")
    return out


def _csv_rows(results: list[dict]) -> list[dict]:
    """The results table's rows: per model, each method's median sync and the training step."""
    rows = []
    for r in results:
        shape = f"{r['model']}: {r['params'] / 1e6:.0f}M parameters, FSDP2 x {r['world']}"
        rows += [{"kernel": "sharded_sync", "shape": shape, "variant": method, "us": 1e3 * m["median_ms"]}
                 for method, m in r["methods"].items()]
        if "train_step_median_ms" in r:
            rows.append({"kernel": "fsdp_train_step", "shape": shape, "variant": "4 x 512 tokens",
                         "us": 1e3 * r["train_step_median_ms"]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="repeatable (default: small)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-step", action="store_true", help="also time one FSDP training step per model")
    ap.add_argument("--out", default=None, help="write results.json here (rank 0)")
    add_csv_argument(ap)
    args = ap.parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    log(f"torch {torch.__version__}, world {dist.get_world_size()}, {device}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    results = []
    for name in args.model or ["small"]:
        results.append(bench_model(name, device, args.repeats, args.train_step))
        log(json.dumps(results[-1]))
    raw = os.path.join(args.out, "results.json") if args.out else ""
    if dist.get_rank() == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        write_atomically(raw, json.dumps(results, indent=1))
    if dist.get_rank() == 0:
        append_results(_csv_rows(results), raw=raw, csv_path=args.csv)
    ok = all(r["packed_equals_gather"] for r in results)
    log("ALL PACKED == GATHER (bitwise):", ok)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
