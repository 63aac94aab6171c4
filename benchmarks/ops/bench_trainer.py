"""Trainer step time and peak memory: BF16 vs the QUADS W4A16 QAT trainer.

    python -m benchmarks.ops.bench_trainer --out results/trainer.json [--models moe,dense]
        [--layers 6 | --layers moe=8,dense=24] [--batch 8] [--seq 512] [--accum 1,4] [--iters 5]
        [--warmup 2] [--variants bf16,bf16-cast,quads,quads-keep,quads-old]
    python -m benchmarks.ops.bench_trainer --device cpu --tiny --out /tmp/trainer.json   # smoke run

One training step = ``accum`` x (forward + backward of ``batch x seq`` random tokens, cross
entropy on random labels) + ``torch.optim.AdamW(fused=True).step()`` + ``zero_grad``, with FP32
masters and the forward under ``torch.autocast(bfloat16)`` (the usual mixed-precision recipe).
Models are built from config with random weights (no hub), ``--layers`` decoder layers, a 32000
vocabulary (embeddings and ``lm_head`` stay high precision in every variant):

* ``moe``: Qwen3-MoE-like, hidden 2048, 32/4 heads of 128, 64 experts top-6 of width 1408;
* ``dense``: Qwen3-like (Qwen3-4B's layer), hidden 2560, MLP 9728, 32/8 heads of 128.

Variants, each a fresh model with the same seed (the same weights):

* ``bf16``: the model unquantized, as transformers ships it (its ``grouped_mm`` experts: with FP32
  masters these multiply in FP32, since transformers' grouped GEMM casts its input to the weight
  dtype and autocast does not cover ``grouped_mm``). Ratio column ``vs_bf16``;
* ``bf16-cast``: **the BF16 trainer** of the targets: the same model, with the expert weights
  cast to the autocast dtype in the forward (what autocast does to every linear's weight, and
  what quads' grouped path multiplies), through transformers' own ``grouped_mm`` forward; the
  casts are kept for the backward, as autocast's linear casts are. Ratio column
  ``vs_bf16_cast``; MoE only (the dense model has no experts: its ``bf16`` row is its BF16
  trainer, and ``vs_bf16_cast`` there is ``vs_bf16``);
* ``quads``: ``quantize_(model, QuadsPolicy(side="trainer"))`` as shipped: the fused fake-quant
  kernel, grouped-GEMM experts (BF16 under autocast, like F.linear), forward weights recomputed
  in the backward; one NVFP4 global scale per sibling group (q/k/v, gate/up: the default; the group's amax is taken once per forward of the members' parent);
* ``quads-tensor``: ``quads`` with one global scale per weight (``weight_global_scale="tensor"``):
  what the group scale costs the step;
* ``quads-keep``: ``quads`` with the forward weight kept for the backward instead of recomputed
  (linears: F.linear on the straight-through forward weight, which saves it, as autocast's
  linear saves its BF16 cast; experts: ``quads_keep_forward_weight``): one fused pass less per
  micro-step, the BF16 peer's forward-weight memory;
* ``quads-tgrad``: ``quads`` with the experts' weight gradient handed to AccumulateGrad
  transposed (``(x^T grad)^T``; AccumulateGrad copies it on the first
  micro-step and adds it strided on the others): measures what the layout fix saved; MoE only;
* ``quads-old``: the trainer before the fused kernel (torch-reference fake quantization, the FP32
  forward weight cast by autocast, F.linear keeping it for the backward, a Python loop over the
  experts), ``accum`` 1 only and fewer iterations (it is slow): the before/after row;
* ``<variant>+compile`` (e.g. ``bf16+compile``, ``bf16-cast+compile``, ``quads+compile``): the
  variant with its forward compiled (``nn.Module.compile()``: TorchInductor, graph breaks
  allowed; the backward through AOT autograd); compiled in the untimed first step. Whether
  compilation takes the trainer's host cost per linear away: ratio column ``vs_same_mode``, the
  variant against its BF16 peer compiled the same way (``bf16-cast+compile`` for MoE).

Times: CUDA events around each whole step, ``--warmup`` steps first, median of ``--iters``; per
step also the host's issue time (``host_ms_all``: wall clock from the step's start until the
host has issued it, before waiting for the GPU; the host blocks when the launch queue is full, so
it reads the host's own time only where it is the slower side) and, over the timed steps, the
Python garbage collector's collections and milliseconds per generation (``gc_pauses_ms``): a
host-bound step shows a host stall as a slow step, these say whether the collector was it.
Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps (reset after warm-up; the
model, its gradients and the AdamW states included). Also measured, once per QUADS model: one
fake-quantization pass over every quantized weight by the kernel and by the reference (the cost a
forward-weight cache could save; docs/trainer.md), and the kernel's forward weights against the
reference's, bit for bit, on every quantized weight, in the autocast dtype and the master dtype.
Output: a table on stdout, every row as JSON lines while running, ``--out`` (JSON), and the step
times and fake-quantization passes (µs) appended to ``results/kernels.csv`` (``--csv``,
:func:`benchmarks.timing.append_results`).

``--profile``: one more step per variant (the first ``--accum``) under ``torch.profiler``: the
device time of every kernel grouped by category (fake quant, grouped GEMM, GEMM, attention,
elementwise incl. casts and copies, index/scatter, reductions, optimizer, other), the top ops by self device time, the union of the
kernels' busy intervals against the step's wall time (the GPU idle time: host-bound stretches),
and the host time. Comparing ``bf16-cast`` and ``quads`` rows splits the MoE step's gap by
category (docs/trainer.md, "where the MoE gap goes"):

    python -m benchmarks.ops.bench_trainer --out $OUT/prof.json --models moe --layers 8 --accum 1 \
        --iters 2 --warmup 1 --variants bf16-cast,quads --profile
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
    p.add_argument("--layers", default="6", help="decoder layers: N for every model, or moe=N,dense=M")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--accum", default="1,4", help="gradient-accumulation steps to time")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default="bf16,bf16-cast,quads,quads-keep,quads-old")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="toy widths (a CPU smoke run of this script)")
    add_csv_argument(p)
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps at the first accum, one more step under torch.profiler: "
                        "per-op and per-kernel device time, by category, and the GPU's idle time")
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
from quads.ops.experts_op import experts_loop
from quads.policies.ste import fake_quantize_activation, fake_quantize_weight
from quads.tensor.files import write_atomically

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


# --- the trainer before the fused kernel (for the before/after row) -----------------------------

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


# --- quads-keep: the forward weight kept for the backward ----------------------------------------

class _KeepLinear(TrainerLinear):
    def forward(self, x):
        backend = self.quads_trainer_backend()
        if self.quads_act is not None:
            x = fake_quantize_activation(x, self.quads_act, backend)
        # the straight-through forward weight (in the autocast dtype); F.linear saves it
        return F.linear(x, fake_quantize_weight(self.weight, backend), self.bias)


def make_keep(model):
    for m in model.modules():
        if isinstance(m, TrainerExperts):
            m.quads_keep_forward_weight = True
        elif isinstance(m, TrainerLinear):
            m.__class__ = type("KeepLinear", (_KeepLinear, type(m).__bases__[1]), {})


# --- quads-tgrad: the experts' weight gradient in the transposed layout ---------------------

def _transposed_grad_function():
    from quads.policies import trainer_experts as te

    class _TransposedGradGroupedMM(te._FakeQuantGroupedMM):
        @staticmethod
        def backward(ctx, grad):
            x, saved_w, scale, ends = ctx.saved_tensors
            quantize, dtype, keep, master_dtype = ctx.state
            grouped_mm = te._grouped_mm_fn()
            grad = grad.contiguous()
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:
                w = saved_w if keep else quantize(saved_w, dtype, scale)[0]
                grad_x = grouped_mm(grad, w, offs=ends)
            if ctx.needs_input_grad[1]:
                grad_w = grouped_mm(x.t(), grad, offs=ends).transpose(-2, -1).to(master_dtype)
            return grad_x, grad_w, None, None, None, None

    return _TransposedGradGroupedMM


class _patched_grouped_mm:
    """Within the block, quads' grouped experts use ``quads-tgrad``'s Function."""

    def __init__(self, variant):
        self.on = variant == "quads-tgrad"

    def __enter__(self):
        if self.on:
            from quads.policies import trainer_experts as te

            self.saved = te._FakeQuantGroupedMM
            te._FakeQuantGroupedMM = _transposed_grad_function()
        return self

    def __exit__(self, *exc):
        if self.on:
            from quads.policies import trainer_experts as te

            te._FakeQuantGroupedMM = self.saved


# --- bf16-cast: the BF16 trainer whose experts multiply in the autocast dtype ------------------

class _CastExpertsView:
    """A transformers experts module as its ``grouped_mm`` forward sees it, with the expert
    weights cast to ``dtype`` (differentiable casts, kept for the backward like autocast's)."""

    def __init__(self, module, dtype):
        self.__dict__["_module"] = module
        self.__dict__["gate_up_proj"] = module.gate_up_proj.to(dtype)
        self.__dict__["down_proj"] = module.down_proj.to(dtype)

    def __getattr__(self, name):
        return getattr(self.__dict__["_module"], name)


def _cast_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    from transformers.integrations.moe import grouped_mm_experts_forward

    dev = hidden_states.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.gate_up_proj.dtype
    return grouped_mm_experts_forward(_CastExpertsView(self, dtype), hidden_states, top_k_index, top_k_weights)


def make_cast(model) -> int:
    import types

    n = 0
    for m in model.modules():
        if getattr(m, "gate_up_proj", None) is not None and getattr(m, "down_proj", None) is not None \
                and m.gate_up_proj.dim() == 3:
            m.forward = types.MethodType(_cast_experts_forward, m)
            n += 1
    return n


def layers_for(kind: str) -> int:
    spec = str(ARGS.layers)
    if "=" not in spec:
        return int(spec)
    table = dict(item.split("=") for item in spec.split(","))
    return int(table.get(kind, 6))


def make_variant(kind: str, variant: str):
    base, _, mode = variant.partition("+")
    if mode:
        if mode != "compile":
            raise ValueError(f"unknown variant mode {mode!r} in {variant!r} (only +compile)")
        model = make_variant(kind, base)
        model.compile()
        return model
    model = build_model(kind, layers_for(kind), ARGS.tiny)
    if variant == "bf16-cast":
        if not make_cast(model):
            raise ValueError(f"bf16-cast: the {kind} model has no experts")
    elif variant == "quads-tensor":  # one global scale per weight, not per sibling group
        quads.quantize_(model, quads.QuadsPolicy(side="trainer", weight_global_scale="tensor"))
    elif variant in ("quads", "quads-keep", "quads-tgrad"):
        quads.quantize_(model, quads.QuadsPolicy(side="trainer"))
        if variant == "quads-keep":
            make_keep(model)
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


class _GcPauses:
    """Python garbage-collector pauses during the timed steps (``gc.callbacks``): per generation,
    how many collections and their total milliseconds. A host-bound step shows a collection as a
    step-time spike (the GPU's queue runs dry while the host is paused); a GPU-bound one hides it."""

    def __enter__(self):
        self.ms, self.count, self._t = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.ms[g] += (time.perf_counter() - self._t) * 1e3

    def per_generation(self) -> dict:
        return {f"gen{g}": [self.count[g], round(self.ms[g], 2)] for g in range(3)}


def _batches(vocab: int, n: int):
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (ARGS.batch, ARGS.seq)
    return [(torch.randint(0, vocab, shape, generator=g).to(DEVICE), torch.randint(0, vocab, shape, generator=g).to(DEVICE))
            for _ in range(n)]


def train_step(model, opt, batches):
    total = 0.0
    for ids, labels in batches:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(ids).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / len(batches)
        loss.backward()
        total = total + loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def time_steps(model, accum: int, warmup: int, iters: int) -> dict:
    fused = DEVICE.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    batches = _batches(model.config.vocab_size, accum)
    # the first step's loss (untimed): every variant starts from the same weights, so quads and
    # quads-keep must agree exactly and bf16 / bf16-cast closely (a sanity check of the variants)
    losses = [float(train_step(model, opt, batches))]
    for _ in range(warmup - 1):
        train_step(model, opt, batches)
    _sync()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, host, pauses = [], [], _GcPauses()
    with pauses:
        for _ in range(iters):
            with _Timer() as t:
                train_step(model, opt, batches)
                t.host_ms = (time.perf_counter() - t.t0) * 1e3  # the host's issue time (no sync yet)
            times.append(t.ms)
            host.append(t.host_ms)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0
    # allocator retries (a cudaMalloc failed, the cache was flushed and the call retried): memory
    # pressure, e.g. another process's memory on a shared (MPS) GPU; reserved: what the cache holds
    stats = torch.cuda.memory_stats() if DEVICE.type == "cuda" else {}
    del opt
    return {"step_ms": round(statistics.median(times), 2), "step_ms_all": [round(x, 2) for x in times],
            "host_ms_all": [round(x, 2) for x in host], "gc_pauses_ms": pauses.per_generation(),
            "peak_gib": round(peak, 3), "first_loss": losses[0],
            "alloc_retries": stats.get("num_alloc_retries"),
            "reserved_peak_gib": round(stats.get("reserved_bytes.all.peak", 0) / 2**30, 3) if stats else None}


#: kernel / op name -> category (first match wins; lower-case substrings)
_CATEGORIES = (
    ("fake_quant", ("_fake_quant", "amax")),
    ("grouped_gemm", ("grouped", "group_gemm", "groupproblem", "ptrarray")),  # CUTLASS: GroupProblemShape
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas", "matmul", "ampere_", "s16816")),
    ("index_scatter", ("index", "scatter", "gather", "sort", "radix", "histc", "cumsum", "scan")),
    ("reduce", ("reduce", "softmax", "norm", "cross_entropy", "nll", "logsumexp")),
    # casts, copies, fills and the other elementwise kernels (norms, activations, masks, adds)
    ("elementwise", ("copy", "cast", "convert", "elementwise", "fill")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _union_us(intervals) -> float:
    busy, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def profile_step(kind: str, variant: str, model, accum: int) -> None:
    """One training step under torch.profiler: device time per kernel category, the top kernels
    and ops, the GPU's busy time (union of kernel intervals) against the step's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    batches = _batches(model.config.vocab_size, accum)
    train_step(model, opt, batches)  # the optimizer state exists before the profiled step
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        with _Timer() as t:
            train_step(model, opt, batches)
    del opt
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    by_kernel, by_cat = {}, {}
    for e in kernels:
        us = e.time_range.elapsed_us()
        k = by_kernel.setdefault(e.name, [0, 0.0])
        k[0] += 1
        k[1] += us
        by_cat[_category(e.name)] = by_cat.get(_category(e.name), 0.0) + us
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3
    ops = []
    for a in prof.key_averages():
        dev = getattr(a, "self_device_time_total", None)
        if dev is None:
            dev = getattr(a, "self_cuda_time_total", 0.0)
        if a.device_type == DeviceType.CUDA:
            continue  # kernels: in top_kernels
        ops.append((a.key, a.count, dev / 1e3, a.self_cpu_time_total / 1e3))
    ops.sort(key=lambda o: (-o[2], -o[3]))
    top_k = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:40]
    record(kind=kind, variant=variant, accum=accum, profile=True, step_ms=round(t.ms, 2),
           gpu_busy_ms=round(busy, 2), gpu_idle_ms=round(t.ms - busy, 2) if cuda else None,
           kernels=len(kernels), kernel_ms_total=round(sum(v[1] for v in by_kernel.values()) / 1e3, 2),
           by_category_ms={c: round(v / 1e3, 2) for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
           top_kernels=[{"name": n[:200], "calls": c, "ms": round(us / 1e3, 3), "category": _category(n)}
                        for n, (c, us) in top_k],
           top_ops=[{"op": n[:80], "calls": c, "self_device_ms": round(d, 3), "self_cpu_ms": round(h, 3)}
                    for n, c, d, h in ops[:40]])
    try:
        print(prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                        row_limit=30), flush=True)
    except Exception as e:  # noqa: BLE001  (a table-format change must not lose the JSON row)
        print(f"profiler table: {type(e).__name__}: {e}")


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
    # bytes of one kernel pass: the amax read + the fused read (FP32) + the BF16 write; the time is
    # the wall time of back-to-back calls (host overhead included when the host is the slower:
    # benchmarks/ops/bench_fake_quant.py separates GPU and host time per shape)
    gbps = numel * (4 + 4 + 2) / (passes["kernel"] * 1e-3) / 1e9
    record(kind=kind, check="fake_quant_kernel_vs_reference", bit_exact=not mismatched, mismatched=mismatched[:8],
           elements_checked=checked, quantized_params=numel,
           fake_quant_pass_ms_kernel=round(passes["kernel"], 2), fake_quant_pass_ms_reference=round(passes["reference"], 2),
           kernel_effective_gbps=round(gbps, 1))
    for label, ms in passes.items():
        CSV_ROWS.append({"kernel": "fake_quant_pass", "shape": f"{kind} L{layers_for(kind)}: {len(weights)} weights, "
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
        ARGS.batch, ARGS.seq, ARGS.layers = min(ARGS.batch, 2), min(ARGS.seq, 32), 2
    record(config=vars(ARGS), torch=torch.__version__,
           device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu")
    results = {}
    for kind in ARGS.models.split(","):
        for variant in variants:
            if variant.partition("+")[0] in ("bf16-cast", "quads-tgrad") and kind != "moe":
                continue  # no experts: the bf16 row is this model's BF16 trainer, quads-tgrad is quads
            model = None
            try:  # one failing variant (an OOM, a transformers API change) must not end the run
                with _patched_grouped_mm(variant):
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
                        record(kind=kind, variant=variant, accum=accum, layers=layers_for(kind), params=n_params, **r)
                        CSV_ROWS.append({"kernel": "trainer_step", "shape": f"{kind} L{layers_for(kind)} "
                                         f"{ARGS.batch}x{ARGS.seq} accum {accum}", "variant": variant,
                                         "us": r["step_ms"] * 1e3})
                        _free()
                    if ARGS.profile:
                        profile_step(kind, variant, model, accums[0])
                        _free()
            except Exception as e:  # noqa: BLE001
                record(kind=kind, variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}")
            del model
            _free()
    table = []
    for (kind, variant, accum), r in results.items():
        base = results.get((kind, "bf16", accum))
        cast = results.get((kind, "bf16-cast", accum), base) if kind == "moe" else base

        def ratio(key, b):
            return round(r[key] / b[key], 3) if b and b[key] else None

        mode = variant.partition("+")[2]
        peer = results.get((kind, ("bf16-cast" if kind == "moe" else "bf16") + (f"+{mode}" if mode else ""), accum))
        table.append({"model": kind, "layers": layers_for(kind), "variant": variant, "accum": accum,
                      "step_ms": r["step_ms"], "vs_bf16": ratio("step_ms", base),
                      "vs_bf16_cast": ratio("step_ms", cast) if kind != "moe" or (kind, "bf16-cast", accum) in results else None,
                      "vs_same_mode": ratio("step_ms", peer),
                      "peak_GiB": r["peak_gib"], "peak_vs_bf16": ratio("peak_gib", base),
                      "peak_vs_bf16_cast": ratio("peak_gib", cast) if kind != "moe" or (kind, "bf16-cast", accum) in results else None})
    for row in table:
        record(table=row)
    try:
        from tabulate import tabulate
        print(tabulate(table, headers="keys", tablefmt="github"))
    except ImportError:
        for row in table:
            print(row)
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    write_atomically(ARGS.out, json.dumps({"rows": ROWS, "table": table}, indent=1))  # never half, never via a link
    append_results(CSV_ROWS, raw=ARGS.out, csv_path=ARGS.csv)
    print(f"wrote {ARGS.out} ({time.time() - START:.0f} s)")


if __name__ == "__main__":
    main()
