"""End-to-end rollout throughput: BF16 vs quads rollout models, sampling with the graphed decoder.

    python -m benchmarks.rl.rollout_throughput --out DIR [--models moe,dense]
        [--batches 1,8,64,256] [--prompt 64] [--new-tokens 128] [--layers 4] [--budget-s 300]

Models are built from config with random weights (no hub): ``moe`` has Qwen3-30B-A3B's layer
shapes (hidden 2048, 32/4 heads of 128, 128 experts top-8 of width 768), ``dense`` Llama-3-8B's
(hidden 4096, MLP 14336, 32/8 heads), ``--layers`` decoder layers each and a 32000 vocabulary
(lm_head and embeddings stay BF16 in every variant). Variants, each a rollout copy of the same
BF16 model: ``bf16`` (transformers' grouped_mm experts), ``fp8`` (W8A8: per-channel E4M3
weights, per-token E4M3 activations by one fused kernel, cuBLASLt ``_scaled_mm`` and
``_scaled_grouped_mm``; ``benchmarks/rl/fp8_rollout.py``), ``quads`` (the default rollout policy:
W4A4 + residual, sibling projections fused by ``build_rollout_model``), ``quads-unfused`` (the
same without :func:`quads.fuse_projections_`: every linear its own GEMM, like the BF16 and FP8
peers), ``naive`` (W4A4, no residual; fused), ``w4a16`` (NVFP4 weights, BF16 activations),
``quads-fast`` / ``w4a16-fast`` (``quads`` / ``w4a16`` with ``kernel="fast"``: humming's GEMMs on
sm_90, docs/humming.md; rows next to the exact ones, same run, same peers; skipped with the reason
where humming is not installed).

For each batch size: prompts of ``--prompt`` random tokens (no padding), ``--new-tokens``
sampled at temperature 1 with no EOS (every row runs to the end). Times, after one warm-up
call (graph capture, Triton compilation): prefill (a ``max_new_tokens=1`` call: prompt forward
+ first token) and the decode loop (the rest of a full call), both synchronized wall clock.
Decode tokens/s = batch x (new tokens - 1) / decode time. ``hf_generate`` rows time
``model.generate`` (dynamic cache, no graphs: the engine before this benchmark) at one batch
size. A greedy check compares the graphed and eager step loops token for token.

``--glue`` (default ``new``): the decoder's glue settings to run, each a full pass over the
batches, rows tagged ``glue``: ``new`` = :class:`GraphedDecoder`'s defaults (GQA attention
without ``repeat_kv``, sibling linears sharing one activation quantization), ``old`` = both
off (the engine as measured before), ``no-gqa`` / ``no-share`` = one of them off. With two or
more, a ``glue_greedy_agreement`` row compares the first two's greedy tokens (the attention
kernel's blocking may move BF16 roundings; informational). ``python -m benchmarks.studies.make_tables
rollout <json>`` prints one table per glue and the new/old step ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch


import quads  # noqa: E402
from quads.engine import GraphedDecoder, SamplingSpec  # noqa: E402
from quads.policies import build_rollout_model, copy_model  # noqa: E402
from quads.tensor.files import write_atomically  # noqa: E402

VOCAB = 32000
VARIANTS = {
    "bf16": None,
    "fp8": "fp8",  # benchmarks/rl/fp8_rollout.py: W8A8, fused per-token activation quantization
    "quads": quads.QuadsPolicy(side="rollout"),
    "quads-unfused": quads.QuadsPolicy(side="rollout"),  # without quads.fuse_projections_
    "naive": quads.QuadsPolicy(side="rollout", residual_fraction=0.0),
    "w4a16": quads.QuadsPolicy(side="rollout", activations="bf16"),
    # kernel="fast": the same policies through humming on sm_90 (docs/humming.md); skipped with the
    # reason where humming is not installed; on CPU (--tiny) the preference picks the torch reference
    "quads-fast": quads.QuadsPolicy(side="rollout", kernel="fast"),
    "w4a16-fast": quads.QuadsPolicy(side="rollout", activations="bf16", kernel="fast"),
}


def fast_unavailable() -> str | None:
    """Why ``kernel="fast"`` variants cannot run here (None: they can)."""
    if DEVICE != "cuda":
        return None  # the preference falls back to the torch reference off sm_90 (the --tiny smoke test)
    from quads.ops.backends.humming.library import HUMMING_REQUIREMENT, import_humming

    try:
        import_humming()
    except ImportError as e:
        return f"humming not installed (pip install {HUMMING_REQUIREMENT}): {e}"
    return None
#: --glue settings -> GraphedDecoder keyword arguments
GLUE = {
    "new": dict(gqa_attention=True, share_quantization=True),
    "old": dict(gqa_attention=False, share_quantization=False),
    "no-gqa": dict(gqa_attention=False, share_quantization=True),
    "no-share": dict(gqa_attention=True, share_quantization=False),
}
ROWS: list[dict] = []
START = time.time()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_model(kind: str, layers: int, tiny: bool = False, vocab: int = VOCAB):
    """The benchmark model (BF16, seed 0, on ``DEVICE``), ``vocab`` tokens; ``tiny``: same architecture at
    toy width (a CPU smoke test of this script)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    w = 32 if tiny else 1  # width divisor
    common = dict(vocab_size=vocab // (100 if tiny else 1), num_hidden_layers=layers, num_attention_heads=32 // (8 if tiny else 1),
                  head_dim=128 // (8 if tiny else 1), max_position_embeddings=4096, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if kind == "moe":
        cfg = Qwen3MoeConfig(hidden_size=2048 // w, num_key_value_heads=4 // (2 if tiny else 1), intermediate_size=6144 // w,
                             moe_intermediate_size=768 // (16 if tiny else 1), num_experts=128 // (16 if tiny else 1),
                             num_experts_per_tok=8 // (4 if tiny else 1), decoder_sparse_step=1, norm_topk_prob=True, **common)
        cls = Qwen3MoeForCausalLM
    elif kind == "dense":
        cfg = LlamaConfig(hidden_size=4096 // w, num_key_value_heads=8 // (4 if tiny else 1), intermediate_size=14336 // (w * 2),
                          **common)
        cls = LlamaForCausalLM
    else:
        raise ValueError(kind)
    if kind == "moe":  # transformers' graph-capturable fused experts path for the BF16 peer
        cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = cls(cfg).to(torch.bfloat16)
    return model.eval()


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def sync_time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _memory(stat: str) -> float:
    return round(getattr(torch.cuda, stat)() / 2**30, 2) if DEVICE == "cuda" else 0.0


def _free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def record(**row):
    row["elapsed_s"] = round(time.time() - START, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def greedy_tokens(model, glue: str, prompt: int) -> torch.Tensor:
    """16 graphed greedy tokens x 8 rows (the seed-1 prompts of :func:`bench_variant`'s check)."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (8, prompt), device=DEVICE, generator=g)
    spec = SamplingSpec(max_new_tokens=16, eos_token_ids=(), pad_token_id=0, do_sample=False)
    return GraphedDecoder(model, **GLUE[glue]).generate(ids, torch.ones_like(ids), spec)[0]


def bench_variant(kind, name, model, batches, prompt, new_tokens, hf_batch, budget_s, glue="new"):
    decoder = GraphedDecoder(model, **GLUE[glue])
    prefill = GraphedDecoder(model, **GLUE[glue])  # its own session: the full-length one keeps its graph
    eager = GraphedDecoder(model, use_cuda_graph=False, **GLUE[glue])
    g = torch.Generator(device=DEVICE).manual_seed(1)
    # greedy check: graphed and eager step loops give the same tokens (same kernels, same order)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (8, prompt), device=DEVICE, generator=g)
    am = torch.ones_like(ids)
    greedy = SamplingSpec(max_new_tokens=16, eos_token_ids=(), pad_token_id=0, do_sample=False)
    a, _ = decoder.generate(ids, am, greedy)
    b, _ = eager.generate(ids, am, greedy)
    record(kind=kind, variant=name, glue=glue, check="graphed_equals_eager_greedy", ok=bool(torch.equal(a, b)),
           mismatched_tokens=int((a != b).sum()))
    for batch in batches:
        if time.time() - START > budget_s:
            record(kind=kind, variant=name, glue=glue, batch=batch, skipped="time budget")
            continue
        ids = torch.randint(0, vocab, (batch, prompt), device=DEVICE, generator=g)
        am = torch.ones_like(ids)
        full = SamplingSpec(max_new_tokens=new_tokens, eos_token_ids=(), pad_token_id=0)
        first = SamplingSpec(max_new_tokens=1, eos_token_ids=(), pad_token_id=0)
        try:
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            decoder.generate(ids, am, full)  # warm-up: capture, compile
            t_prefill = min(sync_time(lambda: prefill.generate(ids, am, first)) for _ in range(2))
            t_full = sync_time(lambda: decoder.generate(ids, am, full))
            t_decode = max(t_full - t_prefill, 1e-9)
            record(kind=kind, variant=name, glue=glue, batch=batch, prompt=prompt, new_tokens=new_tokens,
                   prefill_ms=round(t_prefill * 1e3, 3), decode_ms=round(t_decode * 1e3, 3),
                   decode_step_us=round(t_decode / (new_tokens - 1) * 1e6, 2),
                   decode_tok_s=round(batch * (new_tokens - 1) / t_decode, 1),
                   total_tok_s=round(batch * new_tokens / t_full, 1),
                   peak_mem_gib=_memory("max_memory_allocated"))
        except Exception as error:  # noqa: BLE001 - record and go on: one device run must give every number it can
            record(kind=kind, variant=name, glue=glue, batch=batch, error=f"{type(error).__name__}: {error}",
                   trace=traceback.format_exc()[-1500:])
        decoder._state = prefill._state = None
        _free()
    if hf_batch and time.time() - START < budget_s:
        try:
            ids = torch.randint(0, vocab, (hf_batch, prompt), device=DEVICE, generator=g)
            am = torch.ones_like(ids)
            steps = 32
            kwargs = dict(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0, eos_token_id=None)
            model.generate(**kwargs, max_new_tokens=4)
            t1 = sync_time(lambda: model.generate(**kwargs, max_new_tokens=1))
            tn = sync_time(lambda: model.generate(**kwargs, max_new_tokens=steps, min_new_tokens=steps))
            t_dec = max(tn - t1, 1e-9)
            record(kind=kind, variant=name, engine="hf_generate", batch=hf_batch, new_tokens=steps,
                   decode_step_us=round(t_dec / (steps - 1) * 1e6, 2),
                   decode_tok_s=round(hf_batch * (steps - 1) / t_dec, 1))
        except Exception as error:  # noqa: BLE001
            record(kind=kind, variant=name, engine="hf_generate", error=f"{type(error).__name__}: {error}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="moe,dense")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--glue", default="new", help=f"comma list of {tuple(GLUE)} (see the module doc)")
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke test of the script)")
    args = ap.parse_args()
    glues = args.glue.split(",")
    unknown = [x for x in glues if x not in GLUE]
    if unknown:
        raise SystemExit(f"--glue: unknown {unknown}, use {tuple(GLUE)}")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", date=time.strftime("%Y-%m-%d %H:%M:%S"),
                argv=sys.argv[1:])
    import transformers

    meta["transformers"] = transformers.__version__
    print(meta, flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    bases = {}
    for kind in args.models.split(","):
        bases[kind] = build_model(kind, args.layers, args.tiny)
        record(kind=kind, built="bf16", experts_implementation=getattr(bases[kind].config, "_experts_implementation", None),
               params_b=round(sum(p.numel() for p in bases[kind].parameters()) / 1e9, 3))
    for name in args.variants.split(","):  # variants outermost: a cut-short run still has both models' peers
        for kind, base in bases.items():
            if time.time() - START > args.budget_s:
                record(kind=kind, variant=name, skipped="time budget")
                continue
            model = None
            why = fast_unavailable() if name.endswith("-fast") else None
            if why:
                record(kind=kind, variant=name, skipped=why)
                print(f"{kind} {name}: skipped: {why}", flush=True)
                continue
            try:
                t0 = time.perf_counter()
                if VARIANTS[name] is None:
                    model = base
                elif VARIANTS[name] == "fp8":
                    from benchmarks.rl.fp8_rollout import to_fp8_rollout

                    model = to_fp8_rollout(copy_model(base))
                else:
                    model = build_rollout_model(base, VARIANTS[name], fuse_projections=name != "quads-unfused")
                _sync()
                build_s = time.perf_counter() - t0
                quantized = model is not base and VARIANTS[name] != "fp8"
                sync_s = sync_time(lambda: quads.sync_weights_(model, base, plain_trainer=True)) if quantized else 0.0
                record(kind=kind, variant=name, build_s=round(build_s, 2), sync_ms=round(sync_s * 1e3, 1),
                       weights_gib=_memory("memory_allocated"))
                for i, glue in enumerate(glues):
                    bench_variant(kind, name, model, batches, args.prompt, args.new_tokens,
                                  args.hf_batch if i == 0 else 0, args.budget_s, glue)
                if len(glues) > 1:
                    a, b = (greedy_tokens(model, x, args.prompt) for x in glues[:2])
                    record(kind=kind, variant=name, check="glue_greedy_agreement", glues=glues[:2],
                           mismatched_tokens=int((a != b).sum()), of=a.numel())
            except Exception as error:  # noqa: BLE001
                record(kind=kind, variant=name, error=f"{type(error).__name__}: {error}",
                       trace=traceback.format_exc()[-2000:])
            if model is not base:
                del model
            model = None
            _free()
            write_atomically(os.path.join(args.out, "rollout_throughput.json"), json.dumps(dict(meta=meta, rows=ROWS), indent=1))
    write_atomically(os.path.join(args.out, "rollout_throughput.json"), json.dumps(dict(meta=meta, rows=ROWS), indent=1))


if __name__ == "__main__":
    main()
