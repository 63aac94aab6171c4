#!/usr/bin/env bash
# The MoE GRPO ablation on one H200 through the product, as one background batch that outlives
# the 10-minute command limit (the runs need no checkpoint: a 0.7B MoE's masters and AdamW state
# are ~11 GB per run, too many for the machine's disk):
#
#   bash benchmarks/rl/moe_ablation_h200.sh start "RUNS" SEEDS STEPS STOP_S   # launch, return at once
#   bash benchmarks/rl/moe_ablation_h200.sh watch SECONDS                    # progress until done or SECONDS
#   bash benchmarks/rl/moe_ablation_h200.sh report                           # table, plots, tarball to $OUT
#
# e.g. start "bf16 bf16-fp32-experts naive quads quads-experts w4a16-experts w4a16 quads-experts+r3 w4a16-experts+r3" 0 150 1000
#
# RUNS: preset names of POLICY_PRESETS, a `+r3` suffix adds routing replay. Every run is
# `benchmarks.rl.real_grpo` (the main example, TRL through QuadsGRPOTrainer, the ablation's pinned
# settings) on the MoE upcycled from SmolLM2 (8 experts, top-2), side by side under CUDA MPS, in a
# new process session (setsid) so the next device call finds it still running; STOP_S ends each
# run's training after the first step past that many seconds (`--stop-after-s`: no checkpoint, the
# held-out evaluation still runs). State lives in /tmp/moe_ablation (kept while the machine is warm).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu_env.sh
W=/tmp/moe_ablation
OUTDIR=$W/runs
mkdir -p "$OUTDIR"
cmd=${1:-watch}
shift || true

active() { pgrep -f "benchmarks.rl.real_grpo --out $OUTDIR" >/dev/null; }

progress() {
  for log in "$OUTDIR"/*.log; do
    [ -f "$log" ] || continue
    printf '%-24s %s\n' "$(basename "$log" .log)" "$(grep -E '^(step|held-out|stopped|Traceback|.*Error)' "$log" | tail -n 1 | cut -c1-150)"
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
}

case "$cmd" in
  start)
    RUNS=$1; SEEDS=${2:-0}; STEPS=${3:-150}; STOP=${4:-1000}
    real=$(quads_real_model_status) || { echo "real model $real"; exit 1; }
    MODEL=$($PY -c "from quads.models.upcycle import moe_dir; print(moe_dir())")
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d || echo "MPS: could not start"
    if ! timeout 120 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
      echo "MPS: a CUDA client failed under MPS; running time-sliced"; echo quit | nvidia-cuda-mps-control; sleep 2
    fi
    # shellcheck disable=SC2086
    setsid nohup $PY -m benchmarks.rl.real_grpo --out "$OUTDIR" --presets "${RUNS// /,}" --seeds $SEEDS \
      --steps "$STEPS" --model "$MODEL" --device cuda -- --stop-after-s "$STOP" > "$W/launcher.log" 2>&1 < /dev/null &
    sleep 5; cat "$W/launcher.log"; echo "started: $RUNS (seeds $SEEDS, $STEPS steps, stop after $STOP s) on $MODEL"
    ;;
  watch)
    LIMIT=${1:-540}; t0=$SECONDS
    while active && [ $((SECONDS - t0)) -lt "$LIMIT" ]; do sleep 30; done
    progress; active && echo "still running after $((SECONDS - t0)) s" || { echo "all runs ended"; cat "$W/launcher.log"; }
    ;;
  report)
    $PY -m benchmarks.rl.real_grpo_report "$OUTDIR" --out "$W/img" --prefix moe_grpo > "$W/report.txt" 2>&1
    cat "$W/report.txt"
    if [ -n "${OUT:-}" ]; then
      cp "$W/report.txt" "$OUT/moe_grpo_report.txt"; cp "$W"/img/*.png "$OUT/" 2>/dev/null
      tar czf "$OUT/moe_grpo.tar.gz" -C "$W" --exclude='*/trainer' runs launcher.log
    fi
    ;;
  *) echo "usage: $0 start RUNS SEEDS STEPS STOP_S | watch SECONDS | report"; exit 2 ;;
esac
