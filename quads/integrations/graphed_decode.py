"""The old import path of :mod:`quads.engine` (the graphed decoder moved there); re-exports it."""

from quads.engine import GraphedDecoder, SamplingSpec, SlotCache, process_logits, sample_tokens, unsupported_reason

__all__ = ["GraphedDecoder", "SamplingSpec", "SlotCache", "process_logits", "sample_tokens", "unsupported_reason"]
