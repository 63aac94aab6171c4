"""The real-model GRPO ablation through the product: every preset x seed as one run of the main
example (``examples/trl_grpo_quads.py``: TRL's GRPOTrainer through ``QuadsGRPOTrainer``), all
side by side, each cut by a time budget and resumed by the next call until it has its steps.

    python -m benchmarks.rl.real_grpo --out runs/real_grpo --seeds 0 1 --steps 200 --budget-s 480 --device cuda
    python -m benchmarks.rl.real_grpo --out runs/real_grpo_smoke --presets bf16,quads --seeds 0 --steps 2 \\
        --device cpu -- --prompts-per-step 2 --num-generations 2 --max-completion-length 32 --eval-n 4

Every run is ``trl_grpo_quads.py --task chain-sum --model <SmolLM2> --policy P --seed S`` with the
ablation's settings pinned (the chain-sum task's defaults: learning rate 3e-6, 8 prompts x 8
completions, at most 128 new tokens, backward in micro-batches of 16 sequences, 64 held-out
problems greedy before and after, TRL's ``sequence_mask`` importance correction with cap 3),
``--time-budget-s`` (the run pauses with a checkpoint after the first step past it) and
``--resume`` (a paused run continues bit for bit; a new one starts). Presets: every entry of
``POLICY_PRESETS`` unless ``--presets`` names some. Arguments after ``--`` go to every run.
Output: ``<out>/<preset>-s<seed>/`` (the example's ``metrics.jsonl``, ``metrics.csv``,
``summary.json``; the checkpoint under ``trainer/`` until the run finishes) and
``<out>/<preset>-s<seed>.log`` (appended by every call). ``benchmarks/rl/real_grpo_report.py``
makes the table and plots; ``benchmarks/rl/real_grpo_h200.sh`` runs this on the H200 under CUDA MPS.
Exit status: 0 when every run finished or paused, 1 when one failed (its log says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from quads.tensor.files import open_for_append

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trl_grpo_quads.py"
#: the ablation's settings (docs/real_model.md), pinned so a change of the task defaults cannot move them
ABLATION = ("--task", "chain-sum", "--learning-rate", "3e-6", "--prompts-per-step", "8", "--num-generations", "8",
            "--max-completion-length", "128", "--train-micro-batch", "16", "--eval-n", "64",
            "--is-mode", "sequence_mask", "--is-clip-max", "3")


#: a run name's suffix that adds routing replay (``quads-experts+r3``: ``--policy quads-experts --routing-replay``)
REPLAY_SUFFIX = "+r3"


def run_command(args, preset: str, seed: int, extra: list[str]) -> list[str]:
    """The example's command line of one run (later flags override earlier ones: ``extra`` wins)."""
    replay = preset.endswith(REPLAY_SUFFIX)
    policy = preset.removesuffix(REPLAY_SUFFIX)
    cmd = [sys.executable, str(EXAMPLE), *ABLATION, "--model", str(args.model), "--policy", policy,
           *(["--routing-replay"] if replay else []),
           "--seed", str(seed), "--max-steps", str(args.steps), "--output-dir", str(Path(args.out) / f"{preset}-s{seed}"),
           "--device", args.device, "--threads", str(args.threads), "--resume", "--no-plot"]
    if args.budget_s:
        cmd += ["--time-budget-s", str(args.budget_s)]
    return cmd + list(extra)


def status(run_dir: Path) -> str:
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return "no summary"
    return f"{s.get('status')} at step {s.get('steps')}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    from quads.policies import POLICY_PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/real_grpo")
    p.add_argument("--presets", default="all",
                   help=f"comma-separated POLICY_PRESETS names (a {REPLAY_SUFFIX!r} suffix adds routing replay), or all")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=200, help="each run's length (resumed calls continue to it)")
    p.add_argument("--budget-s", type=float, default=0, help="each run pauses after the first step past this (0: none)")
    p.add_argument("--model", default=None, help="SmolLM2 directory (default: the quads cache)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    presets = list(POLICY_PRESETS) if args.presets == "all" else args.presets.split(",")
    unknown = [x for x in presets if x.removesuffix(REPLAY_SUFFIX) not in POLICY_PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; choose from {sorted(POLICY_PRESETS)}")
    if args.model is None:
        from quads.models import find_smollm2

        args.model = find_smollm2()
        if args.model is None:
            p.error("SmolLM2 is not built: run `quads fetch-real-model` (or pass --model DIR)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    procs = []
    t0 = time.time()
    for seed in args.seeds:
        for preset in presets:
            cmd = run_command(args, preset, seed, extra)
            log = open_for_append(out / f"{preset}-s{seed}.log")
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            procs.append((f"{preset}-s{seed}", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))
    print(f"[real_grpo] {len(procs)} runs started side by side", flush=True)
    failed = 0
    for name, proc, log in procs:
        code = proc.wait()
        log.close()
        failed += code != 0
        print(f"[real_grpo] {name}: exit {code}, {status(out / name)} ({time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
