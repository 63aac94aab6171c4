"""vLLM's default engine (torch.compile, CUDA graphs where there is a GPU) with the quads method.

``LLM(path, quantization="quads")`` without ``enforce_eager=True`` traces the model with dynamo;
the quads forward must reach the compiled graph as custom ops on plain tensors
(``quads::linear``, ``quads::grouped_linear``), never as Python objects dynamo cannot wrap.

Two checks: the compiled layers' path gives the eager path's bits on every quads linear (same
inputs), and the compiled engine's greedy tokens equal the eager engine's on the embedded
trained model. Log-probs are not compared bit for bit: vLLM's compiled graph runs its own
non-quads ops differently (inductor's norm/rope/residual code instead of the eager engine's
kernels: a BF16 engine without quads moves by up to ~0.05 nats between the two modes on the
test models), so only where that cannot flip a token is equality asked for.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from _support import greedy, make_llm, release  # noqa: E402

from quads.integrations.vllm.quant_method import QuadsLinearMethod, compiled_shard_linear  # noqa: E402
from quads.tasks import DEFAULT_MODEL_DIR, make_prompts  # noqa: E402

pytestmark = [pytest.mark.vllm]

PROMPTS = [p["prompt"] for p in make_prompts(16, seed=3, split="heldout")]


def _paths_agree(model) -> list[tuple[str, int, bool]]:
    """(layer, shards, eager apply == compiled path) for every quads linear of ``model``."""
    out = []
    g = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, QuadsLinearMethod):
            x = (torch.randn(5, m.weight.shape[1] * 2, generator=g) * 3).to(torch.bfloat16)
            bias = getattr(m, "bias", None)
            eager = qm.apply(m, x, bias)
            compiled = compiled_shard_linear(m, x, bias, qm.config.activation_quant)
            out.append((name, len(m.quads_output_partition_sizes), torch.equal(eager, compiled)))
    return out


def test_compiled_path_has_the_eager_bits(checkpoint):
    """Merged (q/k/v: 3 shards, gate/up: 2) and plain layers: the op-per-shard path is bit-exact."""
    llm = make_llm(checkpoint("llama"), quantization="quads")
    try:
        (rows,) = llm.apply_model(_paths_agree)
    finally:
        release(llm)
    assert {n for _, n, _ in rows} == {1, 2, 3}, rows  # every kind of layer was checked
    assert all(ok for _, _, ok in rows), rows


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="no embedded default model")
def test_default_engine_compiles_and_matches_eager():
    """The default engine (no enforce_eager) starts, and greedy decoding gives the eager tokens."""
    llm = make_llm(DEFAULT_MODEL_DIR, quantization="quads", enforce_eager=False)
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode != 0  # really compiled
        compiled = greedy(llm, PROMPTS, max_tokens=12)
    finally:
        release(llm)
    llm = make_llm(DEFAULT_MODEL_DIR, quantization="quads", enforce_eager=True)
    try:
        eager = greedy(llm, PROMPTS, max_tokens=12)
    finally:
        release(llm)
    assert [c for _, c, _ in compiled] == [c for _, c, _ in eager]
    assert sum(len(c) for _, c, _ in compiled) > len(PROMPTS)  # not just EOS everywhere
