#!/usr/bin/env bash
# The GPU suite: everything the CPU suite cannot run, on one CUDA machine (made for the H200
# image: torch 2.11, Triton 3.6, transformers 5.17; TRL and the rest come as wheels, see
# scripts/fetch_gpu_wheels.sh).
#
#   bash scripts/gpu_suite.sh [SECTION ...]      # default: tests checks examples
#
# Sections:
#   tests     pytest -m gpu tests/gpu (the GPU checks' own test file excepted: `checks` runs them)
#   checks    python -m benchmarks.gpu_checks (the kernels at real shapes, bit-exact / bounded)
#   examples  the main example (examples/trl_grpo_quads.py, TRL through QuadsGRPOTrainer) on CUDA for
#             every preset of POLICY_PRESETS (and quads with --kernel fast, quads-experts with routing
#             replay) x {embedded MoE, SmolLM2-135M,
#             the MoE upcycled from it},
#             STEPS (default 3) steps each, one model's presets side by side, at most EXAMPLE_JOBS
#             (default 6) at once (the upcycled MoE's runs take about 13 GiB each: 11 at once overflow
#             an H200); a run passes when it
#             finishes; the decoder says in one line why it did not capture a model, if it did not
#             (EXAMPLE_MODELS="embedded smollm2 moe" by default: a subset runs part of it; EXAMPLE_ARGS
#             are added to every run's command line)
#   rl-step   python -m benchmarks.rl.rl_step $RL_STEP_ARGS (the whole RL step: BF16 vs QUADS exact vs fast)
#
# The real model is built once both wheel parts have been carried (scripts/gpu_env.sh); until then
# the examples on it are reported as skipped, with the reason. Every output goes under $OUT
# (default runs/gpu_suite): gpu_suite_summary.txt (one line per test file, check run and example
# run) and gpu_suite.tar.gz (every log, checks.json, each example's summary.json / metrics.csv);
# caches stay in /tmp. QUADS_COMMIT names the commit in the summary (a device that receives a
# copy of the working tree may hold older git metadata than the files it runs). Exit status: 0
# when every section passed. DEVICE=cpu runs the examples on the CPU instead (a dry run of this script on a machine without a GPU; the other sections skip).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
OUT=${OUT:-runs/gpu_suite}
STEPS=${STEPS:-3}
DEVICE=${DEVICE:-cuda}
SECTIONS=${*:-tests checks examples}
W=/tmp/gpu_suite
mkdir -p "$OUT" "$W"
SUMMARY="$OUT/gpu_suite_summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
failed=0
say "gpu suite: sections [$SECTIONS], $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), commit ${QUADS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
$PY -c "import torch, triton, transformers, trl; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" 2>&1 | tee -a "$SUMMARY"

run_tests() {
  local t0=$SECONDS
  $PY -m pytest -q -m gpu tests/gpu --ignore=tests/gpu/test_gpu_checks.py -p no:cacheprovider > "$W/tests.log" 2>&1
  local rc=$?
  say "tests: $( [ $rc = 0 ] && echo PASS || echo FAIL) ($(tail -n 1 "$W/tests.log")) [$((SECONDS - t0)) s]"
  [ $rc = 0 ] || failed=1
}

run_checks() {
  local t0=$SECONDS
  $PY -m benchmarks.gpu_checks --out "$W/checks" > "$W/checks.log" 2>&1
  local rc=$?
  say "checks: $( [ $rc = 0 ] && echo PASS || echo FAIL) ($(grep '^CHECKS:' "$W/checks.log" | tail -n 1)) [$((SECONDS - t0)) s]"
  grep '^\[FAIL\]' "$W/checks.log" | head -n 20 | tee -a "$SUMMARY"
  [ $rc = 0 ] || failed=1
}

example_report() {  # one line per finished example run, from its summary.json
  $PY - "$@" <<'PY'
import json, sys
name, code, path = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    s = json.load(open(path))
except (OSError, ValueError):
    print(f"example {name}: FAIL (exit {code}, no summary.json)"); raise SystemExit
d = s.get("rollout_decode") or {}
how = (f"eager decode: {d['capture_blocker']}" if d.get("capture_blocker") else
       f"graphed, {d.get('captures', 0)} capture(s)" if d.get("decoder") == "graphed" else
       "generate" + (f" ({d['fallback_reason']})" if d.get("fallback_reason") else ""))
ok = code == "0" and s.get("complete")
print(f"example {name}: {'PASS' if ok else 'FAIL'} (exit {code}, {s.get('status')}, {s.get('steps')} steps, "
      f"reward {s.get('reward_first_steps', float('nan')):.3f} -> {s.get('reward_last_steps', float('nan')):.3f}, "
      f"gap mean {s.get('logp_gap_mean', float('nan')):.4f}, step {s.get('step_s_mean', float('nan')):.2f} s; {how})"
      + (f" error: {s['error'][:300]}" if s.get("error") else ""))
PY
}

run_examples() {
  local presets models model dir
  presets="$($PY -c "from quads.policies import POLICY_PRESETS; print(' '.join(POLICY_PRESETS))") quads-fast quads-experts+r3"
  local real; real=$(quads_real_model_status)
  [ "$real" = built ] && say "real model: built (SmolLM2-135M-Instruct and its upcycled 8-expert MoE in $QUADS_CACHE)"
  models=""
  for model in ${EXAMPLE_MODELS:-embedded smollm2 moe}; do
    if [ "$model" != embedded ] && [ "$real" != built ]; then
      say "examples on $model: SKIP (the real model is $real)"
    else
      models="$models $model"
    fi
  done
  for model in $models; do
    case $model in
      embedded) dir="" ;;
      smollm2) dir=$($PY -c "from quads.models import find_smollm2; print(find_smollm2())") ;;
      moe) dir=$($PY -c "from quads.models.upcycle import moe_dir; print(moe_dir())") ;;
    esac
    local t0=$SECONDS pids=() names=()
    for preset in $presets; do
      local name="$model-$preset" run="$W/examples/$model-$preset"
      mkdir -p "$W/examples"
      local how="--policy $preset"
      [ "$preset" = quads-fast ] && how="--policy quads --kernel fast"
      [ "$preset" = quads-experts+r3 ] && how="--policy quads-experts --routing-replay"
      while [ "$(jobs -rp | wc -l)" -ge "${EXAMPLE_JOBS:-6}" ]; do wait -n; done
      # shellcheck disable=SC2086
      $PY examples/trl_grpo_quads.py --device "$DEVICE" $how ${dir:+--model "$dir"} --max-steps "$STEPS" \
        --eval-n 8 --threads 1 --output-dir "$run" --overwrite ${EXAMPLE_ARGS:-} > "$W/examples/$name.log" 2>&1 &
      pids+=($!); names+=("$name")
    done
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}"; local rc=$?
      local na; na=$(grep -oE "error: --(policy [^:]*: preset|routing-replay:) .*" "$W/examples/${names[$i]}.log" | head -n 1)
      if [ "$rc" != 0 ] && [ -n "$na" ]; then  # a plan that cannot apply to this model, refused up front
        say "example ${names[$i]}: N/A (${na#error: })"; continue
      fi
      example_report "${names[$i]}" "$rc" "$W/examples/${names[$i]}/summary.json" | tee -a "$SUMMARY"
      [ $rc = 0 ] || { failed=1; tail -n 5 "$W/examples/${names[$i]}.log" | sed 's/^/    /' | tee -a "$SUMMARY"; }
    done
    say "examples on $model: $((SECONDS - t0)) s"
  done
}

run_rl_step() {
  local t0=$SECONDS
  # shellcheck disable=SC2086
  $PY -m benchmarks.rl.rl_step --out "$W/rl_step" ${RL_STEP_ARGS:-} > "$W/rl_step.log" 2>&1
  local rc=$?
  say "rl-step: $( [ $rc = 0 ] && echo done || echo FAIL) [$((SECONDS - t0)) s]"
  grep '^|' "$W/rl_step.log" | tee -a "$SUMMARY"
  cp results/kernels.csv "$W/kernels_rows.csv" 2>/dev/null
  [ $rc = 0 ] || { failed=1; tail -n 5 "$W/rl_step.log" | tee -a "$SUMMARY"; }
}

for section in $SECTIONS; do
  case $section in
    tests) run_tests ;;
    checks) run_checks ;;
    examples) run_examples ;;
    rl-step) run_rl_step ;;
    *) say "unknown section $section (tests checks examples rl-step)"; failed=1 ;;
  esac
done
tar czf "$OUT/gpu_suite.tar.gz" --exclude='*/trainer' -C /tmp gpu_suite
say "gpu suite: $( [ $failed = 0 ] && echo PASS || echo FAIL)"
exit $failed
