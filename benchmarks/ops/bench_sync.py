"""Benchmark of ``quads.sync_weights_`` (trainer -> rollout), with and without its validation.

    python -m benchmarks.ops.bench_sync [--model qwen3_moe|llama|rl_moe|rl_dense] [--size small|1b]
                                                 [--preset quads] [--masters fp32|bf16] [--host-profile N]
                                                 [--repeats N] [--out DIR] [--csv PATH]

Models are random, built from config (nothing is downloaded): ``small`` (~25M parameters, the
CPU default) or ``1b`` (~1.0B parameters, the default on a GPU). The trainer holds float32
masters under the trainer policy, the rollout BF16 under the QUADS rollout policy (packed
NVFP4 weights, the backend ``quantize_`` picks: the Triton kernels on an H200, the torch
reference on a CPU). Times in milliseconds, minimum and median of ``--repeats`` rounds after one
warm-up, the variants run round-robin, the device synchronised around each call:

* ``sync``: ``quads.sync_weights_`` as shipped (plan, stage, fused finiteness check, write);
* ``sync_unchecked``: the same steps without the finiteness check (what validation costs);
* ``check_fused``: the finiteness check alone, one reduction per tensor, one host sync per device;
* ``check_per_tensor``: for comparison, one ``check_finite`` (one host sync) per tensor.

``rl_moe`` / ``rl_dense`` are the models of ``benchmarks.rl.rl_step`` (``--size`` ignored);
``--preset`` a ``POLICY_PRESETS`` name, ``-fast`` appended for ``kernel="fast"`` (rl_step's
variants); ``--masters`` the trainer's parameter dtype. ``--host-profile N``: N more syncs under
``cProfile``, the top functions by own and cumulative time printed (the sync's host cost: on a GPU
its kernels take a fraction of its wall time).

Output: a table on stdout, ``--out`` (JSON), and one row per variant (median µs) appended to
``results/kernels.csv`` (``--csv``, :func:`benchmarks.timing.append_results`).

Before timing, a self-check on the benchmark's device: a NaN in one master and an Inf in
another must each make ``sync_weights_`` raise with the rollout left bit for bit unchanged
(this relies on ``torch.aminmax`` propagating NaN on that device).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import quads
from benchmarks.timing import add_csv_argument, append_results
from quads.policies import sync as sync_mod
from quads.tensor.finite import check_finite
from quads.tensor.files import write_atomically
from quads.tensor.nvfp4_tensor import NVFP4Tensor

SIZES = {  # (llama kwargs, qwen3-moe kwargs)
    "small": (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=8192),
              dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=8192, moe_intermediate_size=256,
                   num_experts=8, num_experts_per_tok=2)),
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4, head_dim=128, vocab_size=32000),
           dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, head_dim=128, vocab_size=32000, moe_intermediate_size=512,
                num_experts=32, num_experts_per_tok=4)),
}


def build(kind: str, size: str, device: torch.device, dtype: torch.dtype, seed: int):
    if kind.startswith("rl_"):
        from benchmarks.rl.rl_step import build_model

        torch.manual_seed(seed)
        return build_model(kind[3:], False, str(device)).to(dtype)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    llama_kw, moe_kw = SIZES[size]
    torch.manual_seed(seed)
    common = dict(max_position_embeddings=256, tie_word_embeddings=False)
    with torch.device(device):
        if kind == "llama":
            model = LlamaForCausalLM(LlamaConfig(**llama_kw, **common))
        else:
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**moe_kw, **common, decoder_sparse_step=1))
    return model.to(dtype)


def fingerprint(model) -> dict[str, torch.Tensor]:
    """Bytes of every parameter (packed parts included), for a bit-for-bit comparison."""
    out = {}
    for name, p in model.named_parameters():
        parts = p.parts if isinstance(p, NVFP4Tensor) else (p.detach(),)
        for i, t in enumerate(parts):
            out[f"{name}.{i}"] = t.reshape(-1).contiguous().view(torch.uint8).clone()
    return out


def self_check(rollout, trainer) -> bool:
    """A NaN and an Inf master each make the sync raise, the rollout unchanged."""
    before = fingerprint(rollout)
    params = [p for p in trainer.parameters()]
    ok = True
    for victim, value in ((params[-2], float("nan")), (params[len(params) // 2], float("inf"))):
        with torch.no_grad():
            old = victim.view(-1)[0].clone()
            victim.view(-1)[0] = value
        try:
            quads.sync_weights_(rollout, trainer)
            ok = False
        except ValueError:
            pass
        finally:
            with torch.no_grad():
                victim.view(-1)[0] = old
        after = fingerprint(rollout)
        ok = ok and all(torch.equal(before[k], after[k]) for k in before)
    return ok


def time_all(fns: dict, device, repeats: int) -> dict[str, dict[str, float]]:
    """Median and minimum ms of each function, run round-robin (load changes hit all alike)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in fns.values():
        fn()  # warm-up (kernel compilation, caches)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: {"median": statistics.median(ts), "min": min(ts)} for name, ts in times.items()}


def host_profile(fn, device, n: int) -> None:
    """``n`` calls of ``fn`` under cProfile (the device synchronized after each): the top functions."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(n):
        prof.enable()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prof.disable()
    for key in ("tottime", "cumulative"):
        print(f"-- host profile, {n} syncs, by {key}")
        pstats.Stats(prof).sort_stats(key).print_stats(30)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["qwen3_moe", "llama", "rl_moe", "rl_dense"], default="qwen3_moe")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 1b on a GPU, small on a CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--preset", default="quads", help="a POLICY_PRESETS name, optionally + '-fast'")
    ap.add_argument("--masters", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--host-profile", type=int, default=0, help="N syncs under cProfile (module doc)")
    ap.add_argument("--out", default=None, help="write results.json here")
    add_csv_argument(ap)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    size = args.size or ("1b" if device.type == "cuda" else "small")
    if args.threads:
        torch.set_num_threads(args.threads)

    from benchmarks.rl.rl_step import resolve

    preset, _ = resolve(f"{args.preset}@{args.masters}")
    trainer = build(args.model, size, device, torch.float32 if args.masters == "fp32" else torch.bfloat16, seed=0)
    rollout = build(args.model, size, device, torch.bfloat16, seed=1)
    quads.quantize_(trainer, preset.trainer)
    quads.quantize_(rollout, preset.rollout)
    n_params = sum(p.numel() for p in trainer.parameters())
    n_tensors = len(list(trainer.parameters()))
    backend = next(iter(quads.quantized_modules(rollout).values())).quads_backend.name

    caught = self_check(rollout, trainer)

    @torch.no_grad()
    def unchecked():
        writes = sync_mod._plan(rollout, trainer, strict=True)
        sync_mod._stage(writes)
        sync_mod._write(writes, rollout)

    writes = sync_mod._plan(rollout, trainer, strict=True)
    sync_mod._stage(writes)
    targets = [(w.name, w.source if w.packed else w.staged) for w in writes]

    def per_tensor():
        for name, t in targets:
            check_finite(t, name)

    result = {
        "model": args.model,
        "preset": args.preset,
        "masters": args.masters,
        "size": size,
        "parameters": n_params,
        "tensors": n_tensors,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "backend": backend,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "validation_catches_nan_inf_rollout_unchanged": caught,
        "repeats": args.repeats,
        "ms": time_all({
            "sync": lambda: quads.sync_weights_(rollout, trainer),
            "sync_unchecked": unchecked,
            "check_fused": lambda: sync_mod._check_finite(writes),
            "check_per_tensor": per_tensor,
        }, device, args.repeats),
    }
    ms = {k: v["min"] for k, v in result["ms"].items()}
    print(f"{args.model} {size}: {n_params / 1e6:.1f}M parameters in {n_tensors} tensors on {result['device']} "
          f"({result['threads']} threads), rollout backend {backend}")
    print(f"self-check (NaN / Inf master -> raises, rollout unchanged): {caught}")
    print(f"  {'ms':<17} {'min':>10} {'median':>10}")
    for key, value in result["ms"].items():
        print(f"  {key:<17} {value['min']:10.2f} {value['median']:10.2f}")
    print(f"  validation (minima): check_fused = {ms['check_fused'] / ms['sync_unchecked'] * 100:.1f}% of the unchecked "
          f"sync; sync - sync_unchecked = {ms['sync'] - ms['sync_unchecked']:+.2f} ms")
    if args.host_profile:
        host_profile(lambda: quads.sync_weights_(rollout, trainer), device, args.host_profile)
    path = Path(args.out) / f"sync_{args.model}_{size}_{args.preset}_{device.type}.json" if args.out else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    shape = (f"{args.model} {size}: {n_params / 1e6:.0f}M parameters, {n_tensors} tensors, {backend} backend, "
             f"{args.preset}@{args.masters}")
    append_results([{"kernel": "sync_weights_", "shape": shape, "variant": key, "us": value["median"] * 1e3}
                    for key, value in result["ms"].items()], raw=str(path or ""), csv_path=args.csv)
    return result


if __name__ == "__main__":
    main()
