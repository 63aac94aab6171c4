"""Every ``QUADS_*`` setting is read at import or when its backend is made, never per call: a
rollout forward (torch reference, the humming backend on its CPU stand-in), a humming layer's
creation (its tuned-table lookup) and a ``torch.compile`` of quads ops (their trace-time kernels)
run with ``os.environ`` replaced by a mapping that records every ``QUADS_*`` key read, and read none."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import MutableMapping

import pytest
import torch
import torch._inductor.config as inductor_config

import quads
from quads.ops.backends.humming import backend as hb
from quads.ops.compile_alignment import eager_casts, enabled, set_eager_casts
from tests.ops.test_humming_backend import _ORIG_CONFIGS, _weight, fake_humming  # noqa: F401  (fixture)
from tests.ops.test_humming_memory import _fast_rollout, _input
from tests.ops.test_humming_tuned import _cfg, _entry, _table_file, heuristics  # noqa: F401  (fixture)
from tests.tiny_models import build

pytestmark = pytest.mark.usefixtures("memo_weight_kernel")


class _RecordingEnviron(MutableMapping):
    """``os.environ`` that notes each ``QUADS_*`` key looked up (get, [], in); writes, copies and
    iteration pass through unrecorded."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def _note(self, key):
        if isinstance(key, str) and key.startswith("QUADS_"):
            self.reads.append(key)

    def __getitem__(self, key):
        self._note(key)
        return self.real[key]

    def get(self, key, default=None):
        self._note(key)
        return self.real.get(key, default)

    def __contains__(self, key):
        self._note(key)
        return key in self.real

    def __setitem__(self, key, value):
        self.real[key] = value

    def __delitem__(self, key):
        del self.real[key]

    def __iter__(self):
        return iter(self.real)

    def __len__(self):
        return len(self.real)

    def copy(self):
        return self.real.copy()


@contextlib.contextmanager
def _recorded_environ():
    """``os.environ`` (and so ``os.getenv``) recorded inside the block; yields the keys read."""
    real, rec = os.environ, _RecordingEnviron(os.environ)
    os.environ = rec
    try:
        yield rec.reads
    finally:
        os.environ = real


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_recorder_sees_a_read():
    """The check can fail: a read of a ``QUADS_*`` key inside the block is recorded."""
    with _recorded_environ() as reads:
        os.environ.get("QUADS_EAGER_CASTS")
        os.getenv("QUADS_BACKEND")
        "QUADS_CACHE" in os.environ  # noqa: B015
        os.environ.get("HOME")
    assert reads == ["QUADS_EAGER_CASTS", "QUADS_BACKEND", "QUADS_CACHE"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_rollout_forward_reads_no_setting(kind):
    m = build(kind)
    quads.quantize_(m, quads.QuadsPolicy(side="rollout"))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), _recorded_environ() as reads:
        m(ids)
        m(ids[:, :3])
    assert reads == []


def test_a_humming_forward_reads_no_setting(fake_humming):
    model = _fast_rollout()
    with torch.no_grad(), _recorded_environ() as reads:
        model(_input())
    assert fake_humming and reads == []  # humming ran (its stand-in), and read nothing


def test_a_humming_layer_reads_its_backends_tuned_table_and_no_setting(fake_humming, heuristics, tmp_path,
                                                                        monkeypatch):
    """The tuned table is the backend's choice, made when it was made: a layer made later reads
    that table (its entry on M in (48, 64]) whatever the environment says then, and not the environment."""
    path = _table_file(tmp_path, [_entry(n=128)])
    monkeypatch.setenv("QUADS_HUMMING_TUNED", str(path))
    backend = hb.HummingBackend(mode="default")
    monkeypatch.setenv("QUADS_HUMMING_TUNED", "0")
    with _recorded_environ() as reads:
        layer = backend.prepare_weight(_weight()).layer(torch.float16)
        _, tuning = _ORIG_CONFIGS(layer)
    assert reads == []
    assert [48, 64, _cfg(7)] in json.loads(tuning)


def _eager_casts_seen(model, x):
    """The inductor setting each graph of ``torch.compile(model)`` is handed to its backend with."""
    seen = []

    def spy(gm, example_inputs):
        seen.append(inductor_config.emulate_precision_casts)
        return gm.forward

    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend=spy, fullgraph=True)(x), model(x))
    return seen


def test_a_compile_reads_no_setting_and_follows_the_stored_one(_fresh_dynamo):
    """The trace-time kernels read the stored switch: on by default, off inside ``eager_casts(False)``
    (restored after), without a read of ``QUADS_EAGER_CASTS``."""
    lin = torch.nn.Linear(64, 48).bfloat16()
    quads.quantize_(lin, quads.QuadsPolicy(side="rollout"))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert enabled()
    with _recorded_environ() as reads:
        on = _eager_casts_seen(lin, x)
        torch._dynamo.reset()
        with eager_casts(False):
            off = _eager_casts_seen(lin, x)
    assert reads == [] and on == [True] and off == [False] and enabled()
    with pytest.raises(TypeError, match="set_eager_casts takes a bool"):
        set_eager_casts("0")


def test_the_environment_is_read_at_import_and_when_the_backend_is_made(tmp_path):
    """A fresh interpreter: ``QUADS_EAGER_CASTS`` and ``QUADS_WEIGHT_CACHE_MB`` at import, the humming
    backend's settings when it is made (the registered one: on first use); later changes reach neither."""
    code = ("import os, quads\n"
            "from quads.ops import compile_alignment, get_backend, weight_cache\n"
            "h = get_backend('humming')\n"
            "os.environ.update(QUADS_EAGER_CASTS='1', QUADS_WEIGHT_CACHE_MB='9', QUADS_HUMMING_TUNED='1')\n"
            "h2 = get_backend('humming')\n"
            "print(compile_alignment.enabled(), weight_cache.weight_cache_info()['budget_bytes'] >> 20, "
            "h.tuned, h.mode, h.residual_layout, h.stack_siblings, h2 is h)\n")
    env = {**os.environ, "QUADS_EAGER_CASTS": "0", "QUADS_WEIGHT_CACHE_MB": "3", "QUADS_HUMMING_TUNED": "0",
           "QUADS_HUMMING_MODE": "no_stream_k", "QUADS_HUMMING_RESIDUAL": "summed",
           "QUADS_HUMMING_STACK_SIBLINGS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(quads.__file__))).stdout.split()
    assert out == ["False", "3", "off", "no_stream_k", "summed", "False", "True"]
