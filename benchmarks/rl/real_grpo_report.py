"""Table and plots of the real-model GRPO ablation (``benchmarks/rl/real_grpo.py`` runs).

    python -m benchmarks.rl.real_grpo_report runs/real_grpo [--out docs/img] [--prefix real_grpo_trl] [--from-logs]

Reads every run directory under the folder: the main example's (``<preset>-s<seed>/``:
``summary.json`` and TRL's log records in ``metrics.jsonl``, the runs of ``benchmarks/rl/real_grpo.py``)
and the earlier self-contained loop's (``<config>-s<seed>/``, its ``metrics.jsonl`` rows),
so the old table can be re-made beside the new one. Prints the paper-form table (per-step max
log-prob gap averaged over steps, its ratio to the BF16 floor, mean / p99 gap, k3 KL,
importance-sampling masking, the drift of the mean gap (its last 20 steps over its first 20), the
MoE routing flips (share of recorded tokens whose top-k expert set, and whose top-1 expert, the
trainer picks otherwise, mean over layers and steps; "-" for runs that logged none), held-out accuracy before and after, averaged over the seeds that
finished), the paper's numbers beside it, the step's wall clock split (generate / train / sync,
the rollout's share), and writes ``<prefix>_gap.png`` and ``<prefix>_reward.png`` (one line per
configuration: the mean over seeds, the band between the seeds' min and max). Runs that stopped
early count in the per-step columns with the steps they have (the ``steps`` column says how
many); held-out "after" needs a finished run. "after (trainer)" is the trainer's own greedy
forward (the example's; QAT presets: the fake-quantized forward), or the BF16 masters (the old loop).
``--from-logs`` reads the runs' console logs instead (``<preset>-s<seed>.log``, appended by every
call of ``real_grpo.py``): each step's first line and the first run's held-out lines, so a run
whose folder a later start overwrote is still reported as it ran.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from quads.tensor.files import write_atomically
#: the source paper's numbers (max per-step gap, final accuracy); "-" where it gives none
PAPER = {"bf16": ("0.74", "73.15"), "fp8": ("-", "72.88"), "naive": ("1.3", "51.37"), "quads": ("0.86", "72.86")}
#: per-step keys, the example's (TRL log records) -> the table's
EXAMPLE_KEYS = {"sampling/quads/logp_gap_max": "gap_max", "sampling/quads/logp_gap_mean": "gap_mean",
                "sampling/quads/logp_gap_p99": "gap_p99", "sampling/quads/k3_kl": "k3",
                "sampling/quads/is_masked_fraction": "masked", "sampling/quads/is_ratio_raw_max": "is_max",
                "reward": "reward", "timing/quads/generate_s": "generate", "timing/train_s": "train",
                "timing/quads/sync_s": "sync", "sampling/quads/routing_flip_topk": "flips",
                "sampling/quads/routing_flip_top1": "flips_top1", "sampling/quads/routing_replayed": "replayed"}
#: the same for the earlier self-contained loop
LOOP_KEYS = {"logp_gap_max": "gap_max", "logp_gap_mean": "gap_mean", "logp_gap_p99": "gap_p99", "k3_kl": "k3",
             "is_masked_fraction": "masked", "is_ratio_raw_max": "is_max", "reward": "reward",
             "t_generate": "generate", "t_train": "train", "t_sync": "sync"}


def _order() -> list[str]:
    try:
        from quads.policies import POLICY_PRESETS

        presets = list(POLICY_PRESETS)
    except ImportError:  # pragma: no cover - the report reads JSON only
        presets = []
    return ["bf16", "fp8", "naive", "sym-qat", "w4a16-qat", "quads-50", "quads"] + presets


def _normalize(summary: dict, records: list[dict]) -> dict | None:
    """One run as {config, seed, finished, before, after, after_trainer, steps: [{key: value}]}."""
    if "policy" in summary:  # the example
        keys, steps = EXAMPLE_KEYS, [r for r in records if "reward" in r]
        config, seed = summary["policy"], summary.get("args", {}).get("seed")
        after = summary.get("heldout_after") if summary.get("complete") else None
        trainer_key = "trainer"
    else:  # the self-contained loop
        keys, steps = LOOP_KEYS, records
        config, seed, after = summary["config"], summary.get("seed"), summary.get("heldout_after")
        trainer_key = "master_bf16"
    if not steps:  # a run that crashed before its first step has nothing to report
        return None
    before = summary.get("heldout_before") or {}
    return {"config": config, "seed": seed, "finished": after is not None,
            "before": before.get("rollout"), "after": (after or {}).get("rollout"),
            "after_trainer": (after or {}).get(trainer_key),
            "steps": [{new: r.get(old) for old, new in keys.items()} for r in steps]}


def load(runs: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for run in sorted(p for p in runs.iterdir() if p.is_dir() and (p / "summary.json").exists()):
        summary = json.loads((run / "summary.json").read_text())
        metrics = run / "metrics.jsonl"
        records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.exists() else []
        r = _normalize(summary, records)
        if r is not None:
            out[r["config"]].append(r)
    return out


_STEP = re.compile(r"^step +(\d+)/\d+ +reward (\S+) +gap mean (\S+) p99 (\S+) max (\S+) +k3 (\S+) +IS raw "
                   r"\[(\S+), (\S+)\] masked (\S+) +\((\S+)s: generate (\S+) train (\S+) sync (\S+)\)(?: +flips (\S+))?")
_BEFORE = re.compile(r"^held-out greedy accuracy before .*: rollout engine (\S+), trainer forward (\S+)")
_AFTER = re.compile(r"^held-out acc +rollout engine (\S+) -> (\S+) +trainer forward (\S+) -> (\S+)")


def load_logs(runs: Path) -> dict[str, list[dict]]:
    """The runs as their console logs tell them (see the module doc): per step number its first
    line; held-out accuracy from the first finished run's summary lines."""
    out: dict[str, list[dict]] = defaultdict(list)
    for log in sorted(runs.glob("*-s*.log")):
        config, _, seed = log.stem.rpartition("-s")
        steps, before, after = {}, None, None
        for line in log.read_text(errors="replace").splitlines():
            if m := _STEP.match(line):
                v = [None if x is None else float(x) for x in m.groups()]
                steps.setdefault(int(v[0]), {"reward": v[1], "gap_mean": v[2], "gap_p99": v[3], "gap_max": v[4],
                                             "k3": v[5], "is_max": v[7], "masked": v[8], "generate": v[10],
                                             "train": v[11], "sync": v[12], "flips": v[13]})
            elif (m := _BEFORE.match(line)) and before is None:
                before = float(m.group(1))
            elif (m := _AFTER.match(line)) and after is None:
                after = (float(m.group(2)), float(m.group(4)))
        if steps:
            out[config].append({"config": config, "seed": int(seed), "finished": after is not None, "before": before,
                                "after": after and after[0], "after_trainer": after and after[1],
                                "steps": [steps[k] for k in sorted(steps)]})
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def _configs(runs) -> list[str]:
    order = [c for c in dict.fromkeys(_order()) if c in runs]
    return order + sorted(set(runs) - set(order))


#: steps at each end of a run compared by the drift column (mean gap of the last N over the first N)
DRIFT_STEPS = 20


def drift(run) -> float | None:
    """The mean gap of a run's last :data:`DRIFT_STEPS` steps over that of its first ones (a floor
    that holds stays near 1; the FP32-experts trap grows); None for a run shorter than twice that."""
    gaps = [s["gap_mean"] for s in run["steps"] if s.get("gap_mean") is not None]
    if len(gaps) < 2 * DRIFT_STEPS:
        return None
    return statistics.fmean(gaps[-DRIFT_STEPS:]) / statistics.fmean(gaps[:DRIFT_STEPS])


def table(runs: dict[str, list[dict]]) -> str:
    def per_run(run, key):
        return _mean([s.get(key) for s in run["steps"]])

    rows = {}
    for config, rs in runs.items():
        done = [r for r in rs if r["finished"]]
        rows[config] = {
            "seeds": f"{len(done)}/{len(rs)}",
            "steps": "/".join(str(len(r["steps"])) for r in rs),
            **{k: _mean([per_run(r, k) for r in rs]) for k in ("gap_max", "gap_mean", "gap_p99", "k3", "masked", "is_max",
                                                              "flips", "flips_top1")},
            "drift": _mean([drift(r) for r in rs]),
            "before": _mean([r["before"] for r in rs]),
            "after": _mean([r["after"] for r in done]) if done else None,
            "after_trainer": _mean([r["after_trainer"] for r in done]) if done else None,
        }
    floor = rows.get("bf16", {}).get("gap_max", float("nan"))
    head = ("| config | seeds finished / run | steps per seed | max gap (mean over steps) | / BF16 floor | mean gap | p99 gap | k3 KL | "
            "gap drift (last/first 20) | routing flips top-k | top-1 | "
            "IS masked | raw IS max | held-out before | after (rollout) | after (trainer) | paper max gap | paper acc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for config in _configs(rows):
        r = rows[config]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
        paper = PAPER.get(config, ("-", "-"))
        lines.append(f"| {config} | {r['seeds']} | {r['steps']} | {r['gap_max']:.3f} | {r['gap_max'] / floor:.2f} | "
                     f"{r['gap_mean']:.4f} | {r['gap_p99']:.3f} | {r['k3']:.2e} | {_num(r['drift'], '.2f')} | "
                     f"{_num(r['flips'], '.4f')} | {_num(r['flips_top1'], '.4f')} | {r['masked']:.3f} | {r['is_max']:.3g} | "
                     f"{pct(r['before'])} | {pct(r['after'])} | {pct(r['after_trainer'])} | {paper[0]} | {paper[1]} |")
    return "\n".join(lines)


def _num(v, fmt: str) -> str:
    """``v`` formatted, or "-" where no run measured it (NaN: e.g. routing flips of a dense model)."""
    return "-" if v is None or v != v else format(v, fmt)


def timing_table(runs: dict[str, list[dict]]) -> str:
    """Mean seconds per step of each phase, over every step of every seed, and the rollout's share."""
    lines = ["| config | generate s | train s | sync s | step s | rollout share |", "|---|---|---|---|---|---|"]
    for config in _configs(runs):
        steps = [s for r in runs[config] for s in r["steps"]]
        g, t, y = (_mean([s[k] for s in steps]) for k in ("generate", "train", "sync"))
        lines.append(f"| {config} | {g:.2f} | {t:.2f} | {y:.3f} | {g + t + y:.2f} | {100 * g / (g + t + y):.0f}% |")
    return "\n".join(lines)


def plots(runs: dict[str, list[dict]], out: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    configs = _configs(runs)
    for key, name, ylabel in (("gap_max", f"{prefix}_gap.png", "per-step max |log p_rollout - log p_trainer|"),
                              ("gap_mean", f"{prefix}_gap_mean.png", "per-step mean |log p_rollout - log p_trainer|"),
                              ("reward", f"{prefix}_reward.png", "mean reward"),
                              ("flips", f"{prefix}_flips.png", "routing flips (top-k set, share of tokens)")):
        if not any(s.get(key) is not None for rs in runs.values() for r in rs for s in r["steps"]):
            continue  # (no run logged it: e.g. routing flips of dense runs)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, config in enumerate(configs):
            k = 10
            curves = []
            for r in runs[config]:
                ys = [s[key] for s in r["steps"] if s.get(key) is not None]
                curves.append([statistics.fmean(ys[max(0, j - k + 1) : j + 1]) for j in range(len(ys))])
            curves = [c for c in curves if c]
            if not curves:
                continue
            n = max(len(c) for c in curves)
            xs = list(range(n))
            at = [[c[j] for c in curves if j < len(c)] for j in xs]
            seeds = len(curves)
            ax.plot(xs, [statistics.fmean(v) for v in at], color=f"C{i}", label=f"{config} ({seeds} seed{'s' * (seeds > 1)})")
            if seeds > 1:
                ax.fill_between(xs, [min(v) for v in at], [max(v) for v in at], color=f"C{i}", alpha=0.2, linewidth=0)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel + " (10-step mean)")
        if key in ("gap_max", "gap_mean"):
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
    p.add_argument("--prefix", default="real_grpo_trl", help="file name prefix of the plots")
    p.add_argument("--from-logs", action="store_true", help="read the runs' console logs (see the module doc)")
    args = p.parse_args(argv)
    runs = load_logs(args.runs) if args.from_logs else load(args.runs)
    if not runs:
        raise SystemExit(f"no runs with summary.json under {args.runs}")
    print(table(runs))
    print()
    print(timing_table(runs))
    out = args.out or args.runs
    out.mkdir(parents=True, exist_ok=True)
    for path in plots(runs, out, args.prefix):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
