"""Colocated RL on one GPU: the largest rollout batch beside the trainer, BF16 vs NVFP4 rollouts.

    python -m benchmarks.rl.colocated_memory --out DIR [--layers 10] [--settings whole,fsdp] [--shards 8]
        [--variants bf16,quads-experts,w4a16-experts,quads,w4a16,...-fast] [--prompt 256] [--new-tokens 512]
        [--micro-batch 4] [--budget-s 230]
    python -m benchmarks.rl.colocated_memory --tiny --layers 1 --budget-gib 0.0062 --variants bf16,w4a16-experts --out DIR

In a colocated RL job (TRL's colocate mode) the trainer's state and the rollout engine share one
GPU, so the rollout's KV cache gets what the trainer and the rollout weights leave. NVFP4 rollout
weights take 0.5625 bytes per weight against BF16's 2; this measures what the bytes they free buy:
the largest batch of sequences decoded at once, and its decode tokens/s.

Model: Qwen3-30B-A3B's shapes (hidden 2048, 32/4 heads of 128, 128 experts top-8 of width 768,
vocabulary 151936) with ``--layers`` decoder layers, random BF16 weights from the config (no hub;
``benchmarks.rl.rollout_throughput.build_model``). Variants: ``bf16`` (a BF16 copy) and the NVFP4
plans ``quads-experts``, ``w4a16-experts``, ``quads``, ``w4a16`` (the presets' rollout policies,
exact kernels), each also ``-fast`` (``kernel="fast"``: humming's GEMMs; skipped with the reason
where humming is not installed). The rollout is ``build_rollout_model`` of the BF16 model (whose
bytes are then freed: the trainer's weights are counted in its state).

Settings, the trainer's state allocated as real tensors beside the rollout:

* ``whole``: the whole trainer on the GPU: FP32 masters, FP32 gradients, AdamW's two FP32
  moments (16 bytes per parameter) and one micro-batch's activations (:func:`activation_bytes`);
* ``fsdp``: one GPU of an ``--shards``-GPU FSDP2 job: the 16 bytes per parameter divided by N,
  plus FSDP2's unsharded working set (two layers' BF16 parameters, the one being computed and the
  one prefetched, and one layer's FP32 gradients before their reduce-scatter), the micro-batch's
  activations whole; the rollout replica whole.

Per variant and setting: the free bytes after the state (``torch.cuda.mem_get_info`` plus what
the caching allocator holds unused), the largest batch predicted two ways (KV only: free bytes /
the KV bytes of one sequence of ``cache_len = P + T`` positions; probe: from the peak memory of two
small rollouts, which adds the engine's working memory per sequence, mostly the prefill's: it
runs all ``B x P`` prompt tokens at once), then the largest batch measured: a search over B
(:func:`largest_batch`: doubling steps from the probe's prediction, then bisection to
``--resolution``), each try one :class:`quads.engine.GraphedDecoder` call with the full cache
length (``min_cache_len = P + T``) and ``--search-tokens`` new tokens (prefill, the step's warm-up
and capture, a few replays), a try that raises ``torch.OutOfMemoryError`` not fitting; the
session freed and ``torch.cuda.empty_cache()`` between tries. Decode tokens/s is then timed at
that B and at BF16's largest B of the same setting: a prefill-only call (warm-up) and a timed one,
the session freed, then a warm-up call (capture) and a timed call of ``--time-tokens`` new
tokens (one session at a time, as in the search), all with the full cache length
(every decode step attends over the whole static cache, so a step costs the same at any position
of a ``P + T`` rollout); decode tokens/s = B x (time tokens - 1) / (timed call - prefill),
CUDA-synchronized wall clock. ``--budget-s``: no search or timing starts after it (the row says
what was skipped); exact variants run before fast ones.

``--tiny`` runs toy widths on the CPU; ``--budget-gib`` there stands in for the GPU: a byte counter
of what is held (rollout tensors, state tensors) and of each batch's KV bytes raises
``torch.OutOfMemoryError`` past it, before the (real, tiny) rollout runs, so the search logic runs
on CPU. Writes ``<out>/colocated_memory.json`` (every row, the arithmetic) and
``<out>/colocated_memory.md`` (the table), and appends each timed decode step (µs) to the results
CSV (``benchmarks/timing.py``, kernel ``colocated_memory/decode_step``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.rl.rollout_throughput import build_model, fast_unavailable, sync_time
from benchmarks.timing import add_csv_argument, append_results
from quads.engine import GraphedDecoder, SamplingSpec
from quads.engine.decoder import CACHE_LEN_QUANTUM
from quads.ops.weight_cache import weight_cache_enabled
from quads.policies import POLICY_PRESETS, build_rollout_model
from quads.policies.presets import with_kernel
from quads.tensor.files import write_atomically
from quads.tensor.nvfp4_tensor import NVFP4Tensor

VOCAB = 151936  # Qwen3's
GIB = 2**30
PLANS = ("quads-experts", "w4a16-experts", "quads", "w4a16")
VARIANTS = ("bf16",) + PLANS + tuple(f"{p}-fast" for p in PLANS)
SETTINGS = ("whole", "fsdp")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- the arithmetic ---------------------------------------------------------------------------------

def cache_positions(prompt: int, new_tokens: int) -> int:
    """The decoder's cache length for a ``prompt + new_tokens`` rollout (rounded up to its quantum)."""
    return -(-(prompt + new_tokens) // CACHE_LEN_QUANTUM) * CACHE_LEN_QUANTUM


def kv_bytes_per_sequence(config, cache_len: int, dtype_bytes: int = 2) -> int:
    """Keys and values of one sequence: layers x 2 x KV heads x head dim x cache length x bytes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * cache_len * dtype_bytes


def activation_bytes(config, micro_batch: int, seq_len: int) -> int:
    """One micro-batch's training activations, BF16 autocast with gradient checkpointing (the
    setting of a memory-bound colocated trainer), per token: each layer's input (2h bytes), one
    layer's saved tensors while it is recomputed (its norms' outputs, q/k/v, the attention
    output, router logits in FP32, per routed expert its gathered input, gate/up, the activation
    and its output), and the logits (BF16) with their FP32 log-softmax."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    k, width, experts = config.num_experts_per_tok, config.moe_intermediate_size, config.num_experts
    one_layer = 2 * (3 * h + q + 2 * kv + q + 2 * experts + k * (h + 2 * width + width + h))
    per_token = 2 * h * layers + one_layer + (2 + 4) * vocab
    return micro_batch * seq_len * per_token


def layer_parameters(model) -> int:
    """Parameters of the largest decoder layer."""
    return max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)


def trainer_state_bytes(params: int, layer_params: int, shards: int, activations: int) -> dict[str, int]:
    """The trainer's bytes on one GPU: FP32 masters, FP32 gradients, AdamW's two FP32 moments, each
    1/``shards`` of the model; with ``shards`` > 1 FSDP2's unsharded working set (two layers'
    BF16 parameters, one layer's FP32 gradients); one micro-batch's activations."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    share = -(-params // shards)
    state = {"masters": 4 * share, "grads": 4 * share, "adam_moments": 8 * share, "activations": activations}
    if shards > 1:
        state["fsdp_unsharded"] = 2 * 2 * layer_params + 4 * layer_params
    return state


def allocate(state: dict[str, int], device: str) -> list[torch.Tensor]:
    """The state's bytes as real tensors (uninitialized: the allocator reserves them)."""
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in state.values() if n]


def model_bytes(model) -> int:
    """Bytes a model's tensors hold (parameters, buffers; an NVFP4 weight's packed parts)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        parts = t.stored_parts() if isinstance(t, NVFP4Tensor) else (t,)
        total += sum(p.numel() * p.element_size() for p in parts if isinstance(p, torch.Tensor) and p.device.type != "meta")
    return total


# -- memory: the GPU's, or a byte counter standing in for it ---------------------------------------

def release() -> None:
    """Free what a dropped session or an out-of-memory try left (CUDA; nothing to hand back on CPU)."""
    if DEVICE == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


class DeviceMemory:
    """The GPU's memory as CUDA reports it; a batch fits when its rollout runs."""

    def free_bytes(self) -> int:
        release()
        free, _ = torch.cuda.mem_get_info()
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    def hold(self, nbytes: int) -> None:
        pass

    def admit(self, batch: int) -> None:
        pass


class SimulatedMemory:
    """A byte counter standing in for a GPU of ``capacity`` bytes (``--budget-gib`` on CPU): what is
    held is counted (:meth:`hold`), and a rollout of ``batch`` sequences raises
    ``torch.OutOfMemoryError`` when the held bytes plus ``batch`` x ``per_sequence`` pass the capacity."""

    def __init__(self, capacity: int, per_sequence: int):
        self.capacity, self.per_sequence, self._held = capacity, per_sequence, 0

    def free_bytes(self) -> int:
        return self.capacity - self._held

    def hold(self, nbytes: int) -> None:
        self._held += nbytes

    def admit(self, batch: int) -> None:
        need = self._held + batch * self.per_sequence
        if need > self.capacity:
            raise torch.OutOfMemoryError(f"simulated: {need} bytes needed, capacity {self.capacity}")


# -- the search ------------------------------------------------------------------------------------

def largest_batch(fits, start: int, resolution: int = 1, limit: int = 1 << 20) -> tuple[int, list]:
    """The largest B in [1, ``limit``] with ``fits(B)`` (0 if none), ``fits`` monotone; within
    ``resolution`` of the boundary. From ``start``, steps that double (up while B fits, down while
    it does not) bracket the boundary, then bisection. Returns (B, [(tried B, fitted), ...])."""
    if start < 1 or resolution < 1 or limit < 1:
        raise ValueError(f"largest_batch: start, resolution and limit must be >= 1, got {start}, {resolution}, {limit}")
    tries = []

    def test(b):
        ok = bool(fits(b))
        tries.append((b, ok))
        return ok

    start, step = min(start, limit), resolution
    if test(start):
        lo, hi = start, None
        while hi is None and lo < limit:
            b = min(lo + step, limit)
            if test(b):
                lo, step = b, 2 * step
            else:
                hi = b
        if hi is None:
            return lo, tries
    else:
        lo, hi = 0, start
        while lo == 0 and hi > 1:
            b = max(hi - step, 1)
            if test(b):
                lo = b
            else:
                hi, step = b, 2 * step
        if lo == 0:
            return 0, tries
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, tries


def is_oom(error: BaseException | None) -> bool:
    """An out-of-memory error, or one raised while handling one (a capture ended by it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def _end_session(decoder: GraphedDecoder) -> None:
    """Drop the decoder's session (cache, graph) now; the next call makes a new one."""
    decoder._state = None


def prompts(batch: int, prompt: int, vocab: int, seed: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt), device=DEVICE, generator=g)
    return ids, torch.ones_like(ids)


def rollout_fits(decoder, memory, batch: int, prompt: int, new_tokens: int, vocab: int,
                 errors: list | None = None) -> bool:
    """One rollout of ``batch`` sequences runs without running out of memory; freed after. With
    ``errors``, another runtime error (e.g. a kernel's size limit at a large batch) also counts as
    not fitting and is appended there as ``(batch, message)``; without, it is raised."""
    ok = True
    try:
        memory.admit(batch)
        ids, am = prompts(batch, prompt, vocab)
        decoder.generate(ids, am, SamplingSpec(max_new_tokens=new_tokens, eos_token_ids=(), pad_token_id=0))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as error:
        if not is_oom(error):
            if errors is None:
                raise
            errors.append((batch, f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]))
        ok = False
    ids = am = None
    _end_session(decoder)
    release()
    return ok


def probe(decoder, batches, prompt: int, new_tokens: int, vocab: int) -> dict | None:
    """Working bytes per sequence and fixed, from the peak memory of two small rollouts (CUDA)."""
    if DEVICE != "cuda":
        return None
    if not rollout_fits(decoder, DeviceMemory(), batches[0], prompt, new_tokens, vocab):  # compile, workspaces
        return None
    peaks = []
    for b in batches:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if not rollout_fits(decoder, DeviceMemory(), b, prompt, new_tokens, vocab):
            return None
        peaks.append(torch.cuda.max_memory_allocated() - base)
    (b1, b2), (p1, p2) = batches, peaks
    per_seq = (p2 - p1) / (b2 - b1)
    if per_seq <= 0:  # the allocator's rounding hid the growth: no prediction
        return None
    return {"per_sequence": int(per_seq), "fixed": int(p1 - b1 * per_seq), "batches": list(batches)}


def decode_rate(decoder, batch: int, prompt: int, time_tokens: int, vocab: int) -> dict:
    """Decode tokens/s at ``batch`` (module doc); a runtime error (out of memory, ...) is reported, not raised."""
    ids, am = prompts(batch, prompt, vocab, seed=2)
    first = SamplingSpec(max_new_tokens=1, eos_token_ids=(), pad_token_id=0)
    timed = SamplingSpec(max_new_tokens=time_tokens, eos_token_ids=(), pad_token_id=0)
    try:
        decoder.generate(ids, am, first)  # warm-up: kernels at this batch's prefill shapes
        prefill_s = sync_time(lambda: decoder.generate(ids, am, first))  # no decode graph
        _end_session(decoder)  # its cache and pools returned before the timed session's (as between
        release()              # the search's tries: a largest batch fits only one session at a time)
        decoder.generate(ids, am, timed)  # warm-up: the capture, kernels at this batch's shapes
        full_s = sync_time(lambda: decoder.generate(ids, am, timed))
    except RuntimeError as error:  # reported in the row: the other rows still run
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"batch": batch, "error": "out of memory" if is_oom(error) else f"{type(error).__name__}: {text}"[:300]}
    finally:
        ids = am = None
        _end_session(decoder)
        release()
    decode_s = full_s - prefill_s
    row = {"batch": batch, "prefill_s": round(prefill_s, 4), "timed_s": round(full_s, 4)}
    if decode_s <= 0:  # the decode steps took less than the prefill's run-to-run noise
        return {**row, "error": "decode time not measurable (timed call <= prefill)"}
    return {**row, "decode_tok_s": round(batch * (time_tokens - 1) / decode_s, 1),
            "step_us": round(decode_s / (time_tokens - 1) * 1e6, 1)}


# -- one variant -----------------------------------------------------------------------------------

def rollout_policy(name: str):
    """The variant's rollout policy (None: BF16)."""
    if name == "bf16":
        return None
    plan = name.removesuffix("-fast")
    preset = POLICY_PRESETS[plan]
    return with_kernel(preset, "fast").rollout if name.endswith("-fast") else preset.rollout


def run_variant(name: str, args, out: dict, bf16_max: dict, start: float) -> None:
    """Build the variant's rollout, then per setting: state, predictions, search, timings (rows into ``out``)."""
    base = build_model("moe", args.layers, args.tiny, vocab=VOCAB)
    config = base.config
    params, layer_params = sum(p.numel() for p in base.parameters()), layer_parameters(base)
    cache_len = cache_positions(args.prompt, args.new_tokens)
    kv_seq = kv_bytes_per_sequence(config, cache_len)
    before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    rollout = build_rollout_model(base, rollout_policy(name))
    rollout_bytes = torch.cuda.memory_allocated() - before if DEVICE == "cuda" else model_bytes(rollout)
    del base
    release()
    resident = torch.cuda.memory_allocated() if DEVICE == "cuda" else rollout_bytes
    out["arithmetic"].setdefault("params", params)
    out["arithmetic"].setdefault("layer_params", layer_params)
    out["arithmetic"].setdefault("cache_len", cache_len)
    out["arithmetic"].setdefault("kv_bytes_per_sequence", kv_seq)
    decoder = GraphedDecoder(rollout, min_cache_len=cache_len)
    probed = probe(decoder, (args.probe, 4 * args.probe), args.prompt, args.search_tokens, config.vocab_size)
    acts = activation_bytes(config, args.micro_batch, args.prompt + args.new_tokens)
    for setting in args.settings:
        shards = 1 if setting == "whole" else args.shards
        state = trainer_state_bytes(params, layer_params, shards, acts)
        row = {"variant": name, "setting": setting, "shards": shards, "layers": args.layers,
               "rollout_gib": rollout_bytes / GIB, "state_gib": sum(state.values()) / GIB,
               "state_bytes": state, "kv_per_sequence_mib": kv_seq / 2**20, "resident_before_state_gib": resident / GIB}
        out["rows"].append(row)
        if time.time() - start > args.budget_s:
            row["skipped"] = "time budget"
            continue
        memory = (SimulatedMemory(int(args.budget_gib * GIB), kv_seq) if args.budget_gib else DeviceMemory())
        memory.hold(rollout_bytes)
        try:
            held = allocate(state, DEVICE)
        except torch.OutOfMemoryError:
            row["skipped"] = "the trainer state does not fit beside the rollout (fewer --layers)"
            release()
            continue
        memory.hold(sum(t.numel() for t in held))
        free = memory.free_bytes()
        row["free_gib"] = free / GIB
        row["predicted_kv"] = max(free // kv_seq, 0)
        if probed:
            row["probe"] = probed
            row["predicted_probe"] = max(int((free - probed["fixed"]) // probed["per_sequence"]), 0)
        begin = args.start_b or row.get("predicted_probe") or 1
        t0, errors = time.time(), []
        best, tries = largest_batch(
            lambda b: rollout_fits(decoder, memory, b, args.prompt, args.search_tokens, config.vocab_size, errors),
            start=max(begin, 1), resolution=args.resolution, limit=args.max_batch)
        row.update(measured=best, tries=tries, search_s=round(time.time() - t0, 1))
        if errors:  # tries that failed for another reason than memory: the table marks the row
            row["errors"] = errors
        if name == "bf16":
            bf16_max[setting] = best
        for key, batch in (("own", best), ("at_bf16", bf16_max.get(setting))):
            if not batch or (key == "at_bf16" and name == "bf16"):
                continue
            if time.time() - start > args.budget_s:
                row[f"decode_{key}"] = {"batch": batch, "skipped": "time budget"}
                continue
            rate = decode_rate(decoder, batch, args.prompt, args.time_tokens, config.vocab_size)
            if rate.get("error") == "out of memory" and batch > args.resolution:  # at the edge: one step below
                rate = {**decode_rate(decoder, batch - args.resolution, args.prompt, args.time_tokens,
                                      config.vocab_size), "below": f"out of memory at {batch}"}
            row[f"decode_{key}"] = rate
        print(f"[colocated_memory] {name} {setting}: free {row['free_gib']:.1f} GiB, B predicted "
              f"{row['predicted_kv']} (KV) / {row.get('predicted_probe', '-')} (probe), measured {best} "
              f"[{time.time() - start:.0f} s]", flush=True)
        del held
        release()
    del decoder, rollout
    release()


# -- output ----------------------------------------------------------------------------------------

def _rate(row: dict, key: str):
    d = row.get(key) or {}
    return d.get("decode_tok_s")


def table(rows: list[dict]) -> str:
    """Markdown: per variant and setting, the bytes, the largest batch and its decode rate, vs BF16."""
    head = ("| variant | setting | rollout GiB | trainer state GiB | KV GiB free | largest B predicted KV / probe | "
            "largest B measured | decode tok/s at own max B | at BF16's max B | B vs BF16 | tok/s (own B) vs BF16 | "
            "tok/s at BF16's B vs BF16 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    bf16 = {r["setting"]: r for r in rows if r["variant"] == "bf16"}
    fmt = lambda v, spec="": "-" if v is None else format(v, spec)  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    for r in rows:
        peer = bf16.get(r["setting"], {})
        own, at = _rate(r, "decode_own"), _rate(r, "decode_at_bf16")
        if r["variant"] == "bf16":
            at = own
        lines.append(
            f"| {r['variant']} | {r['setting']} (N={r['shards']}) | {r['rollout_gib']:.2f} | {r['state_gib']:.2f} | "
            f"{fmt(r.get('free_gib'), '.2f')} | {fmt(r.get('predicted_kv'))} / {fmt(r.get('predicted_probe'))} | "
            f"{fmt(r.get('measured'))}{' (' + r['skipped'] + ')' if r.get('skipped') else ''}"
            f"{' (errors above it: json)' if r.get('errors') else ''} | {fmt(own)} | {fmt(at)} | "
            f"{ratio(r.get('measured'), peer.get('measured'))} | {ratio(own, _rate(peer, 'decode_own'))} | "
            f"{ratio(at, _rate(peer, 'decode_own'))} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 10; --tiny 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list; bf16 first (the peer)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="whole, fsdp (module doc)")
    p.add_argument("--shards", type=int, default=8, help="N of the fsdp setting")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; --tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens T, cache P+T (default 512; --tiny 16)")
    p.add_argument("--search-tokens", type=int, default=4, help="new tokens per search try")
    p.add_argument("--time-tokens", type=int, default=None, help="new tokens of the timed call (default 128; --tiny 4)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences of the trainer's micro-batch")
    p.add_argument("--probe", type=int, default=32, help="the probe's batches: this and 4x this")
    p.add_argument("--start-b", type=int, default=0, help="the search's first B (default: the probe's prediction, else 1)")
    p.add_argument("--resolution", type=int, default=None, help="sequences (default 16; --tiny 1)")
    p.add_argument("--max-batch", type=int, default=1 << 16)
    p.add_argument("--budget-s", type=float, default=230.0, help="start no search or timing after this")
    p.add_argument("--budget-gib", type=float, default=0.0, help="a simulated capacity (byte counter) instead of the GPU's")
    p.add_argument("--tiny", action="store_true", help="toy widths (CPU)")
    add_csv_argument(p)
    args = p.parse_args(argv)
    tiny = args.tiny
    for key, full, small in (("layers", 10, 2), ("prompt", 256, 16), ("new_tokens", 512, 16), ("time_tokens", 128, 4),
                             ("resolution", 16, 1)):
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    args.variants, args.settings = args.variants.split(","), args.settings.split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}, choose from {VARIANTS}")
    if "bf16" in args.variants and args.variants[0] != "bf16":
        p.error("--variants: bf16 must come first (the other rows are timed at its largest batch)")
    bad = [s for s in args.settings if s not in SETTINGS]
    if bad:
        p.error(f"--settings: unknown {bad}, choose from {SETTINGS}")
    if DEVICE != "cuda" and not args.budget_gib:
        p.error("--budget-gib is needed without a GPU (a simulated capacity)")
    if min(args.layers, args.prompt, args.new_tokens, args.search_tokens, args.shards, args.micro_batch,
           args.probe, args.resolution) < 1 or args.time_tokens < 2:
        p.error("sizes must be >= 1 (--time-tokens >= 2)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    out = {"args": vars(args), "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "torch": torch.__version__, "arithmetic": {}, "rows": []}
    bf16_max: dict[str, int] = {}
    exact = [v for v in args.variants if not v.endswith("-fast")]
    for name in exact + [v for v in args.variants if v.endswith("-fast")]:
        why = fast_unavailable() if name.endswith("-fast") else None
        if why or time.time() - start > args.budget_s:
            out["rows"] += [{"variant": name, "setting": s, "skipped": why or "time budget"} for s in args.settings]
            print(f"[colocated_memory] {name}: skipped ({why or 'time budget'})", flush=True)
            continue
        try:
            with contextlib.nullcontext() if DEVICE == "cuda" else weight_cache_enabled():
                run_variant(name, args, out, bf16_max, start)  # CPU: the reference path dequantizes each weight once
        except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others' rows
            first = str(error).splitlines()[0] if str(error) else ""
            out.setdefault("failed", []).append(f"{name}: {type(error).__name__}: {first}")
            traceback.print_exc()
        release()  # after the handler: its traceback no longer holds the variant's tensors
        write_atomically(out_dir / "colocated_memory.json", json.dumps(out, indent=1))
    rows = [r for r in out["rows"] if "rollout_gib" in r]
    skipped = [f"{r['variant']}/{r['setting']}: {r['skipped']}" for r in out["rows"] if "rollout_gib" not in r]
    text = table(rows) + ("\n\nnot run: " + "; ".join(skipped) if skipped else "")
    text += "".join(f"\n\nFAILED {f}" for f in out.get("failed", []))
    out["elapsed_s"] = round(time.time() - start, 1)
    write_atomically(out_dir / "colocated_memory.json", json.dumps(out, indent=1))
    write_atomically(out_dir / "colocated_memory.md", text + "\n")
    print(text)
    print(f"[colocated_memory] {out['elapsed_s']} s", flush=True)
    timing_rows = []
    for r in rows:
        for key in ("decode_own", "decode_at_bf16"):
            d = r.get(key) or {}
            if "step_us" in d:
                timing_rows.append({"kernel": "colocated_memory/decode_step", "variant": r["variant"], "us": d["step_us"],
                                    "shape": f"moe L={r['layers']} B={d['batch']} cache={out['arithmetic']['cache_len']} "
                                             f"{r['setting']}"})
    append_results(timing_rows, raw=os.path.abspath(out_dir / "colocated_memory.json"), csv_path=args.csv)
    return 1 if out.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
