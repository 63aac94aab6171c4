"""The H200 correctness checks (:mod:`benchmarks.gpu_checks`) as pytest tests, one per check.

Marked ``gpu`` and skipped without CUDA (the CPU suite runs the kernels at small shapes under the
Triton interpreter instead): ``python -m pytest -m gpu tests/gpu``. The runner
``python -m benchmarks.gpu_checks --out DIR`` runs the same functions and writes checks.json.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU checks need a CUDA GPU (sm_90)")]

NAMES = ("act_quant", "weights", "layout", "gemm", "w4a16", "moe", "fused", "humming", "humming_compiled", "compiled",
         "humming_padded", "humming_siblings", "four_over_six", "moe_routing", "graphed_sync",
         "graphed_routing", "save_load")


@pytest.mark.parametrize("name", NAMES)
def test_gpu_check(name):
    from benchmarks import gpu_checks

    assert set(gpu_checks.CHECKS) == set(NAMES)  # a new check gets its test
    gpu_checks.RESULTS.clear()
    gpu_checks.CHECKS[name]()
    skipped = [r["detail"] for r in gpu_checks.RESULTS.values() if r.get("skipped")]
    if skipped:
        pytest.skip(skipped[0])
    failed = {k: r["detail"] for k, r in gpu_checks.RESULTS.items() if not r["ok"]}
    assert gpu_checks.RESULTS and not failed, failed
