"""Numbers behind docs/ecosystem.md (CPU, seconds to run).

1. torchao 0.18's NVFP4 recipe vs quads' on random weights: packed bytes and block scales that
   differ, elements whose dequantization of the *same* parts differs, global scales that do not
   survive the float32 reciprocal round trip.
2. ``quads export`` of the embedded trained MoE: which weights are exact, and the error of the
   fused-layer shards re-quantized to one global scale (``fused_scales="shared"``), next to the
   NVFP4 quantization error of the weights themselves.

    python -m benchmarks.studies.ecosystem_numbers --out results/ecosystem_numbers_cpu_2026-12-03
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from quads.tensor.files import write_atomically


def recipe_diff(sizes=(1024, 4096), seeds=(0, 1, 2)) -> list[dict]:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as TorchaoNVFP4
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    import quads
    from quads.integrations.torchao import to_torchao_nvfp4

    rows = []
    for n in sizes:
        for seed in seeds:
            w = (torch.randn(n, n, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()
            ours = quads.NVFP4Tensor.from_float(w)
            theirs = TorchaoNVFP4.to_nvfp4(w, per_tensor_scale=per_tensor_amax_to_scale(w.abs().max()))
            same_parts_dq = to_torchao_nvfp4(ours).dequantize(torch.float32) != ours.dequantize(torch.float32)
            rows.append({
                "shape": [n, n], "seed": seed,
                "packed_bytes_differ": (ours.qdata != theirs.qdata).float().mean().item(),
                "block_scales_differ": (ours.scale.view(torch.uint8) != theirs.scale.view(torch.uint8)).float().mean().item(),
                "same_parts_dequant_elements_differ": same_parts_dq.float().mean().item(),
            })
    return rows


def reciprocal_round_trip(n=1_000_000) -> float:
    from quads.tensor.nvfp4_math import global_encode_scale_from_amax

    amax = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 20 + 1e-3
    s = global_encode_scale_from_amax(amax)
    one = torch.ones(())
    return ((one / (one / s)) != s).float().mean().item()


def export_errors() -> dict:
    from quads.integrations.modelopt import export_modelopt
    from quads.tasks import load_default_model
    from quads.tensor import nvfp4_fake_quantize

    model, _ = load_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        report = export_modelopt(model, Path(tmp) / "ck", "w4a16")
    base = {}
    for name, p in model.named_parameters():
        if name in report.requantized:
            base[name] = ((nvfp4_fake_quantize(p.detach()).float() - p.float()).norm() / p.float().norm()).item()
    return {
        "model": "quads/assets/tiny-moe-arith (embedded trained Qwen3-MoE)",
        "quantized_weights": report.quantized_weights,
        "exact_weights": report.exact_weights,
        "requantized": {k: {**v, "nvfp4_rel_error_of_master": base[k]} for k, v in report.requantized.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {"recipe_diff": recipe_diff(), "reciprocal_round_trip_fails": reciprocal_round_trip(), "export": export_errors()}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_atomically(Path(args.out) / "ecosystem_numbers.json", text + "\n")


if __name__ == "__main__":
    main()
