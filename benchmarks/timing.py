"""CUDA-graph timing shared by the kernel benchmarks (rotating input sets, median of replays)."""

from __future__ import annotations

import statistics

import torch


def graph_time(calls, iters=30):
    """Median µs per call of a CUDA graph running ``calls`` (one per input set) back to back."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for c in calls:
            c()
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=st):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(ts)


# -- the one results table -----------------------------------------------------------------------

#: every kernel timing of every run, appended (the raw logs / JSON stay in the run's folder beside it)
RESULTS_CSV = __import__("pathlib").Path(__file__).resolve().parent / "results" / "kernels.csv"
RESULT_FIELDS = ("kernel", "shape", "variant", "us", "gpu", "commit", "date", "raw")


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=RESULTS_CSV.parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def append_results(rows, raw: str, csv_path=RESULTS_CSV) -> None:
    """Append ``rows`` (dicts with kernel, shape, variant, us) to the results CSV, with the GPU,
    the commit, the date and ``raw`` (where the run's raw log / JSON lies)."""
    import csv
    import time

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    fixed = {"gpu": gpu, "commit": _commit(), "date": time.strftime("%Y-%m-%d"), "raw": raw}
    new = not csv_path.exists()
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k, "") for k in ("kernel", "shape", "variant", "us")}, **fixed})
