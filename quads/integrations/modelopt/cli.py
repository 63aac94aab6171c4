"""``quads export``: a local HF checkpoint of a QUADS-trained model -> a ModelOpt NVFP4 checkpoint.

    quads export --model runs/trainer --out runs/trainer-nvfp4 --format w4a16
    quads export --model runs/trainer --out runs/trainer-w4a4 --format nvfp4 --calib prompts.txt

``--model`` holds the BF16 masters (``save_pretrained`` of the trainer model; quads' trainer
layers keep the parameter names; read as a plain checkpoint's, its quads config set aside). The model is converted with ``QuadsPolicy(side="trainer",
weight_global_scale=--weight-global-scale, weight_block_scaling=--weight-block-scaling,
scope=--scope, skip_first_layers=--skip-first-layers, skip_last_layers=--skip-last-layers)`` (the
values the model was trained with; the layers a scoped plan keeps in BF16 are written as stored
and listed in ``exclude_modules``)
(so ``--calib`` runs the training forward, W4A16) and the weights written are that forward's
weights (see :mod:`quads.integrations.modelopt.export` for the fused-layer rule and formats).

Every input is checked before any work (``--out`` new, not a symlink, its parent writable;
``--model`` a loadable directory; ``--calib`` readable and tokenizable; ``--extra-skip`` valid
regexes); a bad one exits with status 2 and one line. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser"]


def _progress(message: str) -> None:
    """One progress line on stderr (stdout keeps the result: the path and the report)."""
    print(f"quads export: {message}", file=sys.stderr, flush=True)


def _reason(err: BaseException) -> str:
    """An export error's message without its own ``export:`` prefix (the CLI adds ``quads export:``)."""
    return str(err).strip().splitlines()[0].removeprefix("export: ") if str(err).strip() else type(err).__name__


def _cmd(args: argparse.Namespace) -> int:
    """Every input is checked, in this order, before any work: --out, --format/--calib, the
    --calib file, --model (config, weights, tokenizer), the prompts' tokenization. Each bad one
    is a UsageError: one line, exit status 2 (``quads.cli``)."""
    from quads.diagnostics.cli_inputs import (
        UsageError,
        check_new_output_dir,
        check_tokenizer,
        load_local_causal_lm,
        read_prompts,
    )

    from quads.extras import require

    require("quads export", "transformers")
    out = check_new_output_dir(args.out)  # before loading a large model
    if args.format == "nvfp4" and not args.calib:
        raise UsageError("--format nvfp4 (W4A4) needs --calib FILE (one prompt per line) for its input_scale")
    if args.format == "w4a16" and args.calib:
        raise UsageError("--format w4a16 has no activation scales; drop --calib")
    prompts = read_prompts(args.calib) if args.calib else None

    import torch

    from quads.integrations.modelopt.export import export_modelopt, stale_temp_dirs
    from quads.policies.policy import QuadsPolicy
    from quads.policies.quantize import quantize_

    for stale in stale_temp_dirs(out):
        _progress(f"note: {stale} is an unfinished export's temporary directory (its process is alive)")
    _progress(f"loading {args.model}")
    model, tokenizer = load_local_causal_lm(args.model, "auto", require_tokenizer=prompts is not None,
                                            set_pad=False, prompts=prompts, prompts_source=args.calib)
    model.eval()
    calibration = None
    if prompts is not None:
        check_tokenizer(tokenizer, model, args.model, prompts, source=args.calib)
        calibration = [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]
    policy = QuadsPolicy(side="trainer", extra_skip_patterns=tuple(args.extra_skip),
                         weight_global_scale=args.weight_global_scale, weight_block_scaling=args.weight_block_scaling,
                         scope=args.scope, skip_first_layers=args.skip_first_layers,
                         skip_last_layers=args.skip_last_layers)
    try:
        _progress("converting to the training forward (W4A16)")
        quantize_(model, policy)  # the training forward, which calibration then runs
        _progress(f"quantizing and writing {args.format}" + (f" ({len(prompts)} calibration prompts)" if prompts else ""))
        with torch.no_grad():
            report = export_modelopt(
                model, out, args.format, calibration=calibration, fused_scales=args.fused_scales,
                tokenizer=tokenizer, policy=policy, dtype=args.dtype,
            )
    except (FileExistsError, ValueError, TypeError, NotImplementedError) as err:
        raise UsageError(f"{args.model}: {_reason(err)}") from err
    print(f"wrote {out}")
    print(report.summary())
    return 0


def add_parser(sub) -> None:
    from quads.diagnostics.cli_inputs import nonnegative_int, regex
    from quads.policies.policy import SCOPES

    from quads.diagnostics.cli_inputs import HelpFormatter as Formatter

    p = sub.add_parser("export", help="write a ModelOpt NVFP4 checkpoint (vLLM modelopt_fp4, SGLang, TensorRT-LLM)",
                       description=__doc__, formatter_class=Formatter)
    p.add_argument("--model", required=True, help="local HF checkpoint directory (BF16 masters)")
    p.add_argument("--out", required=True, help="new output directory")
    p.add_argument("--format", choices=("nvfp4", "w4a16"), default="w4a16",
                   help="w4a16: W4A16_NVFP4 (the trainer's numerics); nvfp4: W4A4 with calibrated static input scales")
    p.add_argument("--calib", default=None, help="text file, one calibration prompt per line (needed for nvfp4)")
    p.add_argument("--fused-scales", choices=("shared", "separate"), default="shared",
                   help="shared: one global scale per vLLM fused layer (q/k/v, gate/up); separate: bit-exact shards")
    p.add_argument("--weight-global-scale", choices=("group", "tensor"), default="group",
                   help="the trainer's QuadsPolicy.weight_global_scale: group (one global scale per q/k/v and "
                        "gate/up group: fused layers are written exactly) or tensor (one per weight)")
    p.add_argument("--scope", choices=SCOPES, default="all",
                   help="the trainer's QuadsPolicy.scope: all (every linear and experts module) or routed_experts "
                        "(attention, shared experts, routers and lm_head written in BF16)")
    p.add_argument("--skip-first-layers", type=nonnegative_int, default=0, metavar="N",
                   help="the trainer's QuadsPolicy.skip_first_layers: the first N decoder layers written in BF16")
    p.add_argument("--skip-last-layers", type=nonnegative_int, default=0, metavar="N",
                   help="the trainer's QuadsPolicy.skip_last_layers: the last N decoder layers written in BF16")
    p.add_argument("--weight-block-scaling", choices=("6", "4over6"), default="6",
                   help="the trainer's QuadsPolicy.weight_block_scaling: 6 (NVIDIA's recipe) or 4over6 (Four Over "
                        "Six: each block's max to 4 or 6); the checkpoint is standard NVFP4 either way")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype of the tensors not quantized (embeddings, norms, routers, lm_head); auto: the masters' "
                        "dtype, BF16 for float32 masters (TRL's bf16=True autocast; vLLM's NVFP4 serves 16-bit only)")
    p.add_argument("--extra-skip", action="append", default=[], metavar="REGEX", type=regex,
                   help="module-name regex to keep in BF16 (repeatable)")
    p.set_defaults(func=_cmd)
