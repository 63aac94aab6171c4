"""``quads export``: a local HF checkpoint of a QUADS-trained model -> a ModelOpt NVFP4 checkpoint.

    quads export --model runs/trainer --out runs/trainer-nvfp4 --format w4a16
    quads export --model runs/trainer --out runs/trainer-w4a4 --format nvfp4 --calib prompts.txt

``--model`` holds the BF16 masters (``save_pretrained`` of the trainer model; quads' trainer
layers keep the parameter names). The model is converted with ``QuadsPolicy(side="trainer")``
(so ``--calib`` runs the training forward, W4A16) and the weights written are that forward's
weights (see :mod:`quads.integrations.modelopt.export` for the fused-layer rule and formats).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser"]


def _calibration(path: str, tokenizer):
    if tokenizer is None:
        raise SystemExit("quads export: --calib needs a tokenizer in --model")
    lines = [line.rstrip("\n").replace("\\n", "\n") for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"quads export: {path} has no prompts")
    return [tokenizer(line, return_tensors="pt")["input_ids"] for line in lines]


def _cmd(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quads.integrations.modelopt.export import check_out_dir, export_modelopt
    from quads.policies.policy import QuadsPolicy
    from quads.policies.quantize import quantize_

    try:
        check_out_dir(Path(args.out))  # before loading a large model
    except FileExistsError as err:
        raise SystemExit(f"quads export: {err}") from None
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", local_files_only=True).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    if args.format == "nvfp4" and not args.calib:
        raise SystemExit("quads export: --format nvfp4 (W4A4) needs --calib FILE (one prompt per line) for its input_scale")
    calibration = _calibration(args.calib, tokenizer) if args.calib else None
    policy = QuadsPolicy(side="trainer", extra_skip_patterns=tuple(args.extra_skip))
    try:
        quantize_(model, policy)  # the training forward (W4A16), which calibration then runs
        with torch.no_grad():
            report = export_modelopt(
                model, args.out, args.format, calibration=calibration, fused_scales=args.fused_scales,
                tokenizer=tokenizer, policy=policy, dtype=args.dtype,
            )
    except (FileExistsError, ValueError, TypeError, NotImplementedError) as err:
        raise SystemExit(f"quads export: {err}") from None
    print(f"wrote {args.out}")
    print(report.summary())
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a ModelOpt NVFP4 checkpoint (vLLM modelopt_fp4, SGLang, TensorRT-LLM)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF checkpoint directory (BF16 masters)")
    p.add_argument("--out", required=True, help="new output directory")
    p.add_argument("--format", choices=("nvfp4", "w4a16"), default="w4a16",
                   help="w4a16: W4A16_NVFP4 (the trainer's numerics); nvfp4: W4A4 with calibrated static input scales")
    p.add_argument("--calib", default=None, help="text file, one calibration prompt per line (needed for nvfp4)")
    p.add_argument("--fused-scales", choices=("shared", "separate"), default="shared",
                   help="shared: one global scale per vLLM fused layer (q/k/v, gate/up); separate: bit-exact shards")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype of the tensors not quantized (embeddings, norms, routers, lm_head); auto: the masters' dtype")
    p.add_argument("--extra-skip", action="append", default=[], metavar="REGEX",
                   help="module-name regex to keep in BF16 (repeatable)")
    p.set_defaults(func=_cmd)
