"""Host time of one eager decode step of the embedded MoE (``quads/assets/tiny-moe-arith``).

    python -m benchmarks.ops.bench_decode_host [--steps 400] [--prompt 8] [--threads 1] [--device cpu|cuda]
                                               [--count-calls]

The rollout model (``quantize_(model, QuadsPolicy(side="rollout"))``: the torch backend on CPU,
the exact Triton kernels on a CUDA GPU) decodes one token per step with transformers'
key/value cache; each step is timed alone (``time.perf_counter``; on CUDA the device is
synchronized at both ends), the cache reset every ``--run`` steps (the model's 64 positions).
Prints the median and the quartiles in microseconds. The shapes are tiny (hidden 128, 8 experts
of 128): on CPU the number is mostly the torch reference math and dispatch; on a GPU, whose
kernels take microseconds at these shapes, the step is host-bound: what the rollout path's
Python and launches cost. On CUDA attention runs on the math SDPA backend: under torch's default
backend choice a cProfile of this script on the H200 put 7.7 ms of host time in each
``scaled_dot_product_attention`` call (eager decode, a new key length every step), more than
the rest of the step, the same in every tree: not the rollout path's cost.

``--count-calls`` counts instead the Python calls in quads' own files per decode step
(``sys.setprofile`` over the timed steps): a count, not a time, so two trees compare without
the machine's run-to-run spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import quads
from quads.tasks.default_model import load_default_model


def decode_step_times(steps: int, prompt: int, run: int, device: str = "cpu", count_calls: bool = False) -> list[float]:
    """Each step's host time in seconds, or with ``count_calls`` each step's count of Python calls
    in quads' own files."""
    model, _ = load_default_model()
    model.to(device)
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    root, calls = os.path.dirname(quads.__file__) + os.sep, [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls[0] += 1

    with torch.no_grad():
        while len(times) < steps:
            ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=gen).to(device)
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for pos in range(prompt, min(prompt + run, model.config.max_position_embeddings)):
                sync()
                t0, calls[0] = time.perf_counter(), 0
                if count_calls:
                    sys.setprofile(profile)
                try:
                    out = model(input_ids=token, past_key_values=cache, use_cache=True,
                                position_ids=torch.tensor([[pos]], device=device))
                finally:
                    sys.setprofile(None)
                token = out.logits[:, -1:].argmax(-1)
                sync()
                times.append(calls[0] if count_calls else time.perf_counter() - t0)
    return times[:steps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="decode steps timed")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens before each run")
    ap.add_argument("--run", type=int, default=48, help="decode steps per cache")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--count-calls", action="store_true", help="count quads' Python calls per step instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            times = decode_step_times(args.steps, args.prompt, args.run, args.device, args.count_calls)
    else:
        times = decode_step_times(args.steps, args.prompt, args.run, args.device, args.count_calls)
    where = "torch backend, CPU" if args.device == "cpu" else f"exact kernels, {torch.cuda.get_device_name()}"
    if args.count_calls:
        print(f"decode step, tiny-moe-arith, {where}: {statistics.median(times):.0f} Python calls in quads "
              f"(min {min(times)}, max {max(times)}; {len(times)} steps)")
        return
    q = statistics.quantiles([t * 1e6 for t in times], n=4)
    print(f"decode step, tiny-moe-arith, {where}: median {q[1]:.0f} us "
          f"(quartiles {q[0]:.0f} / {q[2]:.0f}; {len(times)} steps)")


if __name__ == "__main__":
    main()
