"""The main example's time budget and resume: a run cut into pieces by ``--time-budget-s`` and
continued with ``--resume`` is the same run, bit for bit, as one that never stopped (TRL's
checkpoint: masters, AdamW state, scheduler, RNG states, data position); the task follows the
model; a first step without reward says why."""

from __future__ import annotations

import csv
import importlib.util
import json
import pathlib

import pytest
import torch

pytest.importorskip("trl")

from quads.diagnostics.cli_inputs import UsageError  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "trl_grpo_quads.py"
RUN = ["--max-steps", "3", "--eval-n", "0", "--prompts-per-step", "2", "--num-generations", "2",
       "--train-prompts", "32", "--no-plot", "--threads", "2", "--seed", "3", "--learning-rate", "3e-3"]
TIMING = ("timing/", "step_time", "elapsed_s")


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example_resume", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(out: pathlib.Path) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in csv.DictReader(f)]


def _main(example, argv):
    threads = torch.get_num_threads()
    try:
        return example.main(argv)
    finally:
        torch.set_num_threads(threads)


def test_paused_and_resumed_run_equals_the_uncut_run(tmp_path):
    """3 steps in one go == 1 step + resume + 1 step + resume + 1 step, on the embedded MoE
    under QUADS (QAT trainer with fused experts: the weights transformers' own resume would
    leave at their initial values), with micro-batched backward (gradient accumulation)."""
    example = _example()
    args = [*RUN, "--train-micro-batch", "2"]
    whole = _main(example, [*args, "--output-dir", str(tmp_path / "whole")])
    assert whole["complete"] and whole["steps"] == 3
    cut = tmp_path / "cut"
    for k in (1, 2):
        paused = _main(example, [*args, "--output-dir", str(cut), "--time-budget-s", "1e-9", "--resume"])
        assert paused["status"] == "paused" and paused["steps"] == k and not paused["complete"]
        assert json.loads((cut / "summary.json").read_text())["status"] == "paused"
        assert (cut / "trainer" / f"checkpoint-{k}").is_dir()
    with pytest.raises(UsageError, match="holds a paused run"):  # never replaced by accident
        _main(example, [*args, "--output-dir", str(cut)])
    with pytest.raises(UsageError, match=r"--resume: --seed is 4, the paused run used 3"):
        _main(example, [*args, "--seed", "4", "--output-dir", str(cut), "--resume"])
    done = _main(example, [*args, "--output-dir", str(cut), "--resume"])
    assert done["complete"] and done["steps"] == 3
    assert done["masters_crc32"] == whole["masters_crc32"]  # the same weights, bit for bit
    assert _rows(cut) == _rows(tmp_path / "whole")  # every step's reward, loss, grad norm, gap, IS ratio
    assert not list((cut / "trainer").glob("checkpoint-*"))  # a finished run deletes its checkpoint
    records = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # the phase times of every step
        assert r["timing/quads/generate_s"] > 0 and r["timing/quads/sync_s"] > 0
        assert r["timing/step_s"] >= r["timing/train_s"] > 0


def test_a_run_cut_without_pausing_resumes_from_its_last_checkpoint(tmp_path):
    """A command killed after a pause (status 'running', steps logged past the checkpoint)
    continues from the checkpoint; the steps after it run again and are logged once."""
    example = _example()
    whole = _main(example, [*RUN, "--output-dir", str(tmp_path / "whole")])
    cut = tmp_path / "cut"
    _main(example, [*RUN, "--output-dir", str(cut), "--time-budget-s", "1e-9"])
    summary = json.loads((cut / "summary.json").read_text())
    summary["status"] = "running"  # what a killed resumed call leaves ...
    (cut / "summary.json").write_text(json.dumps(summary))
    with open(cut / "metrics.jsonl", "a") as f:  # ... after logging a step it never checkpointed
        f.write(json.dumps({"step": 2, "reward": 0.5}) + "\n")
    done = _main(example, [*RUN, "--output-dir", str(cut), "--resume"])
    assert done["complete"] and done["masters_crc32"] == whole["masters_crc32"]
    assert _rows(cut) == _rows(tmp_path / "whole")


def test_the_task_follows_the_model(tmp_path, capsys):
    from transformers import AutoTokenizer

    from quads.tasks import load_default_tokenizer
    from quads.tasks.grpo_tasks import TASKS, choose_task, no_signal_hint

    embedded = load_default_tokenizer()
    assert choose_task("auto", embedded, embedded_model=True).name == "arithmetic"
    chat = AutoTokenizer.from_pretrained(str(REPO / "quads" / "assets" / "tiny-moe-arith"))
    chat.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert choose_task("auto", chat, embedded_model=False).name == "chain-sum"
    assert choose_task("auto", embedded, embedded_model=False).name == "arithmetic"  # no template: nothing fits better
    with pytest.raises(ValueError, match="chat template"):
        choose_task("chain-sum", embedded, embedded_model=False)
    hint = no_signal_hint(TASKS["arithmetic"], "/models/smollm2", chat)
    assert "\n" not in hint and "'arithmetic'" in hint and "/models/smollm2" in hint and "--task chain-sum" in hint
    # the example prints it when the first step earns nothing (here: a reward that never pays)
    example = _example()
    monkey = TASKS["arithmetic"].__class__
    never = monkey(**{**TASKS["arithmetic"].__dict__, "reward": lambda completions, **kw: [0.0] * len(completions)})
    import quads.tasks.grpo_tasks as tasks_mod

    saved = tasks_mod.TASKS["arithmetic"]
    tasks_mod.TASKS["arithmetic"] = never
    try:
        _main(example, [*RUN[:1], "1", *RUN[2:], "--output-dir", str(tmp_path / "zero")])
    finally:
        tasks_mod.TASKS["arithmetic"] = saved
    printed = capsys.readouterr().out
    assert "warning: every completion of the first step earned reward 0" in printed


def test_micro_batched_backward_gives_the_batch_gradient(tmp_path):
    """--train-micro-batch splits the backward (TRL's gradient accumulation over one generation),
    not the step: the same completions, the same loss, the same gradient up to float summation order."""
    example = _example()
    one = [*RUN[:1], "1", *RUN[2:]]
    whole = _main(example, [*one, "--output-dir", str(tmp_path / "whole")])
    split = _main(example, [*one, "--train-micro-batch", "2", "--output-dir", str(tmp_path / "split")])
    assert whole["args"]["train_micro_batch"] == 4 and split["args"]["train_micro_batch"] == 2
    (a,), (b,) = _rows(tmp_path / "whole"), _rows(tmp_path / "split")
    assert a["reward"] == b["reward"] and a["sampling/quads/logp_gap_mean"] == b["sampling/quads/logp_gap_mean"]
    assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-4)
    assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-4, abs=1e-7)
    with pytest.raises(UsageError, match="does not divide"):
        _main(example, [*one, "--train-micro-batch", "3", "--output-dir", str(tmp_path / "bad")])


def test_a_second_run_in_a_folder_in_use_is_refused(tmp_path):
    """Two processes in one --output-dir would interleave their metrics and overwrite each
    other's summary: the second is refused in one line, the first's files untouched."""
    import os

    from quads.diagnostics.cli_inputs import UsageError
    from quads.tensor.files import lock_folder

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("first run\n")
    fd = lock_folder(out, "--output-dir")  # as a running example holds it
    try:
        with pytest.raises(UsageError, match=r"in use by another running process \(pid \d+\)"):
            _main(_example(), [*RUN, "--output-dir", str(out)])
    finally:
        os.close(fd)
    assert (out / "metrics.jsonl").read_text() == "first run\n"


def test_stop_after_s_ends_the_run_early_without_a_checkpoint(tmp_path):
    """``--stop-after-s`` ends training after the first step past the budget, keeps no
    checkpoint, and still finishes the run (status ``stopped``, summary written)."""
    example = _example()
    out = tmp_path / "stopped"
    done = _main(example, [*RUN, "--output-dir", str(out), "--stop-after-s", "1e-9"])
    assert done["status"] == "stopped" and done["complete"] and done["steps"] == 1
    assert json.loads((out / "summary.json").read_text())["status"] == "stopped"
    assert not (out / "trainer").exists() or not list((out / "trainer").glob("checkpoint-*"))
    assert "masters_crc32" in done
