"""The mismatch ablation: GRPO on the embedded MoE task once per precision configuration.

Runs ``examples/trl_grpo_quads.py`` for each policy (bf16, naive, sym-qat, w4a16-qat, quads),
in parallel subprocesses, then aggregates their ``metrics.jsonl`` / ``summary.json`` into the
paper-style table (max per-step log-prob gap, gap / BF16 floor, final held-out accuracy) and
plots of the gap and the reward per step.

    python -m benchmarks.rl.ablation --steps 200 --out runs/ablation --parallel 5 [--device cuda]
    python -m benchmarks.rl.ablation --aggregate-only --out runs/ablation   # re-make table/plots

Extra arguments after ``--`` go to every example run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from quads.tensor.files import open_for_append, write_atomically

POLICIES = ["bf16", "naive", "sym-qat", "w4a16-qat", "quads"]
ROOT = Path(__file__).resolve().parents[2]


def run_all(args, extra) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen, float]] = []
    pending = list(args.policies)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while pending or procs:
        while pending and len(procs) < args.parallel:
            policy = pending.pop(0)
            cmd = [sys.executable, str(ROOT / "examples" / "trl_grpo_quads.py"), "--policy", policy,
                   "--max-steps", str(args.steps), "--output-dir", str(out / policy),
                   "--seed", str(args.seed), "--threads", str(args.threads), *extra]
            if args.device:
                cmd += ["--device", args.device]
            log = open_for_append(out / f"{policy}.log", truncate=True)  # never through a planted link
            print(f"[ablation] start {policy}: {' '.join(cmd)}", flush=True)
            procs.append((policy, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), time.time()))
        for item in list(procs):
            policy, proc, t0 = item
            if proc.poll() is not None:
                print(f"[ablation] {policy} exited {proc.returncode} after {time.time() - t0:.0f}s", flush=True)
                procs.remove(item)
        time.sleep(2)


def _rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "reward" in rec:
                rows.append(rec)
    return rows


def aggregate(out: Path, policies: list[str]) -> dict:
    results = {}
    for policy in policies:
        summary_path = out / policy / "summary.json"
        rows = _rows(out / policy / "metrics.jsonl")
        if not rows:
            continue
        gmax = [r.get("sampling/quads/logp_gap_max", math.nan) for r in rows]
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        after = summary.get("heldout_after") or {}
        before = summary.get("heldout_before") or {}
        results[policy] = {
            "steps": len(rows),
            "gap_max_over_steps": max(gmax),
            "gap_max_per_step_mean": sum(gmax) / len(gmax),
            "gap_mean": sum(r.get("sampling/quads/logp_gap_mean", math.nan) for r in rows) / len(rows),
            "reward_first10": sum(r["reward"] for r in rows[:10]) / min(10, len(rows)),
            "reward_last10": sum(r["reward"] for r in rows[-10:]) / min(10, len(rows)),
            "acc_before": before.get("rollout"),
            "acc_after_rollout": after.get("rollout"),
            "acc_after_trainer": after.get("trainer"),
            "train_seconds": summary.get("train_seconds"),
            "steps_series": [r["step"] for r in rows],
            "gap_max_series": gmax,
            "gap_mean_series": [r.get("sampling/quads/logp_gap_mean", math.nan) for r in rows],
            "reward_series": [r["reward"] for r in rows],
        }
    return results


def table(results: dict) -> str:
    floor = results.get("bf16", {}).get("gap_max_over_steps", math.nan)
    floor_mean = results.get("bf16", {}).get("gap_max_per_step_mean", math.nan)
    fmt = lambda x: "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"  # noqa: E731
    pct = lambda x: "n/a" if x is None else f"{100 * x:.2f}"  # noqa: E731
    lines = ["| config | steps | max gap (max over steps) | / BF16 floor | per-step max gap (mean) | / floor | mean gap | reward first 10 -> last 10 | held-out acc before -> after (%) | train s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        lines.append(
            f"| {policy} | {r['steps']} | {fmt(r['gap_max_over_steps'])} | {r['gap_max_over_steps'] / floor:.2f} | "
            f"{fmt(r['gap_max_per_step_mean'])} | {r['gap_max_per_step_mean'] / floor_mean:.2f} | {fmt(r['gap_mean'])} | "
            f"{r['reward_first10']:.3f} -> {r['reward_last10']:.3f} | {pct(r['acc_before'])} -> {pct(r['acc_after_rollout'])} | "
            f"{r['train_seconds']} |"
        )
    return "\n".join(lines)


def plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for policy, r in results.items():
        axes[0].plot(r["steps_series"], r["gap_max_series"], label=policy, lw=1)
        axes[1].plot(r["steps_series"], r["gap_mean_series"], label=policy, lw=1)
        k = 10
        smooth = [sum(r["reward_series"][max(0, i - k + 1): i + 1]) / min(k, i + 1) for i in range(len(r["reward_series"]))]
        axes[2].plot(r["steps_series"], smooth, label=policy, lw=1)
    axes[0].set_ylabel("per-step max |Δ log p|")
    axes[1].set_ylabel("per-step mean |Δ log p|")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("reward (10-step mean)")
    axes[2].set_xlabel("GRPO step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("QUADS ablation on the embedded MoE arithmetic task")
    fig.tight_layout()
    write_atomically(out / "ablation.png", lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--device", default=None, help="passed to the example (e.g. cuda)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aggregate-only", action="store_true")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    out = Path(args.out)
    if not args.aggregate_only:
        run_all(args, extra)
    results = aggregate(out, args.policies)
    text = table(results)
    print(text)
    write_atomically(out / "ablation.md", text + "\n")
    write_atomically(out / "ablation.json", json.dumps(results, indent=1))
    if results:
        plots(results, out)


if __name__ == "__main__":
    main()
