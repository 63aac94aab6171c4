#!/usr/bin/env python
"""Build quads' embedded default model: a tiny Qwen3-MoE trained on integer addition.

The model is created from ``quads.tasks.default_model.default_model_config()`` (random init),
trained with plain supervised next-token loss on the answer tokens (plus the usual small MoE
load-balancing loss, so that all experts stay in use), cast to bfloat16 and saved with
``save_pretrained`` (safetensors) together with the tokenizer and a generation config.

Training stops at ``--steps`` or as soon as the held-out greedy accuracy of the fp32 model
reaches ``--stop-acc``: the point is a model that is *partly* right (so GRPO rewards vary) while
its output distributions are already peaked.

    PYTHONPATH=. python examples/build_default_model.py --out quads/assets/tiny-moe-arith
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from transformers import GenerationConfig, Qwen3MoeForCausalLM  # noqa: E402

from quads.tasks.arithmetic import (  # noqa: E402
    EOS_TOKEN,
    MAX_DIGITS,
    MAX_NEW_TOKENS,
    format_prompt,
    held_out_accuracy,
    make_tokenizer,
    sample_problem,
)
from quads.tasks.default_model import DEFAULT_MODEL_DIR, default_model_config  # noqa: E402


def make_batch(tok, rng: random.Random, batch_size: int):
    prompts, texts = [], []
    for _ in range(batch_size):
        a, b = sample_problem(rng, "train")
        p = format_prompt(a, b)
        prompts.append(p)
        texts.append(p + str(a + b) + EOS_TOKEN)
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.clone()
    labels[mask == 0] = -100
    # mask the prompt (<bos> + "a+b="): with left padding the prompt ends where "=" is
    eq_id = tok.convert_tokens_to_ids("=")
    eq_pos = (ids == eq_id).int().argmax(dim=1)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    labels[pos <= eq_pos.unsqueeze(1)] = -100
    return ids, mask, labels


@torch.no_grad()
def answer_token_stats(model, tok, n: int = 512, seed: int = 0) -> dict[str, float]:
    """Teacher-forced stats on held-out answer tokens: mean entropy (nats), mean max-prob, mean NLL."""
    from quads.tasks.arithmetic import make_prompts

    probs = make_prompts(n, seed=seed, split="heldout")
    enc = tok([p["prompt"] + p["answer"] + EOS_TOKEN for p in probs], padding=True, padding_side="left", return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    was = model.training
    model.eval()
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    model.train(was)
    eq_pos = (ids == tok.convert_tokens_to_ids("=")).int().argmax(dim=1)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    # predictions at positions eq_pos .. L-2 predict the answer tokens and <eos>
    pred_mask = (pos >= eq_pos.unsqueeze(1)) & (pos < ids.shape[1] - 1)
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    tgt = ids[:, 1:]
    m = pred_mask[:, :-1]
    ent = -(lp.exp() * lp).sum(-1)
    nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    pmax = lp.exp().max(-1).values
    return {
        "entropy": ent[m].mean().item(),
        "max_prob": pmax[m].mean().item(),
        "nll": nll[m].mean().item(),
        "frac_max_prob_gt_0.9": (pmax[m] > 0.9).float().mean().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--steps", type=int, default=1500, help="maximum optimizer steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-n", type=int, default=256)
    ap.add_argument("--stop-acc", type=float, default=0.65, help="stop once fp32 held-out greedy acc >= this (<=0: never)")
    ap.add_argument("--final-eval-n", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    tok = make_tokenizer()
    cfg = default_model_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model = Qwen3MoeForCausalLM(cfg).float()
    model.config._experts_implementation = "eager"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}  config: hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} "
          f"experts={cfg.num_experts} top{cfg.num_experts_per_tok} moe_inter={cfg.moe_intermediate_size} "
          f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim} vocab={cfg.vocab_size}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    model.train()
    step, acc = 0, 0.0
    ema = None
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1)
        ids, mask, labels = make_batch(tok, rng, args.batch_size)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ce = (out.loss - cfg.router_aux_loss_coef * out.aux_loss).item()
        ema = ce if ema is None else 0.98 * ema + 0.02 * ce
        if step % 50 == 0:
            print(f"step {step:5d}  lr {lr_at(step - 1):.2e}  ce {ema:.4f}  aux {out.aux_loss.item():.3f}  "
                  f"{time.time() - t0:6.1f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            acc = held_out_accuracy(model, tok, n=args.eval_n, greedy=True, seed=1000 + step)
            print(f"step {step:5d}  held-out greedy acc (fp32, n={args.eval_n}) {acc:.3f}", flush=True)
            if 0 < args.stop_acc <= acc:
                print(f"reached --stop-acc {args.stop_acc}; stopping", flush=True)
                break
    train_s = time.time() - t0

    # Final evaluation in bf16, as quads uses it.
    model.eval()
    model = model.to(torch.bfloat16)
    n = args.final_eval_n
    results = {
        "steps": step,
        "train_seconds": round(train_s, 1),
        "params": n_params,
        "greedy_acc_bf16": held_out_accuracy(model, tok, n=n, greedy=True, seed=0),
        "sampled_acc_T1_bf16": held_out_accuracy(model, tok, n=n, greedy=False, temperature=1.0, seed=0),
        "answer_token_stats_bf16": answer_token_stats(model, tok),
    }
    print(json.dumps(results, indent=2), flush=True)

    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    save_model_files(args.out, model, tok, {"command": " ".join(sys.argv), "seed": args.seed,
                                            "max_digits": MAX_DIGITS, **results})
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved to {args.out} ({size / 1e6:.2f} MB); total {time.time() - t0:.1f}s", flush=True)


def save_model_files(out: Path, model, tok, info: dict) -> None:
    """The model, tokenizer and ``build_info.json`` into ``out``: written in a fresh directory
    beside it, then each file renamed into place (a symlink planted at one of their names in
    ``out`` is replaced, never written through), with ``save_pretrained``'s modes."""
    import os
    import shutil
    import tempfile

    from quads.tensor.files import publish_modes, write_atomically

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        write_atomically(staging / "build_info.json", json.dumps(info, indent=2) + "\n")
        publish_modes(staging)
        for f in sorted(staging.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    main()
