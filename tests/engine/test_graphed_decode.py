"""The graphed decoder's step loop (eager on CPU: the same body the CUDA graph captures)."""

import pytest
import torch
from transformers import GenerationConfig

import quads
from quads.diagnostics.scoring import build_scoring_batch, score_incremental
from quads.engine import GraphedDecoder, SamplingSpec, process_logits, unsupported_reason
from tests.ops.test_humming_backend import fake_humming  # noqa: F401  (fixture)
from tests.tiny_models import build

# the weight quantizer kernel runs once per distinct weight in the session (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("memo_weight_kernel")

EOS = 7


def _prompts(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 6, 1, 5, 4, 2][:batch]
    prompts = [torch.randint(8, 96, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    am = torch.zeros(batch, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        am[i, width - len(p):] = 1
    return prompts, ids, am


def _trim(row, eos=EOS):
    out = []
    for t in row:
        out.append(t)
        if t == eos:
            break
    return out


@pytest.mark.parametrize("kind,side", [("llama", None), ("qwen3_moe", None), ("qwen3_moe", "rollout")])
def test_greedy_matches_generate(kind, side):
    model = build(kind).float().eval()
    if side:
        quads.quantize_(model, quads.QuadsPolicy(side=side))
    _, ids, am = _prompts()
    ref = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=12, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)[:, ids.shape[1]:]
    spec = SamplingSpec(max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0, do_sample=False)
    tokens, logps = GraphedDecoder(model, use_cuda_graph=False).generate(ids, am, spec)
    assert tokens.shape[1] <= 12 and torch.isfinite(logps).all()
    for got, want in zip(tokens.tolist(), ref.tolist()):
        assert _trim(got) == _trim(want)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_sampled_logprobs_are_the_scorers(temperature, top_k, top_p):
    """The returned log-prob of every sampled token is what a prefill+decode scorer of those
    tokens gives (temperature only: top-k/p renormalize, checked separately)."""
    model = build("qwen3_moe").float().eval()
    quads.quantize_(model, quads.QuadsPolicy(side="rollout"))
    prompts, ids, am = _prompts()
    torch.manual_seed(3)
    spec = SamplingSpec(max_new_tokens=10, eos_token_ids=(EOS,), pad_token_id=0, temperature=temperature,
                        top_k=top_k, top_p=top_p)
    tokens, logps = GraphedDecoder(model, use_cuda_graph=False, check_every=4).generate(ids, am, spec)
    completions = [_trim(r) for r in tokens.tolist()]
    batch_ids, batch_am, cm, n = build_scoring_batch(prompts, completions, pad_token_id=0)
    scored = score_incremental(model, batch_ids, batch_am, n, temperature=temperature)
    for i, c in enumerate(completions):
        got = logps[i, : len(c)]
        if top_k == 0 and top_p == 1.0:
            torch.testing.assert_close(got, scored[i, : len(c)], atol=2e-5, rtol=0)
        else:  # renormalized over the kept tokens: never below the full-vocabulary log-prob
            assert (got >= scored[i, : len(c)] - 2e-5).all()
        assert (got <= 0).all()


def test_rows_after_eos_are_padding_and_loop_stops_early():
    model = build("llama").float().eval()
    _, ids, am = _prompts()
    with torch.no_grad():  # make EOS the argmax everywhere: every row ends at its first token
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(96))
        model.lm_head.bias[EOS] = 1e4
    spec = SamplingSpec(max_new_tokens=40, eos_token_ids=(EOS,), pad_token_id=0, do_sample=False)
    tokens, _ = GraphedDecoder(model, use_cuda_graph=False, check_every=4).generate(ids, am, spec)
    assert tokens.shape[1] == 1 and (tokens[:, 0] == EOS).all()


def test_process_logits_matches_generate_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(5, 96) * 3
    logits[0, :10] = 2.0  # ties at the cut
    spec = SamplingSpec(max_new_tokens=1, eos_token_ids=(), pad_token_id=0, temperature=0.8, top_k=12, top_p=0.9)
    want = TemperatureLogitsWarper(0.8)(None, logits)
    want = TopKLogitsWarper(12)(None, want)
    want = TopPLogitsWarper(0.9)(None, want)
    assert torch.equal(process_logits(logits, spec), want)


def test_unsupported_configs_are_named():
    assert unsupported_reason(GenerationConfig(max_new_tokens=4, do_sample=True)) is None
    why = unsupported_reason(GenerationConfig(max_new_tokens=4, repetition_penalty=1.1, min_p=0.1))
    assert "repetition_penalty" in why and "min_p" in why
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingSpec.from_generation_config(GenerationConfig(max_new_tokens=4, repetition_penalty=1.1))
    with pytest.raises(ValueError, match="use_cuda_graph=True needs a CUDA model"):
        model = build("llama").float()
        _, ids, am = _prompts()
        GraphedDecoder(model, use_cuda_graph=True).generate(
            ids, am, SamplingSpec(max_new_tokens=2, eos_token_ids=(), pad_token_id=0))


def test_sync_updates_the_kernel_layout_in_place():
    """Captured graphs hold the prepared (kernel-layout) tensors' addresses: a sync must write
    them in place, with the values a fresh preparation gives."""
    from quads.policies.modules import RolloutModule
    from tests.tiny_models import twin

    trainer, rollout = twin("qwen3_moe")
    with quads.use_backend("hopper"):
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout"))
    modules = [m for m in rollout.modules() if isinstance(m, RolloutModule)]
    assert modules and all(m.quads_backend.name == "hopper" for m in modules)
    before = {id(m): [p.values.data_ptr() for p in m.quads_prepared] for m in modules}
    old_bytes = [p.values.clone() for m in modules for p in m.quads_prepared]
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    quads.sync_weights_(rollout, trainer, plain_trainer=True)
    for m in modules:
        assert [p.values.data_ptr() for p in m.quads_prepared] == before[id(m)]
        fresh = [m.quads_backend.prepare_weight(getattr(m, n).parts) for n in m.quads_packed_names]
        for held, want in zip(m.quads_prepared, fresh):
            assert torch.equal(held.values, want.values) and torch.equal(held.scales, want.scales)
    now = [p.values for m in modules for p in m.quads_prepared]
    changed = sum(not torch.equal(a, b) for a, b in zip(old_bytes, now))
    assert changed == len(now)  # every weight moved, so every layout was rewritten


def test_min_cache_len_sizes_the_cache_and_keeps_the_tokens():
    """A cache longer than the call needs (``min_cache_len``) holds that many positions, rounded
    up to the quantum, and the extra masked keys change no greedy token."""
    from quads.engine.decoder import CACHE_LEN_QUANTUM

    model = build("llama").float().eval()
    _, ids, am = _prompts()
    spec = SamplingSpec(max_new_tokens=6, eos_token_ids=(), pad_token_id=0, do_sample=False)
    short = GraphedDecoder(model, use_cuda_graph=False)
    want, _ = short.generate(ids, am, spec)
    assert short._state.cache_len == CACHE_LEN_QUANTUM
    long = GraphedDecoder(model, use_cuda_graph=False, min_cache_len=CACHE_LEN_QUANTUM + 1)
    got, _ = long.generate(ids, am, spec)
    assert long._state.cache_len == 2 * CACHE_LEN_QUANTUM
    assert long._state.cache.layers[0].keys.shape[2] == 2 * CACHE_LEN_QUANTUM
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="min_cache_len"):
        GraphedDecoder(model, min_cache_len=-1)


class _EagerGraph:
    """A captured step's stand-in on CPU: ``replay`` runs the step again (what the graph runs)."""

    def __init__(self, step):
        self.replay = step


def _recording_decoder(model, monkeypatch):
    """A decoder whose 'captures' on CPU are counted stand-ins (the decision to capture, keep or
    capture again is the real one)."""
    monkeypatch.setattr(GraphedDecoder, "_graphs_on", lambda self, device: True)

    def capture(self, state, spec):
        state.graph = _EagerGraph(lambda: self._step(state, spec))
        self.num_captures += 1

    monkeypatch.setattr(GraphedDecoder, "_capture", capture)
    return None if model is None else GraphedDecoder(model)


def test_a_capture_is_kept_across_syncs_and_taken_again_when_the_model_changed(monkeypatch):
    """A captured step reads the model's tensors and kernel layouts by address: kept across syncs
    (written in place), captured again once they were replaced (sibling sets fused or dissolved,
    a parameter replaced), with the same tokens as the eager decoder."""
    from quads.policies.fused_projections import unfuse_projections_
    from tests.ops.test_humming_memory import _llama

    trainer = quads.quantize_(_llama(1), quads.QuadsPolicy(side="trainer"))
    rollout = quads.quantize_(_llama(2), quads.QuadsPolicy(side="rollout"))
    decoder = _recording_decoder(rollout, monkeypatch)
    eager = GraphedDecoder(rollout, use_cuda_graph=False)
    _, ids, am = _prompts(batch=2)
    spec = SamplingSpec(max_new_tokens=3, eos_token_ids=(), pad_token_id=0, do_sample=False)

    def decode_and_compare():
        tokens, logps = decoder.generate(ids, am, spec)
        want_tokens, want_logps = eager.generate(ids, am, spec)
        assert torch.equal(tokens, want_tokens) and torch.equal(logps, want_logps)

    decode_and_compare()
    decode_and_compare()
    assert decoder.num_captures == 1
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    quads.sync_weights_(rollout, trainer)
    decode_and_compare()
    assert decoder.num_captures == 1  # written in place: the capture reads the new weights
    assert quads.fuse_projections_(rollout) >= 1
    decode_and_compare()
    assert decoder.num_captures == 2
    unfuse_projections_(rollout)
    decode_and_compare()
    assert decoder.num_captures == 3
    norm = rollout.model.norm.weight
    norm.data = norm.data.clone()  # a new storage for a dense parameter
    decode_and_compare()
    assert decoder.num_captures == 4
    decode_and_compare()
    assert decoder.num_captures == 4


@pytest.mark.parametrize("backend", ["hopper", "humming"])
def test_what_a_capture_reads_is_kept_by_a_sync_of_stacked_sets(backend, fake_humming):
    """The kernel backends' layouts (Hopper's derived copy, humming's layout as the weight's
    storage) and fused sets' stacked layouts are written in place by a sync: what a captured step
    reads is unchanged; dissolving the sets changes it."""
    from quads.engine.capture import captured_reads
    from quads.policies.fused_projections import unfuse_projections_
    from tests.ops.test_humming_memory import _llama

    trainer = quads.quantize_(_llama(1), quads.QuadsPolicy(side="trainer"))
    rollout = _llama(2)
    with quads.use_backend(backend):
        quads.quantize_(rollout, quads.QuadsPolicy(side="rollout", kernel="fast" if backend == "humming" else "exact"))
    assert quads.fuse_projections_(rollout) >= 1
    assert any(getattr(m, "quads_group", None) is not None and m.quads_group.stacked is not None
               for m in rollout.modules())
    reads = captured_reads(rollout)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    quads.sync_weights_(rollout, trainer)
    assert captured_reads(rollout) == reads
    unfuse_projections_(rollout)
    assert captured_reads(rollout) != reads
