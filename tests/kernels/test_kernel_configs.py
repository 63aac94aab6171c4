"""The interpreter's kernel configs are the GPU defaults on smaller tiles.

The CPU suite runs the kernels under ``TRITON_INTERPRET=1`` with whatever the ``pick_*`` functions
return there; these tests pin that those are the configs the GPU gets for the same shape, up to
tile sizes, warps and stages (and the PTX-only features the interpreter cannot run: inline-PTX
decode, programmatic dependent launch), so the CPU suite runs the branches the GPU runs.
"""

import pytest

pytest.importorskip("triton")

from quads.kernels.hopper import moe_grouped_gemm, w4a4_decode, w4a4_gemm  # noqa: E402


def _both(monkeypatch, module, pick, *args):
    """(GPU config, interpreter config) of ``module.pick(*args)``."""
    monkeypatch.setattr(module, "interpreting", lambda: False)
    gpu = getattr(module, pick)(*args)
    monkeypatch.setattr(module, "interpreting", lambda: True)
    return gpu, getattr(module, pick)(*args)


@pytest.mark.parametrize("m,residual", [(65, True), (300, False), (4096, True)])
def test_prefill_interpreter_config_is_the_gpu_config(monkeypatch, m, residual):
    gpu, cpu = _both(monkeypatch, w4a4_gemm, "pick_config", m, 4096, 4096, residual)
    assert (cpu.loads, cpu.group) == (gpu.loads, gpu.group) == ("tma", 8)
    assert cpu.bk == gpu.bk and cpu.bn <= gpu.bn and cpu.bm <= gpu.bm


@pytest.mark.parametrize("columns,n", [(2, 4096), (16, 4096), (24, 4096), (40, 16384), (64, 4096), (128, 4096)])
def test_decode_interpreter_config_is_the_gpu_config(monkeypatch, columns, n):
    gpu, cpu = _both(monkeypatch, w4a4_decode, "pick_decode_config", columns, n, 4096)
    same = ("bn", "kbi", "num_warps", "num_stages", "prefetch", "reduce_kernel")
    assert {a: getattr(cpu, a) for a in same} == {a: getattr(gpu, a) for a in same}
    assert gpu.use_asm and not cpu.use_asm  # the portable decode: same bits (tests/kernels/test_kernel_layout)
    assert not cpu.pdl  # no grid dependency control in the interpreter


@pytest.mark.parametrize("rows,experts,k", [(8, 8, 4096), (64, 8, 768), (512, 8, 4096), (16, 128, 14336)])
def test_moe_interpreter_config_is_the_gpu_config(monkeypatch, rows, experts, k):
    gpu, cpu = _both(monkeypatch, moe_grouped_gemm, "pick_moe_config", rows, experts, 4096, k)
    same = ("bn", "bm", "kbi", "num_warps", "num_stages", "split")
    assert {a: getattr(cpu, a) for a in same} == {a: getattr(gpu, a) for a in same}
    assert gpu.use_asm and not cpu.use_asm
