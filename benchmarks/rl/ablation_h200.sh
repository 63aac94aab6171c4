#!/usr/bin/env bash
# The ablation on one H200 (device tool): carried wheels (trl, datasets, transformers 5.19)
# into a private site dir, 5 policies in parallel on the one GPU, results tarred into $OUT.
#   carry: .wheels      usage: bash benchmarks/rl/ablation_h200.sh STEPS [extra example args]
set -euo pipefail
STEPS=${1:-200}; shift || true
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-deps --target /tmp/pylib .wheels/*.whl
export PYTHONPATH=/tmp/pylib:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers, trl; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -m benchmarks.rl.ablation --steps "$STEPS" --out runs/ablation --parallel 5 --device cuda --threads 2 -- "$@" || true
for p in bf16 naive sym-qat w4a16-qat quads; do tail -n 12 runs/ablation/$p.log || true; done
tar czf "$OUT/ablation.tar.gz" --exclude='*/trainer' runs/ablation
cp runs/ablation/ablation.md "$OUT/" 2>/dev/null || true
