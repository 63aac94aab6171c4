#!/usr/bin/env bash
# Create (or reuse) the project virtualenv .venv with quads and its test/TRL extras.
# Idempotent; safe to run before every command. CPU machines: torch==2.13.0 is the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import quads, trl, triton, torchao, pytest, xdist, gguf" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
fi
