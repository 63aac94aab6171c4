"""Table and plots of the real-model GRPO ablation (``benchmarks/real_grpo.py`` runs).

    python benchmarks/real_grpo_report.py runs/real_grpo [--out docs/img]

Reads every ``<config>-s<seed>/metrics.jsonl`` and ``summary.json``; prints the paper-form table
(per-step max log-prob gap averaged over steps, its ratio to the BF16 floor, mean / p99 gap,
k3 KL, importance-sampling masking, held-out accuracy before and after, averaged over the seeds
that finished), the paper's numbers beside it, the step's wall clock split (generate / train /
sync, the rollout's share), and writes ``real_grpo_gap.png`` and ``real_grpo_reward.png`` (one line
per configuration: the mean over seeds, the band between the seeds' min and max). Runs that
stopped early count in the per-step columns with the steps they have (the ``steps`` column says
how many); held-out "after" needs a finished run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from quads.tensor.files import write_atomically

ORDER = ["bf16", "fp8", "naive", "sym-qat", "w4a16-qat", "quads-50", "quads"]
#: the source paper's numbers (max per-step gap, final accuracy); "-" where it gives none
PAPER = {"bf16": ("0.74", "73.15"), "fp8": ("-", "72.88"), "naive": ("1.3", "51.37"), "quads": ("0.86", "72.86")}


def load(runs: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and (p / "summary.json").exists()):
        summary = json.loads((run / "summary.json").read_text())
        metrics = run / "metrics.jsonl"
        steps = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.exists() else []
        if steps:  # a run that crashed before its first step has nothing to report
            out[summary["config"]].append({"summary": summary, "steps": steps})
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def table(runs: dict[str, list[dict]]) -> str:
    def per_run(run, key):
        return _mean([s[key] for s in run["steps"]])

    rows = {}
    for config, rs in runs.items():
        done = [r for r in rs if "heldout_after" in r["summary"]]
        rows[config] = {
            "seeds": f"{len(done)}/{len(rs)}",
            "steps": "/".join(str(len(r["steps"])) for r in rs),
            "gap_max": _mean([per_run(r, "logp_gap_max") for r in rs]),
            "gap_mean": _mean([per_run(r, "logp_gap_mean") for r in rs]),
            "gap_p99": _mean([per_run(r, "logp_gap_p99") for r in rs]),
            "k3": _mean([per_run(r, "k3_kl") for r in rs]),
            "masked": _mean([per_run(r, "is_masked_fraction") for r in rs]),
            "is_max": _mean([per_run(r, "is_ratio_raw_max") for r in rs]),
            "before": _mean([r["summary"]["heldout_before"]["rollout"] for r in rs]),
            "after": _mean([r["summary"]["heldout_after"]["rollout"] for r in done]) if done else None,
            "after_master": _mean([r["summary"]["heldout_after"]["master_bf16"] for r in done]) if done else None,
        }
    floor = rows.get("bf16", {}).get("gap_max", float("nan"))
    head = ("| config | seeds finished / run | steps per seed | max gap (mean over steps) | / BF16 floor | mean gap | p99 gap | k3 KL | "
            "IS masked | raw IS max | held-out before | after (rollout) | after (BF16 masters) | paper max gap | paper acc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for config in [c for c in ORDER if c in rows] + sorted(set(rows) - set(ORDER)):
        r = rows[config]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
        paper = PAPER.get(config, ("-", "-"))
        lines.append(f"| {config} | {r['seeds']} | {r['steps']} | {r['gap_max']:.3f} | {r['gap_max'] / floor:.2f} | "
                     f"{r['gap_mean']:.4f} | {r['gap_p99']:.3f} | {r['k3']:.2e} | {r['masked']:.3f} | {r['is_max']:.3g} | "
                     f"{pct(r['before'])} | {pct(r['after'])} | {pct(r['after_master'])} | {paper[0]} | {paper[1]} |")
    return "\n".join(lines)


def timing_table(runs: dict[str, list[dict]]) -> str:
    """Mean seconds per step of each phase, over every step of every seed, and the rollout's share."""
    lines = ["| config | generate s | train s | sync s | step s | rollout share |", "|---|---|---|---|---|---|"]
    for config in [c for c in ORDER if c in runs] + sorted(set(runs) - set(ORDER)):
        steps = [s for r in runs[config] for s in r["steps"]]
        g, t, y = (_mean([s[k] for s in steps]) for k in ("t_generate", "t_train", "t_sync"))
        lines.append(f"| {config} | {g:.2f} | {t:.2f} | {y:.3f} | {g + t + y:.2f} | {100 * g / (g + t + y):.0f}% |")
    return "\n".join(lines)


def plots(runs: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, name, ylabel in (("logp_gap_max", "real_grpo_gap.png", "per-step max |log p_rollout - log p_trainer|"),
                              ("reward", "real_grpo_reward.png", "mean reward")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for config in [c for c in ORDER if c in runs] + sorted(set(runs) - set(ORDER)):
            k = 10
            curves = []
            for r in runs[config]:
                ys = [s[key] for s in r["steps"]]
                curves.append([statistics.fmean(ys[max(0, j - k + 1) : j + 1]) for j in range(len(ys))])
            n = max(len(c) for c in curves)
            xs = list(range(n))
            at = [[c[j] for c in curves if j < len(c)] for j in xs]
            color = f"C{ORDER.index(config) if config in ORDER else len(ORDER)}"
            seeds = len(curves)
            ax.plot(xs, [statistics.fmean(v) for v in at], color=color, label=f"{config} ({seeds} seed{'s' * (seeds > 1)})")
            if seeds > 1:
                ax.fill_between(xs, [min(v) for v in at], [max(v) for v in at], color=color, alpha=0.2, linewidth=0)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel + " (10-step mean)")
        if key == "logp_gap_max":
            ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / name
        write_atomically(path, lambda f: fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=110))
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path)
    p.add_argument("--out", type=Path, default=None, help="folder for the PNG plots (default: the runs folder)")
    args = p.parse_args(argv)
    runs = load(args.runs)
    if not runs:
        raise SystemExit(f"no runs with summary.json under {args.runs}")
    print(table(runs))
    print()
    print(timing_table(runs))
    out = args.out or args.runs
    out.mkdir(parents=True, exist_ok=True)
    for path in plots(runs, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
