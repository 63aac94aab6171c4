"""NVFP4 error with and without Four Over Six block scaling (``block_scaling="4over6"``), on CPU.

Four measurements, all through the recipe (:func:`quads.tensor.nvfp4_math.nvfp4_quantize`):

1. **weights**: every linear weight of a local model (SmolLM2-135M: 210), quantized as the trainer's
   forward weight is, with one global scale per weight and per q/k/v and gate/up group: relative
   squared error ``|DQ(Q(w)) - w|^2 / |w|^2`` per weight and overall (sum over sum), and the
   fraction of blocks that choose the max-to-4 scale;
2. **gaussian**: the same shapes filled with N(0, 0.02^2) (bf16);
3. **activations**: the real inputs of every linear (teacher-forced on the text below), per-token
   global scales: relative squared error of ``DQ(Q(x))`` (naive W4A4) and of ``DQ(Q(x)) + DQ(Q(r))``
   (the rollout's k = 100% residual, which shares the row's global scale), for each combination
   of block scaling of the main term and of the residual;
4. **model**: teacher-forced token log-prob gaps (mean / p99 / max over the tokens) of the model
   with NVFP4 forward weights against the BF16 model (the trainer's weight error), and of each
   activation configuration against those forward weights with unquantized activations (the
   rollout's activation part, what ``quads diagnose`` measures; on the standard forward weights),
   computed in float32 with the activations replaced through forward pre-hooks.

The text: the completions ``quads diagnose`` samples (its 8 prompts, BF16 model, T = 1, seed 0,
120 new tokens), prompts included.

    python -m benchmarks.studies.four_over_six_error --model ~/.cache/quads/smollm2-135m-instruct \\
        --json results/four_over_six_cpu_2026-12-03/error.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from quads.diagnostics.cli_inputs import load_local_causal_lm
from quads.diagnostics.diagnose import GENERIC_PROMPTS, sample_completions
from quads.diagnostics.scoring import positions_from_mask
from quads.policies.scale_groups import sibling_groups
from quads.tensor.files import write_atomically
from quads.tensor.nvfp4_math import (
    BLOCK_SCALINGS,
    nvfp4_dequantize,
    nvfp4_quantize,
    shared_global_encode_scale,
)

SKIP = ("lm_head",)


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {f"{n}.weight": m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not n.endswith(SKIP)}


def group_scales(weights: dict[str, torch.Tensor], block_scaling: str) -> dict[str, torch.Tensor]:
    """Weight name -> the S_enc of its q/k/v or gate/up group (weights outside a group: absent)."""
    out = {}
    for names in sibling_groups(n.removesuffix(".weight") for n in weights):
        members = [f"{n}.weight" for n in names]
        scale = shared_global_encode_scale((weights[m] for m in members), block_scaling)
        out.update({m: scale for m in members})
    return out


def quantize_stats(w: torch.Tensor, block_scaling: str, scale: torch.Tensor | None = None):
    """(squared error, squared norm, blocks choosing 4, blocks, forward weight fp32) of ``w``."""
    parts = nvfp4_quantize(w, None, scale, block_scaling)
    w_hat = nvfp4_dequantize(*parts)
    wf = w.float()
    four = 0
    if block_scaling == "4over6":  # a block chose 4 iff its scale differs from the 6 candidate's
        six = nvfp4_quantize(w, None, parts.global_encode_scale, "6")
        four = int((parts.scale.view(torch.uint8) != six.scale.view(torch.uint8)).sum())
    return float(((w_hat - wf) ** 2).sum()), float((wf ** 2).sum()), four, parts.scale.numel(), w_hat


def weight_table(weights: dict[str, torch.Tensor]) -> dict:
    rows, totals = [], {}
    forward = {}
    for mode in ("tensor", "group"):
        for bs in BLOCK_SCALINGS:
            scales = group_scales(weights, bs) if mode == "group" else {}
            err = norm = four = blocks = 0.0
            for name, w in weights.items():
                e, n, f, b, w_hat = quantize_stats(w, bs, scales.get(name))
                err, norm, four, blocks = err + e, norm + n, four + f, blocks + b
                rows.append({"weight": name, "global_scale": mode, "block_scaling": bs, "rel_sq_err": e / n,
                             "frac_4": f / b})
                if mode == "group":
                    forward.setdefault(bs, {})[name] = w_hat
            progress(f"weights: {mode} / {bs}: {err / norm:.5f}")
            totals[f"{mode}/{bs}"] = {"rel_sq_err": err / norm, "frac_4": four / blocks,
                                      "mean_per_weight": sum(r["rel_sq_err"] for r in rows
                                                             if r["global_scale"] == mode and r["block_scaling"] == bs)
                                      / len(weights)}
    return {"totals": totals, "rows": rows}, forward


def gaussian_table(weights: dict[str, torch.Tensor]) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for bs in BLOCK_SCALINGS:
        err = norm = four = blocks = 0.0
        for w in weights.values():
            e, n, f, b, _ = quantize_stats((torch.randn(w.shape, generator=g) * 0.02).bfloat16(), bs)
            err, norm, four, blocks = err + e, norm + n, four + f, blocks + b
        out[bs] = {"rel_sq_err": err / norm, "frac_4": four / blocks}
        g.manual_seed(0)  # the same tensors for both
    return out


ACT_CONFIGS = [  # (name, main block scaling, residual block scaling or None)
    ("W4A4 naive, 6", "6", None),
    ("W4A4 naive, 4over6", "4over6", None),
    ("+ residual, main 6 / residual 6", "6", "6"),
    ("+ residual, main 4over6 / residual 6", "4over6", "6"),
    ("+ residual, main 6 / residual 4over6", "6", "4over6"),
    ("+ residual, main 4over6 / residual 4over6", "4over6", "4over6"),
]


def simulated_activation(x: torch.Tensor, main: str, residual: str | None) -> torch.Tensor:
    """``DQ(Q(x))`` (+ ``DQ(Q(r))`` with the row's global scale) of 2-D ``x``, float32."""
    parts = nvfp4_quantize(x, "row", None, main)
    x_hat = nvfp4_dequantize(*parts)
    if residual is None:
        return x_hat
    r = x.float() - x_hat
    return x_hat + nvfp4_dequantize(*nvfp4_quantize(r, "row", parts.global_encode_scale, residual))


def forward(model, batch):
    ids, mask = batch
    return model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))


def capture_inputs(model, batch, names) -> dict[str, torch.Tensor]:
    """The inputs of the linears ``names`` on the batch's real (unpadded) tokens."""
    modules = dict(model.named_modules())
    seen, hooks = {}, []
    real = batch[1].reshape(-1).bool()

    def keep(name, x):
        seen[name] = x.detach().reshape(-1, x.shape[-1])[real].float()

    for n in names:
        hooks.append(modules[n].register_forward_pre_hook(lambda m, a, n=n: keep(n, a[0])))
    with torch.no_grad():
        forward(model, batch)
    for h in hooks:
        h.remove()
    return seen


def activation_table(inputs: dict[str, torch.Tensor]) -> dict:
    out = {}
    for name, main, residual in ACT_CONFIGS:
        err = norm = 0.0
        for x in inputs.values():
            x_hat = simulated_activation(x, main, residual)
            err, norm = err + float(((x_hat - x) ** 2).sum()), norm + float((x ** 2).sum())
        out[name] = err / norm
    return out


def token_logprobs(model, batch) -> torch.Tensor:
    """Log-probs of the batch's real tokens (after the first of each row) under ``model``."""
    ids, mask = batch
    with torch.no_grad():
        logits = forward(model, batch).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp[mask[:, 1:].bool()]


def gap_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"mean": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max())}


def model_table(model, batch, forward_weights: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Log-prob gaps in float32: forward weights (each block scaling) vs BF16 weights; then, on the
    standard forward weights, each activation configuration vs unquantized activations."""
    model = model.float()
    params = dict(model.named_parameters())
    masters = {n: params[n].detach().clone() for n in forward_weights["6"]}
    base = token_logprobs(model, batch)
    modules = dict(model.named_modules())
    out = {"weights": {}, "activations": {}}
    for bs in ("4over6", "6"):  # the standard weights last: the activation rows run on them
        with torch.no_grad():
            for n, w_hat in forward_weights[bs].items():
                params[n].copy_(w_hat)
        trainer = token_logprobs(model, batch)
        out["weights"][f"forward weights {bs} vs BF16"] = gap_stats(trainer, base)
        progress(f"model: forward weights {bs}")
    for name, main, residual in ACT_CONFIGS:
        hooks = [modules[n.removesuffix(".weight")].register_forward_pre_hook(
            lambda m, a, main=main, residual=residual: (
                simulated_activation(a[0].reshape(-1, a[0].shape[-1]), main, residual).reshape(a[0].shape),))
            for n in forward_weights["6"]]
        out["activations"][name] = gap_stats(token_logprobs(model, batch), trainer)
        for h in hooks:
            h.remove()
        progress(f"model: {name}")
    with torch.no_grad():
        for n, w in masters.items():
            params[n].copy_(w)
    return out


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def text_batch(model, tok, new_tokens: int):
    """``(ids, attention mask)``: the completions ``quads diagnose`` samples (its prompts, T = 1,
    seed 0, left padding, the tokens after an EOS masked)."""
    ids, mask, _ = sample_completions(model, tok, GENERIC_PROMPTS, new_tokens, 1.0, 0)
    return ids, mask


def print_report(report: dict) -> None:
    print(f"# {report['model_path']}: {report['weights_count']} linear weights, {report['tokens']} tokens "
          f"({report['seconds']:.0f} s)\n")
    print("| weights | global scale | block scaling | rel. sq. error (overall) | mean per weight | blocks choosing 4 |")
    print("|---|---|---|---|---|---|")
    for key, t in report["weights"]["totals"].items():
        mode, bs = key.split("/")
        print(f"| {report['model_name']} | {mode} | {bs} | {t['rel_sq_err']:.5f} | {t['mean_per_weight']:.5f} "
              f"| {t['frac_4']:.1%} |")
    for bs, t in report["gaussian"].items():
        print(f"| N(0, 0.02^2), same shapes | tensor | {bs} | {t['rel_sq_err']:.5f} | | {t['frac_4']:.1%} |")
    print("\n| activations (per-token scale) | rel. sq. error |\n|---|---|")
    for name, e in report["activations"].items():
        print(f"| {name} | {e:.3e} |")
    print("\n| model (float32, teacher-forced) | gap mean | gap p99 | gap max |\n|---|---|---|---|")
    for name, g in report["model_gaps"]["weights"].items():
        print(f"| {name} | {g['mean']:.4f} | {g['p99']:.4f} | {g['max']:.4f} |")
    for name, g in report["model_gaps"]["activations"].items():
        print(f"| weights 6, activations {name} vs W4A16 | {g['mean']:.4f} | {g['p99']:.4f} | {g['max']:.4f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face causal LM directory")
    ap.add_argument("--new-tokens", type=int, default=120, help="as quads diagnose --max-new-tokens")
    ap.add_argument("--json", default=None, help="write the full report (every weight's row) here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    start = time.time()
    model, tok = load_local_causal_lm(args.model, torch.bfloat16)
    model.eval()
    weights = linear_weights(model)
    batch = text_batch(model, tok, args.new_tokens)
    progress(f"text: {tuple(batch[0].shape)}, {int(batch[1].sum())} tokens")
    report = {"model_path": args.model, "model_name": type(model).__name__, "weights_count": len(weights),
              "tokens": int(batch[1].sum())}
    report["weights"], forward_weights = weight_table(weights)
    progress("weights")
    report["gaussian"] = gaussian_table(weights)
    progress("gaussian")
    report["activations"] = activation_table(capture_inputs(model, batch, [n.removesuffix(".weight") for n in weights]))
    progress("activations")
    report["model_gaps"] = model_table(model, batch, forward_weights)
    report["seconds"] = time.time() - start
    print_report(report)
    if args.json:
        write_atomically(args.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
