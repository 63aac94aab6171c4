"""Markdown tables for docs/ from the raw benchmark JSON (nothing is re-measured).

    python -m benchmarks.studies.make_tables kernels results/h200_2026-12-01_decode_kernels/run3/bench.json
    python -m benchmarks.studies.make_tables rollout results/engine_h200_2026-12-01/run6/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import json
import re


def kernels(path: str) -> None:
    rows = json.load(open(path))["rows"]
    linear = [r for r in rows if r["section"] == "linear"]
    shapes = sorted({re.match(r"K=(\d+) N=(\d+)", r["name"]).groups() for r in linear}, key=lambda s: (int(s[0]), int(s[1])))
    ms = sorted({int(re.search(r" M=(\d+) ", r["name"]).group(1)) for r in linear})
    us = {}
    for r in linear:
        k, n = re.match(r"K=(\d+) N=(\d+)", r["name"]).groups()
        m = int(re.search(r" M=(\d+) ", r["name"]).group(1))
        op = r["name"].split(f" M={m} ", 1)[1]
        us[(k, n, m, op)] = r["us"]
    ops = [("QUADS k=100% (default) incl. quantize", "QUADS default"), ("QUADS k=50% top-k incl. quantize", "k=50% top-k"),
           ("W4A4 plain incl. quantize", "plain W4A4"), ("W4A16 weight-only", "W4A16")]
    print("| K x N | M | cuBLAS BF16 us | FP8 us | " + " | ".join(f"{label} us (vs BF16 / FP8)" for _, label in ops) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(ops))
    for k, n in shapes:
        for m in ms:
            bf16 = us.get((k, n, m, "cuBLAS BF16"))
            fp8 = us.get((k, n, m, "FP8 W8A8 (fused act quant + _scaled_mm)"))
            if bf16 is None:
                continue
            cells = []
            for op, _ in ops:
                t = us.get((k, n, m, op))
                cells.append("-" if t is None else f"{t:.1f} ({bf16 / t:.2f}x / {fp8 / t:.2f}x)")
            print(f"| {k} x {n} | {m} | {bf16:.1f} | {fp8:.1f} | " + " | ".join(cells) + " |")
    print()
    print("| MoE block | BF16 grouped_mm us | QUADS default us (vs BF16) | plain W4A4 us (vs BF16) |")
    print("|---|---:|---:|---:|")
    moe = {r["name"]: r["us"] for r in rows if r["section"] == "moe"}
    for name, t in moe.items():
        if name.endswith("BF16 grouped_mm"):
            stem = name[: -len("BF16 grouped_mm")]
            q, p = moe.get(stem + "QUADS k=100% (graph-captured)"), moe.get(stem + "W4A4 plain (graph-captured)")
            print(f"| {stem.strip()} | {t:.1f} | {q:.1f} ({t / q:.2f}x) | {p:.1f} ({t / p:.2f}x) |")


def rollout(path: str) -> None:
    """Tables of a rollout_throughput.json: one per model and ``glue`` setting (rows without one
    predate the flag: the old glue), then the glue settings' step ratios against ``old``."""
    data = json.load(open(path))
    by_glue = {}
    for r in data["rows"]:
        if "decode_step_us" in r and r.get("engine") != "hf_generate":
            by_glue.setdefault(r.get("glue", "old"), {})[(r["kind"], r["variant"], r.get("batch"))] = r
    for i, glue in enumerate(by_glue):
        if len(by_glue) > 1:
            print(f"\n## glue = {glue}")
        _rollout_tables(data, by_glue[glue], show_hf=i == 0)
    if "old" in by_glue and len(by_glue) > 1:
        old = by_glue["old"]
        for glue, steps in by_glue.items():
            if glue == "old":
                continue
            print(f"\nglue {glue} vs old: decode step us saved (old step / {glue} step)")
            for (kind, variant, b), r in sorted(steps.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
                o = old.get((kind, variant, b))
                if o:
                    print(f"- {kind} {variant} B={b}: {o['decode_step_us'] - r['decode_step_us']:.0f} us "
                          f"({o['decode_step_us'] / r['decode_step_us']:.3f}x)")


def _rollout_tables(data: dict, steps: dict, show_hf: bool) -> None:
    hf = {}
    for r in data["rows"] if show_hf else ():
        if "decode_step_us" in r and r.get("engine") == "hf_generate":
            hf[(r["kind"], r["variant"], r.get("batch"))] = r
    batches = sorted({b for (_, _, b) in steps})
    for kind in ("moe", "dense"):
        print(f"\n{kind}: decode step us (graphed), ratio = BF16 step / this step; prefill ratio in brackets")
        print("| variant | " + " | ".join(f"B={b}" for b in batches) + " |")
        print("|---|" + "---:|" * len(batches))
        for variant in ("bf16", "fp8", "quads", "quads-unfused", "naive", "w4a16"):
            cells = []
            for b in batches:
                r, base = steps.get((kind, variant, b)), steps.get((kind, "bf16", b))
                if r is None or base is None:
                    cells.append("-")
                    continue
                cells.append(f"{r['decode_step_us']:.0f} ({base['decode_step_us'] / r['decode_step_us']:.2f}x) "
                             f"[{base['prefill_ms'] / r['prefill_ms']:.2f}x]")
            if any(c != "-" for c in cells):
                print(f"| {variant} | " + " | ".join(cells) + " |")
        for (k, v, b), r in sorted(hf.items()):
            if k == kind:
                g = steps.get((k, v, b))
                extra = f" -> graphed {g['decode_step_us']:.0f} us ({r['decode_step_us'] / g['decode_step_us']:.1f}x)" if g else ""
                print(f"- `generate` (eager, dynamic cache) {v} B={b}: {r['decode_step_us']:.0f} us/step{extra}")


TABLES = {"kernels": kernels, "rollout": rollout}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=sorted(TABLES), help="kernels: bench_kernels.py's bench.json; "
                    "rollout: rollout_throughput.py's rollout_throughput.json")
    ap.add_argument("path", help="the raw JSON")
    args = ap.parse_args(argv)
    TABLES[args.table](args.path)


if __name__ == "__main__":
    main()
