"""README's Python example runs as written, from the repository root (the embedded model)."""

import pathlib
import re

from quads.policies.modules import RolloutExperts, RolloutLinear

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_readme_python_example_runs(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert len(blocks) == 1, "README holds one Python example"
    monkeypatch.chdir(REPO)
    scope = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102 - the documented example itself
    rollout = [m for m in scope["rollout"].modules() if isinstance(m, (RolloutLinear, RolloutExperts))]
    trainer = [type(m).__name__ for m in scope["trainer"].modules() if type(m).__name__.startswith("Trainer")]
    assert rollout and trainer, "the example converted neither side"
    assert len(rollout) == len(trainer)  # both sides converted the same modules
