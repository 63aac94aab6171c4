"""The distribution name: every install line a user copies names the package pyproject builds.

The import name is ``quads``; the PyPI name ``quads`` belongs to an unrelated project, so the
distribution has another name (pyproject's ``[project] name``), not on the package index yet:
README installs from a clone and names it; pyproject's self-referencing extras and every ``pip
install`` hint in the package's error messages and docs must use that name, or a user installs the
wrong package.
"""

from __future__ import annotations

import pathlib
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
NAME = PYPROJECT["project"]["name"]

# `pip install NAME`, `pip install "NAME[extra]"`, `pip install 'NAME[extra]'`: the requirement after it
_PIP_HINT = re.compile(r"""pip install\s+(?:-[-\w]+\s+)*["']?([A-Za-z0-9_.\-]+)(\[[^\]"']*\])?""")


def _hints(text: str) -> list[str]:
    """The package names (not local paths or flags) that ``pip install`` lines in ``text`` install."""
    return [m.group(1) for m in _PIP_HINT.finditer(text) if not m.group(1).startswith((".", "-"))]


def test_name_is_not_the_import_name_taken_on_pypi():
    assert PYPROJECT["project"]["name"] != "quads"  # taken on PyPI by a quadtree library
    assert PYPROJECT["project"]["scripts"]["quads"] == "quads.cli:main"  # the command keeps its name


def test_extras_refer_to_this_distribution():
    extras = PYPROJECT["project"]["optional-dependencies"]
    self_refs = [req for reqs in extras.values() for req in reqs if req.split("[")[0] in ("quads", NAME)]
    assert self_refs and all(req.startswith(f"{NAME}[") for req in self_refs), self_refs


def test_readme_installs_from_a_clone_and_names_the_distribution():
    """The distribution is not on the package index: README's install block installs the clone (no
    package name for pip to look up) and names the distribution in prose."""
    text = (REPO / "README.md").read_text()
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = install.split("```", 2)[1]
    assert "git clone" in block and "./scripts/setup.sh" in block and 'pip install -e ".[trl]"' in block
    assert _hints(block) == [], _hints(block)
    assert f"`{NAME}`" in install
    bad = [n for n in _hints(text) if n.split("[")[0] == "quads"]
    assert not bad, f"README installs {bad}, not {NAME}"


def test_every_install_hint_in_the_package_and_docs_uses_it():
    files = [*sorted((REPO / "quads").rglob("*.py")), *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "scripts").glob("*")), *sorted((REPO / "examples").glob("*.py"))]
    bad = [f"{path.relative_to(REPO)}: pip install {name}" for path in files if path.is_file()
           for name in _hints(path.read_text(errors="ignore")) if name == "quads"]
    assert not bad, "install hints naming the PyPI project 'quads':\n" + "\n".join(bad)
    hints_in_package = [n for p in (REPO / "quads").rglob("*.py") for n in _hints(p.read_text()) if n == NAME]
    assert len(hints_in_package) >= 3  # the TRL, real-model and humming hints


def test_hint_pattern_reads_the_forms_used():
    assert _hints("""pip install "quads[trl]" x""") == ["quads"]
    assert _hints("pip install 'quads-rl[real]'") == ["quads-rl"]
    assert _hints("pip install -q --upgrade pip") == ["pip"]
    assert _hints('pip install -e ".[test]"') == []
