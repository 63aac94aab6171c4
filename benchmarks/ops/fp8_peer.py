"""The FP8 W8A8 peer the benchmarks compare against (benchmark-only; not a quads path).

What an FP8 rollout engine runs per linear layer: a fused per-token E4M3 activation quantization
(one Triton kernel: row amax, scale = amax / 448, round to nearest even) and cuBLASLt's FP8 GEMM
with row-wise scales (``torch._scaled_mm``), weights pre-quantized per output channel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_rows_kernel(X, stride_xm, K, Q, S, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(Q + row * K + k, (x / scale).to(tl.float8e4nv), mask=k < K)
    tl.store(S + row, scale)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 (M, K), fp32 (M, 1) scales) in one launch."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _fp8_rows_kernel[(m,)](x, x.stride(0), k, q, s, BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return q, s


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel E4M3 weight (N, K) and its (1, N) scales."""
    amax = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.float().reshape(1, -1)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``y = x Wᵀ`` in W8A8: quantize x (one kernel), cuBLASLt FP8 GEMM with row-wise scales."""
    xq, xs = fp8_quantize_rows(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=True)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__ + "\nA helper module, nothing to run: imported by bench_kernels.py (its FP8 rows) and fp8_rollout.py, "
                            "which time it and append the rows to results/kernels.csv.",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
