"""vLLM integration tests (marker ``vllm``): run in the vLLM venv, see docs/vllm.md.

Skipped cleanly where vLLM is not importable (each module calls ``pytest.importorskip``).
The engine runs in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a 1 GiB KV cache.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (run in the vLLM venv: scripts/install_vllm_cpu.sh)")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(kind, seed=0)`` -> directory of a saved tiny model (cached per session)."""
    from _support import build, save

    cache: dict = {}

    def make(kind: str, seed: int = 0) -> Path:
        key = (kind, seed)
        if key not in cache:
            cache[key] = save(build(kind, seed), tmp_path_factory.mktemp(f"{kind}-{seed}"))
        return cache[key]

    return make
