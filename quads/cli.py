"""The ``quads`` console script.

    quads demo       quantize a small MoE both ways and print the error / alignment summary
    quads diagnose   rollout-vs-trainer mismatch report for a local HF causal LM (see --help)
    quads export     a QUADS-trained checkpoint as a ModelOpt NVFP4 checkpoint for serving
"""

from __future__ import annotations

import argparse
import sys

from quads.diagnostics.cli_inputs import UsageError


def _demo(args: argparse.Namespace) -> int:
    import copy

    import torch

    import quads
    from quads.tensor import NVFP4Tensor, nvfp4_fake_quantize

    try:
        from quads.tasks import load_default_model

        model, _ = load_default_model()
        what = "embedded Qwen3-MoE"
    except Exception:  # noqa: BLE001
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                   moe_intermediate_size=32, num_experts=4,
                                                   num_experts_per_tok=2)).to(torch.bfloat16)
        what = "random tiny Qwen3-MoE"
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    trainer, rollout = copy.deepcopy(model), copy.deepcopy(model)
    quads.quantize_(trainer, quads.QuadsPolicy(side="trainer"))
    quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", residual_fraction=args.residual_fraction))
    quads.sync_weights_(rollout, trainer)
    masters = dict(trainer.named_parameters())
    packed = [(n, p) for n, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)]
    exact = all(torch.equal(p.dequantize(torch.bfloat16), nvfp4_fake_quantize(masters[n].detach())) for n, p in packed)
    with torch.no_grad():
        ref = model.float()(ids).logits
        lt = trainer(ids).logits.float()
        lr = rollout(ids).logits.float()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"model: {what}; {len(packed)} packed NVFP4 weights; rollout weights == trainer fake-quant weights: {exact}")
    print(f"logits rel. error vs BF16: trainer W4A16 {rel(lt, ref):.4f}, rollout W4A4+{args.residual_fraction:.0%} residual {rel(lr, ref):.4f}")
    print(f"rollout vs trainer (activation error only): {rel(lr, lt):.4f}")
    return 0 if exact else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quads", description="QUADS: NVFP4 precision policies for RL")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a small MoE both ways and print errors")
    demo.add_argument("--residual-fraction", type=float, default=0.5)
    demo.set_defaults(func=_demo)
    try:
        from quads.diagnostics.diagnose import add_parser as add_diagnose
    except ImportError:
        add_diagnose = None
    if add_diagnose is not None:
        add_diagnose(sub)
    from quads.integrations.modelopt.cli import add_parser as add_export

    add_export(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:  # bad input: one line, no traceback (argparse's own errors exit 2 too)
        print(f"quads {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
