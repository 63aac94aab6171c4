"""Host cost of two checks made on the CPU between kernels: the graphed decoder's and the trainer group's.

    python -m benchmarks.ops.bench_host_checks [--layers 48] [--reps 50] [--calls 20000]

* ``captured_reads``: what the graphed decoder compares at each ``generate`` before replaying its
  captured step (``quads.engine.capture.captured_reads`` of the rollout, then the comparison
  with the recorded one), on a Qwen3-MoE rollout of ``--layers`` layers at tiny widths (hidden
  64, 8 experts): the cost grows with the number of parameters and modules, not their sizes.
* ``ScaleGroup.scale``: what a trainer group member's forward adds to read its parent's shared
  global scale (the masters' key compared), on one q/k/v group of a tiny Llama, with the
  parent's call open; beside it the key alone.

Prints one line per measurement (milliseconds or microseconds per call, median of 5 rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import quads


def _per_call(fn, n: int) -> float:
    """Seconds per call of ``fn``: the median of 5 rounds of ``n`` calls."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n)
    return statistics.median(rounds)


def captured_reads_cost(layers: int, reps: int) -> tuple[int, float]:
    """(parameters, seconds per ``captured_reads`` + comparison) of a ``layers``-layer rollout."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from quads.engine.capture import captured_reads

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    model = quads.quantize_(Qwen3MoeForCausalLM(cfg).bfloat16(), quads.QuadsPolicy(side="rollout"))
    recorded = captured_reads(model)
    return len(list(model.parameters())), _per_call(lambda: captured_reads(model) == recorded, reps)


def group_scale_cost(calls: int) -> tuple[float, float]:
    """(seconds per ``ScaleGroup.scale()`` with the parent's call open, seconds per masters' key)."""
    from tests.tiny_models import build

    model = quads.quantize_(build("llama", seed=1), quads.QuadsPolicy(side="trainer"))
    group = model.model.layers[0].self_attn.q_proj.quads_scale_group
    group._open_call(None, None)
    try:
        return _per_call(group.scale, calls), _per_call(group._masters_key, calls)
    finally:
        group._close_call(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params, reads = captured_reads_cost(args.layers, args.reps)
    scale, key = group_scale_cost(args.calls)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"captured_reads + compare: {reads * 1e3:.2f} ms per generate ({args.layers} layers, {params} parameters)")
    print(f"ScaleGroup.scale (parent call open): {scale * 1e6:.2f} us per member call; masters' key alone "
          f"{key * 1e6:.2f} us")


if __name__ == "__main__":
    main()
