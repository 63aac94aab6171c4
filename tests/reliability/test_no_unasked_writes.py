"""No writes where none were asked for: nothing is ever written through a symlink planted at a
name quads writes (the target, ``X.tmp``, the write probe), and files get the usual modes."""

import os
import re
from pathlib import Path

import pytest
import torch

from benchmarks.studies.reliability_sweeps import planted_link_sweep

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _canary(tmp_path):
    canary = tmp_path / "canary"
    canary.write_bytes(b"precious")
    return canary


def test_the_output_dir_probe_never_opens_a_planted_link(tmp_path):
    from quads.diagnostics.cli_inputs import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    canary = _canary(tmp_path)
    (out / f".quads-write-probe-{os.getpid()}").symlink_to(canary)
    check_output_dir(str(out))
    assert canary.read_bytes() == b"precious"


def test_diagnose_json_never_writes_through_a_dangling_link(tmp_path, monkeypatch):
    import quads.diagnostics.diagnose as diagnose
    from quads.cli import main

    monkeypatch.setattr(diagnose, "run_diagnose", lambda *a, **k: {"rows": []})
    monkeypatch.setattr(diagnose, "format_report", lambda report: "report")
    target = tmp_path / "elsewhere.json"  # does not exist
    (tmp_path / "out.json").symlink_to(target)
    assert main(["diagnose", "--json", str(tmp_path / "out.json"), "--threads", "1"]) == 0
    assert not target.exists()  # the link's destination was never created
    assert (tmp_path / "out.json").is_file() and not (tmp_path / "out.json").is_symlink()


def test_planted_links_at_every_writer_sampled_sweep():
    """Every writer kind but the two slow ones (the export and the model files: in the script)."""
    from benchmarks.studies.reliability_sweeps import _writers

    fast = [name for name in _writers() if name not in ("export --out", "model files (save_pretrained + build_info)")]
    result = planted_link_sweep(only=fast)
    assert result.tried == 4 * len(fast) and result.bad == 0, result


#: raw ways to write a file; every writer in quads/, benchmarks/ and examples/ goes through
#: quads/tensor/files.py instead (atomic, no symlink followed, umask modes)
_RAW_WRITES = [
    re.compile(r"""\bopen\([^)]*,\s*["'][wax]b?\+?["']"""),
    re.compile(r"\.write_text\(|\.write_bytes\("),
    re.compile(r"\bos\.open\((?![^)]*O_NOFOLLOW)[^)]*O_CREAT"),
    re.compile(r"\bsavefig\(\s*(?!f\b)"),
    re.compile(r"""\bos\.replace\(\s*\w*\s*\+\s*["']\.tmp"""),
]


def test_every_writer_in_the_project_uses_the_safe_helper():
    offenders = []
    for folder in ("quads", "benchmarks", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.relative_to(REPO).as_posix() == "quads/tensor/files.py":
                continue
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if any(p.search(line) for p in _RAW_WRITES):
                    offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "raw file writes:\n" + "\n".join(offenders)


def test_files_get_the_umask_modes(tmp_path, umask_022):
    from quads.diagnostics.cli_inputs import atomic_write_text
    from quads.tensor import save_safetensors
    from quads.tensor.files import open_for_append, write_atomically

    save_safetensors({"x": torch.ones(2)}, tmp_path / "a.safetensors")
    atomic_write_text(tmp_path / "b.json", "{}")
    write_atomically(tmp_path / "c.bin", b"x")
    with open_for_append(tmp_path / "d.jsonl") as f:
        f.write("{}\n")
    for name in ("a.safetensors", "b.json", "c.bin", "d.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
    os.umask(0o077)
    write_atomically(tmp_path / "e.bin", b"x")
    assert (tmp_path / "e.bin").stat().st_mode & 0o777 == 0o600


def test_the_examples_summary_json_gets_the_umask_mode(tmp_path, umask_022):
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_grpo_quads_example", REPO / "examples" / "trl_grpo_quads.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.write_summary(tmp_path, {"complete": False})
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o644
