#!/usr/bin/env bash
# Session 5, device call 6 (one H200, ~5.5 min), from the repository root:
#   OUT=$OUT bash results/h200_2026-12-02_trainer_humming/call6.sh
# 1. trainer after the host-glue cut (s5-host) and the once-per-parent group scale: the max|x| reduction natively,
#    a dense profile (GPU idle), the step table
# 0. the lean fake-quant variant natively (bits, per-shape time), the quads-lean step row
# 2. humming: Stream-K vs no-Stream-K timings (W4A16's bf16 Stream-K fix-ups broke its bound), linear + MoE
set -u
source results/h200_2026-12-02_trainer_humming/setup.sh
mkdir -p $OUT
timeout 90 python -m pytest -q tests/test_nvfp4_math.py tests/kernels/test_kernel_fake_quantize.py -k "max_abs or fake" 2>&1 | tail -2
timeout 40 python -m benchmarks.ops.bench_fake_quant --out $OUT/bench_fake_quant.json > $OUT/bench_fake_quant.log 2>&1; echo "fq rc=$?"
grep -E '"call": "(fwd|bwd|fwd-lean|bwd-lean)"' $OUT/bench_fake_quant.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l)
    if r['fused_tile'] == '8x16x4' and r['amax_tile'] == '8x512x4': print(r['model'], r['weight'], r['call'], r['gpu_us'], r['bit_exact'])"
timeout 110 python -m benchmarks.ops.bench_trainer --out $OUT/trainer_profile.json --models dense --layers dense=36 --accum 1 \
    --iters 2 --warmup 1 --variants bf16,quads --profile > $OUT/trainer_profile.log 2>&1; echo "profile rc=$?"
grep -E '"profile": true' $OUT/trainer_profile.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['kind'], r['variant'], r['step_ms'], 'busy', r['gpu_busy_ms'], 'idle', r['gpu_idle_ms'], r['by_category_ms'])"
timeout 150 python -m benchmarks.ops.bench_trainer --out $OUT/trainer.json --models dense,moe --layers moe=8,dense=36 \
    --iters 4 --warmup 1 --variants bf16,bf16-cast,quads,quads-tensor,quads-lean > $OUT/trainer.log 2>&1; echo "trainer rc=$?"
grep -E "^\| (dense|moe)" $OUT/trainer.log
grep -E '"step_ms_all"' $OUT/trainer.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['kind'], r['variant'], r['accum'], r['step_ms_all'])"
timeout 75 python -m benchmarks.ops.bench_humming --out $OUT/modes_lin --sections linear --shapes 4096:4096,4096:14336 \
    --ms 1,16,64,256 --modes default,no_stream_k --check-modes "" --budget-s 65 --linear-budget-s 65 > $OUT/modes_lin.log 2>&1
echo "modes linear rc=$?"; grep -E "^time|FAIL" $OUT/modes_lin.log | cut -c1-700
timeout 90 python -m benchmarks.ops.bench_humming --out $OUT/modes_moe --sections moe --moe-ts 1,16 --modes default,no_stream_k \
    --budget-s 80 > $OUT/modes_moe.log 2>&1; echo "modes moe rc=$?"; grep -E "^moe E=|FAIL" $OUT/modes_moe.log | cut -c1-800
cp results/kernels.csv $OUT/kernels_rows.csv 2>/dev/null; echo "kernels.csv rows: $(wc -l < $OUT/kernels_rows.csv 2>/dev/null)"
