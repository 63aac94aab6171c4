"""The base install (``pip install quads-rl``: torch, numpy, safetensors) works without the extras.

Triton comes only with the ``kernels`` extra, transformers with ``hf``: ``import quads`` and the
torch reference path (``quantize_``, forward of both sides, ``sync_weights_``, safetensors
save/load) must not need them. Each check runs in a fresh interpreter where the extras'
packages are absent as Python sees a package that is not installed: ``sys.modules[name] =
None`` makes ``import name`` raise ``ModuleNotFoundError`` and ``importlib.util.find_spec(name)``
return None (what libraries probing for Triton, such as TRL, check), so a top-level
``import triton`` anywhere on the path fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

BLOCKER = """
import importlib.util, sys
for _name in {blocked!r}:
    sys.modules[_name] = None  # not installed, as far as import and find_spec can tell
"""


def _run(body: str, blocked: tuple[str, ...]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "QUADS_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = BLOCKER.format(blocked=blocked) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_blocker_really_blocks():
    """The harness itself: a blocked package cannot be imported (else every other test here is vacuous)."""
    out = _run("""
        assert importlib.util.find_spec("triton") is None
        try:
            import triton.language
        except ModuleNotFoundError as e:
            print("blocked", e.name)
    """, ("triton",))
    assert out.strip().startswith("blocked triton")


def test_torch_only_install_quantizes_runs_and_syncs(tmp_path):
    """No triton, transformers, torchao, trl, vllm: a plain torch model through both sides."""
    out = _run(f"""
        import sys, torch, torch.nn as nn
        import quads
        from quads.tensor import save_safetensors, load_safetensors

        torch.manual_seed(0)
        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(torch.bfloat16)

        trainer, rollout = build(), build()
        quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
        backends = {{m.quads_backend.name for m in rollout.modules() if hasattr(m, "quads_backend")}}
        assert backends == {{"torch"}}, backends

        x = torch.randn(5, 64, dtype=torch.bfloat16)
        y_t, y_r = trainer(x), rollout(x)
        assert y_t.shape == y_r.shape == (5, 32) and torch.isfinite(y_r).all()
        y_t.float().pow(2).mean().backward()  # QAT: gradients reach the BF16 masters
        assert trainer[0].weight.grad is not None and trainer[0].weight.grad.abs().sum() > 0

        with torch.no_grad():  # an optimizer step, then the sync writes the new masters' bits
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert quads.sync_weights_(rollout, trainer) > 0
        for i in (0, 2):
            w_t = quads.nvfp4_fake_quantize(trainer[i].weight.detach())
            w_r = rollout[i].weight.dequantize(torch.bfloat16)
            assert torch.equal(w_t, w_r), i  # exact alignment after the sync

        path = {str(tmp_path / "rollout.safetensors")!r}
        save_safetensors(rollout.state_dict(), path)
        loaded = load_safetensors(path)
        assert torch.equal(loaded["0.weight"].qdata, rollout[0].weight.qdata)
        assert sys.modules["triton"] is None and sys.modules["transformers"] is None  # never loaded
        print("ok")
    """, ("triton", "transformers", "torchao", "trl", "vllm"))
    assert out.strip().endswith("ok")


def test_no_triton_transformers_moe_reference_path():
    """No triton (transformers present): a tiny Qwen3-MoE, fused experts included, on the torch reference."""
    pytest.importorskip("transformers")
    out = _run("""
        import sys, torch
        import quads
        from tests.tiny_models import build

        trainer, rollout = build("qwen3_moe"), build("qwen3_moe")
        quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
        ids = torch.randint(0, 96, (2, 7))
        with torch.no_grad():
            a = trainer(ids).logits
            b = rollout(ids).logits
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        assert quads.sync_weights_(rollout, trainer) > 0
        with torch.no_grad():
            c = rollout(ids).logits
        assert not torch.equal(b, c)  # the sync changed what the rollout computes
        quads.fuse_projections_(rollout)  # sibling groups: one quantization per input, no stacked layout here
        with torch.no_grad():
            assert torch.equal(rollout(ids).logits, c)  # same bits, and no Triton needed
        assert sys.modules["triton"] is None
        print("ok")
    """, ("triton",))
    assert out.strip().endswith("ok")


def test_no_triton_every_module_outside_the_kernels_imports():
    """``pip install "quads-rl[trl]"`` on a machine without Triton: every module but the kernels
    themselves (and the vLLM method, which needs vLLM) imports."""
    pytest.importorskip("trl")
    out = _run("""
        import importlib, pkgutil
        import quads
        bad = []
        for m in pkgutil.walk_packages(quads.__path__, "quads."):
            if m.name.startswith(("quads.kernels.", "quads.integrations.vllm")):
                continue
            try:
                importlib.import_module(m.name)
            except Exception as e:  # noqa: BLE001
                bad.append((m.name, repr(e)[:200]))
        assert not bad, bad
        assert "triton" not in {k for k, v in sys.modules.items() if v is not None}
        print("ok")
    """.replace("import quads\n", "import quads, sys\n"), ("triton",))
    assert out.strip().endswith("ok")
