"""``torchao.quantization.quantize_(model, QuadsPolicy(...))`` after ``import quads`` alone, in
either import order, without ``import quads`` importing torchao (fresh interpreters)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchao")
REPO = Path(__file__).resolve().parents[2]

BODY = """
    import sys, inspect, torch
    {imports}
    from tests.tiny_models import build
    a, b = build("llama"), build("llama")
    torchao.quantization.quantize_(a, quads.QuadsPolicy(side="rollout"))
    quads.quantize_(b, quads.QuadsPolicy(side="rollout"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        x, y = pa[n], pb[n]
        assert type(x) is type(y), n
        assert torch.equal(x.qdata, y.qdata) if isinstance(x, quads.NVFP4Tensor) else torch.equal(x, y), n
    assert "def quantize_" in inspect.getsource(torchao.quantization.quant_api.quantize_)  # loader intact
    print("ok", sum(isinstance(p, quads.NVFP4Tensor) for p in pa.values()))
"""


def _run(imports: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = textwrap.dedent(BODY.format(imports=imports))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quads_first_then_torchao():
    out = _run("import quads\n    assert 'torchao' not in sys.modules\n    import torchao")
    assert out.split()[:2] == ["ok", "14"]


def test_torchao_first_then_quads():
    out = _run("import torchao\n    import quads")
    assert out.split()[:2] == ["ok", "14"]
