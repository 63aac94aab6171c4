"""Every CLI command and integration without its extra: one line naming the command or API and the
``pip install`` line, exit status 2 for the CLI, no traceback.

Each case runs in a fresh interpreter where the extra's package is absent as Python sees a package
that is not installed (``sys.modules[name] = None``: ``import name`` raises ``ModuleNotFoundError``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(blocked: tuple[str, ...], body: str) -> subprocess.CompletedProcess:
    code = "import sys\n" + "".join(f"sys.modules[{b!r}] = None\n" for b in blocked) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def _error_lines(text: str) -> list[str]:
    """stderr without the warnings torch and torchao print on CPU machines."""
    return [l for l in text.splitlines() if l.strip() and not l.startswith(("W1", "Failed to load", "  warn"))]


@pytest.mark.parametrize("argv, blocked, extra", [
    (["demo"], ("transformers",), "hf"),
    (["export", "--model", "quads/assets/tiny-moe-arith", "--out", "OUT"], ("transformers",), "hf"),
    (["diagnose", "--plans", "w4a16"], ("transformers",), "hf"),
    (["diagnose", "--plans", "w4a16"], ("tqdm",), "hf"),  # transformers' own dependency
])
def test_cli_command_without_its_extra_is_one_line_exit_2(argv, blocked, extra, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    proc = _run(blocked, f"from quads.cli import main; sys.exit(main({argv!r}))")
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"quads {argv[0]}: error: quads {argv[0]} needs ")
    assert f"pip install 'quads-rl[{extra}]'" in lines[0] and blocked[0] in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("body, blocked, api, extra", [
    ("import quads.integrations.torchao", ("torchao",), "quads.integrations.torchao", "torchao"),
    ("import quads.integrations.trl", ("trl",), "quads.integrations.trl", "trl"),
    ("import quads.integrations.trl", ("transformers",), "quads.integrations.trl", "hf"),
    ("import quads.integrations.transformers", ("transformers",), "quads.integrations.transformers", "hf"),
    ("from quads.integrations.modelopt import load_exported\nload_exported('quads/assets/tiny-moe-arith')",
     ("transformers",), "quads.integrations.modelopt.load_exported", "hf"),
    ("from quads.integrations.vllm import register\nregister()", ("vllm",), "quads.integrations.vllm.register",
     "vllm"),
    ("import quads.integrations.vllm.quant_method", ("vllm",), "quads.integrations.vllm.quant_method", "vllm"),
])
def test_integration_without_its_extra_names_the_api_and_the_pip_line(body, blocked, api, extra):
    probe = f"""
        from quads.extras import MissingExtra
        try:
{textwrap.indent(body, " " * 12)}
        except MissingExtra as err:
            assert isinstance(err, ImportError)
            print("MISSING", err)
        else:
            print("IMPORTED")
    """
    proc = _run(blocked, probe)
    out = [l for l in proc.stdout.splitlines() if l.startswith(("MISSING", "IMPORTED"))]
    assert proc.returncode == 0 and out, proc.stderr
    assert len(out) == 1 and out[0].startswith(f"MISSING {api} needs {blocked[0]}")
    assert f"pip install 'quads-rl[{extra}]'" in out[0]


def test_every_extra_is_one_of_pyproject():
    """The table names only extras that exist (a typo would print a pip line that fails)."""
    import tomllib

    from quads.extras import EXTRA_OF

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF.values()) <= set(extras)
