"""The plan table of docs/plans.md (and the README's short form), rendered from what was measured.

    python -m benchmarks.studies.plan_table            # print both tables
    python -m benchmarks.studies.plan_table --write    # write them between the marker comments

One row per plan of ``quads.POLICY_PRESETS`` (a new preset is a new row). Columns: the mean
rollout-vs-trainer gap over the BF16 floor from ``quads diagnose`` runs (:data:`GAP_SOURCES`),
held-out accuracy after GRPO through TRL (:data:`ACCURACY_SOURCES`), and the whole RL step against
BF16 from :data:`quads.diagnostics.plan_speeds.PLAN_SPEEDS`. The short table is what
:func:`quads.diagnostics.recommend.recommend` picks per hardware and model kind from those gap
runs, so the docs say what ``quads diagnose`` says. Nothing is re-measured; to add a model kind
or an accuracy run, add its results file or folder to the lists below and re-run with ``--write``
(``tests/test_plan_table.py`` fails while a committed table differs from the rendered one).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.rl.real_grpo_report import load, load_logs
from quads.diagnostics.plan_speeds import PLAN_SPEEDS
from quads.tensor.files import write_atomically
from quads.diagnostics.recommend import recommend
from quads.policies import POLICY_PRESETS

REPO = Path(__file__).resolve().parents[2]

#: model kind -> (what ran, the ``quads diagnose --json`` report)
GAP_SOURCES: dict[str, tuple[str, str]] = {
    "dense": ("SmolLM2-135M-Instruct, CPU", "results/plans_cpu_2026-12-03/diagnose_dense.json"),
    "moe": ("SmolLM2 upcycled to 8 experts top-2, CPU", "results/plans_cpu_2026-12-03/diagnose_moe8x.json"),
}
#: (model kind, what ran, folder of ``benchmarks.rl.real_grpo`` runs or their console logs): held-out
#: greedy accuracy of the rollout engine after GRPO, the mean over the finished seeds
ACCURACY_SOURCES: list[tuple[str, str, str]] = [
    ("dense", "SmolLM2-135M-Instruct, chain-sum, 100 GRPO steps, 2 seeds, H200",
     "results/h200_2026-12-03_rl_step/real_grpo_logs"),
    ("moe", "SmolLM2 upcycled to 8 experts top-2, chain-sum, 114-150 GRPO steps (of 150), 2 seeds, H200",
     "results/h200_2026-12-04_moe_grpo"),
]
KIND_NAMES = {"dense": "dense", "moe": "MoE"}
HARDWARE_NAMES = {"hopper": "Hopper (H200)", "blackwell": "Blackwell (sm_100+)"}
MARKERS = {"presets": "plan-presets", "recommendation": "plan-recommendation", "table": "plan-table"}


def _gap_rows(kind: str) -> list[dict]:
    return json.loads((REPO / GAP_SOURCES[kind][1]).read_text())["rows"]


def _gap_cells(kind: str) -> dict[str, str]:
    """Preset -> its mean gap over the BF16 floor in the run, or "n/a" where the run could not apply it."""
    report = json.loads((REPO / GAP_SOURCES[kind][1]).read_text())
    plans = {r["preset"]: r["gap_mean"] for r in report["rows"] if r.get("preset")}
    cells = {name: f"{gap / plans['bf16']:.2f}x" for name, gap in plans.items()}
    cells.update({r["config"]: "n/a" for r in report.get("not_run", []) if r["config"] in POLICY_PRESETS})
    return cells


def _accuracy(folder: str) -> dict[str, float]:
    """Preset -> held-out accuracy after GRPO, the mean over the finished seeds: from the runs'
    ``summary.json`` (exact), or from their console logs (printed to 3 decimals) where a log has
    no run folder left beside it (a later start overwrote it)."""
    path = REPO / folder
    logs = list(path.glob("*-s*.log"))
    runs = load_logs(path) if any(not (log.with_suffix("") / "summary.json").exists() for log in logs) else load(path)
    out = {}
    for config, rs in runs.items():
        done = [r["after"] for r in rs if r["finished"] and r["after"] is not None]
        if done:
            out[config] = sum(done) / len(done)
    return out


def _source_link(path: str) -> str:
    return f"[{path}](../{path})"


def _configuration(source: str) -> str:
    """The kernel and trainer parameters a ``StepTime`` source names (its result file's description)."""
    kernel = "`kernel=\"fast\"`" if "kernel='fast'" in source else "exact kernels" if "exact kernels" in source else ""
    params = "BF16 parameters" if "BF16 parameters" in source else "FP32 masters" if "FP32 masters" in source else ""
    return ", ".join(x for x in (kernel, params) if x) or "see its source"


def preset_list() -> str:
    """Every preset name, in ``POLICY_PRESETS`` order (the default first)."""
    names = [f"`{n}`" + (" (the default)" if n == "quads" else "") for n in POLICY_PRESETS]
    return ", ".join(names)


def recommendation_table() -> str:
    """Hardware x model kind -> the plan ``recommend`` picks from the diagnose runs, with its speed."""
    lines = ["| hardware | model | recommended plan | whole RL step vs BF16 | measured with |", "|---|---|---|---|---|"]
    for hardware in HARDWARE_NAMES:
        for kind in GAP_SOURCES:
            rec = recommend(_gap_rows(kind), hardware, kind)
            entry = PLAN_SPEEDS.get((hardware, kind), {}).get(rec.plan)
            speed = f"{entry.speedup:.2f}x" if entry else ("1 (the reference)" if rec.plan == "bf16" else "unmeasured")
            why = "" if PLAN_SPEEDS.get((hardware, kind)) else " (no plan's step measured here)"
            how = _configuration(entry.source) if entry else "-"
            lines.append(f"| {HARDWARE_NAMES[hardware]} | {KIND_NAMES[kind]} | `{rec.plan}`{why} | {speed} | {how} |")
    return "\n".join(lines)


def plan_table() -> str:
    """Every preset: gap over the floor per model kind, accuracy per run, step speed per hardware and kind."""
    gaps = {kind: _gap_cells(kind) for kind in GAP_SOURCES}
    accuracy = [(kind, what, _accuracy(folder)) for kind, what, folder in ACCURACY_SOURCES]
    speed_keys = [key for key, entries in PLAN_SPEEDS.items() if entries]
    sources = list(dict.fromkeys(e.source for key in speed_keys for e in PLAN_SPEEDS[key].values()))
    head = (["plan", "what it is"] + [f"mean gap / BF16 floor, {KIND_NAMES[k]}" for k in GAP_SOURCES]
            + [f"held-out after GRPO, {KIND_NAMES[k]}" for k, _, _ in accuracy]
            + [f"whole RL step vs BF16, {HARDWARE_NAMES[h].split(' ')[0]} {KIND_NAMES[k]}" for h, k in speed_keys])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, preset in POLICY_PRESETS.items():
        experts_only = any(p is not None and p.scope == "routed_experts" for p in (preset.trainer, preset.rollout))

        def absent(kind: str, missing: str) -> str:  # a routed-experts plan has nothing to quantize in a dense model
            return "n/a" if experts_only and kind == "dense" else missing

        cells = [f"`{name}`", preset.description.replace("|", "/")]
        cells += [gaps[k].get(name, absent(k, "-")) for k in GAP_SOURCES]
        cells += [f"{100 * acc[name]:.1f}%" if name in acc else absent(k, "-") for k, _, acc in accuracy]
        for key in speed_keys:
            entry = PLAN_SPEEDS[key].get(name)
            cells.append("1" if name == "bf16" else f"{entry.speedup:.2f}x [{sources.index(entry.source) + 1}]"
                         if entry else absent(key[1], "unmeasured"))
        lines.append("| " + " | ".join(cells) + " |")
    unmeasured = [f"{HARDWARE_NAMES[h]} {KIND_NAMES[k]}" for (h, k), entries in PLAN_SPEEDS.items() if not entries]
    notes = ["", "Sources. Gaps: `quads diagnose` (mean over the sampled tokens; \"n/a\": the plan does not apply to "
             "that model; \"-\": not in that run), "
             + "; ".join(f"{KIND_NAMES[k]}: {what}, {_source_link(path)}" for k, (what, path) in GAP_SOURCES.items())
             + ". Accuracy (rollout engine, mean over the finished seeds; \"-\": not run): "
             + "; ".join(f"{KIND_NAMES[k]}: {what}, {_source_link(folder)}" for k, what, folder in ACCURACY_SOURCES)
             + ". Step (each plan's fastest measured configuration; `quads/diagnostics/plan_speeds.py`): "
             + "; ".join(f"[{i + 1}] {s}" for i, s in enumerate(sources)) + "."]
    if unmeasured:
        notes.append("")
        notes.append(f"No plan's whole RL step is measured on {', '.join(unmeasured)}.")
    return "\n".join(lines + notes)


def render() -> dict[str, str]:
    """Marker name -> the block written between its markers."""
    return {MARKERS["presets"]: preset_list(), MARKERS["recommendation"]: recommendation_table(),
            MARKERS["table"]: plan_table()}


def _span(marker: str) -> re.Pattern:
    return re.compile(rf"(<!-- {marker}: generated by python -m benchmarks\.studies\.plan_table --write -->\n)"
                      rf"(.*?)\n?(<!-- /{marker} -->)", re.S)


def blocks_in(text: str) -> dict[str, str]:
    """Marker name -> the block a page holds between that marker's comments."""
    return {m: found.group(2) for m in MARKERS.values() if (found := _span(m).search(text))}


def write(path: Path, blocks: dict[str, str]) -> bool:
    """Replace the blocks ``path`` holds; True when the file changed."""
    text = path.read_text()
    new = text
    for marker, block in blocks.items():
        new = _span(marker).sub(lambda m: m.group(1) + block + "\n" + m.group(3), new)
    if new != text:
        write_atomically(path, new)
    return new != text


#: the pages holding generated blocks (each holds the blocks it has markers for)
PAGES = ("docs/plans.md", "docs/trl.md", "README.md")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write the blocks into {', '.join(PAGES)}")
    args = ap.parse_args(argv)
    blocks = render()
    if not args.write:
        print("\n\n".join(blocks.values()))
        return 0
    for page in PAGES:
        print(f"{page}: {'written' if write(REPO / page, blocks) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
