"""Host (CPU) time of the trainer's GPU-path glue per call: linear and experts forward/backward,
and the sibling group's global scale (the eager quads step is host-bound on the H200).

    python -m benchmarks.ops.bench_trainer_host [--reps 2000] [--profile] [--out FILE]

What runs: the trainer modules of a tiny Qwen3-MoE (``quantize_(model, QuadsPolicy(side="trainer"))``)
with the kernel backend forced onto them (``module.quads_backend = get_backend("hopper")``, set
after conversion: ``select_backend`` would pick ``torch`` for CPU tensors, and nothing on the
trainer's path checks the device once the backend object is chosen), and the two Triton kernels
of the fused fake quantizer replaced by no-op stubs (``_NoLaunch``, as in
``bench_fake_quant.py``'s ``glue_host_us``). ``TRITON_INTERPRET`` stays unset, so the glue is
the GPU path's (no interpreter copies or casts). Shapes are tiny (hidden 64, 4 experts of 32), so
the CPU math the GPU would run (GEMMs, the router gathers, the group scale's reductions) costs
little; ``peer`` rows are the same calls on a plain ``nn.Linear`` / BF16 weights, the floor the
glue is compared against. Outputs are not checked here (the kernels do not run): the tests do that.

Rows (microseconds per call, median of ``--rounds`` rounds of ``--reps`` calls each):
``linear fwd`` (``q_proj(x)``, fp32 master; float32 GEMMs unless ``--autocast``), ``linear bwd``
(``y.backward(g)`` of it), ``linear, group mode`` (the same ``q_proj`` of a group-mode trainer,
called alone: it computes its q/k/v group's scale, then fake-quantizes with it), the same for the
experts module (``experts(hidden, idx, weights)``), ``group scale`` (the torch
``shared_global_encode_scale`` of three weights: q/k/v, what sync/export run) and ``group scale,
trainer`` (``ScaleGroup.scale()``: what the parent's forward pre-hook runs, by the modules'
backend: on the kernel backend one zeroed int32 buffer and one (stubbed) amax launch per member).
``--profile`` adds a cProfile of linear and experts forward+backward (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import time

os.environ.pop("TRITON_INTERPRET", None)  # the GPU path's glue, not the interpreter's

import torch  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from quads import QuadsPolicy, quantize_  # noqa: E402
from quads.kernels import fake_quantize_nvfp4 as fq  # noqa: E402
from quads.ops.backend_registry import get_backend  # noqa: E402
from quads.policies.modules import TrainerModule  # noqa: E402
from quads.tensor.nvfp4_math import shared_global_encode_scale  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402


class _NoLaunch:
    """A stand-in for a Triton kernel: ``k[grid](...)`` does nothing (host glue timing)."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def build(policy_scale: str):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=128, intermediate_size=128,
                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                         norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(cfg).float()
    peer = Qwen3MoeForCausalLM(cfg).float()
    quantize_(model, QuadsPolicy(side="trainer", weight_global_scale=policy_scale))
    hopper = get_backend("hopper")
    for m in model.modules():
        if isinstance(m, TrainerModule):
            m.quads_backend = hopper
    return model, peer


def timed(fwd, reps, rounds):
    """Median over rounds of (forward us, backward us) per call; ``fwd()`` returns the output."""
    g = None
    fw, bw = [], []
    for _ in range(rounds):
        tf = tb = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            y = fwd()
            t1 = time.perf_counter()
            if g is None:
                g = torch.ones_like(y)
            y.backward(g)
            tb += time.perf_counter() - t1
            tf += t1 - t0
        fw.append(tf / reps * 1e6)
        bw.append(tb / reps * 1e6)
    return statistics.median(fw), statistics.median(bw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--autocast", action="store_true",
                   help="run under CPU bf16 autocast (the GPU run's dtypes; CPU bf16 GEMMs are slow, which hides the glue)")
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fq._fake_quant_kernel = fq._fake_quant_amax_kernel = _NoLaunch()

    model, peer = build("tensor")
    grouped, _ = build("group")  # weight_global_scale="group": q/k/v share one S_enc
    q_grouped = grouped.model.layers[0].self_attn.q_proj
    layer, peer_layer = model.model.layers[0], peer.model.layers[0]
    q, q_peer = layer.self_attn.q_proj, peer_layer.self_attn.q_proj
    experts, experts_peer = layer.mlp.experts, peer_layer.mlp.experts
    x = torch.randn(4, 8, 64, requires_grad=True)
    hidden = torch.randn(32, 64, requires_grad=True)
    top_idx = torch.stack([torch.arange(32) % 4, (torch.arange(32) + 1) % 4], dim=-1)
    top_w = torch.full((32, 2), 0.5)

    def autocast(fn):
        if not args.autocast:
            return fn

        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn()
        return run

    cases = {
        "linear": autocast(lambda: q(x)),
        "linear peer": autocast(lambda: q_peer(x)),
        "linear, group mode (group scale + fake quant)": autocast(lambda: q_grouped(x)),
        "experts": autocast(lambda: experts(hidden, top_idx, top_w)),
        "experts peer (grouped_mm, transformers)": autocast(lambda: experts_peer(hidden, top_idx, top_w)),
    }
    lines = [f"# bench_trainer_host: python -m benchmarks.ops.bench_trainer_host --reps {args.reps} "
             f"--rounds {args.rounds}{' --profile' if args.profile else ''}{' --autocast' if args.autocast else ''}",
             f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
             f"(torch threads 1), torch {torch.__version__}, python {platform.python_version()}",
             f"# backend on the quads modules: {q.quads_backend.name} (Triton kernels stubbed); "
             f"experts path: {'grouped' if experts.quads_grouped else 'loop'}",
             f"{'case':48s} {'fwd us':>9s} {'bwd us':>9s}"]
    for name, fn in cases.items():
        f, b = timed(fn, args.reps, args.rounds)
        lines.append(f"{name:48s} {f:9.1f} {b:9.1f}")

    weights = [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]
    gs = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.reps):
            shared_global_encode_scale(w.detach() for w in weights)
        gs.append((time.perf_counter() - t0) / args.reps * 1e6)
    lines.append(f"{'group scale (q/k/v, CPU math included)':48s} {statistics.median(gs):9.1f}")
    group = q_grouped.quads_scale_group
    gs = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.reps):
            group.scale()
        gs.append((time.perf_counter() - t0) / args.reps * 1e6)
    lines.append(f"{'group scale, trainer (ScaleGroup.scale, q/k/v)':48s} {statistics.median(gs):9.1f}")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        timed(cases["linear"], args.reps // 4, 1)
        timed(cases["experts"], args.reps // 4, 1)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        lines.append(f"\n# cProfile: linear + experts fwd+bwd, {args.reps // 4} calls each, by own time")
        lines.extend(ln for ln in s.getvalue().splitlines() if ln.strip())
    report = "\n".join(lines)
    print(report)
    if args.out:
        write_atomically(args.out, report + "\n")  # whole or not at all, never through a planted link


if __name__ == "__main__":
    main()
