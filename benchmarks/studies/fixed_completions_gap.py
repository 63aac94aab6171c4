"""The "Fixed completions" table of docs/trl.md: every preset scores the same completions.

On the embedded model, held-out prompts (seed 0): one completion per prompt sampled at T = 1 from
the BF16 model, then scored by each preset's trainer (float32 masters, BF16 autocast) and rollout
model (teacher forcing), ``quads.diagnostics.measure_policy_gap``; the 64-prompt column is what
``tests/integrations/test_trl_integration.py::test_embedded_model_quads_gap_smaller_than_naive`` checks.

    python -m benchmarks.studies.fixed_completions_gap --prompts 64 256
"""

from __future__ import annotations

import argparse
import json

import torch
from quads.tensor.files import write_atomically

PRESETS = ("bf16", "naive", "w4a16-qat", "sym-qat", "quads")
KEYS = ("logp_gap_mean", "logp_gap_p99", "logp_gap_max", "k3_kl")


def gaps(n_prompts: int, seed: int = 0) -> dict[str, dict[str, float]]:
    from quads.diagnostics import build_scoring_batch, measure_policy_gap
    from quads.tasks import generate_completions, load_default_model, make_prompts

    model, tok = load_default_model(dtype=torch.float32)
    prompts = [p["prompt"] for p in make_prompts(n_prompts, seed=seed, split="heldout")]
    texts = generate_completions(model, tok, prompts, greedy=False, temperature=1.0, seed=seed)
    p_ids = [tok(p)["input_ids"] for p in prompts]
    c_ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    ids, am, cm, _ = build_scoring_batch(p_ids, c_ids, tok.pad_token_id)
    out = {}
    for preset in PRESETS:
        metrics = measure_policy_gap(model, preset, ids, am, cm)
        out[preset] = {k: metrics[f"sampling/quads/{k}"] for k in KEYS}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    table = {n: gaps(n) for n in args.prompts}
    print("| preset | " + " | ".join(f"{n} prompts: gap mean | p99 | max | k3 KL" for n in args.prompts) + " |")
    for p in PRESETS:
        cells = [f"{t[p]['logp_gap_mean']:.4f} | {t[p]['logp_gap_p99']:.3f} | {t[p]['logp_gap_max']:.2f} | "
                 f"{t[p]['k3_kl']:.1e}" for t in table.values()]
        print(f"| `{p}` | " + " | ".join(cells) + " |")
    if args.json:
        write_atomically(args.json, json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
