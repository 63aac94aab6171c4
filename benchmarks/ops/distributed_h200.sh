#!/usr/bin/env bash
# FSDP2 + quads on 2 GPUs of one host (device tool kind nvidia-h200-x2), NCCL. No wheels needed
# (no trl: the TRL test is CPU-only and skips here). NVLink multicast stays off.
#   usage: bash benchmarks/ops/distributed_h200.sh        (writes logs and JSON into $OUT)
# 1. the bitwise checks of tests/distributed/test_fsdp.py on the GPUs (QUADS_DIST_DEVICE=cuda);
# 2. saved-for-backward bytes, plain FSDP2 vs quads QAT;
# 3. sync time per step, packed vs gather, Llama ~1.1B and Qwen3-MoE ~1.4B, plus one FSDP train step.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
QUADS_DIST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_fsdp.py 2>&1 | tee "$OUT/fsdp_checks.log" | tail -n 30
timeout 60 torchrun --nproc-per-node 2 -m benchmarks.studies.fsdp_saved_bytes --device cuda --out "$OUT" 2>&1 | tail -n 20
timeout 240 torchrun --nproc-per-node 2 -m benchmarks.ops.sharded_sync --device cuda --model llama-1b --model qwen3-moe-1b \
    --repeats 10 --train-step --out "$OUT" 2>&1 | tee "$OUT/sharded_sync.log" | grep -v '^{'
