"""An FP8 W8A8 rollout model: the engine-level FP8 peer of ``rollout_throughput.py`` (benchmark-only).

What an FP8 rollout engine (vLLM's ``fp8`` with dynamic per-token activations, verl/NeMo-RL's
on-the-fly FP8) runs: weights E4M3 per output channel, activations E4M3 per token by one fused
Triton kernel (``fp8_peer.fp8_quantize_rows``), GEMMs in cuBLASLt FP8 with row-wise scales
(``torch._scaled_mm``) and, for fused MoE experts, the grouped FP8 GEMM
``torch._scaled_grouped_mm`` (2-D activations x 3-D weights with per-expert row offsets; no
host sync, CUDA-graph capturable). Off CUDA (the ``--tiny`` CPU smoke test) experts loop over
``torch._scaled_mm``. ``lm_head`` and embeddings stay BF16, as in the quads variants.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from benchmarks.ops.fp8_peer import fp8_linear, fp8_quantize_rows, fp8_weight


class FP8Linear(nn.Module):
    """``nn.Linear`` in W8A8 (weights quantized once, activations per call)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        wq, ws = fp8_weight(linear.weight.detach())
        self.register_buffer("wq", wq)
        self.register_buffer("ws", ws)
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.is_contiguous() else x2.contiguous()
        y = fp8_linear(x2, self.wq, self.ws)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _fp8_experts_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) -> E4M3 (E, N, K) and (E, N) per-output-channel scales."""
    amax = w.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1).float()


class FP8Experts(nn.Module):
    """A transformers fused experts module (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)) in W8A8."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.act_fn = experts.act_fn  # SiLU-gated experts (Qwen3-MoE, Mixtral); the BF16 weights are dropped
        gq, gs = _fp8_experts_weight(experts.gate_up_proj.detach())
        dq, ds = _fp8_experts_weight(experts.down_proj.detach())
        for name, t in (("gq", gq), ("gs", gs), ("dq", dq), ("ds", ds)):
            self.register_buffer(name, t)
        self.num_experts = gq.shape[0]

    def _grouped(self, xq, xs, wq, ws, offsets, counts):
        if xq.device.type == "cuda":
            return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs.reshape(-1), ws, offs=offsets,
                                            out_dtype=torch.bfloat16, use_fast_accum=True)
        out, start = [], 0  # CPU smoke test only: a host loop
        for e, n in enumerate(counts.tolist()):
            if n:
                out.append(torch._scaled_mm(xq[start:start + n], wq[e].t(), scale_a=xs[start:start + n],
                                            scale_b=ws[e].reshape(1, -1), out_dtype=torch.bfloat16))
            start += n
        return torch.cat(out) if out else xq.new_zeros((0, wq.shape[1]), dtype=torch.bfloat16)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat.clamp(max=self.num_experts - 1), torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // k
        xq, xs = fp8_quantize_rows(hidden_states[token].contiguous())
        gate, up = self._grouped(xq, xs, self.gq, self.gs, offsets, counts).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        hq, hs = fp8_quantize_rows(h.contiguous())
        y = self._grouped(hq, hs, self.dq, self.ds, offsets, counts)
        y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))


def to_fp8_rollout(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` but ``lm_head`` and every fused experts module."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not full.endswith("lm_head") and "router" not in full \
                    and not full.endswith("mlp.gate"):
                setattr(module, child_name, FP8Linear(child))
            elif isinstance(getattr(child, "gate_up_proj", None), torch.Tensor) and child.gate_up_proj.dim() == 3:
                setattr(module, child_name, FP8Experts(child))
    return model


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__ + "\nA helper module, nothing to run: imported by rollout_throughput.py (its fp8 variant), "
                            "which time it and append the rows to results/kernels.csv.",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
