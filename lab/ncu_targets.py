"""Kernel launches for an ncu profile (no timing): the default decode GEMM at 4096 x 4096, M = 1
(W4A4 + residual), and the grouped MoE gate_up of a Qwen3-30B-A3B-shaped layer at T = 1.

    ncu --set full -k regex:"_decode_gemm|_moe_" python -m lab.ncu_targets
"""

from __future__ import annotations


import torch


from quads.kernels.hopper.weight_layout import to_hopper_layout  # noqa: E402
from quads.kernels.hopper.moe_grouped_gemm import moe_w4a4_gemm  # noqa: E402
from quads.kernels.hopper.w4a4_decode import decode_gemm  # noqa: E402
from quads.ops.activation_quant import ActivationQuant, activation_operands_triton  # noqa: E402
from quads.tensor.nvfp4_math import nvfp4_quantize  # noqa: E402


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    act = ActivationQuant(residual_fraction=1.0)
    w = nvfp4_quantize((torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).bfloat16())
    hw = to_hopper_layout(w.qdata, w.scale)
    ops = activation_operands_triton(torch.randn(1, 4096, device="cuda", generator=g).bfloat16(), act)
    E, top, H, I = 128, 8, 2048, 768
    we = nvfp4_quantize((torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16())
    hwe = to_hopper_layout(we.qdata, we.scale)
    idx = torch.randn(1, E, device="cuda", generator=g).topk(top, dim=-1).indices.reshape(-1)
    order = torch.argsort(idx, stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(torch.bincount(idx, minlength=E), 0)
    rows = (order // top).to(torch.int32)
    opm = activation_operands_triton(torch.randn(1, H, device="cuda", generator=g).bfloat16(), act)
    for _ in range(3):  # the last launch of each is profiled (-c / --launch-skip as needed)
        decode_gemm(ops.stacked, ops.main_scale, hw, w.global_encode_scale, 1, True, None, torch.bfloat16)
        moe_w4a4_gemm(opm.stacked, opm.main_scale, rows, offsets, hwe, we.global_encode_scale, top, 1, True,
                      torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
