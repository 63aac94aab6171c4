"""The rollout engine: sampling from a transformers causal LM with the decode step as one CUDA graph.

Between ``policies`` and ``integrations`` (it imports tensor, kernels, ops, policies; TRL's and
vLLM's glue import it):

* :mod:`.sampling` -- :class:`SamplingSpec` and ``generate``'s warpers on static shapes;
* :mod:`.slot_cache` -- the fixed-length key/value cache written at the decoder's slots;
* :mod:`.decoder` -- :class:`GraphedDecoder` (prefill eagerly, then one captured decode step);
* :mod:`.gqa_attention` -- grouped-query sdpa attention without ``repeat_kv`` copies of the cache.

See docs/engine.md.
"""

from quads.engine.decoder import GraphedDecoder
from quads.engine.sampling import SamplingSpec, process_logits, sample_tokens, unsupported_reason
from quads.engine.slot_cache import SlotCache

__all__ = ["GraphedDecoder", "SamplingSpec", "SlotCache", "process_logits", "sample_tokens", "unsupported_reason"]
