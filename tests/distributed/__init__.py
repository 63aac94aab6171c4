"""Multi-process tests: FSDP2 + quads on 2 gloo processes (or 2 GPUs with QUADS_DIST_DEVICE=cuda), multi-process TRL."""
