"""Which interrupted line of ``sync_weights_`` leaves the rollout's sync lock unusable from another thread.

    python -m benchmarks.studies.sync_lock_scan 1 6200        # executed lines 1..6200 of one sync

For each executed line N in the range: a ``KeyboardInterrupt`` at line N of a sync into a fresh
rollout (:func:`benchmarks.studies.reliability_sweeps.run_traced`), then a second thread syncs the
same rollout; a line after which that sync does not finish within ``--timeout`` seconds is
printed. The interrupt sweep of ``reliability_sweeps`` checks the rollout's state after each
interrupt, not whether another thread can still sync it: this scan is that check
(docs/reliability.md).
"""

from __future__ import annotations

import argparse
import copy
import threading

import torch

import quads
from benchmarks.studies.reliability_sweeps import _count_lines, run_traced, tiny_model


def scan(lo: int, hi: int, timeout: float = 10.0, log=print) -> tuple[int, list[int]]:
    """(executed lines of one sync, the lines in ``lo..hi`` after whose interrupt another thread waits)."""
    trainer = tiny_model(seed=1, dtype=torch.float32)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    base = tiny_model()
    quads.quantize_(base, quads.QuadsPolicy(side="rollout"))
    total = _count_lines(lambda m: quads.sync_weights_(m, trainer), base)
    stuck = []
    for n in range(lo, min(hi, total) + 1):
        rollout = copy.deepcopy(base)
        run_traced(lambda: quads.sync_weights_(rollout, trainer), stop=n)
        torch.set_grad_enabled(True)
        done = []
        other = threading.Thread(target=lambda: (quads.sync_weights_(rollout, trainer), done.append(1)), daemon=True)
        other.start()
        other.join(timeout)
        if not done:
            stuck.append(n)
            log(f"stuck after interrupt at line {n}")
    return total, stuck


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lo", type=int, help="first executed line to interrupt at (1-based)")
    ap.add_argument("hi", type=int, help="last executed line (clipped to the sync's length)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds the second thread's sync may take")
    args = ap.parse_args(argv)
    if not 1 <= args.lo <= args.hi:
        ap.error(f"need 1 <= lo <= hi, got lo={args.lo} hi={args.hi}")
    total, stuck = scan(args.lo, args.hi, args.timeout)
    print("total", total, "scanned", args.lo, "..", min(args.hi, total), "stuck", len(stuck), stuck[:10])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
