#!/usr/bin/env bash
# Session 4 trainer run on one H200 (about 4 min wall), from the repository root:
#   OUT=$OUT bash benchmarks/h200_trainer_s4.sh
# 1. the step table (bf16 as shipped, bf16-cast = the BF16 trainer, quads, quads-keep), 8 MoE / 36 dense layers (Qwen3-4B depth)
# 2. the fake-quant pass per weight shape (GPU / wall / host time, per-kernel bandwidth, tile sweep)
# 3. ncu --set full on the dense gate/up and down passes (amax + fused kernels)
# 4. the fake-quant kernel's bit-exactness tests, natively on the GPU
set -u
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import quads, torch, triton; print(quads.__file__, torch.__version__, triton.__version__)"
timeout 120 $PY -m benchmarks.bench_trainer --out "$OUT/bench_trainer.json" --models dense,moe --layers moe=8,dense=36 \
    --iters 3 --warmup 1 --variants bf16,bf16-cast,quads,quads-keep 2>&1 | tee "$OUT/bench_trainer.log"
timeout 60 $PY -m benchmarks.bench_fake_quant --out "$OUT/bench_fake_quant.json" 2>&1 | tee "$OUT/bench_fake_quant.log"
timeout 45 ncu --clock-control none --set full -k regex:fake_quant -c 4 -f -o "$OUT/fq_dense" $PY -m benchmarks.bench_fake_quant --ncu \
    > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"
ncu -i "$OUT/fq_dense.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
grep -E "fake_quant|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Block Size|Grid Size|Waves Per SM" \
    "$OUT/ncu_details.txt" | head -80
timeout 40 $PY -m pytest -q -x tests/kernels/test_kernel_fake_quantize.py 2>&1 | tail -4 | tee "$OUT/pytest_fake_quant.log"
