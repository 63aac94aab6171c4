#!/usr/bin/env bash
# One H200 session: kernel checks, end-to-end rollout throughput, weight-sync cost.
#   RT_GLUE=new,old: the throughput run once per decoder glue setting (before/after, rollout_throughput.py --glue)
#   bash benchmarks/rl/engine_h200.sh   (on the device; results under $OUT)
set -u
export PYTHONPATH=.
OUT=${OUT:-results/engine_h200}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout ${RT_TIMEOUT:-320} python -m benchmarks.rl.rollout_throughput --out "$OUT" --budget-s ${RT_BUDGET:-260} --glue ${RT_GLUE:-new} > "$OUT/rollout_throughput.log" 2>&1; echo "rollout rc=$?" >> "$OUT/rc.txt"
for m in qwen3_moe llama; do
  timeout 60 python -m benchmarks.ops.bench_sync --model $m --out "$OUT/sync_$m" > "$OUT/sync_$m.log" 2>&1; echo "sync $m rc=$?" >> "$OUT/rc.txt"
done
timeout 100 python -m benchmarks.gpu_checks --out "$OUT" > "$OUT/checks.log" 2>&1; echo "gpu_checks rc=$?" >> "$OUT/rc.txt"
grep -c PASS "$OUT/checks.log"; grep FAIL "$OUT/checks.log" | head
cat "$OUT/rc.txt"
grep -v '"trace"' "$OUT/rollout_throughput.log" | tail -60
