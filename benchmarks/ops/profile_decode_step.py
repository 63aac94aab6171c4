"""Where one rollout decode step spends its GPU time: kernel-level profile, BF16 vs quads.

    python -m benchmarks.ops.profile_decode_step --out DIR [--cases dense:1,moe:8] [--layers 4]
        [--glue new,old] [--new-tokens 256]

Same models as ``rollout_throughput.py``. For each case (model kind : batch size) and variant
(``bf16``, ``quads``): the graphed decoder's step time (CUDA-graph replay, median of 50), then
the same step run eagerly under ``torch.profiler`` (10 steps): per kernel name, calls and
microseconds per step, grouped into families (quads quantization / quads GEMM / cuBLAS GEMM /
attention / elementwise+norm / sampling / other). The sum of kernel times against the replay
time shows what the graph leaves as gaps between kernels.

``--glue`` (default ``new,old``): the decoder's glue settings profiled, each case once per
setting (``rollout_throughput.GLUE``: ``new`` = GQA attention without ``repeat_kv`` + one
activation quantization per sibling group, ``old`` = both off). ``--new-tokens`` sets the cache
length as the end-to-end run has it (prompt + new tokens, rounded up to 64: 320 for 64 + 256),
since the ``repeat_kv`` copies scale with it.

Output: ``--out``/profile_decode_step.json, and per case the replayed step and its kernel
families' sums (µs per step) appended to ``results/kernels.csv`` (``--csv``,
:func:`benchmarks.timing.append_results`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict

import torch

import quads
from benchmarks.rl.rollout_throughput import DEVICE, GLUE, build_model
from benchmarks.timing import add_csv_argument, append_results
from quads.engine import GraphedDecoder, SamplingSpec
from quads.policies import build_rollout_model
from quads.tensor.files import write_atomically

FAMILIES = [
    ("quads quant", r"^_(act_quant|quantize|amax|scaled_fp16)"),  # quads' Triton kernels are named _...
    ("quads gemm", r"^_(decode_gemm|decode_reduce|moe_w4a4|moe_segment|moe_reduce|w4a4|dequant)"),
    ("cublas gemm", r"gemm|sm90_xmma|cutlass|nvjet|cublas|gemv"),
    ("attention", r"flash|attention|fmha|sdpa|softmax_warp|efficient"),
    ("sampling", r"topk|sort|exponential|argmax|log_softmax|isin|radix"),
    ("elementwise/norm", r"elementwise|vectorized|reduce|pow|rsqrt|mean|mul|add|copy|cat|index|fill|where"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name if fam.startswith("quads") else name.lower()):
            return fam
    return "other"


def rewind(decoder: GraphedDecoder, width: int) -> None:
    """Put the session's next step back at slot ``width`` (right after the unpadded prompt), so
    that the steps timed after a full ``generate`` write inside the cache."""
    decoder._state.slot.fill_(width)
    decoder._state.position.fill_(width)


def replay_us(decoder: GraphedDecoder, ids, am, new_tokens: int) -> float:
    spec = SamplingSpec(max_new_tokens=new_tokens, eos_token_ids=(), pad_token_id=0)  # sets the cache length
    decoder.generate(ids, am, spec)  # capture
    rewind(decoder, ids.shape[1])  # 50 replays from slot P: inside the cache (P + 50 <= P + new_tokens)
    graph = decoder._state.graph
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def kernel_profile(decoder: GraphedDecoder, ids, am, new_tokens: int, steps: int = 10):
    spec = SamplingSpec(max_new_tokens=new_tokens, eos_token_ids=(), pad_token_id=0)
    decoder.generate(ids, am, spec)  # the session at the end-to-end cache length (eager steps: warm-up too)
    rewind(decoder, ids.shape[1])  # profile steps at slots [P, P + steps): inside the cache
    state = decoder._state
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder._step(state, spec)
        torch.cuda.synchronize()
    rows = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if getattr(evt, "device_type", None) is None or str(evt.device_type) not in ("DeviceType.CUDA",):
            continue
        r = rows[evt.name]
        r[0] += 1
        r[1] += evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
    out = [dict(kernel=k[:120], family=family(k), calls_per_step=c / steps, us_per_step=round(t / steps, 2))
           for k, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us_per_step"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="dense:1,moe:8")
    ap.add_argument("--variants", default="bf16,quads")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256, help="sets the cache length (prompt + new tokens)")
    ap.add_argument("--glue", default="new,old", help=f"comma list of {tuple(GLUE)}")
    add_csv_argument(ap)
    args = ap.parse_args()
    if args.new_tokens < 51:
        raise SystemExit("--new-tokens must be >= 51 (50 timed replays run inside the cache)")
    glues = args.glue.split(",")
    if any(x not in GLUE for x in glues):
        raise SystemExit(f"--glue: use names of {tuple(GLUE)}")
    if DEVICE != "cuda":
        raise SystemExit("profile_decode_step.py needs a CUDA device (it profiles GPU kernels)")
    os.makedirs(args.out, exist_ok=True)
    results = dict(meta=dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                             date=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:]), cases=[])
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    for kind in dict.fromkeys(k for k, _ in cases):
        base = build_model(kind, args.layers)
        for name in args.variants.split(","):
            t0 = time.perf_counter()
            model = base if name == "bf16" else build_rollout_model(base, quads.QuadsPolicy(side="rollout"))
            torch.cuda.synchronize()
            build_s = time.perf_counter() - t0
            for k, batch in cases:
                if k != kind:
                    continue
                g = torch.Generator(device="cuda").manual_seed(0)
                ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device="cuda", generator=g)
                am = torch.ones_like(ids)
                for glue in glues:
                    graph_us = replay_us(GraphedDecoder(model, **GLUE[glue]), ids, am, args.new_tokens)
                    kernels = kernel_profile(GraphedDecoder(model, use_cuda_graph=False, **GLUE[glue]), ids, am,
                                             args.new_tokens)
                    fams = defaultdict(float)
                    for r in kernels:
                        fams[r["family"]] += r["us_per_step"]
                    total = sum(fams.values())
                    case = dict(kind=kind, variant=name, glue=glue, batch=batch, build_s=round(build_s, 1),
                                graph_step_us=round(graph_us, 1), kernel_sum_us=round(total, 1),
                                kernels_per_step=sum(r["calls_per_step"] for r in kernels),
                                families={f: round(v, 1) for f, v in sorted(fams.items(), key=lambda x: -x[1])},
                                top=kernels[:30])
                    results["cases"].append(case)
                    print(json.dumps({k2: v for k2, v in case.items() if k2 != "top"}), flush=True)
                    for r in kernels[:18]:
                        print(f"   {r['us_per_step']:9.1f} us {r['calls_per_step']:6.1f}x  [{r['family']}] {r['kernel']}",
                              flush=True)
            if model is not base:
                del model
            torch.cuda.empty_cache()
        del base
        torch.cuda.empty_cache()
        write_atomically(os.path.join(args.out, "profile_decode_step.json"), json.dumps(results, indent=1))
    append_results(_csv_rows(results["cases"], args), raw=os.path.join(args.out, "profile_decode_step.json"),
                   csv_path=args.csv)


def _csv_rows(cases: list[dict], args) -> list[dict]:
    """The results table's rows: per case the replayed step, then its kernel families (profiled
    eagerly: their sum against the step is what the graph leaves as gaps)."""
    rows = []
    for c in cases:
        shape = f"{c['kind']} L{args.layers} batch {c['batch']}, cache {args.prompt}+{args.new_tokens}"
        variant = f"{c['variant']}, glue {c['glue']}"
        rows.append({"kernel": "decode_step", "shape": shape, "variant": variant, "us": c["graph_step_us"]})
        rows += [{"kernel": f"decode_step/{fam}", "shape": shape, "variant": f"{variant}, profiled eagerly", "us": us}
                 for fam, us in c["families"].items()]
    return rows


if __name__ == "__main__":
    main()
