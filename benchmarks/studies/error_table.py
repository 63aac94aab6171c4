"""Relative output error vs BF16 of one layer and of a whole model, per precision config.

Measures what the core issue asks: trainer W4A16 (weight fake-quant), the symmetric W4A4 QAT
ablation, rollout naive W4A4, and rollout W4A4 + residual compensation at k = 25/50/75%
(per-token selection) and 50% static (calibrated). Errors are relative Frobenius norms
against the unquantized model run in float32.

    python -m benchmarks.studies.error_table                 # embedded trained MoE (quads.tasks)
    python -m benchmarks.studies.error_table --random-model  # tiny random Qwen3-MoE instead
    python -m benchmarks.studies.error_table --weight-global-scale tensor   # one global scale per weight
    python -m benchmarks.studies.error_table --model ~/.cache/quads/smollm2-135m-instruct   # a local model

``--weight-global-scale`` (``group``, the default, or ``tensor``) is the policies'
``weight_global_scale``; the weight table compares both on every quantized linear weight.

Prints a markdown table (paste into docs/results.md with the command, machine and date).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import quads
from quads.ops import ActivationQuant, quantize_activation, dequantize_activation
from quads.policies.scale_groups import group_scale_of
from quads.tensor.files import write_atomically

CONFIGS = [
    # name, side, policy kwargs
    ("trainer W4A16 (QUADS trainer)", "trainer", {}),
    ("trainer W4A4 (sym. QAT ablation)", "trainer", {"activations": "nvfp4"}),
    ("rollout W4A4 naive (k=0)", "rollout", {"residual_fraction": 0.0}),
    ("rollout W4A4 + residual k=25%", "rollout", {"residual_fraction": 0.25}),
    ("rollout W4A4 + residual k=50% (the paper's k)", "rollout", {"residual_fraction": 0.5}),
    ("rollout W4A4 + residual k=75%", "rollout", {"residual_fraction": 0.75}),
    ("rollout W4A4 + residual k=100% (QUADS default)", "rollout", {}),
    ("rollout W4A4 + residual k=50% static", "rollout", {"residual_fraction": 0.5, "residual_selection": "static"}),
]


def load_model(random_model: bool, path: str | None = None):
    if path is not None:  # a local HF causal LM (e.g. SmolLM2-135M from `quads fetch-real-model`)
        from quads.diagnostics.cli_inputs import load_local_causal_lm
        from quads.diagnostics.diagnose import GENERIC_PROMPTS

        model, tok = load_local_causal_lm(path, torch.bfloat16)
        batch = tok(list(GENERIC_PROMPTS), padding=True, return_tensors="pt")
        return model, batch["input_ids"], batch["attention_mask"], f"{path} (bf16), the diagnose prompts"
    if not random_model:
        try:
            from quads.tasks import load_default_model
            from quads.tasks.arithmetic import make_prompts

            model, tok = load_default_model()
            prompts = make_prompts(64, seed=7, split="heldout")
            texts = [p["prompt"] + p["answer"] for p in prompts]
            batch = tok(texts, padding=True, return_tensors="pt")
            return model, batch["input_ids"], batch["attention_mask"], "embedded trained Qwen3-MoE (quads.tasks)"
        except Exception as exc:  # noqa: BLE001 - fall back, but say so
            print(f"# embedded model unavailable ({exc!r}); using a random tiny model")
    from tests.tiny_models import build

    model = build("qwen3_moe")
    ids = torch.randint(0, 96, (16, 24), generator=torch.Generator().manual_seed(0))
    return model, ids, torch.ones_like(ids), "random tiny Qwen3-MoE (weights x3)"


def capture_inputs(model, ids, mask, module_name):
    """Inputs of one nn.Linear during a forward of the unquantized model."""
    module = dict(model.named_modules())[module_name]
    seen = []
    h = module.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    h.remove()
    x = torch.cat(seen)
    keep = mask.reshape(-1).bool() if x.shape[0] == mask.numel() else slice(None)
    return module, x[keep]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def forward_weights(model, mode):
    """Linear weight name -> ``DQ(Q(w))`` in float32 with the global scale ``weight_global_scale=mode``
    gives it (the trainer's forward weight before its cast to the master's dtype)."""
    trainer = copy.deepcopy(model)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale=mode))
    return {f"{n}.weight": quads.nvfp4_fake_quantize(m.weight.detach(), dtype=torch.float32,
                                                     global_encode_scale=group_scale_of(m))
            for n, m in quads.quantized_modules(trainer).items() if isinstance(m, torch.nn.Linear)}


def weight_table(model):
    """Relative weight error of every quantized linear weight, one global scale per weight vs
    per sibling group (the members of a group of one are unaffected)."""
    masters = {n: p.detach().float() for n, p in model.named_parameters()}
    per_mode = {mode: forward_weights(model, mode) for mode in ("tensor", "group")}
    rows = []
    for name in per_mode["tensor"]:
        rows.append({"weight": name, **{f"{mode}_rel_err": rel(per_mode[mode][name], masters[name]) for mode in per_mode},
                     "same": bool(torch.equal(per_mode["tensor"][name], per_mode["group"][name]))})
    return rows


def layer_table(model, ids, mask, layer_name, mode="group"):
    linear, x = capture_inputs(model, ids, mask, layer_name)
    w = linear.weight.detach()
    ref = x.float() @ w.float().T
    rows = []
    w_hat = forward_weights(model, mode)[f"{layer_name}.weight"]
    static_k = None
    for name, side, kw in CONFIGS:
        policy = quads.QuadsPolicy(side=side, weight_global_scale=mode, **kw)
        act = policy.activation_quant
        if act is None:
            x_used = x.float()
        else:
            static_mask = None
            if act.selection == "static":
                # calibrate on the first half of the tokens, evaluate on all
                r = (x[: len(x) // 2].float() - dequantize_activation(quantize_activation(x[: len(x) // 2], ActivationQuant(0.0))))
                static_k = quads.ops.activation_quant.num_residual_channels(x.shape[1], act.residual_fraction)
                static_mask = torch.zeros(x.shape[1], dtype=torch.bool)
                static_mask[r.abs().mean(0).topk(static_k).indices] = True
            x_used = dequantize_activation(quantize_activation(x, act, static_mask))
        y = x_used @ w_hat.T
        rows.append({"config": name, "act_rel_err": rel(x_used, x), "out_rel_err": rel(y, ref)})
    return rows


def model_table(model, ids, mask, mode="group"):
    with torch.no_grad():
        ref_model = copy.deepcopy(model).float()
        ref = ref_model(input_ids=ids, attention_mask=mask).logits.float()
        ref_logp = torch.log_softmax(ref, -1)
    tgt = ids[:, 1:]
    m = mask[:, 1:].bool()
    trainer = copy.deepcopy(model)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer", weight_global_scale=mode))
    with torch.no_grad():
        trainer_logits = trainer(input_ids=ids, attention_mask=mask).logits.float()
    trainer_logp = torch.log_softmax(trainer_logits, -1)

    def token_gap(logp, other):
        return (logp[:, :-1].gather(-1, tgt[..., None]) - other[:, :-1].gather(-1, tgt[..., None])).squeeze(-1)[m].abs()

    rows = []
    for name, side, kw in CONFIGS:
        qm = copy.deepcopy(model)
        quads.quantize_(qm, quads.QuadsPolicy(side=side, weight_global_scale=mode, **kw))
        if kw.get("residual_selection") == "static":
            quads.calibrate_residual_channels(qm, [{"input_ids": ids[:8], "attention_mask": mask[:8]}])
        with torch.no_grad():
            logits = qm(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, -1)
        gap = token_gap(logp, ref_logp)
        gap_trainer = token_gap(logp, trainer_logp)
        rows.append({
            "vs_w4a16_trainer_logits_rel_err": rel(logits[mask.bool()], trainer_logits[mask.bool()]),
            "vs_w4a16_trainer_gap_mean": gap_trainer.mean().item(),
            "vs_w4a16_trainer_gap_max": gap_trainer.max().item(),
            "config": name,
            "logits_rel_err": rel(logits[mask.bool()], ref[mask.bool()]),
            "token_logp_gap_mean": gap.mean().item(),
            "token_logp_gap_max": gap.max().item(),
        })
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random-model", action="store_true")
    ap.add_argument("--model", default=None, help="a local HF causal LM directory instead of the embedded model")
    ap.add_argument("--layer", default=None, help="nn.Linear to study (default: layer 0 q_proj)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--weight-global-scale", choices=("group", "tensor"), default="group",
                    help="QuadsPolicy.weight_global_scale of every config")
    args = ap.parse_args()
    mode = args.weight_global_scale
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model, ids, mask, what = load_model(args.random_model, args.model)
    model.eval()
    layer = args.layer or "model.layers.0.self_attn.q_proj"
    wt = weight_table(model)
    lt = layer_table(model, ids, mask, layer, mode)
    mt = model_table(model, ids, mask, mode)
    print(f"model: {what}; tokens: {int(mask.sum())}; reference: unquantized model in float32; "
          f"weight_global_scale={mode!r}\n")
    print("weights (rel. error of the forward weight vs the master; experts are per expert in both modes):\n")
    print("| weight | one scale per tensor | one scale per sibling group | same bits |\n|---|---|---|---|")
    for r in wt:
        print(f"| {r['weight']} | {r['tensor_rel_err']:.5f} | {r['group_rel_err']:.5f} | {'yes' if r['same'] else 'no'} |")
    grouped = [r for r in wt if not r["same"]]
    if grouped:
        mean = lambda key: sum(r[key] for r in grouped) / len(grouped)  # noqa: E731
        print(f"| mean over the {len(grouped)} weights that differ | {mean('tensor_rel_err'):.5f} | "
              f"{mean('group_rel_err'):.5f} | |")
    print()
    print(f"one layer ({layer}, real activations from the model):\n")
    print("| config | activation rel. err | output rel. err |\n|---|---|---|")
    for r in lt:
        print(f"| {r['config']} | {r['act_rel_err']:.4f} | {r['out_rel_err']:.4f} |")
    print("\nwhole model (teacher-forced on the batch):\n")
    print("| config | logits rel. err vs BF16 | mean / max abs token log-prob gap vs BF16 "
          "| logits rel. err vs W4A16 trainer | mean / max gap vs W4A16 trainer |\n|---|---|---|---|---|")
    for r in mt:
        print(
            f"| {r['config']} | {r['logits_rel_err']:.4f} | {r['token_logp_gap_mean']:.4f} / {r['token_logp_gap_max']:.4f} "
            f"| {r['vs_w4a16_trainer_logits_rel_err']:.4f} | {r['vs_w4a16_trainer_gap_mean']:.4f} / {r['vs_w4a16_trainer_gap_max']:.4f} |"
        )
    if args.json:
        write_atomically(args.json, json.dumps({"model": what, "layer": layer, "weight_global_scale": mode,
                                                "weight_rows": wt, "layer_rows": lt, "model_rows": mt}, indent=1))


if __name__ == "__main__":
    main()
