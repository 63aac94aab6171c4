"""What the timing benchmarks share: CUDA-graph timing (rotating input sets, median of replays)
and the one results table, ``results/kernels.csv``, every timing row appended by
:func:`append_results` (a benchmark takes ``--csv`` through :func:`add_csv_argument`)."""

from __future__ import annotations

import csv
import fcntl
import io
import os
import statistics
import subprocess
import time
from pathlib import Path

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
RESULTS_CSV = Path(__file__).resolve().parents[1] / "results" / "kernels.csv"
#: its columns: what was timed, at which shape, which variant, microseconds per call, on which GPU,
#: at which commit, on which date, and where the run's raw log / JSON lies
RESULT_FIELDS = ("kernel", "shape", "variant", "us", "gpu", "commit", "date", "raw")


def add_csv_argument(parser) -> None:
    """``--csv PATH``: the results table a benchmark appends its rows to (default
    :data:`RESULTS_CSV`; ``''``: none). Every timing benchmark takes it the same way."""
    parser.add_argument("--csv", default=str(RESULTS_CSV),
                        help="the results table the timing rows are appended to ('' : none)")


def _commit() -> str:
    """The code's commit: ``QUADS_COMMIT`` if set (the device machine's copy of the working tree
    may carry a stale ``.git``: the device scripts pass the commit in), else ``git rev-parse``."""
    if os.environ.get("QUADS_COMMIT"):
        return os.environ["QUADS_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=RESULTS_CSV.parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _csv_text(rows) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def append_results(rows, raw: str, csv_path=RESULTS_CSV) -> None:
    """Append ``rows`` (dicts with kernel, shape, variant, us) to the results CSV (``csv_path``;
    ``None`` or ``''``: nothing), each with the GPU, the commit, the date and ``raw`` (where the
    run's raw log / JSON lies).

    Atomic per call, so the table never holds half a row: every row is formatted first (a bad
    row raises before anything is written), the file is locked (``flock``: concurrent benchmarks
    append one after the other), a half row left by a writer killed mid-write is cut off, the
    header goes in if the file is empty, and all rows are written by one ``write`` and synced."""
    if not csv_path:
        return
    csv_path = Path(csv_path)
    fixed = {"gpu": _device_name(), "commit": _commit(), "date": time.strftime("%Y-%m-%d"), "raw": raw}
    lines = []
    for r in rows:
        missing = [k for k in ("kernel", "us") if r.get(k) in (None, "")]
        if missing:
            raise ValueError(f"append_results: row {r} has no {missing}")
        row = {**{k: r.get(k, "") for k in ("kernel", "shape", "variant")}, "us": f"{float(r['us']):.3f}", **fixed}
        lines.append([row[k] for k in RESULT_FIELDS])
    if not lines:
        return
    body = _csv_text(lines)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(csv_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # a planted link: refused
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size:
            os.lseek(fd, max(0, size - 65536), os.SEEK_SET)
            tail = os.read(fd, 65536)
            if not tail.endswith(b"\n"):  # a killed writer's half row: cut back to the last full line
                cut = tail.rfind(b"\n")
                os.ftruncate(fd, size - len(tail) + cut + 1 if cut >= 0 else 0)
                size = os.fstat(fd).st_size
        text = (_csv_text([RESULT_FIELDS]) if size == 0 else "") + body
        os.lseek(fd, 0, os.SEEK_END)
        data = text.encode()
        written = os.write(fd, data)
        if written != len(data):  # e.g. a full disk: take the partial write back
            os.ftruncate(fd, size)
            raise OSError(f"append_results: wrote {written} of {len(data)} bytes to {csv_path}")
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock
