#!/usr/bin/env bash
# Session 5's last device call (one H200, ~6 min), from the repository root: OUT=$OUT bash benchmarks/results/h200_2026-12-02_s5/final_call.sh
# 1. trainer after the host-glue cut and the once-per-parent group scale: dense profile (GPU idle), step table
# 2. humming: Stream-K vs no-Stream-K timings (W4A16's bf16 Stream-K fix-ups broke its bound), linear + MoE
set -u
source benchmarks/results/h200_2026-12-02_s5/setup.sh
mkdir -p $OUT
timeout 130 python -m benchmarks.bench_trainer --out $OUT/trainer_profile.json --models dense --layers dense=36 --accum 1 \
    --iters 2 --warmup 1 --variants bf16,quads-tensor,quads --profile > $OUT/trainer_profile.log 2>&1; echo "profile rc=$?"
grep -E '"profile": true' $OUT/trainer_profile.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['kind'], r['variant'], r['step_ms'], 'idle', r['gpu_idle_ms'], r['by_category_ms'])"
timeout 150 python -m benchmarks.bench_trainer --out $OUT/trainer.json --models dense,moe --layers moe=8,dense=36 \
    --iters 5 --warmup 1 --variants bf16,bf16-cast,quads,quads-tensor > $OUT/trainer.log 2>&1; echo "trainer rc=$?"
grep -E "^\| (dense|moe)" $OUT/trainer.log
timeout 100 python -m benchmarks.bench_humming --out $OUT/modes_lin --sections linear --shapes 4096:4096,4096:14336 \
    --ms 1,16,64,256 --modes default,no_stream_k --check-modes "" --budget-s 90 --linear-budget-s 90 > $OUT/modes_lin.log 2>&1
echo "modes linear rc=$?"; grep -E "^time|FAIL" $OUT/modes_lin.log | cut -c1-600
timeout 110 python -m benchmarks.bench_humming --out $OUT/modes_moe --sections moe --moe-ts 1,16,64 --modes default,no_stream_k \
    --budget-s 100 > $OUT/modes_moe.log 2>&1; echo "modes moe rc=$?"; grep -E "^moe E=|FAIL" $OUT/modes_moe.log | cut -c1-700
cp benchmarks/results/kernels.csv $OUT/kernels_rows.csv 2>/dev/null; echo "kernels.csv rows: $(wc -l < $OUT/kernels_rows.csv 2>/dev/null)"
