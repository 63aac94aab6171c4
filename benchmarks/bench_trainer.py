"""Trainer step time and peak memory: BF16 vs the QUADS W4A16 QAT trainer (issue 23).

    python -m benchmarks.bench_trainer --out results/trainer.json [--models moe,dense]
        [--layers 6] [--batch 8] [--seq 512] [--accum 1,4] [--iters 5] [--warmup 2]
    python -m benchmarks.bench_trainer --device cpu --tiny --out /tmp/trainer.json   # smoke run

One training step = ``accum`` x (forward + backward of ``batch x seq`` random tokens, cross
entropy on random labels) + ``torch.optim.AdamW(fused=True).step()`` + ``zero_grad``, with FP32
masters and the forward under ``torch.autocast(bfloat16)`` (the usual mixed-precision recipe).
Models are built from config with random weights (no hub), ``--layers`` decoder layers, a 32000
vocabulary (embeddings and ``lm_head`` stay high precision in every variant):

* ``moe``: Qwen3-MoE-like, hidden 2048, 32/4 heads of 128, 64 experts top-6 of width 1408;
* ``dense``: Qwen3-like (Qwen3-4B's layer), hidden 2560, MLP 9728, 32/8 heads of 128.

Variants, each a fresh model with the same seed (the same weights):

* ``bf16``: the model unquantized (transformers' ``grouped_mm`` experts: with FP32 masters these
  multiply in FP32, since transformers' grouped GEMM casts its input to the weight dtype and
  autocast does not cover ``grouped_mm``);
* ``quads``: ``quantize_(model, QuadsPolicy(side="trainer"))`` as shipped: the fused fake-quant
  kernel, grouped-GEMM experts (BF16 under autocast, like F.linear), forward weights recomputed
  in the backward;
* ``quads-old``: the trainer before issue 23 (torch-reference fake quantization, the FP32
  forward weight cast by autocast, F.linear keeping it for the backward, a Python loop over the
  experts), ``accum`` 1 only and fewer iterations (it is slow): the before/after row.

Times: CUDA events around each whole step, ``--warmup`` steps first, median of ``--iters``.
Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps (reset after warm-up; the
model, its gradients and the AdamW states included). Also measured, once per QUADS model: one
fake-quantization pass over every quantized weight by the kernel and by the reference (the cost a
forward-weight cache could save; docs/trainer.md), and the kernel's forward weights against the
reference's, bit for bit, on every quantized weight, in the autocast dtype and the master dtype.
Output: a table on stdout, every row as JSON lines while running, ``--out`` (JSON), and the step
times and fake-quantization passes (µs) appended to ``benchmarks/results/kernels.csv`` (``--csv``,
:func:`benchmarks.timing.append_results`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

from benchmarks.timing import add_csv_argument, append_results

VOCAB = 32000
ROWS: list[dict] = []
CSV_ROWS: list[dict] = []  # the timings for the results table (kernel, shape, variant, us)
START = time.time()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--models", default="moe,dense")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--accum", default="1,4", help="gradient-accumulation steps to time")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default="bf16,quads,quads-old")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="toy widths (a CPU smoke run of this script)")
    add_csv_argument(p)
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny (the full models take minutes per step on a CPU)")
    return args


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel check runs under the interpreter

import torch
import torch.nn.functional as F

import quads
from quads.ops import use_backend
from quads.ops.weight_quant import fake_quantize_weight_reference, fake_quantize_weight_triton
from quads.policies.modules import TrainerExperts, TrainerLinear, apply_gate
from quads.ops.experts import experts_loop
from quads.policies.ste import fake_quantize_weight

DEVICE = torch.device(ARGS.device)


def record(**row):
    row["elapsed_s"] = round(time.time() - START, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def build_model(kind: str, layers: int, tiny: bool):
    """The benchmark model in FP32 (the masters) on the benchmark device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB // (100 if tiny else 1), num_hidden_layers=layers,
                  num_attention_heads=32 // (8 if tiny else 1), head_dim=128 // (8 if tiny else 1),
                  max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa")
    if kind == "moe":  # tiny: hidden 64, 8 experts top-3 of width 64
        cfg = Qwen3MoeConfig(hidden_size=64 if tiny else 2048, num_key_value_heads=2 if tiny else 4,
                             intermediate_size=192 if tiny else 6144, moe_intermediate_size=64 if tiny else 1408,
                             num_experts=8 if tiny else 64, num_experts_per_tok=3 if tiny else 6,
                             decoder_sparse_step=1, norm_topk_prob=True, **common)
        cfg._experts_implementation = "grouped_mm"  # the BF16 model's fused experts path
        cls = Qwen3MoeForCausalLM
    elif kind == "dense":
        cfg = Qwen3Config(hidden_size=64 if tiny else 2560, num_key_value_heads=2 if tiny else 8,
                          intermediate_size=240 if tiny else 9728, **common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown model {kind!r}; use moe or dense")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = cls(cfg).to(torch.float32)
    return model.train()


# --- the trainer before issue 23 (for the before/after row) -----------------------------------

def _old_forward_weight(w, backend):
    # reference fake quant in the master dtype, then the copy the old STE returned (it cloned the
    # weight cache's result, which with the cache off was a fresh tensor already)
    return fake_quantize_weight(w, backend, w.dtype).clone()


class _OldLinear(TrainerLinear):
    def forward(self, x):
        # autocast casts the FP32 forward weight; F.linear keeps the cast for the backward
        return F.linear(x, _old_forward_weight(self.weight, self.quads_backend), self.bias)


class _OldExperts(TrainerExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate_up = _old_forward_weight(self.gate_up_proj, self.quads_backend)
        down = _old_forward_weight(self.down_proj, self.quads_backend)

        def mlp(rows, e):
            return F.linear(apply_gate(self, F.linear(rows, gate_up[e])), down[e])

        return experts_loop(hidden_states, top_k_index, top_k_weights, gate_up.shape[0], mlp)


def make_old(model):
    for m in model.modules():
        if isinstance(m, TrainerExperts):
            m.__class__ = type("OldExperts", (_OldExperts, type(m).__bases__[1]), {})
        elif isinstance(m, TrainerLinear):
            m.__class__ = type("OldLinear", (_OldLinear, type(m).__bases__[1]), {})


def make_variant(kind: str, variant: str):
    model = build_model(kind, ARGS.layers, ARGS.tiny)
    if variant == "quads":
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
    elif variant == "quads-old":
        with use_backend("torch"):
            quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
        make_old(model)
    elif variant != "bf16":
        raise ValueError(f"unknown variant {variant!r}")
    return model


# --- timing ---------------------------------------------------------------------------------------

def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class _Timer:
    def __enter__(self):
        _sync()
        if DEVICE.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if DEVICE.type == "cuda":
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def _batches(vocab: int, n: int):
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (ARGS.batch, ARGS.seq)
    return [(torch.randint(0, vocab, shape, generator=g).to(DEVICE), torch.randint(0, vocab, shape, generator=g).to(DEVICE))
            for _ in range(n)]


def train_step(model, opt, batches):
    for ids, labels in batches:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(ids).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / len(batches)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_steps(model, accum: int, warmup: int, iters: int) -> dict:
    fused = DEVICE.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    batches = _batches(model.config.vocab_size, accum)
    for _ in range(warmup):
        train_step(model, opt, batches)
    _sync()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        with _Timer() as t:
            train_step(model, opt, batches)
        times.append(t.ms)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0
    del opt
    return {"step_ms": round(statistics.median(times), 2), "step_ms_all": [round(x, 2) for x in times],
            "peak_gib": round(peak, 3)}


def _quantized_weights(model):
    out = []
    for name, m in model.named_modules():
        if isinstance(m, TrainerLinear):
            out.append((f"{name}.weight", m.weight))
        elif isinstance(m, TrainerExperts):
            out += [(f"{name}.gate_up_proj", m.gate_up_proj), (f"{name}.down_proj", m.down_proj)]
    return out


def kernel_checks(kind: str, model) -> None:
    """Bit-exactness of the kernel's forward weights on every quantized weight, and the time of one
    fake-quant pass over all of them (kernel, reference)."""
    weights = _quantized_weights(model)
    if DEVICE.type == "cpu":  # the interpreter: a few weights prove the check runs
        weights = weights[:2] + [w for w in weights if w[1].dim() == 3][:1]
    mismatched, checked = [], 0
    with torch.no_grad():
        for name, w in weights:
            for dtype in (torch.bfloat16, w.dtype):
                got, _ = fake_quantize_weight_triton(w, dtype)
                ref, _ = fake_quantize_weight_reference(w, dtype)
                bits = torch.int16 if dtype != torch.float32 else torch.int32
                if not torch.equal(got.view(bits), ref.view(bits)):
                    mismatched.append(f"{name}:{dtype}")
                checked += got.numel()
                del got, ref
        numel = sum(w.numel() for _, w in weights)
        passes = {}
        for label, fn in (("kernel", fake_quantize_weight_triton), ("reference", fake_quantize_weight_reference)):
            for _ in range(2 if label == "kernel" and DEVICE.type == "cuda" else 1):  # warm-up (compilation), then time
                with _Timer() as t:
                    for _, w in weights:
                        fn(w, torch.bfloat16)
            passes[label] = t.ms
    # bytes of one kernel pass: the amax read + the fused read (FP32) + the BF16 write
    gbps = numel * (4 + 4 + 2) / (passes["kernel"] * 1e-3) / 1e9
    record(kind=kind, check="fake_quant_kernel_vs_reference", bit_exact=not mismatched, mismatched=mismatched[:8],
           elements_checked=checked, quantized_params=numel,
           fake_quant_pass_ms_kernel=round(passes["kernel"], 2), fake_quant_pass_ms_reference=round(passes["reference"], 2),
           kernel_effective_gbps=round(gbps, 1))
    for label, ms in passes.items():
        CSV_ROWS.append({"kernel": "fake_quant_pass", "shape": f"{kind} L{ARGS.layers}: {len(weights)} weights, "
                         f"{numel} elements, bf16 out", "variant": label, "us": ms * 1e3})


def _free():
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def main():
    accums = [int(a) for a in ARGS.accum.split(",")]
    variants = ARGS.variants.split(",")
    if ARGS.tiny:
        ARGS.iters, ARGS.warmup = min(ARGS.iters, 2), min(ARGS.warmup, 1)
        ARGS.batch, ARGS.seq, ARGS.layers = min(ARGS.batch, 2), min(ARGS.seq, 32), min(ARGS.layers, 2)
    record(config=vars(ARGS), torch=torch.__version__,
           device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu")
    results = {}
    for kind in ARGS.models.split(","):
        for variant in variants:
            model = make_variant(kind, variant)
            n_params = sum(p.numel() for p in model.parameters())
            if variant == "quads":
                kernel_checks(kind, model)
            for accum in accums:
                if variant == "quads-old" and accum != accums[0]:
                    continue  # slow: the before/after row at the first accumulation only
                warmup, iters = (1, min(ARGS.iters, 3)) if variant == "quads-old" else (ARGS.warmup, ARGS.iters)
                r = time_steps(model, accum, warmup, iters)
                results[(kind, variant, accum)] = r
                record(kind=kind, variant=variant, accum=accum, params=n_params, **r)
                CSV_ROWS.append({"kernel": "trainer_step", "shape": f"{kind} L{ARGS.layers} {ARGS.batch}x{ARGS.seq} "
                                 f"accum {accum}", "variant": variant, "us": r["step_ms"] * 1e3})
                _free()
            del model
            _free()
    table = []
    for (kind, variant, accum), r in results.items():
        base = results.get((kind, "bf16", accum))
        table.append({"model": kind, "variant": variant, "accum": accum, "step_ms": r["step_ms"],
                      "vs_bf16": round(r["step_ms"] / base["step_ms"], 3) if base else None,
                      "peak_GiB": r["peak_gib"],
                      "peak_vs_bf16": round(r["peak_gib"] / base["peak_gib"], 3) if base and base["peak_gib"] else None})
    for row in table:
        record(table=row)
    try:
        from tabulate import tabulate
        print(tabulate(table, headers="keys", tablefmt="github"))
    except ImportError:
        for row in table:
            print(row)
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    tmp = ARGS.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": ROWS, "table": table}, f, indent=1)
    os.replace(tmp, ARGS.out)  # never a half-written file
    append_results(CSV_ROWS, raw=ARGS.out, csv_path=ARGS.csv)
    print(f"wrote {ARGS.out} ({time.time() - START:.0f} s)")


if __name__ == "__main__":
    main()
