#!/usr/bin/env bash
# Trainer run on one H200 (about 6 min wall), from the repository root:
#   OUT=$OUT bash benchmarks/ops/trainer_h200.sh            # STOP_MPS=1: quit an MPS daemon before ncu
# 1. the step table (bf16 as shipped, bf16-cast = the BF16 trainer, quads, quads-keep, quads-tgrad = the old
#    transposed expert weight gradient), 8 MoE / 36 dense layers (Qwen3-4B depth)
# 2. one profiled MoE step per variant (bf16-cast, quads, quads-tgrad): device time by kernel category, GPU idle time
# 3. the fake-quant pass per weight shape (GPU / wall / host / glue-host time, per-kernel bandwidth, tile sweep)
# 4. ncu --set full on the dense gate/up and down passes (amax + fused kernels)
# 5. the fake-quant kernel's bit-exactness tests, natively on the GPU
# MPS may be enabled on the machine (another job's daemon): ncu then refuses
# ("Profiling is not supported with MPS enabled"). The script profiles as an MPS client
# (ncu --mps client) when a daemon runs, and quits the daemon only with STOP_MPS=1 (it may not
# be this job's: quitting it ends other jobs' GPU contexts).
set -u
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import quads, torch, triton; print(quads.__file__, torch.__version__, triton.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,compute_mode --format=csv | tee -a "$OUT/versions.txt"
timeout 170 $PY -m benchmarks.ops.bench_trainer --out "$OUT/bench_trainer.json" --models dense,moe --layers moe=8,dense=36 \
    --iters 3 --warmup 1 --variants bf16,bf16-cast,quads,quads-tensor,quads-keep,quads-tgrad 2>&1 | tee "$OUT/bench_trainer.log"
timeout 120 $PY -m benchmarks.ops.bench_trainer --out "$OUT/bench_trainer_profile.json" --models moe --layers moe=8 --accum 1 \
    --iters 2 --warmup 1 --variants bf16-cast,quads,quads-tgrad --profile > "$OUT/bench_trainer_profile.log" 2>&1
grep -E '"profile": true' "$OUT/bench_trainer_profile.log" | cut -c1-700
timeout 75 $PY -m benchmarks.ops.bench_fake_quant --out "$OUT/bench_fake_quant.json" 2>&1 | tee "$OUT/bench_fake_quant.log"
NCU_MPS=()
if pgrep -f nvidia-cuda-mps-control >/dev/null 2>&1 || pgrep -f nvidia-cuda-mps-server >/dev/null 2>&1; then
    if [ "${STOP_MPS:-0}" = 1 ]; then
        echo "MPS daemon running: quitting it (STOP_MPS=1)"; echo quit | nvidia-cuda-mps-control; sleep 2
    else
        echo "MPS daemon running: ncu --mps client"; NCU_MPS=(--mps client)
    fi
fi
timeout 45 ncu ${NCU_MPS[@]+"${NCU_MPS[@]}"} --clock-control none --set full -k regex:fake_quant -c 4 -f -o "$OUT/fq_dense" \
    $PY -m benchmarks.ops.bench_fake_quant --ncu > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"
tail -3 "$OUT/ncu.log"
ncu -i "$OUT/fq_dense.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
grep -E "fake_quant|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Block Size|Grid Size|Waves Per SM" \
    "$OUT/ncu_details.txt" | head -80
timeout 40 $PY -m pytest -q -x tests/kernels/test_kernel_fake_quantize.py 2>&1 | tail -4 | tee "$OUT/pytest_fake_quant.log"
