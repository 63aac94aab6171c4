#!/usr/bin/env python
"""GRPO with TRL + QUADS: NVFP4 W4A4 rollouts, QAT trainer, mismatch metrics every step.

The project's main job. Trains a model with ``trl.GRPOTrainer`` through
:class:`quads.integrations.trl.QuadsGRPOTrainer`: completions and their log-probs come from a
separate NVFP4 rollout model that is re-synced from the trainer's masters before every
generation; TRL's importance-sampling correction runs on those log-probs. By default the model is
quads' embedded tiny Qwen3-MoE on integer addition (exact-match reward); ``--model DIR`` takes any
local causal LM, and the task follows the model (``--task auto``): a chat model gets the
chain-sum task in its chat template (``quads.tasks.chain_sum``, e.g. SmolLM2-135M-Instruct from
``quads fetch-real-model``), with that task's defaults (learning rate 3e-6, 8 prompts x 8
completions, 128 new tokens, 64 held-out problems). A first step where every completion earns
reward 0 prints a one-line warning naming the task/model mismatch. Prints per-step reward,
rollout-vs-trainer log-prob gap and phase times (generate / train / sync), held-out accuracy
before and after, and writes into ``--output-dir``:

* ``metrics.jsonl`` (every TRL log record), ``metrics.csv`` (one row per step),
* ``reward_gap.png`` (reward and log-prob gap per step), ``summary.json``.

Every input (counts, rates, seed, threads, device, ``--model`` and its tokenizer,
``--output-dir``, TRL's config) is checked before anything is written; a bad one exits with
status 2 and a one-line error, and the output directory is left as it was. A run replaces an
unfinished previous run's outputs in the same directory, a finished or paused one only with
``--overwrite``; ``summary.json`` reads ``"complete": false`` (``"status"``: ``running``,
``paused``, ``interrupted`` or ``failed``) until the run has finished, so a Ctrl-C'd run (exit
status 130) leaves its partial metrics marked as such. ``--time-budget-s S`` stops after the
first step that ends past S seconds of training, saves a checkpoint (TRL's: masters, optimizer,
scheduler, RNG states, data position) and exits 0 with ``"status": "paused"``; the same
command with ``--resume`` continues it bit for bit (tested on CPU: N steps in one go equal the
same N steps cut by resumes), and the finished run deletes its checkpoint.

    PYTHONPATH=. python examples/trl_grpo_quads.py                    # QUADS, ~25 steps
    PYTHONPATH=. python examples/trl_grpo_quads.py --policy naive     # the baseline
    PYTHONPATH=. python examples/trl_grpo_quads.py --routing-replay   # MoE: the trainer routes by the rollout's experts (R3)
    PYTHONPATH=. python examples/trl_grpo_quads.py --model ~/.cache/quads/smollm2-135m-instruct --device cuda
    PYTHONPATH=. python examples/trl_grpo_quads.py ... --max-steps 200 --time-budget-s 480 [--resume]

Policies: every preset of ``quads.integrations.trl.POLICY_PRESETS`` (bf16, bf16-fp32-experts, naive, w4a16-qat,
sym-qat, quads, w4a16, quads-experts, w4a16-experts, quads-boundary, ...); a plan that cannot
apply to the model (``quads-boundary`` on a model of 6 or fewer decoder layers, such as the
embedded one) exits with status 2 and the reason, before any file is touched.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no OpenMP spin-waiting on a shared 2-core box
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

#: files a run writes into --output-dir (summary.json last)
OUTPUTS = ("metrics.jsonl", "metrics.csv", "reward_gap.png", "summary.json")

STEP_KEYS = [  # columns of metrics.csv (TRL's names, then quads')
    "step",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "sampling/quads/logp_gap_mean",
    "sampling/quads/logp_gap_p99",
    "sampling/quads/logp_gap_max",
    "sampling/quads/k3_kl",
    "sampling/quads/is_ratio_raw_min",
    "sampling/quads/is_ratio_raw_mean",
    "sampling/quads/is_ratio_raw_max",
    "sampling/quads/is_masked_fraction",
    "sampling/importance_sampling_ratio/mean",
    "sampling/quads/delta_num_abs_mean",
    "sampling/quads/delta_weight_abs_mean",
    "sampling/quads/delta_act_abs_mean",
    "sampling/quads/routing_flip_topk",
    "sampling/quads/routing_flip_topk_max",
    "sampling/quads/routing_flip_worst_layer",
    "sampling/quads/routing_flip_top1",
    "sampling/quads/routing_replayed",
    "loss",
    "grad_norm",
    "entropy",
    "step_time",
    "timing/quads/generate_s",
    "timing/train_s",
    "timing/quads/sync_s",
    "timing/step_s",
]

#: arguments a resumed run must share with the run it continues (the others may change)
MAY_CHANGE_ON_RESUME = ("resume", "time_budget_s", "threads", "no_plot", "overwrite", "output_dir")


def parse_args(argv=None):
    """The command line; every count and rate is checked here (argparse exits 2 with one line)."""
    from quads.diagnostics.cli_inputs import (
        int_at_least,
        nonnegative_float,
        nonnegative_int,
        positive_float,
        positive_int,
        seed_int,
        thread_count,
    )
    from quads.diagnostics.mismatch import IS_MODES
    from quads.integrations.trl import POLICY_PRESETS

    from quads.diagnostics.cli_inputs import HelpFormatter as Formatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    from quads.tasks.grpo_tasks import TASKS

    ap.add_argument("--policy", choices=sorted(POLICY_PRESETS), default="quads")
    ap.add_argument("--kernel", choices=["exact", "fast"], default="exact",
                    help="the rollout's kernels (QuadsPolicy.kernel): exact (bit-exact Triton) or fast (humming, "
                         "sm_90; widths humming cannot tile as they are run in padded layouts)")
    ap.add_argument("--max-steps", type=positive_int, default=30)
    ap.add_argument("--model", default=None, help="local HF causal LM directory (default: quads' embedded tiny MoE)")
    ap.add_argument("--task", choices=["auto", *sorted(TASKS)], default="auto",
                    help="auto: arithmetic for the embedded model, chain-sum for a chat model; the task sets the "
                         "defaults of the counts and rates marked 'task default'")
    ap.add_argument("--output-dir", default=None, help="default: runs/trl_grpo_<policy>; an unfinished previous run's "
                                                     "outputs there are replaced, a finished one only with --overwrite")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a finished run's outputs in --output-dir (refused without it)")
    ap.add_argument("--prompts-per-step", type=positive_int, default=None, help="task default (16 / 8)")
    ap.add_argument("--num-generations", type=int_at_least(2), default=8, help="completions per prompt (GRPO: >= 2)")
    ap.add_argument("--max-completion-length", type=positive_int, default=None,
                    help="task default (arithmetic: its answer length 5, 16 for another model; chain-sum: 128)")
    ap.add_argument("--learning-rate", type=positive_float, default=None, help="task default (1e-4 / 3e-6)")
    ap.add_argument("--train-micro-batch", type=positive_int, default=None,
                    help="sequences per trainer forward/backward (gradient accumulation, same loss; task default: "
                         "the whole batch / 16); must divide prompts-per-step x num-generations")
    ap.add_argument("--temperature", type=positive_float, default=1.0)
    ap.add_argument("--beta", type=nonnegative_float, default=0.0, help="KL coefficient (TRL's; 0 = no reference model)")
    ap.add_argument("--is-mode", choices=IS_MODES, default="sequence_mask", help="TRL vllm_importance_sampling_mode")
    ap.add_argument("--is-clip-max", type=positive_float, default=3.0, help="TRL vllm_importance_sampling_clip_max")
    ap.add_argument("--decompose", action="store_true", help="also log delta_num / delta_weight / delta_act")
    ap.add_argument("--routing-replay", action="store_true",
                    help="MoE: the trainer routes each token by the rollout's recorded experts (R3; preset <policy>+r3)")
    ap.add_argument("--eval-n", type=nonnegative_int, default=None,
                    help="held-out problems for accuracy before/after (0: skip; task default 512 / 64)")
    ap.add_argument("--train-prompts", type=positive_int, default=2048)
    ap.add_argument("--seed", type=seed_int, default=0, help="in [0, 2**32)")
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--time-budget-s", type=positive_float, default=None,
                    help="stop after the first step ending past this many seconds of training, save a checkpoint "
                         "and exit 0 (status paused); continue with the same command and --resume")
    ap.add_argument("--stop-after-s", type=positive_float, default=None,
                    help="end training after the first step ending past this many seconds of training, without a "
                         "checkpoint: evaluate and finish (status stopped: a run shorter than --max-steps)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the unfinished run in --output-dir from its last checkpoint (same arguments); "
                         "without one, start")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: trainer and rollout on the GPU")
    ap.add_argument("--compare", nargs="+", metavar="RUN_DIR", default=None,
                    help="no training: plot reward and gap of finished runs (their metrics.csv) into "
                         "<output-dir>/compare.png and print a table")
    return ap.parse_args(argv)


def load_models(args):
    """(trainer model in float32 masters, tokenizer, task); fills the task's defaults into ``args``."""
    from quads.diagnostics.cli_inputs import UsageError
    from quads.tasks import load_default_model
    from quads.tasks.grpo_tasks import choose_task

    if args.model is None:
        model, tok = load_default_model(dtype=torch.float32)
    else:
        from quads.diagnostics.cli_inputs import load_local_causal_lm

        model, tok = load_local_causal_lm(args.model, torch.float32)  # UsageError for a bad directory
    try:
        task = choose_task(args.task, tok, embedded_model=args.model is None)
    except ValueError as err:
        raise UsageError(f"--task {args.task}: {err}") from None
    args.task = task.name
    if args.max_completion_length is None:
        args.max_completion_length = 16 if task.name == "arithmetic" and args.model is not None else task.max_new_tokens
    for name in ("learning_rate", "prompts_per_step", "eval_n", "train_micro_batch"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(task, name))
    batch = args.prompts_per_step * args.num_generations
    args.train_micro_batch = min(args.train_micro_batch or batch, batch)
    if batch % args.train_micro_batch:
        raise UsageError(f"--train-micro-batch {args.train_micro_batch} does not divide the batch of "
                         f"{args.prompts_per_step} prompts x {args.num_generations} completions = {batch}")
    tok.padding_side = "left"
    model.train()
    return model, tok, task


def held_out(trainer, tok, task, n, max_new_tokens, seed):
    """Greedy held-out accuracy of the rollout engine (what serves) and of the trainer's forward."""
    trainer.quads_rollout.sync_weights()
    model = trainer.accelerator.unwrap_model(trainer.model)
    t = time.time()
    with torch.no_grad():
        rollout_acc = task.held_out_accuracy(trainer.rollout_model, tok, n, max_new_tokens, seed)
        with trainer.accelerator.autocast():
            trainer_acc = task.held_out_accuracy(model, tok, n, max_new_tokens, seed)
    return {"rollout": rollout_acc, "trainer": trainer_acc, "seconds": time.time() - t}


def make_step_callback(path_jsonl, total_steps, t0, no_signal_hint: str, rows=()):
    """The per-step printer; ``rows``: the steps a paused run already logged (a resume)."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    from quads.tensor.files import open_for_append

    class StepPrinter(TrainerCallback):
        """One compact line per step (reward, gap, IS masking, phase times) and the raw records to
        JSONL; the step's wall clock (``timing/step_s``, the device synchronized at its end) and
        the train phase (``timing/train_s`` = step - generate - sync: the trainer's scoring
        forward, loss, backward and optimizer step, and TRL's own work) are added to each record."""

        def __init__(self):
            self.rows = list(rows)
            self.bar = None
            self.step_start = None
            self.step_s = float("nan")

        def on_train_begin(self, args, state, control, **kw):
            # a bar only on a terminal: in a pipe or a log file its \r updates land between the step lines
            self.bar = tqdm(total=total_steps, initial=state.global_step, desc="GRPO", unit="step",
                            dynamic_ncols=True, file=sys.stdout, disable=not sys.stdout.isatty())

        def on_step_begin(self, args, state, control, **kw):
            self.step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            if self.step_start is not None:
                self.step_s = time.perf_counter() - self.step_start

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs:
                return
            rec = {"step": state.global_step, "elapsed_s": round(time.time() - t0, 2), **logs}
            if "reward" in logs:
                gen, sync = logs.get("timing/quads/generate_s", 0.0), logs.get("timing/quads/sync_s", 0.0)
                rec.update({"timing/step_s": self.step_s, "timing/train_s": self.step_s - gen - sync})
            with open_for_append(path_jsonl) as f:  # a symlink planted there is refused, not followed
                f.write(json.dumps(rec) + "\n")
            if "reward" not in logs:
                return
            self.rows.append(rec)
            if len(self.rows) == 1 and logs["reward"] == 0 and not logs.get("reward_std"):
                self.bar.write(f"warning: {no_signal_hint}")
            g = lambda k: logs.get(f"sampling/quads/{k}", float("nan"))  # noqa: E731
            line = (
                f"step {state.global_step:3d}/{total_steps}  reward {logs['reward']:.3f}  "
                f"gap mean {g('logp_gap_mean'):.4f} p99 {g('logp_gap_p99'):.3f} max {g('logp_gap_max'):.3f}  "
                f"k3 {g('k3_kl'):.2e}  IS raw [{g('is_ratio_raw_min'):.2f}, {g('is_ratio_raw_max'):.2f}] "
                f"masked {g('is_masked_fraction'):.2f}  ({rec['timing/step_s']:.1f}s: generate "
                f"{logs.get('timing/quads/generate_s', float('nan')):.2f} train {rec['timing/train_s']:.2f} "
                f"sync {logs.get('timing/quads/sync_s', float('nan')):.3f})"
            )
            if "sampling/quads/routing_flip_topk" in logs:  # MoE: the share of tokens the trainer routes otherwise
                line += f"  flips {g('routing_flip_topk'):.3f}"
            self.bar.write(line, file=sys.stdout)
            self.bar.update(state.global_step - self.bar.n)

        def on_train_end(self, args, state, control, **kw):
            if self.bar is not None:
                self.bar.close()

    return StepPrinter()


def make_time_budget(seconds: float | None, save: bool = True):
    """A callback that ends training after the first step ending past ``seconds`` of training
    (before the last step); with ``save``, with a checkpoint: TRL saves it as its own (``should_save``)."""
    from transformers import TrainerCallback

    class TimeBudget(TrainerCallback):
        def __init__(self):
            self.start = None
            self.paused_at: int | None = None

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if (seconds is not None and state.global_step < state.max_steps
                    and time.perf_counter() - self.start > seconds):
                control.should_save = save
                control.should_training_stop = True
                self.paused_at = state.global_step
            return control

    return TimeBudget()


def write_csv(rows, path):
    import io

    from quads.tensor.files import write_atomically

    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(STEP_KEYS)
    for r in rows:
        w.writerow([r.get(k, "") for k in STEP_KEYS])
    write_atomically(path, buf.getvalue())


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    rewards = [r["reward"] for r in rows]
    ax1.plot(steps, rewards, marker="o", ms=3, alpha=0.5, label="mean reward (exact match)")
    ax1.plot(steps, _running_mean(rewards, 5), lw=2, label="running mean (5 steps)")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    for key, label in (("logp_gap_mean", "mean"), ("logp_gap_p99", "p99"), ("logp_gap_max", "max")):
        ax2.plot(steps, [r.get(f"sampling/quads/{key}", float("nan")) for r in rows], marker="o", ms=3, label=label)
    ax2.set_ylabel("|log p_rollout - log p_trainer|")
    ax2.set_yscale("log")
    ax2.set_xlabel("GRPO step")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def save_figure(fig, path) -> None:
    """``fig`` as a PNG at ``path``, written atomically (never through a planted symlink)."""
    from quads.tensor.files import write_atomically

    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))


def _running_mean(xs, w):
    return [sum(xs[max(0, i - w + 1) : i + 1]) / len(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def compare(run_dirs, out: Path):
    """Overlay reward (running mean) and mean log-prob gap of several finished runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quads.diagnostics.cli_inputs import UsageError

    for d in map(Path, run_dirs):
        if not (d / "metrics.csv").is_file():
            raise UsageError(f"--compare {str(d)!r}: no metrics.csv there (not a finished run directory)")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    print(f"{'run':28s} {'steps':>5s} {'reward first5':>13s} {'last5':>6s} {'gap mean':>9s} {'p99':>7s} {'max':>7s} "
          f"{'k3':>9s} {'masked':>7s} {'held-out (rollout) before->after':>33s}")
    for d in run_dirs:
        d = Path(d)
        with open(d / "metrics.csv") as f:
            rows = [{k: float(v) if v not in ("", None) else float("nan") for k, v in r.items()} for r in csv.DictReader(f)]
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
        label = summary.get("policy", d.name)
        if not summary.get("complete"):
            label += f" ({summary.get('status', 'incomplete')})"  # interrupted, failed, or a pre-marker run
        if not rows:  # interrupted before its first step: nothing to plot or average
            print(f"{label:28s} {0:5d}  (no steps logged)")
            continue
        steps = [r["step"] for r in rows]
        ax1.plot(steps, _running_mean([r["reward"] for r in rows], 5), lw=2, label=label)
        ax2.plot(steps, [r["sampling/quads/logp_gap_mean"] for r in rows], marker="o", ms=3, label=label)
        g = lambda k: _mean([r[k] for r in rows])  # noqa: E731
        ho = ""
        if summary.get("heldout_before") and summary.get("heldout_after"):
            ho = f"{summary['heldout_before']['rollout']:.3f} -> {summary['heldout_after']['rollout']:.3f}"
        print(f"{label:28s} {len(rows):5d} {summary.get('reward_first_steps', float('nan')):13.3f} "
              f"{summary.get('reward_last_steps', float('nan')):6.3f} {g('sampling/quads/logp_gap_mean'):9.4f} "
              f"{g('sampling/quads/logp_gap_p99'):7.3f} {max(r['sampling/quads/logp_gap_max'] for r in rows):7.3f} "
              f"{g('sampling/quads/k3_kl'):9.2e} {g('sampling/quads/is_masked_fraction'):7.3f} {ho:>33s}")
    ax1.set_ylabel("reward (running mean, 5 steps)")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right", fontsize=8)
    ax2.set_ylabel("mean |log p_rollout - log p_trainer|")
    ax2.set_yscale("log")
    ax2.set_xlabel("GRPO step")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle("TRL GRPO on the embedded MoE: reward and rollout-vs-trainer gap per policy")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out / "compare.png")
    plt.close(fig)
    print(f"wrote {out / 'compare.png'}")


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _describe(policy) -> str:
    if policy is None:
        return "BF16 (not quantized)"
    if policy.side == "trainer":
        return "NVFP4 fake-quant weights (STE), " + ("BF16 activations (W4A16 QAT)" if policy.activations == "bf16" else "NVFP4 fake-quant activations (W4A4 QAT)")
    if policy.activations == "bf16":
        return "packed NVFP4 weights, BF16 activations (W4A16)"
    which = "all channels" if policy.residual_fraction == 1.0 else policy.residual_selection
    return f"packed NVFP4 weights, NVFP4 activations (W4A4), residual compensation {policy.residual_fraction:.0%} ({which})"


def write_summary(out: Path, summary: dict) -> None:
    """summary.json, replaced atomically (a reader sees the old or the new one, never half;
    the temporary file is unique and created with O_EXCL, so no planted symlink is followed)."""
    from quads.diagnostics.cli_inputs import atomic_write_text

    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")


def check_previous_run(out: Path, overwrite: bool) -> None:
    """Raise UsageError if ``out`` holds a finished run and ``overwrite`` was not asked for."""
    from quads.diagnostics.cli_inputs import UsageError

    path = out / "summary.json"
    if overwrite or not path.is_file():
        return
    try:
        summary = json.loads(path.read_text())
        finished, paused = summary.get("complete") is True, summary.get("status") == "paused"
    except (OSError, ValueError, AttributeError):
        finished = paused = False  # an unreadable summary is no finished run
    if finished:
        raise UsageError(f"{str(out)!r} holds a finished run (summary.json: complete); pass --overwrite to "
                         "replace it, or choose another --output-dir")
    if paused:
        raise UsageError(f"{str(out)!r} holds a paused run (at step {summary.get('steps')}); pass --resume to "
                         "continue it, --overwrite to replace it, or choose another --output-dir")


def paused_run(out: Path, args) -> tuple[dict, str, list[dict]] | None:
    """What ``--resume`` continues: (summary, checkpoint directory, logged step rows up to it) of
    the unfinished run in ``out`` (paused, or cut later without pausing: it continues from its
    last checkpoint), or None when there is none to continue (then the run starts; a finished
    one is still refused without --overwrite). UsageError when it was made with other arguments."""
    from transformers.trainer_utils import get_last_checkpoint

    from quads.diagnostics.cli_inputs import UsageError

    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("complete") is True:
        return None
    checkpoint = get_last_checkpoint(str(out / "trainer")) if (out / "trainer").is_dir() else None
    if checkpoint is None:
        if summary.get("status") == "paused":
            raise UsageError(f"--resume: the paused run in {str(out)!r} has no checkpoint under {str(out / 'trainer')!r}")
        return None
    before = summary.get("args", {})
    for key, value in vars(args).items():
        if key not in MAY_CHANGE_ON_RESUME and before.get(key) != value:
            raise UsageError(f"--resume: --{key.replace('_', '-')} is {value!r}, the paused run used {before.get(key)!r}")
    step = int(Path(checkpoint).name.split("-")[-1])
    rows = [r for r in _read_jsonl(out / "metrics.jsonl") if "reward" in r and r.get("step", 0) <= step]
    return summary, checkpoint, rows


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def remove_checkpoints(out: Path) -> None:
    """Delete the run's checkpoint directories (``<out>/trainer/checkpoint-N``) once it finished."""
    import re
    import shutil

    for path in (out / "trainer").glob("checkpoint-*"):
        if path.is_dir() and not path.is_symlink() and re.fullmatch(r"checkpoint-\d+", path.name):
            shutil.rmtree(path)


def masters_crc32(model) -> str:
    """CRC32 of every master parameter's bytes in name order: equal runs end with equal weights."""
    import zlib

    crc = 0
    for name, p in sorted(model.named_parameters()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


def start_run(out: Path, args) -> None:
    """Replace a previous run's outputs and mark this run incomplete until it finishes.

    A run reusing ``--output-dir`` must never leave its partial metrics beside the previous
    run's csv/png/summary: they are removed here (after every input was checked), and
    ``summary.json`` says ``"complete": false`` until the last write of a finished run.
    """
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    write_summary(out, {"complete": False, "status": "running", "policy": args.policy, "args": vars(args)})


def summarize(rows, args, preset, train_s, t0, before, after, num_syncs, status) -> dict:
    k = max(1, min(5, len(rows) // 3))
    q = lambda key: [r.get(key) for r in rows]  # noqa: E731
    summary = {
        "complete": status in ("complete", "stopped"),  # stopped: finished early by --stop-after-s
        "status": status,
        "policy": preset.name,
        "task": args.task,
        "steps": len(rows),
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t0, 1),
        "reward_first_steps": _mean(q("reward")[:k]),
        "reward_last_steps": _mean(q("reward")[-k:]),
        "logp_gap_mean": _mean(q("sampling/quads/logp_gap_mean")),
        "logp_gap_p99_mean": _mean(q("sampling/quads/logp_gap_p99")),
        "logp_gap_max_max": max([x for x in q("sampling/quads/logp_gap_max") if x is not None], default=float("nan")),
        "k3_kl_mean": _mean(q("sampling/quads/k3_kl")),
        "is_masked_fraction_mean": _mean(q("sampling/quads/is_masked_fraction")),
        "heldout_before": before,
        "heldout_after": after,
        "num_weight_syncs": num_syncs,
        **{f"{phase}_s_mean": _mean(q(key)) for phase, key in (
            ("generate", "timing/quads/generate_s"), ("train", "timing/train_s"), ("sync", "timing/quads/sync_s"),
            ("step", "timing/step_s"))},
        "args": vars(args),
    }
    if any(r.get("sampling/quads/routing_flip_topk") is not None for r in rows):
        summary["routing_flip_topk_mean"] = _mean(q("sampling/quads/routing_flip_topk"))
        summary["routing_flip_top1_mean"] = _mean(q("sampling/quads/routing_flip_top1"))
    if args.decompose:
        for part in ("num", "weight", "act"):
            summary[f"delta_{part}_abs_mean"] = _mean(q(f"sampling/quads/delta_{part}_abs_mean"))
    return summary


def print_summary(summary, preset, out) -> None:
    k = max(1, min(5, summary["steps"] // 3))
    before, after = summary["heldout_before"], summary["heldout_after"]
    print("\n==================== summary ====================")
    print(f"policy            {preset.name}  ({preset.description})")
    print(f"task              {summary['task']}")
    print(f"steps             {summary['steps']}  in {summary['train_seconds']:.0f}s  "
          f"(total {summary['total_seconds']:.0f}s incl. setup + eval)")
    print(f"reward            first {k}: {summary['reward_first_steps']:.3f}  ->  last {k}: {summary['reward_last_steps']:.3f}")
    print(f"log-prob gap      mean {summary['logp_gap_mean']:.4f}  p99 (avg) {summary['logp_gap_p99_mean']:.4f}  "
          f"max {summary['logp_gap_max_max']:.4f}")
    print(f"k3 KL             {summary['k3_kl_mean']:.3e}   IS masked fraction {summary['is_masked_fraction_mean']:.3f}")
    print(f"step time         {summary['step_s_mean']:.2f}s  (generate {summary['generate_s_mean']:.2f}  train "
          f"{summary['train_s_mean']:.2f}  sync {summary['sync_s_mean']:.3f})")
    if "routing_flip_topk_mean" in summary:
        print(f"routing flips     top-k set {summary['routing_flip_topk_mean']:.4f}  top-1 "
              f"{summary['routing_flip_top1_mean']:.4f}  (share of recorded tokens, mean over MoE layers and steps)")
    if "delta_num_abs_mean" in summary:
        print(f"decomposition     |d_num| {summary['delta_num_abs_mean']:.4f}  |d_weight| {summary['delta_weight_abs_mean']:.4f}  "
              f"|d_act| {summary['delta_act_abs_mean']:.4f}")
    if before and after:
        print(f"held-out acc      rollout engine {before['rollout']:.3f} -> {after['rollout']:.3f}   "
              f"trainer forward {before['trainer']:.3f} -> {after['trainer']:.3f}")
    decode = summary.get("rollout_decode") or {}
    if decode.get("decoder") == "graphed":
        how = (f"graphed decoder, eager steps: {decode['capture_blocker']}" if decode.get("capture_blocker")
               else f"graphed decoder ({decode['captures']} capture(s))")
        print(f"rollout decode    {how}")
    elif decode:
        print("rollout decode    transformers generate" + (f" ({decode['fallback_reason']})" if decode.get("fallback_reason") else ""))
    print(f"outputs           {out}/metrics.jsonl, metrics.csv, reward_gap.png, summary.json")
    if summary["status"] == "stopped":
        print(f"stopped           after step {summary['steps']} of {summary['args']['max_steps']} (--stop-after-s)")
    if summary["status"] == "paused":
        print(f"paused            after step {summary['steps']} of {summary['args']['max_steps']} (time budget); "
              "run the same command with --resume to continue")


def main(argv=None) -> dict:
    """Train and write the outputs; raises UsageError (bad input, nothing written) or
    KeyboardInterrupt (after writing the partial outputs, marked ``"complete": false``)."""
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    t0 = time.time()
    from quads.diagnostics.cli_inputs import UsageError, check_device

    check_device(args.device)  # --device cuda without a GPU: one line now, not a traceback from TRL later
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from quads.diagnostics.cli_inputs import check_model_convertible, check_output_dir, check_tokenizer
    from quads.integrations.trl import POLICY_PRESETS, QuadsGRPOConfig, QuadsGRPOTrainer
    from quads.tasks.grpo_tasks import no_signal_hint
    from quads.tensor.files import FolderInUse, lock_folder

    if args.compare:
        compare(args.compare, check_output_dir(args.output_dir or "runs/compare"))
        return {}
    from quads.policies.presets import with_kernel, with_routing_replay

    try:
        preset = with_kernel(POLICY_PRESETS[args.policy], args.kernel)
    except ValueError as err:
        raise UsageError(f"--kernel {args.kernel}: {err}") from None
    if args.routing_replay:
        preset = with_routing_replay(preset)
    print(f"quads GRPO | policy {preset.name}: {preset.description}")
    print(f"  trainer side: {_describe(preset.trainer)}\n  rollout side: {_describe(preset.rollout)}")

    model, tok, task = load_models(args)  # a bad --model fails here, before any file is touched
    print(f"  task {task.name} (fits {task.fits})")
    from quads.policies.presets import preset_problem

    problem = preset_problem(preset, model)
    if problem:
        raise UsageError(f"--policy {args.policy}: {problem}")
    if args.routing_replay:
        from quads.policies.routing import routing_problem

        if routing_problem(model):
            raise UsageError(f"--routing-replay: {routing_problem(model)}")
    where = args.model or "the embedded model"
    check_model_convertible(model, [preset.trainer, preset.rollout], where)  # K % 16 & co., one line
    try:
        train_rows = task.rows(tok, args.train_prompts, args.seed)
    except ValueError as err:  # more distinct problems asked for than the task has
        raise UsageError(f"--train-prompts: {err}") from None
    check_tokenizer(tok, model, where, [r["prompt"] for r in train_rows])  # the prompts it will train on
    out_name = args.output_dir or f"runs/trl_grpo_{args.policy}" + ("+r3" if args.routing_replay else "")
    if Path(out_name).is_file():
        raise UsageError(f"output directory {out_name!r} is a file")
    out = Path(out_name)
    resume = paused_run(out, args) if args.resume else None
    if resume is None:
        check_previous_run(out, args.overwrite)
    train = Dataset.from_list(train_rows)
    batch = args.prompts_per_step * args.num_generations
    try:
        config = QuadsGRPOConfig(
            quads_policy=args.policy,  # the trainer reads its plan and options from its config
            quads_kernel=args.kernel,
            quads_decompose_mismatch=args.decompose,
            quads_routing_replay=args.routing_replay,
            output_dir=str(out / "trainer"),
            use_cpu=args.device == "cpu",
            bf16=True,  # float32 masters, bf16 autocast compute
            per_device_train_batch_size=args.train_micro_batch,
            gradient_accumulation_steps=batch // args.train_micro_batch,  # one generation, one optimizer step
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=args.beta,
            max_steps=args.max_steps,
            logging_steps=1,
            save_strategy="no",  # the time budget saves (a checkpoint to resume from), nothing else
            save_total_limit=1,
            report_to=[],
            seed=args.seed,
            data_seed=args.seed,
            vllm_importance_sampling_mode=args.is_mode,
            vllm_importance_sampling_clip_max=args.is_clip_max,
            dataloader_num_workers=0,
        )
    except ValueError as err:  # TRL's / transformers' own checks of the combination
        raise UsageError(f"TRL refuses the configuration: {str(err).strip().splitlines()[0]}") from err
    out = check_output_dir(out_name)  # creates it; nothing in it is touched before start_run
    try:  # one process per run folder, held until this run's outputs are written
        lock = lock_folder(out, "--output-dir")
    except FolderInUse as err:
        raise UsageError(str(err)) from None
    rows, before, after, train_s, trainer = [], None, None, 0.0, None
    checkpoint, train_s_before = None, 0.0
    if resume is not None:
        previous, checkpoint, rows = resume
        before, train_s_before = previous.get("heldout_before"), previous.get("train_seconds", 0.0)
    status, error = "failed", None
    started = False
    try:
        trainer = QuadsGRPOTrainer(
            model,
            task.reward,
            config,
            train_dataset=train,
            processing_class=tok,
        )
        if resume is None:
            start_run(out, args)  # every input was checked and the trainer built: now replace the old outputs
        else:
            continue_run(out, args, checkpoint)
        started = True
        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        hint = no_signal_hint(task, args.model or "the embedded model", tok, preset.name if preset.rollout else None)
        printer = make_step_callback(out / "metrics.jsonl", args.max_steps, t0, hint, rows)
        rows = printer.rows
        budget = make_time_budget(args.time_budget_s)
        stop = make_time_budget(args.stop_after_s, save=False)
        trainer.add_callback(printer)
        trainer.add_callback(budget)
        trainer.add_callback(stop)
        print(f"  setup {time.time() - t0:.1f}s" + (f", resuming from {checkpoint}" if checkpoint else ""))

        if args.eval_n > 0 and resume is None:
            before = held_out(trainer, tok, task, args.eval_n, args.max_completion_length, args.seed)
            print(f"held-out greedy accuracy before (n={args.eval_n}): rollout engine {before['rollout']:.3f}, "
                  f"trainer forward {before['trainer']:.3f}  ({before['seconds']:.1f}s)")
        t_train = time.time()
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
        finally:
            train_s = train_s_before + time.time() - t_train
        if budget.paused_at is not None:
            status = "paused"
        else:
            if args.eval_n > 0:
                after = held_out(trainer, tok, task, args.eval_n, args.max_completion_length, args.seed)
                print(f"held-out greedy accuracy after  (n={args.eval_n}): rollout engine {after['rollout']:.3f}, "
                      f"trainer forward {after['trainer']:.3f}  ({after['seconds']:.1f}s)")
            remove_checkpoints(out)
            status = "complete" if stop.paused_at is None else "stopped"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        raise
    finally:  # partial or not, the outputs say what they are; summary.json is written last
        try:
            if started:  # (a failure before start_run leaves the directory as it was)
                summary = finish_run(out, rows, args, preset, train_s, t0, before, after, trainer, status, error)
        finally:
            os.close(lock)
    print_summary(summary, preset, out)
    return summary


def continue_run(out: Path, args, checkpoint: str) -> None:
    """Mark a resumed run running again; records logged after its checkpoint (a run cut
    without pausing) are dropped: those steps run again."""
    from quads.diagnostics.cli_inputs import atomic_write_text

    step = int(Path(checkpoint).name.split("-")[-1])
    kept = [r for r in _read_jsonl(out / "metrics.jsonl") if r.get("step", 0) <= step]
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept))
    write_summary(out, {"complete": False, "status": "running", "policy": args.policy, "args": vars(args),
                        "resumed_from": checkpoint})


def finish_run(out, rows, args, preset, train_s, t0, before, after, trainer, status, error) -> dict:
    """metrics.csv, the plot, then summary.json (last) for a run that started, whatever its end."""
    write_csv(rows, out / "metrics.csv")
    if not args.no_plot and rows:
        plot(rows, out / "reward_gap.png", f"TRL GRPO, policy={preset.name} ({len(rows)} steps"
             + ("" if status == "complete" else f", {status}") + ")")
    num_syncs = trainer.quads_rollout.num_syncs if trainer is not None else 0
    summary = summarize(rows, args, preset, train_s, t0, before, after, num_syncs, status)
    if trainer is not None:
        summary["rollout_decode"] = trainer.quads_rollout.decode_report()
    if status in ("complete", "stopped") and trainer is not None:
        summary["masters_crc32"] = masters_crc32(trainer.accelerator.unwrap_model(trainer.model))
    if error:
        summary["error"] = error
    write_summary(out, summary)
    return summary


def _run_from_command_line() -> int:
    from quads.diagnostics.cli_inputs import UsageError

    try:
        main()
    except UsageError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: partial outputs written, summary.json has \"complete\": false", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_run_from_command_line())
