"""The package's structure: layers import one way; the backend is chosen once and stored."""

import ast
import copy
import io
import pathlib
import re
import sys
import tokenize

import pytest
import torch

import quads
import quads.ops.backend_registry as backend_mod
from quads.policies.modules import RolloutExperts, RolloutLinear
from tests.tiny_models import build

# the weight quantizer kernel runs once per distinct weight in the session (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("memo_weight_kernel")

ROOT = pathlib.Path(quads.__file__).parent
RANK = {"tensor": 0, "kernels": 1, "ops": 2, "policies": 3, "tasks": 3, "models": 3, "engine": 4, "diagnostics": 4,
        "integrations": 5}


def _imports(tree: ast.AST, package: tuple[str, ...]):
    """(lineno, module) of every import in a file, function-level and relative ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                yield node.lineno, ".".join(base + ((node.module,) if node.module else ()))
            elif node.module:
                yield node.lineno, node.module


def test_layers_import_one_way():
    """tensor <- kernels <- ops <- policies (tasks, models) <- engine, diagnostics <- integrations, nothing upward."""
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent)
        parts = rel.with_suffix("").parts  # ("quads", layer, ...)
        if len(parts) < 3 or parts[1] not in RANK:
            continue
        for lineno, module in _imports(ast.parse(path.read_text()), parts[:-1]):
            target = module.split(".")
            if target[0] == "quads" and len(target) > 1 and target[1] in RANK and RANK[target[1]] > RANK[parts[1]]:
                bad.append(f"{rel}:{lineno} imports {module}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_nothing_cites_what_a_clone_does_not_hold():
    """Code, docs, tests and scripts cite docs/ (background.md), never a design file outside the repository."""
    repo = ROOT.parent
    outside = ("QUADS" + ".md", "../" + "shared")
    bad = [str(p.relative_to(repo)) for p in repo.rglob("*")
           if p.is_file() and p.suffix in (".py", ".md", ".sh", ".toml", ".txt")
           and not any(part.startswith(".") or part in ("results", "runs", "outputs")
                       for part in p.relative_to(repo).parts[:-1])  # .git, virtualenvs (.venv, .venv-vllm), run output
           and any(o in p.read_text(errors="ignore") for o in outside)]
    assert not bad, f"files citing {outside}: {bad}"


def _module_graph() -> dict[str, set[str]]:
    """file module -> the quads file modules it imports (package ``__init__`` files left out: they
    only re-export). Every import statement counts: function-level ones and those under
    ``if TYPE_CHECKING:`` too (a type-only edge still ties the two files together)."""
    files = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p for p in ROOT.rglob("*.py")
             if p.name != "__init__.py"}
    graph = {}
    for name, path in files.items():
        package, deps = tuple(name.split(".")[:-1]), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for _, module in _imports(node, package):
                deps.add(module)
                if isinstance(node, ast.ImportFrom):  # from quads.x import module
                    deps.update(f"{module}.{a.name}" for a in node.names)
        graph[name] = (deps & files.keys()) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_file_import_cycles():
    """No two files import each other, directly or around a loop (function-level and
    ``TYPE_CHECKING`` imports included)."""
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_cycle_finder_sees_type_checking_and_function_level_edges(tmp_path, monkeypatch):
    """The checks above on a planted package: a loop closed only under ``TYPE_CHECKING`` (or only
    inside a function) is a cycle."""
    pkg = tmp_path / "quads"
    (pkg / "integrations").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "integrations" / "__init__.py").write_text("")
    (pkg / "integrations" / "a.py").write_text("from quads.integrations.b import B\n")
    (pkg / "integrations" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from quads.integrations.a import A\n")
    (pkg / "integrations" / "c.py").write_text("def f():\n    from quads.integrations import d\n")
    (pkg / "integrations" / "d.py").write_text("from quads.integrations.c import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert _cycles(_module_graph()) == ["quads.integrations.a -> quads.integrations.b -> quads.integrations.a",
                                        "quads.integrations.c -> quads.integrations.d -> quads.integrations.c"]
    (pkg / "__init__.py").write_text("from quads.integrations.a import A\n")
    assert _package_root_imports_of_integrations() == ["quads/__init__.py:1 imports quads.integrations.a"]


def _package_root_imports_of_integrations() -> list[str]:
    """Imports of ``quads.integrations`` in ``quads/__init__.py`` and the package's top-level modules
    (the command line, ``cli.py`` / ``__main__.py``, excepted: it is the top of the stack)."""
    bad = []
    for path in sorted(ROOT.glob("*.py")):
        if path.name in ("cli.py", "__main__.py"):
            continue
        for lineno, module in _imports(ast.parse(path.read_text()), ("quads",)):
            if module == "quads.integrations" or module.startswith("quads.integrations."):
                bad.append(f"quads/{path.name}:{lineno} imports {module}")
    return bad


def test_import_quads_does_not_import_integrations():
    """``quads/__init__.py`` (which every ``import quads.x`` runs) imports no integration: an upward edge
    from the package root into the top layer. Integrations register themselves when imported
    (torchao: :mod:`quads.integration_hooks` names the module to import once torchao loads)."""
    bad = _package_root_imports_of_integrations()
    assert not bad, "the package root imports integrations:\n" + "\n".join(bad)



def test_import_quads_is_light():
    """``import quads`` loads no integration, no third-party extra and no ``torch.distributed.tensor``
    (~0.4 s on its own): the sharded sync asks ``sys.modules`` for DTensor/FSDP2 instead."""
    import subprocess
    import sys

    code = ("import sys, torch; before = set(sys.modules); import quads; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=pathlib.Path(__file__).resolve().parent.parent, check=True).stdout.split()
    heavy = ("torch.distributed.tensor", "torch.distributed.fsdp", "quads.integrations", "transformers", "trl",
             "torchao", "triton", "vllm", "tqdm")
    bad = [m for m in out if any(m == h or m.startswith(h + ".") for h in heavy)]
    assert not bad, f"import quads loads: {bad[:10]}"

MAX_MODULE_DOCSTRING_LINES = 25
#: work history, which belongs in CHANGELOG.md: ISO dates, "issue N", "stage N", "session N", and
#: commit hashes (7-40 hex characters with a digit and a letter, not part of a word or a 0x literal)
HISTORY = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\bissues? #?\d|\bstages? \d|\bsessions? \d"
                     r"|(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![0-9A-Za-z_])", re.I)


def _checked_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.rglob("*.py"))


def _prose(source: str):
    """(lineno, text) of every comment and every module, class and function docstring line."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                yield from ((first + i, line) for i, line in enumerate(doc.split("\n")))


def _history_notes(folder: pathlib.Path) -> list[str]:
    repo = folder.parent
    return [f"{p.relative_to(repo)}:{lineno}: {text.strip()}" for p in _checked_files(folder)
            for lineno, text in _prose(p.read_text()) if HISTORY.search(text)]


def _long_module_docstrings(folder: pathlib.Path) -> list[str]:
    repo = folder.parent
    out = []
    for p in _checked_files(folder):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        lines = 0 if doc is None else len(doc.strip("\n").split("\n"))
        if lines > MAX_MODULE_DOCSTRING_LINES:
            out.append(f"{p.relative_to(repo)}: {lines} lines")
    return out


def test_module_docstrings_are_short():
    """A module docstring says what and why in at most 25 lines; design detail goes to docs/."""
    long = _long_module_docstrings(ROOT)
    assert not long, "module docstrings over 25 lines:\n" + "\n".join(long)


def test_no_work_history_in_docstrings_or_comments():
    """Docstrings and comments of quads/, tests/ and benchmarks/ say what the code does, not when or
    in which issue it changed (dates, issue / stage / session numbers, commit hashes: CHANGELOG.md)."""
    notes = _history_notes(ROOT) + _history_notes(ROOT.parent / "tests") + _history_notes(ROOT.parent / "benchmarks")
    assert not notes, "work history in docstrings or comments:\n" + "\n".join(notes)


def _imports_of(folder: pathlib.Path, packages: tuple[str, ...]) -> list[str]:
    """``file:line imports module`` for every import in ``folder`` of one of ``packages``."""
    repo = folder.parent
    return [f"{p.relative_to(repo)}:{lineno} imports {module}" for p in _checked_files(folder)
            for lineno, module in _imports(ast.parse(p.read_text()), p.relative_to(repo).with_suffix("").parts[:-1])
            if module.split(".")[0] in packages]


def test_benchmarks_and_the_package_do_not_import_lab_or_results():
    """lab/ holds one-off experiments on top of everything: nothing in quads/ or benchmarks/ imports
    it; results/ holds raw outputs, no code."""
    repo = ROOT.parent
    bad = _imports_of(ROOT, ("lab", "benchmarks")) + _imports_of(repo / "benchmarks", ("lab",))
    assert not bad, "imports of lab/ (or of benchmarks/ from quads/):\n" + "\n".join(bad)
    code = sorted(str(p.relative_to(repo)) for p in (repo / "results").rglob("*.py"))
    assert not code, f"code inside results/: {code}"


def test_import_check_sees_a_planted_lab_import(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "a.py").write_text("import torch\nfrom lab.x import y\n\ndef f():\n    import lab\n")
    assert _imports_of(bench, ("lab",)) == ["benchmarks/a.py:2 imports lab.x", "benchmarks/a.py:5 imports lab"]


def test_history_and_length_checks_see_planted_cases(tmp_path):
    """The two checks above on a planted folder: each pattern is found, code and 0x literals are not."""
    pkg = tmp_path / "quads"
    pkg.mkdir()
    planted = [
        '"""Line.',
        "",
        'Measured on 2026-12-01."""',
        "X = 0x7F800000  # a mask, not a hash",
        "STAMP = '2026-12-01'  # code is not prose",
        "def f():",
        '    """Fixed in issue 12."""',
        "# as in stage 1; see commit 38cbda1",
        "# cafe, a 64-bit mask 0xFFFF0000FFFF, the digits 1234567",
    ]
    (pkg / "a.py").write_text("\n".join(planted) + "\n")
    (pkg / "b.py").write_text('"""' + "\n".join(["line"] * 26) + '"""\n')
    notes = _history_notes(pkg)
    assert sorted(int(n.split(":")[1]) for n in notes) == [3, 7, 8], notes
    assert _long_module_docstrings(pkg) == ["quads/b.py: 26 lines"]


#: work labels in docs prose: "session N", "issue N" / "issue #N", a bare "#N" issue
#: reference (not an anchor: ``](#5-...)``, ``page.md#5-...``) and "S5"-style work-period tags
DOC_LABELS = re.compile(r"(?i:\bsessions? \d|\bissue #?\d|\bissues #\d)|(?<![\w(/&#])#\d+\b|\bS\d+\b")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
#: a date inside a results folder or file name (``results/h200_2026-12-03_rl_step``, ``..._cpu_2026-12-01/``)
DATED_NAME = re.compile(r"[\w./-]*(?:results/|_)20\d\d-[01]\d-[0-3]\d[\w./-]*|[\w./-]*20\d\d-[01]\d-[0-3]\d_[\w./-]*")


def _doc_history(text: str) -> list[tuple[int, str]]:
    """(line, text) of docs lines holding a work label anywhere, or a date outside a table row and
    outside a results folder or file name (a table's "measured on" cell may hold one)."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if DOC_LABELS.search(line):
            out.append((lineno, line))
        elif not line.lstrip().startswith("|") and DATE.search(DATED_NAME.sub("", line)):
            out.append((lineno, line))
    return out


def test_docs_say_what_is_true_today():
    """docs/ pages describe what is, not when or in which session or issue it changed (CHANGELOG.md
    holds that): no work labels, and dates only in tables (a run's "measured on" cell) and in the
    names of results folders."""
    docs = ROOT.parent / "docs"
    bad = [f"docs/{p.name}:{n}: {line.strip()[:120]}" for p in sorted(docs.glob("*.md")) for n, line in _doc_history(p.read_text())]
    assert not bad, "history in docs prose:\n" + "\n".join(bad)


def test_doc_history_check_sees_planted_cases():
    planted = [
        "Measured in session 5 on the H200.",  # 1: label
        "Issue 23 fixed it, see #41.",  # 2
        "The S6 run.",  # 3
        "The default since 2026-12-01.",  # 4: a date in prose
        "| quads | 1.25x | 2026-12-04 |",  # a table's measured-on cell
        "Raw output: `results/h200_2026-12-03_rl_step/` and results/plans_cpu_2026-12-03.",
        "See [the table](plans.md#5-the-plan-table) and [above](#3-kernels).",
        "Pipeline stages 1-4; S-curves; `sha256:ab12`; the host issues 252 calls.",
    ]
    assert [n for n, _ in _doc_history("\n".join(planted))] == [1, 2, 3, 4]


def test_rollout_modules_store_their_backend_and_forward_never_reselects(monkeypatch):
    model = build("qwen3_moe")
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    rollout = [m for m in model.modules() if isinstance(m, (RolloutLinear, RolloutExperts))]
    assert rollout and all(m.quads_backend.name == "torch" for m in rollout)
    assert "backend=torch" in repr(rollout[0])

    def boom(*a, **k):
        raise AssertionError("select_backend called in a forward")

    import quads.ops.activation_quant as activation_quant
    import quads.ops.experts_op as experts
    import quads.ops.linear_op as linear
    import quads.ops.weight_quant as weight_quant

    for mod in (backend_mod, activation_quant, experts, linear, weight_quant):  # every front that may pick
        monkeypatch.setattr(mod, "select_backend", boom)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        model(ids)


def test_backend_forced_at_conversion_is_kept_and_moves_reselect():
    model = build("llama")
    with quads.use_backend("hopper"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # the interpreter runs kernels on CPU tensors
        quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.quads_backend.name == "hopper"  # stored: no longer depends on the context
    model.to("cpu")  # a move picks again, for the new device (auto: torch on CPU)
    assert layer.quads_backend.name == "torch"
    clone = copy.deepcopy(model)  # backends copy (and pickle) as themselves
    assert clone.model.layers[0].self_attn.q_proj.quads_backend is quads.ops.get_backend("torch")


def test_auto_never_picks_blackwell_and_bad_names_raise(monkeypatch):
    assert quads.select_backend("cpu").name == "torch"
    assert quads.select_backend("meta").name == "torch"
    monkeypatch.setenv("QUADS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="QUADS_BACKEND"):
        quads.select_backend("cpu")
    monkeypatch.delenv("QUADS_BACKEND")
    with pytest.raises(ValueError):
        quads.ops.get_backend("auto")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with quads.use_backend("hopper"), pytest.raises(RuntimeError, match="forced"):
            quads.select_backend("cpu")
    monkeypatch.setattr(backend_mod.torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(backend_mod, "_triton_available", lambda: True)
    assert quads.select_backend(torch.device("cuda", 0)).name == "torch"  # sm_100: not auto-picked


def test_no_merge_conflict_markers():
    """No file the repository tracks holds a merge's conflict markers (a merge resolved by hand
    can leave them in a page no test reads)."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    marked = []
    for name in files:
        path = root / name
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yaml", ".yml") or not path.is_file():
            continue
        lines = path.read_text(errors="replace").splitlines()
        if any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in lines):
            marked.append(name)
    assert not marked, "conflict markers in: " + ", ".join(marked)
