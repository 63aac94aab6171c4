"""Sampling from a transformers causal LM with the decode step captured as one CUDA graph.

Why: a rollout decode step is ~100 small kernels per layer, bound by launch overhead when
launched one by one from Python (docs/background.md). :class:`GraphedDecoder` runs the
prompt (prefill) eagerly, then captures one decode step -- model forward, sampling and the
sampled token's log-prob -- into a CUDA graph once per (batch, cache length) and replays it for
every new token. Everything the step reads lives in static buffers updated inside the graph
(a fixed-length :class:`SlotCache`, the current token, slot, positions, mask and finished rows).

Weights are read from the modules' own tensors, so a graph stays valid across
``quads.sync_weights_`` (which writes them in place); a tensor or kernel replaced since the
capture (sets fused or dissolved, a move) is seen before the next replay
(:func:`~quads.engine.capture.captured_reads`): the step is captured again.

Sampling follows ``generate``'s warpers for what a GRPO rollout uses: temperature, top-k,
top-p (greedy when ``do_sample=False``); logits are float32 as ``generate`` makes them, and the
returned log-prob is that of the sampled token under the processed distribution (what TRL keeps
from vLLM). Other configurations (repetition penalty, min-p, beams, ...) are reported by
:func:`unsupported_reason` so callers fall back to ``generate``.

Inside its forwards it runs grouped-query attention without ``repeat_kv`` (``gqa_attention``) and
one activation quantization per sibling group (``share_quantization``); before capturing,
:func:`quads.engine.capture.capture_plan` decides whether the step can be captured (else: one
warning line, eager decoding). Both in detail: docs/engine.md. Without CUDA (or with
``use_cuda_graph=False``) the same step runs eagerly (how the CPU tests check it).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import warnings

import torch
import torch.nn as nn

from quads.engine.capture import CapturePlan, capture_plan, captured_reads
from quads.engine.gqa_attention import model_configs, use_gqa_attention
from quads.engine.sampling import SamplingSpec, sample_tokens, unsupported_reason  # noqa: F401
from quads.engine.slot_cache import SlotCache, Slots
from quads.ops.sibling_linear import enabled_groups
from quads.policies.fused_projections import sibling_groups_
from quads.policies.routing import RoutingRecorder
from quads.policies.trainer_experts import grouped_mm_available
from quads.policies.warmup import warm_up_kernels

__all__ = ["GraphedDecoder", "SamplingSpec", "unsupported_reason"]

#: cache lengths are rounded up to this, so prompts of similar width share one graph
CACHE_LEN_QUANTUM = 64


class _DecodeState:
    """The static buffers of one (batch, cache length) session.

    Two aliasings save a kernel each per step: the sampled token (``out_token``) *is* the next
    step's input (``token`` is its (B, 1) view: the step reads it in the embedding before it
    writes the new one), and the cache slot and the position ids are one buffer, advanced by one
    ``add_``."""

    def __init__(self, batch: int, cache_len: int, device: torch.device, num_layers: int):
        self.batch, self.cache_len, self.device = batch, cache_len, device
        long = dict(dtype=torch.long, device=device)
        self.out_token = torch.zeros(batch, **long)  # the token sampled by the last step
        self.token = self.out_token.view(batch, 1)  # = the token fed to the next step
        self.counters = torch.zeros(1 + batch, **long)  # [slot, position per row]
        self.slot = self.counters[:1]  # the next token's cache slot
        self.position = self.counters[1:].view(batch, 1)  # its position id per row
        self.key_valid = torch.zeros(batch, cache_len, dtype=torch.bool, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out_logp = torch.zeros(batch, dtype=torch.float32, device=device)
        self.eos = torch.zeros(0, **long)  # the spec's EOS ids (set per session: no host copy in the graph)
        self.where = Slots(cache_len, self.slot)
        self.cache = SlotCache(self.where, num_layers)
        self.routing: torch.Tensor | None = None  # (L, B, cache_len, k) int16 when recording routing
        self.graph: torch.cuda.CUDAGraph | None = None


class _CaptureRefused(RuntimeError):
    """The decode step synchronized with the host during the warm-up (it cannot be captured)."""


@contextlib.contextmanager
def _no_host_syncs():
    """CUDA's sync debug mode set to error inside the block: a synchronizing op raises
    :class:`_CaptureRefused` naming it, before any capture."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        raise _CaptureRefused(f"the decode step synchronizes with the host ({str(err).strip().splitlines()[0]})") from err
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _num_layers(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


class GraphedDecoder:
    """Sample completions from ``model`` (a transformers causal LM), the decode step graph-captured.

    ``use_cuda_graph``: None (default) captures on CUDA and runs eagerly elsewhere; False always
    runs eagerly (same results up to kernel choice). ``check_every``: decode steps between the
    host checks for "every row finished" (the only host syncs of the loop).
    ``min_cache_len``: the cache holds at least this many positions (default 0: the prompt width
    plus ``max_new_tokens``); a cache sized for the longest rollout keeps one length (one
    capture) for every call, and a short call then costs the memory and the per-step attention
    reads of the long one.
    One captured session (batch size, cache length) is kept; a call with another shape
    recaptures (a prefill-sized cost).

    ``gqa_attention`` (default True): an sdpa model's attention runs
    :func:`~quads.engine.gqa_attention.gqa_sdpa_attention` inside the decoder's forwards
    (no ``repeat_kv`` copy of the cache; equal to sdpa's result up to the kernel's blocking;
    eager-attention models are left on eager). ``share_quantization`` (default True): rollout
    linears reading the same input quantize it once (bit-identical): the model's sibling
    groups (``quads.fuse_projections_``) serve as they always do, and sibling sets without one get
    a dormant group (attached to the modules, off outside this decoder's forwards). False for
    either runs the model's own glue there: its attention implementation (e.g. for an attention
    module the grouped view does not cover), one activation quantization per linear (same bits,
    one launch per linear); the benchmarks' ``--glue old`` passes both False.

    ``record_routing`` (default False; an MoE model with routers
    :mod:`quads.policies.routing` supports): every forward writes each router's top-k ids into
    a static (layers, batch, cache length, k) int16 buffer at the tokens' cache slots
    (``index_copy_`` inside the captured step, no host sync); :attr:`last_routing` is then
    (B, P + T - 1, layers, k) for the prompt slots and the fed completion tokens (-1 where
    nothing was fed).
    """

    def __init__(self, model: nn.Module, *, use_cuda_graph: bool | None = None, check_every: int = 16,
                 gqa_attention: bool = True, share_quantization: bool = True, record_routing: bool = False,
                 min_cache_len: int = 0):
        if check_every < 1:
            raise ValueError(f"GraphedDecoder: check_every must be >= 1, got {check_every}")
        if min_cache_len < 0:
            raise ValueError(f"GraphedDecoder: min_cache_len must be >= 0, got {min_cache_len}")
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager"):
            raise ValueError(
                f"GraphedDecoder: attention implementation {impl!r} is not supported (it takes a prepared "
                "boolean or additive 4-D mask: use 'sdpa' or 'eager')"
            )
        self.model = model
        self.use_cuda_graph = use_cuda_graph
        self.check_every = check_every
        self.min_cache_len = int(min_cache_len)
        self._state: _DecodeState | None = None
        self._spec: SamplingSpec | None = None
        self.num_captures = 0
        self._kernels_warm = False
        params = inspect.signature(model.forward).parameters
        self._pass_cache_position = "cache_position" in params
        self._pass_logits_to_keep = "logits_to_keep" in params
        self.gqa_attention = gqa_attention
        self.share_quantization = share_quantization
        self._groups: list | None = None
        self._configs = model_configs(model)
        self.capture_blocker: str | None = None
        self._plan: CapturePlan | None = None  # decided on the first CUDA call
        self._experts_switch: CapturePlan | None = None  # the plan applied in this call's forwards
        self._recorder = RoutingRecorder(model) if record_routing else None
        self.last_routing: torch.Tensor | None = None
        self._captured_reads: list | None = None  # what the captured step reads (captured_reads)

    def _forget_captures(self) -> None:
        """The model's tensors or kernels were replaced since the capture: drop the graph (it reads
        the old addresses), the sibling sets and the capture plan; warm up and capture again."""
        if self._state is not None:
            self._state.graph = None
        self._captured_reads, self._groups, self._plan, self._kernels_warm = None, None, None, False

    def _glue(self):
        """The forward's context: the GQA attention switched in, sibling linears sharing one
        activation quantization (each as configured), both undone on exit."""
        stack = contextlib.ExitStack()
        if self.gqa_attention:
            stack.enter_context(use_gqa_attention(self.model, self._configs))
        if self.share_quantization:
            if self._groups is None or any(not g.members for g in self._groups):  # dissolved (a move): again
                self._groups = sibling_groups_(self.model)
            stack.enter_context(enabled_groups(self._groups))
        if self._experts_switch is not None:
            stack.enter_context(self._experts_switch.applied())
        return stack

    # -- one forward -------------------------------------------------------------------------

    def _forward(self, state: _DecodeState, input_ids, mask4d, position_ids, slots) -> torch.Tensor:
        state.where.slots = slots
        kwargs = dict(input_ids=input_ids, attention_mask=mask4d, position_ids=position_ids,
                      past_key_values=state.cache, use_cache=True)
        if self._pass_cache_position:
            kwargs["cache_position"] = slots
        if self._pass_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with self._glue(), (self._recorder.into(state.routing, lambda: state.where.slots)
                            if state.routing is not None else contextlib.nullcontext()):
            out = self.model(**kwargs)
        return out.logits[:, -1, :].float()

    def _mask_dtype(self, mask: torch.Tensor) -> torch.Tensor:
        """The 4-D mask as the model's attention implementation takes it: bool for sdpa/flex,
        additive float (0 / dtype min) for eager."""
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        if impl == "eager":
            dtype = next(self.model.parameters()).dtype
            dtype = dtype if dtype.is_floating_point else torch.float32
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return mask

    def _step(self, state: _DecodeState, spec: SamplingSpec) -> None:
        """One decode step on the static buffers (the captured body)."""
        state.key_valid.index_fill_(1, state.slot, True)
        mask = self._mask_dtype(state.key_valid[:, None, None, :])
        logits = self._forward(state, state.token, mask, state.position, state.slot)
        token, logp = sample_tokens(logits, spec)
        token = token.masked_fill(state.finished, spec.pad_token_id)  # one kernel (was full_like + where)
        state.out_token.copy_(token)  # also the next step's input (state.token is its view)
        state.out_logp.copy_(logp)
        if spec.eos_token_ids:
            state.finished.logical_or_(torch.isin(token, state.eos))
        state.counters.add_(1)  # slot and positions

    # -- sessions ----------------------------------------------------------------------------

    def _graphs_on(self, device: torch.device) -> bool:
        """Capture this call's step: asked for (or the default on CUDA) and not refused."""
        if self.use_cuda_graph is None:
            wanted = device.type == "cuda"
        elif self.use_cuda_graph and device.type != "cuda":
            raise ValueError(f"GraphedDecoder: use_cuda_graph=True needs a CUDA model, this one is on {device}")
        else:
            wanted = bool(self.use_cuda_graph)
        if not wanted or self.capture_blocker is not None:
            return False
        if self._plan is None:
            self._plan = capture_plan(self.model, grouped_mm_available(device))
            if self._plan.blocker is not None:
                self._refuse(self._plan.blocker)
                return False
        return True

    def _refuse(self, reason: str) -> None:
        """Decode eagerly from now on, and say why once (one line)."""
        self.capture_blocker = reason
        warnings.warn(f"GraphedDecoder: not capturing the decode step of {type(self.model).__name__}: {reason}; "
                      "decoding eagerly", RuntimeWarning, stacklevel=3)

    def _session(self, batch: int, cache_len: int, device: torch.device, spec: SamplingSpec) -> _DecodeState:
        s = self._state
        if s is None or (s.batch, s.cache_len, s.device) != (batch, cache_len, device) or self._spec != spec:
            self._state = s = None  # free the old cache and graph now (no cycles: refcounting frees them)
            s = self._state = _DecodeState(batch, cache_len, device, _num_layers(self.model))
            s.eos = torch.tensor(spec.eos_token_ids, dtype=torch.long, device=device)
            if self._recorder is not None:
                s.routing = self._recorder.buffer(batch, cache_len, device)
            self._spec = spec
        return s

    def _capture(self, state: _DecodeState, spec: SamplingSpec) -> None:
        """Capture one step; the warm-up runs on copies of the buffers' values, restored after,
        and its random draws are undone (the generator state is restored after the capture).
        Raises :class:`_CaptureRefused` (nothing captured) when the warm-up synchronizes."""
        buffers = (state.token, state.slot, state.position, state.key_valid, state.finished)
        saved = [t.clone() for t in buffers]
        rng = torch.cuda.get_rng_state(state.device)
        stream = torch.cuda.Stream(device=state.device)
        stream.wait_stream(torch.cuda.current_stream(state.device))
        try:
            with torch.cuda.stream(stream):
                self._step(state, spec)  # warm-up: allocator pools, Triton autotune/compile, cuBLAS handles
                with _no_host_syncs():  # steady state: a sync here would fail the capture
                    self._step(state, spec)
        finally:
            torch.cuda.current_stream(state.device).wait_stream(stream)  # its cache writes land first
            for buf, value in zip(buffers, saved):
                buf.copy_(value)
            torch.cuda.set_rng_state(rng, state.device)
        # No garbage collection during the capture: freeing another graph (or anything that
        # synchronizes) inside it invalidates the capture. Collect now, pause the collector.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step(state, spec)
        finally:
            if was_enabled:
                gc.enable()
        for buf, value in zip(buffers, saved):
            buf.copy_(value)  # capture does not run the body, but keep the invariant explicit
        torch.cuda.set_rng_state(rng, state.device)
        state.graph = graph
        self.num_captures += 1

    # -- public ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, spec: SamplingSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``spec.max_new_tokens`` tokens after left-padded prompts.

        ``input_ids`` / ``attention_mask``: (B, P) on the model's device, left padding (mask 0).
        Returns ``(tokens, logprobs)``, both (B, T) with T <= max_new_tokens (the loop stops
        early once every row emitted an EOS, checked every ``check_every`` steps): tokens after
        a row's EOS are ``pad_token_id``; logprobs are float32.
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"GraphedDecoder.generate: input_ids {tuple(input_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must be the same (batch, prompt) shape"
            )
        device = input_ids.device
        if self._captured_reads is not None and self._captured_reads != captured_reads(self.model):
            self._forget_captures()  # tensors or kernels replaced since (fused, moved, reloaded): read anew
        if not self._kernels_warm:  # the JIT kernels compile here, with a progress line, not mid-capture
            warm_up_kernels(self.model)
            self._kernels_warm = True
        batch, width = input_ids.shape
        need = max(width + spec.max_new_tokens, self.min_cache_len)
        cache_len = -(-need // CACHE_LEN_QUANTUM) * CACHE_LEN_QUANTUM
        state = self._session(batch, cache_len, device, spec)
        graphs = self._graphs_on(device)
        self._experts_switch = self._plan if graphs else None  # capturable experts, prefill included

        # prefill (eager): prompt keys at slots [0, width)
        valid = attention_mask.to(torch.bool)
        state.key_valid.zero_()
        state.key_valid[:, :width] = valid
        state.finished.zero_()
        state.where.seen = 0
        if state.routing is not None:
            state.routing.fill_(-1)
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(~valid, 1)
        slots = torch.arange(width, device=device)
        causal = slots[:, None] >= torch.arange(cache_len, device=device)[None, :]  # (P, L)
        mask = state.key_valid[:, None, None, :] & causal[None, None]
        mask |= (slots[:, None] == torch.arange(cache_len, device=device)[None, :])[None, None]  # pad rows: self
        logits = self._forward(state, input_ids, self._mask_dtype(mask), positions, slots)
        state.where.seen = width
        token, logp = sample_tokens(logits, spec)
        tokens, logps = [token], [logp]
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        if spec.eos_token_ids:
            finished |= torch.isin(token, state.eos)
        state.finished.copy_(finished)
        state.token.copy_(token[:, None])
        state.slot.fill_(width)
        state.position.copy_(positions[:, -1:] + 1)

        steps = spec.max_new_tokens - 1
        if steps and graphs and state.graph is None:
            self._captured_reads = captured_reads(self.model)  # first: no graph is ever held without it
            try:
                self._capture(state, spec)
            except _CaptureRefused as why:
                self._refuse(str(why))
                graphs = False
            if state.routing is not None:
                state.routing[:, :, width:].fill_(-1)  # the warm-up steps' writes
        for t in range(steps):
            if t % self.check_every == 0 and bool(state.finished.all()):
                break
            if graphs:
                state.graph.replay()
            else:
                self._step(state, spec)
            state.where.seen += 1
            tokens.append(state.out_token.clone())
            logps.append(state.out_logp.clone())
        if state.routing is not None:  # prompt slots and the fed completion tokens (all but the last)
            self.last_routing = state.routing[:, :, : width + len(tokens) - 1].permute(1, 2, 0, 3).clone()
        return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)
