"""The trainer's forward weights computed independently of quads' group bookkeeping: the recipe
(``nvfp4_quantize``/``nvfp4_dequantize``) with the global scale the policy's
``weight_global_scale`` gives, the group scale written out here as ``448*6 / max amax`` over the
siblings' masters (what ModelOpt computes for a fused layer; ``256*6`` under 4over6 block scaling)."""

import torch

from quads.policies.fused_projections import SIBLING_PROJECTIONS
from quads.tensor import nvfp4_dequantize, nvfp4_quantize


def siblings_of(name: str, names) -> list[str]:
    """Weight names of ``name``'s sibling group present in ``names`` (itself included)."""
    module, _, pname = name.rpartition(".")
    parent, _, child = module.rpartition(".")
    if pname != "weight":
        return [name]
    for group in SIBLING_PROJECTIONS:
        if child in group:
            members = [f"{parent}.{s}.weight" if parent else f"{s}.weight" for s in group]
            return [m for m in members if m in names]
    return [name]


def group_encode_scale(weights, block_scaling: str = "6") -> torch.Tensor:
    amax = max(float(w.detach().abs().float().max()) for w in weights)
    numerator = 448.0 * 6.0 if block_scaling == "6" else 256.0 * 6.0
    return torch.tensor(numerator, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)


def reference_forward_weight(masters: dict, name: str, mode: str = "group", dtype=None,
                             block_scaling: str = "6") -> torch.Tensor:
    """``DQ(Q(masters[name]))`` in ``dtype`` (default the master's) with its ``mode`` global scale."""
    w = masters[name].detach()
    scale = None
    if mode == "group":
        members = siblings_of(name, masters)
        if len(members) > 1:
            scale = group_encode_scale([masters[m] for m in members], block_scaling)
    return nvfp4_dequantize(*nvfp4_quantize(w, None, scale, block_scaling), dtype=dtype or w.dtype)
