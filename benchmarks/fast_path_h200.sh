#!/usr/bin/env bash
# The fast path's measurements on one H200 as one background batch that outlives the 10-minute
# command limit: named steps run one after another (never two timed ones at once), each under its
# own time limit, state and caches in /tmp/fast_path (kept while the machine is warm).
#
#   bash benchmarks/fast_path_h200.sh start "STEP ..."   # launch in a new session, return at once
#   bash benchmarks/fast_path_h200.sh watch SECONDS      # progress until done or SECONDS; logs to $OUT
#
# Steps (in the order given):
#   checks       gpu_checks of the compiled and humming paths (compiled, humming_compiled, fused,
#                humming_padded, humming_siblings, humming) beside pytest tests/gpu/test_fast_kernel_gpu.py
#   rechecks     gpu_checks compiled, humming_padded and humming alone (a longer limit) beside the
#                fast-kernel GPU test
#   siblings     gpu_checks of the sibling and humming-layer paths (fused, graphed_sync, humming_siblings,
#                humming_compiled, and compiled: a fused Qwen3-MoE rollout, its sets' parent hooks traced,
#                under torch.compile) beside the GPU suite's examples on the embedded MoE, then quads' Python
#                calls per eager decode step on the GPU (bench_decode_host --count-calls), this tree and .before/
#   suite        the GPU suite's tests and checks (scripts/gpu_suite.sh tests checks), outputs in /tmp/fast_path/suite
#   host         host time of one eager decode step of the embedded MoE on the GPU
#                (benchmarks.ops.bench_decode_host --device cuda), this tree and, when carried, the
#                tree in .before/ (the same script over an older quads), one after the other
#   moe2880      rl_step --models moe-2880: bf16@bf16 vs the fast MoE plans, a fresh humming cache
#   dense_cold   rl_step --models dense: bf16@bf16 vs w4a16-fast / quads-fast, humming's own
#                configurations (QUADS_HUMMING_TUNED=0), a fresh humming cache (the cold first step)
#   dense_unstacked  bf16@bf16 vs w4a16-fast with QUADS_HUMMING_STACK_SIBLINGS=0 (each sibling its own
#                GEMM), the dense_cold cache (what the stacked sibling sets buy)
#   tune         benchmarks.ops.tune_humming on the dense model's shapes at M = 64 (bf16 and fp16),
#                the table written to /tmp/fast_path/tune/nvidia-h200.json (the dense steps' cache)
#   dense_tuned  the dense_cold variants again with that table (QUADS_HUMMING_TUNED=<it>), the
#                humming cache of the steps before (the warm first step)
#   colocated    benchmarks.rl.colocated_memory --layers 48 --settings fsdp (Qwen3-30B-A3B's widths
#                and depth, one GPU of an 8-way FSDP2 job)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
W=/tmp/fast_path
mkdir -p "$W"
cmd=${1:-watch}
shift || true

step() {  # name, seconds, command...: one step under its limit, its log in $W/<name>.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "[$(date +%T)] $name: start" >> "$W/driver.log"
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name: exit $rc$( [ $rc = 124 ] && echo " (cut at $limit s)") [$((SECONDS - t0)) s]" >> "$W/driver.log"
}

run_step() {
  case $1 in
    checks)
      $PY -m pytest -q -m gpu tests/gpu/test_fast_kernel_gpu.py -p no:cacheprovider > "$W/gpu_tests.log" 2>&1 &
      step checks 420 $PY -m benchmarks.gpu_checks --out "$W/checks" \
        --only compiled,humming_compiled,fused,humming_padded,humming_siblings,humming
      wait; echo "[$(date +%T)] gpu_tests: $(tail -n 1 "$W/gpu_tests.log")" >> "$W/driver.log" ;;
    rechecks)
      $PY -m pytest -q -m gpu tests/gpu/test_fast_kernel_gpu.py -p no:cacheprovider > "$W/gpu_tests.log" 2>&1 &
      step rechecks 560 $PY -m benchmarks.gpu_checks --out "$W/rechecks" --only compiled,humming_padded,humming
      wait; echo "[$(date +%T)] gpu_tests: $(tail -n 1 "$W/gpu_tests.log")" >> "$W/driver.log" ;;
    siblings)
      $PY -m benchmarks.gpu_checks --out "$W/sibling_checks" --only fused,graphed_sync,humming_siblings,humming_compiled,compiled \
        > "$W/sibling_checks.log" 2>&1 &
      EXAMPLE_MODELS=embedded OUT=$W/examples step examples 520 bash scripts/gpu_suite.sh examples
      wait; echo "[$(date +%T)] sibling_checks: $(grep '^CHECKS:' "$W/sibling_checks.log" | tail -n 1)" >> "$W/driver.log"
      step calls_after 120 $PY -m benchmarks.ops.bench_decode_host --device cuda --steps 48 --count-calls
      [ -d .before/quads ] && step calls_before 120 bash -c "cd .before && $PY -m benchmarks.ops.bench_decode_host --device cuda --steps 48 --count-calls" ;;
    suite)
      OUT=$W/suite step suite 1700 bash scripts/gpu_suite.sh tests checks
      echo "[$(date +%T)] suite: $(grep -E '^(tests|checks):' "$W/suite/gpu_suite_summary.txt" | tr '\n' ' ')" >> "$W/driver.log" ;;
    host)
      for i in 1; do
        step "host_after_$i" 120 $PY -m benchmarks.ops.bench_decode_host --device cuda --steps 300
        [ -d .before/quads ] && step "host_before_$i" 120 bash -c "cd .before && $PY -m benchmarks.ops.bench_decode_host --device cuda --steps 300"
      done ;;
    moe2880)
      HUMMING_CACHE_DIR=$W/humming_cold_moe2880 step moe2880 330 $PY -m benchmarks.rl.rl_step --out "$W/moe2880" \
        --models moe-2880 --variants bf16@bf16,quads-experts-fast@bf16,w4a16-experts-fast@bf16 ;;
    dense_cold)
      QUADS_HUMMING_TUNED=0 HUMMING_CACHE_DIR=$W/humming_cold_dense step dense_cold 330 $PY -m benchmarks.rl.rl_step \
        --out "$W/dense_cold" --models dense --variants bf16@bf16,w4a16-fast@bf16,quads-fast@bf16 ;;
    dense_unstacked)
      QUADS_HUMMING_STACK_SIBLINGS=0 QUADS_HUMMING_TUNED=0 HUMMING_CACHE_DIR=$W/humming_cold_dense step dense_unstacked 240 \
        $PY -m benchmarks.rl.rl_step --out "$W/dense_unstacked" --models dense --variants bf16@bf16,w4a16-fast@bf16 ;;
    tune)
      HUMMING_CACHE_DIR=$W/humming_cold_dense step tune 280 $PY -m benchmarks.ops.tune_humming --out "$W/tune" --write-table "$W/tune/nvidia-h200.json" \
        --dtypes bf16,fp16 --ms 64 --max-candidates 14 --budget-s 200 ;;
    dense_tuned)
      if [ -f "$W/tune/nvidia-h200.json" ]; then
        QUADS_HUMMING_TUNED=$W/tune/nvidia-h200.json HUMMING_CACHE_DIR=$W/humming_cold_dense step dense_tuned 300 \
          $PY -m benchmarks.rl.rl_step --out "$W/dense_tuned" --models dense --variants bf16@bf16,w4a16-fast@bf16,quads-fast@bf16
      else
        echo "[$(date +%T)] dense_tuned: skipped (no tuned table)" >> "$W/driver.log"
      fi ;;
    colocated)
      step colocated 400 $PY -m benchmarks.rl.colocated_memory --out "$W/colocated" --layers 48 --settings fsdp \
        --variants bf16,quads-experts,quads-experts-fast,w4a16-experts-fast --budget-s 320 ;;
    *) echo "[$(date +%T)] unknown step $1" >> "$W/driver.log" ;;
  esac
}

collect() {  # what exists so far, into $OUT
  [ -n "${OUT:-}" ] || return 0
  cp "$W"/*.log "$OUT/" 2>/dev/null
  tar czf "$OUT/fast_path.tar.gz" -C "$W" --exclude='humming_*' --exclude='*.cubin' . 2>/dev/null
}

case "$cmd" in
  start)
    [ -f "$W/driver.pid" ] && kill -0 "$(cat "$W/driver.pid")" 2>/dev/null && { echo "a batch is running"; exit 1; }
    : > "$W/driver.log"
    echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); steps: $1" >> "$W/driver.log"
    setsid nohup bash "$0" _run "$1" > "$W/driver.out" 2>&1 < /dev/null &
    echo $! > "$W/driver.pid"; sleep 2; cat "$W/driver.log" ;;
  _run)
    for s in $1; do run_step "$s"; done
    echo "[$(date +%T)] done" >> "$W/driver.log" ;;
  watch)
    LIMIT=${1:-540}; t0=$SECONDS
    while ! grep -q "] done$" "$W/driver.log" 2>/dev/null && [ $((SECONDS - t0)) -lt "$LIMIT" ]; do sleep 10; done
    cat "$W/driver.log"; collect ;;
  *) echo "usage: $0 start \"STEP ...\" | watch SECONDS"; exit 2 ;;
esac
