"""The trainer's weight fake-quantization pass per weight shape: achieved bandwidth, kernels per
call, host time; a tile sweep; and an ``ncu`` mode (where the dense weights' bandwidth goes).

    python -m benchmarks.ops.bench_fake_quant --out results/fq.json            # bandwidth table
        [--shapes dense,moe] [--reps 20] [--tiles 4x16x4,8x16x4] [--amax-tiles 8x512x4]
    ncu --clock-control none --set full -k regex:fake_quant -c 4 -o fq_dense python3 -m benchmarks.ops.bench_fake_quant --ncu
    python -m benchmarks.ops.bench_fake_quant --device cpu --out /tmp/fq.json  # smoke (interpreter, tiny)
    python -m benchmarks.ops.bench_fake_quant --block-scaling 6,4over6 --tiles 8x16x4 --amax-tiles 8x512x4 --out fq46.json

Shapes: the weights of ``bench_trainer.py``'s models (FP32 masters, BF16 forward weights, as
under autocast): dense (Qwen3-4B layer) q 4096x2560, k/v 1024x2560, o 2560x4096, gate/up
9728x2560, down 2560x9728; MoE (Qwen3-MoE-like) experts gate_up 64x2816x2048, down 64x2048x1408,
and its attention projections.

Per shape and configuration, three measurements of ``fake_quantize_weight_triton(w, bf16)``
(``fwd``: amax pass + fused pass; ``bwd``: the backward's recomputation, global scale given):

* ``gpu_us``: GPU time per call with the host out of the way: a ``torch.cuda._sleep`` long
  enough for the host to enqueue all ``--reps`` calls, then CUDA events around them;
* ``wall_us``: back-to-back calls as a training loop issues them (host time included when the
  host is slower than the GPU);
* ``host_us``: the host's time per call (enqueue only); ``glue_host_us``: the same with the two
  Triton kernels replaced by no-op stubs (quads' Python glue and torch allocations only), so
  ``host_us - glue_host_us`` is the Triton launcher's share (two launches fwd, one bwd);
* ``cast-bf16``: ``w.to(bfloat16)``, the BF16 peer's autocast cast (6 B per element): the
  ceiling of a plain elementwise pass on that shape;
* per kernel (torch.profiler): device time per call of each kernel and the number of kernels
  per call, and the fused/amax kernels' bandwidth on their own bytes.

The fused pass is the kernel's only one (the ALU-lean pass: no E2M1 codes or scale byte built;
the code-building variant's numbers: docs/kernel_log.md).
``glue=old`` is the launch pattern before this change (``amax_rows``, a torch reduction and the
torch ``S_enc`` ops, then the fused pass with the scale given): the same bits, about ten kernels.
Bytes: fwd = amax read + fused read (4 B each, FP32) + BF16 write (2 B); bwd = 4 + 2.
``--ncu`` runs only the dense gate/up and down weights' passes (two calls: 2 kernels each), for
``ncu -k regex:fake_quant`` (kernel names ``_fake_quant_amax_kernel``, ``_fake_quant_kernel``).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file for the results")
    p.add_argument("--shapes", default="dense,moe")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiles", default="8x16x4,4x16x4,16x16x8",
                   help="fused-pass tiles: rows x blocks-of-16 x warps (the first is the shipped one)")
    p.add_argument("--amax-tiles", default="8x512x4,4x1024x1",
                   help="amax-pass tiles: rows x columns x column-iterations (the first is the shipped one)")
    p.add_argument("--block-scaling", default="6",
                   help="comma list of QuadsPolicy.weight_block_scaling values timed with the shipped tiles "
                        "(6, 4over6); the tile sweep runs 6")
    p.add_argument("--ncu", action="store_true", help="only the dense gate/up and down passes, for ncu")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    if not args.ncu and not args.out:
        p.error("--out is required (except with --ncu)")
    return args


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from quads.kernels import fake_quantize_nvfp4 as fq  # noqa: E402
from quads.kernels.amax import amax_rows  # noqa: E402
from quads.ops.weight_quant import fake_quantize_weight_reference, fake_quantize_weight_triton  # noqa: E402
from quads.tensor.nvfp4_math import global_encode_scale_from_amax  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402

DEVICE = torch.device(ARGS.device)
CUDA = DEVICE.type == "cuda"
START = time.time()
ROWS: list[dict] = []

SHAPES = {
    "dense": [("q", (4096, 2560)), ("k/v", (1024, 2560)), ("o", (2560, 4096)), ("gate/up", (9728, 2560)),
              ("down", (2560, 9728))],
    "moe": [("experts.gate_up", (64, 2816, 2048)), ("experts.down", (64, 2048, 1408)), ("q", (4096, 2048)),
            ("k/v", (512, 2048)), ("o", (2048, 4096))],
}
TINY = {"dense": [("q", (64, 96)), ("down", (48, 256))], "moe": [("experts.gate_up", (4, 32, 64))]}


def record(**row):
    row["elapsed_s"] = round(time.time() - START, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def _tile(spec: str) -> tuple[int, int, int]:
    a, b, c = (int(v) for v in spec.split("x"))
    return a, b, c


def set_tiles(fused: str, amax: str) -> None:
    fq.TILE_ROWS, fq.TILE_BLOCKS, fq._NUM_WARPS = _tile(fused)
    fq.AMAX_ROWS, fq.AMAX_COLS, fq.AMAX_ITERS = _tile(amax)


def old_glue(w, dtype=torch.bfloat16):
    """The launch pattern before: per-row amax kernel, torch reduction, torch S_enc ops, fused pass."""
    k = w.shape[-1]
    x2 = w.reshape(-1, k)
    groups = w.shape[0] if w.dim() == 3 else 1
    gs = global_encode_scale_from_amax(amax_rows(x2).reshape(groups, -1).amax(dim=1))
    return fake_quantize_weight_triton(w, dtype, gs if w.dim() == 3 else gs.reshape(()))


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _gpu_and_wall(fn, reps):
    """(gpu_us, wall_us, host_us) per call."""
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    _sync()
    wall = (time.perf_counter() - t0) / reps * 1e6
    if not CUDA:
        return wall, wall, host
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    wall = a.elapsed_time(b) * 1e3 / reps
    # the host enqueues every call while the GPU sleeps: the events then time the GPU alone
    torch.cuda._sleep(int(max(host * reps * 3, 2000) * 2000))  # ~2000 cycles per us
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    gpu = a.elapsed_time(b) * 1e3 / reps
    return gpu, wall, host


def _kernels(fn, reps):
    """{kernel name: device us per call}, kernels per call (torch.profiler)."""
    if not CUDA:
        return {}, None
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        _sync()
    out, count = {}, 0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if e.count and t:
            out[e.key[:60]] = round(t / reps, 2)
            count += e.count
    return out, round(count / reps, 2)


class _NoLaunch:
    """A stand-in for a Triton kernel: ``k[grid](...)`` does nothing (host glue timing)."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def _glue_host_us(fn, reps):
    saved = fq._fake_quant_kernel, fq._fake_quant_amax_kernel
    fq._fake_quant_kernel = fq._fake_quant_amax_kernel = _NoLaunch()
    try:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    finally:
        fq._fake_quant_kernel, fq._fake_quant_amax_kernel = saved


def bench_shape(model, name, shape, fused, amax, glues, per_kernel=True, block_scaling="6"):
    torch.manual_seed(0)
    w = torch.randn(shape, device=DEVICE) * 0.02
    n = w.numel()
    set_tiles(fused, amax)
    ref, gs_ref = fake_quantize_weight_reference(w, torch.bfloat16, None, block_scaling)
    got, gs = fake_quantize_weight_triton(w, torch.bfloat16, None, block_scaling)
    exact = torch.equal(got.view(torch.int16), ref.view(torch.int16)) and torch.equal(gs, gs_ref)
    del ref, got
    calls = {"fwd": lambda: fake_quantize_weight_triton(w, torch.bfloat16, None, block_scaling),
             "bwd": lambda: fake_quantize_weight_triton(w, torch.bfloat16, gs, block_scaling)}
    if "old" in glues:
        calls["fwd-old-glue"] = lambda: old_glue(w)
        calls["cast-bf16"] = lambda: w.to(torch.bfloat16)  # the BF16 peer's autocast cast: the ceiling
    for what, fn in calls.items():
        reps = ARGS.reps if CUDA else 1
        gpu, wall, host = _gpu_and_wall(fn, reps)
        kern, nk = _kernels(fn, reps) if per_kernel else ({}, None)
        glue = (round(_glue_host_us(fn, max(reps, 20)), 1)
                if per_kernel and what in ("fwd", "bwd") else None)
        nbytes = n * (6 if what in ("bwd", "cast-bf16") else 10)
        fused_us = sum(v for k, v in kern.items() if k.startswith("_fake_quant_kernel"))
        amax_us = sum(v for k, v in kern.items() if "amax" in k)
        record(model=model, weight=name, shape=list(shape), call=what, fused_tile=fused, amax_tile=amax,
               block_scaling=block_scaling, bit_exact=exact,
               gpu_us=round(gpu, 1), wall_us=round(wall, 1), host_us=round(host, 1),
               glue_host_us=glue,
               gpu_TBps=round(nbytes / (gpu * 1e-6) / 1e12, 3),
               fused_kernel_TBps=round(n * 6 / (fused_us * 1e-6) / 1e12, 3) if fused_us else None,
               amax_kernel_TBps=round(n * 4 / (amax_us * 1e-6) / 1e12, 3) if amax_us else None,
               kernels_per_call=nk, kernel_us=kern)


def main():
    if ARGS.ncu:
        w1 = torch.randn(9728, 2560, device=DEVICE) * 0.02
        w2 = torch.randn(2560, 9728, device=DEVICE) * 0.02
        for w in (w1, w2):
            fake_quantize_weight_triton(w, torch.bfloat16)
        _sync()
        print("ncu pass done (2 calls: amax + fused each)")
        return
    record(config=vars(ARGS), torch=torch.__version__,
           device=torch.cuda.get_device_name() if CUDA else "cpu")
    tiles = ARGS.tiles.split(",")
    amax_tiles = ARGS.amax_tiles.split(",")
    shapes = TINY if not CUDA else SHAPES
    for model in ARGS.shapes.split(","):
        for name, shape in shapes[model]:
            bench_shape(model, name, shape, tiles[0], amax_tiles[0], ("old",))
            for bs in (b for b in ARGS.block_scaling.split(",") if b != "6"):  # 4over6: the same calls, its branch
                bench_shape(model, name, shape, tiles[0], amax_tiles[0], (), block_scaling=bs)
            for t in tiles[1:]:  # the sweep: GPU time only (no profiler session)
                bench_shape(model, name, shape, t, amax_tiles[0], (), per_kernel=False)
            for a in amax_tiles[1:]:
                bench_shape(model, name, shape, tiles[0], a, (), per_kernel=False)
    set_tiles(tiles[0], amax_tiles[0])
    rows = [r for r in ROWS if "call" in r]
    print(f"{'model':6} {'weight':16} {'call':12} {'blocks':6} {'fused':8} {'amax':9} {'gpu_us':>8} {'wall_us':>8} "
          f"{'host_us':>8} {'glue_us':>8} {'TB/s':>6} {'fusedTB/s':>9} {'amaxTB/s':>8} {'kern':>5} exact")
    for r in rows:
        print(f"{r['model']:6} {r['weight']:16} {r['call']:12} {r['block_scaling']:6} {r['fused_tile']:8} {r['amax_tile']:9} "
              f"{r['gpu_us']:8} "
              f"{r['wall_us']:8} {r['host_us']:8} {str(r['glue_host_us']):>8} {r['gpu_TBps']:6} {str(r['fused_kernel_TBps']):>9} "
              f"{str(r['amax_kernel_TBps']):>8} {str(r['kernels_per_call']):>5} {r['bit_exact']}")
    if ARGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
        write_atomically(ARGS.out, json.dumps({"rows": ROWS}, indent=1))
        print(f"wrote {ARGS.out} ({time.time() - START:.0f} s)")


if __name__ == "__main__":
    main()
