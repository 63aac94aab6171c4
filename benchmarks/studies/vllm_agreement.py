"""The agreement table of docs/vllm.md: vLLM's ``quads`` engine vs the transformers rollout model.

Tiny random checkpoints of ``tests/vllm/_support.py`` (Qwen3-MoE, Llama, Qwen3; seeds 0-2), and a
stand-in with the embedded model's config (random scaled weights): greedy decoding of 6 prompts x
12 tokens in vLLM, the same tokens re-scored by the transformers model under the same quads
policy (teacher forcing). Every row uses the quads defaults (``QuadsPolicy(side="rollout")``, the
engine's default ``quantization_config``), unless it names another setting. Run in the vLLM venv:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        .venv-vllm/bin/python -m benchmarks.studies.vllm_agreement --out results/vllm_agreement
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from quads.tensor.files import write_atomically

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "vllm"))

EMBEDDED_CONFIG = Path(__file__).resolve().parents[2] / "quads" / "assets" / "tiny-moe-arith" / "config.json"


def _stand_in(seed: int = 0):
    """A model with the embedded model's config and random weights, scaled as ``_support.build``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(EMBEDDED_CONFIG.parent))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
        model.lm_head.weight.mul_(8.0)
    return model.to(torch.bfloat16).eval()


def _transformers(path, policy=None, attn=None):
    from transformers import AutoModelForCausalLM

    import quads

    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()
    if policy is not None:
        quads.quantize_(model, policy)
    return model


def _engine_vs(path, policy, engine_config, row: str) -> dict:
    from _support import agreement, make_llm, release

    kwargs = {} if engine_config is False else {"quantization": "quads"}
    if engine_config:
        kwargs["hf_overrides"] = {"quantization_config": engine_config}
    llm = make_llm(path, **kwargs)
    try:
        stats = agreement(llm, _transformers(path, policy))
    finally:
        release(llm)
    print(f"{row}: {stats}", flush=True)
    return {"row": row, **stats}


def _eager_vs_sdpa(path, policy, row: str) -> dict:
    """transformers with eager vs SDPA attention on the same quads rollout: its own kernel spread."""
    from _support import PROMPTS, teacher_forced

    from quads.tasks.arithmetic import make_tokenizer

    tok, sdpa, eager = make_tokenizer(), _transformers(path, policy, "sdpa"), _transformers(path, policy, "eager")
    diffs = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            greedy = sdpa.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        diffs.append((teacher_forced(sdpa, ids, greedy)[0] - teacher_forced(eager, ids, greedy)[0]).abs())
    d = torch.cat(diffs)
    stats = {"row": row, "max": d.max().item(), "mean": d.mean().item(), "tokens": d.numel()}
    print(f"{row}: {stats}", flush=True)
    return stats


def _engine_vs_trainer(path, engine_config, row: str) -> dict:
    """Greedy tokens of the quads engine re-scored by the W4A16 QAT trainer (the QUADS gap)."""
    import quads

    from _support import agreement, make_llm, release

    llm = make_llm(path, quantization="quads", hf_overrides={"quantization_config": engine_config})
    try:
        stats = agreement(llm, _transformers(path, quads.QuadsPolicy(side="trainer")))
    finally:
        release(llm)
    print(f"{row}: {stats}", flush=True)
    return {"row": row, **stats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)

    import quads
    from _support import KINDS, build, save
    from quads.integrations.vllm.quant_method import quads_quantization_config

    rollout, w4a16 = quads.QuadsPolicy(side="rollout"), quads.QuadsPolicy(side="rollout", activations="bf16")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("qwen3_moe", "llama", "qwen3"):
            assert kind in KINDS
            for seed in args.seeds:
                path = save(build(kind, seed), Path(tmp) / f"{kind}-{seed}")
                rows.append(_engine_vs(path, rollout, None, f"{kind} seed {seed}: quads default"))
            path = Path(tmp) / f"{kind}-{args.seeds[0]}"
            rows.append(_engine_vs(path, None, False, f"{kind} seed {args.seeds[0]}: BF16 vLLM vs BF16 transformers"))
            rows.append(_eager_vs_sdpa(path, rollout, f"{kind} seed {args.seeds[0]}: transformers eager vs sdpa"))
        path = Path(tmp) / f"qwen3_moe-{args.seeds[0]}"
        rows.append(_engine_vs(path, w4a16, quads_quantization_config(activations="bf16"),
                               f"qwen3_moe seed {args.seeds[0]}: W4A16"))
        stand_in = save(_stand_in(), Path(tmp) / "stand-in")
        rows.append(_engine_vs(stand_in, rollout, None, "embedded-config stand-in: quads default"))
        for fraction in (1.0, 0.0):
            rows.append(_engine_vs_trainer(stand_in, quads_quantization_config(residual_fraction=fraction),
                                           f"embedded-config stand-in: engine (residual {fraction}) vs W4A16 QAT trainer"))
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomically(args.out / "agreement.json", json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'agreement.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
