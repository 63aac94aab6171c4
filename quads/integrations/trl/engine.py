"""The rollout engine TRL sees as ``trainer.vllm_generation``: sampling with the quads rollout model."""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.nn as nn

from quads.engine import GraphedDecoder, SamplingSpec, unsupported_reason
from quads.policies import sync_weights_
from quads.policies.graphed_sync import GraphedSync
from quads.policies.routing import RoutingRecorder

__all__ = ["QuadsRolloutEngine"]


class QuadsRolloutEngine:
    """The rollout engine TRL sees as ``trainer.vllm_generation`` (its two-method contract).

    ``sync_weights()`` re-quantizes the trainer's masters into the rollout model
    (``quads.sync_weights_``, exact; a collective when the trainer is sharded with FSDP2: TRL
    calls it on every rank, each syncing its own replica); replayed from CUDA graphs when
    ``graphed_sync`` is True, or None (default) and the rollout model is on CUDA
    (:class:`~quads.policies.graphed_sync.GraphedSync`: same bits; its staged values and snapshot
    stay allocated between syncs; :meth:`sync_report`). ``generate(prompts, images, num_generations, profiler)``
    samples one completion per prompt entry (TRL's prompt list already repeats each prompt
    ``num_generations`` times, like vLLM's colocate mode) and returns
    ``(prompt_ids, completion_ids, logprobs, None)`` with ``logprobs[i][t] == [log p]`` of the
    sampled token (TRL keeps ``lp[0]``). Completions stop at the first EOS (kept), as TRL's own
    ``generate`` path does.

    Sampling runs through :class:`quads.engine.GraphedDecoder` (decode
    step captured as a CUDA graph; it stays valid across syncs, which write weights in place)
    when ``graphed`` is True, or when it is None (default) and the rollout model is on CUDA;
    otherwise, or when the generation config asks for something the decoder does not do
    (``unsupported_reason``; the reason is kept in ``fallback_reason``), through ``generate``.
    A model whose step the decoder cannot capture is decoded by it eagerly (its
    ``capture_blocker`` says why).

    It takes from the trainer only what it uses: ``trainer_model`` and ``global_step`` (callables,
    read at each sync: the trainer's unwrapped model and optimizer step), TRL's
    ``generation_config``, the pad token id and the ids that end a completion.

    ``record_routing`` (an MoE rollout model with supported routers,
    :mod:`quads.policies.routing`): each ``generate`` also records every router's top-k ids of
    the prompt tokens and of every fed completion token (both samplers); :attr:`last_routing` is
    then ``(prompt_routing, completion_routing)``, per row int16 tensors (len, layers, k) on the
    device, the completion's last token -1 (it is never fed): TRL's padding of ``prompt_ids``
    (left) and ``completion_ids`` (right) applied to them with -1 gives the routing of the
    trainer's input.

    ``seconds``: wall-clock seconds spent in ``generate`` and ``sync_weights`` since the last
    :meth:`take_seconds` (each measured after the device finished its work).
    """

    def __init__(
        self,
        rollout_model: nn.Module,
        *,
        trainer_model: Callable[[], nn.Module],
        global_step: Callable[[], int],
        generation_config,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        graphed: bool | None = None,
        graphed_sync: bool | None = None,
        record_routing: bool = False,
    ):
        self._recorder = RoutingRecorder(rollout_model) if record_routing else None  # refuses unsupported routers
        self.record_routing = record_routing
        self.last_routing: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.model = rollout_model
        self.graphed_sync = graphed_sync
        self._graphed_sync: GraphedSync | None = None
        self.trainer_model = trainer_model
        self.global_step = global_step
        self.generation_config = generation_config
        self.pad_token_id = pad_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_syncs = 0
        self.last_sync_step: int | None = None
        self.graphed = graphed
        self.fallback_reason: str | None = None
        self._decoder: GraphedDecoder | None = None
        self.seconds = {"generate": 0.0, "sync": 0.0}

    def decode_report(self) -> dict:
        """How the rollout sampled: ``decoder`` (``"graphed"``: :class:`GraphedDecoder`, or
        ``"generate"``), its ``captures``, ``capture_blocker`` (why it decoded eagerly) and
        ``fallback_reason`` (why ``generate`` was used)."""
        d = self._decoder
        return {"decoder": "graphed" if d is not None else "generate", "captures": d.num_captures if d else 0,
                "capture_blocker": d.capture_blocker if d else None, "fallback_reason": self.fallback_reason}

    def sync_report(self) -> dict:
        """How the weights were synced: ``sync`` (the latest sync: ``"graphed"`` or ``"eager"``), the
        graphs' ``captures`` and ``replays`` so far, and ``sync_blocker`` (why the graphs are not used)."""
        g = self._graphed_sync
        return {"sync": "graphed" if g is not None and g.last_replayed else "eager", "captures": g.captures if g else 0,
                "replays": g.replays if g else 0, "sync_blocker": g.blocker if g else None}

    def take_seconds(self) -> dict[str, float]:
        """The phase seconds since the last call (then reset)."""
        taken, self.seconds = self.seconds, {"generate": 0.0, "sync": 0.0}
        return taken

    @torch.no_grad()
    def sync_weights(self) -> int:
        start = time.perf_counter()
        trainer = self.trainer_model()
        device = next(self.model.parameters()).device
        if self.graphed_sync if self.graphed_sync is not None else device.type == "cuda":
            if self._graphed_sync is None or self._graphed_sync.trainer_model is not trainer:
                self._graphed_sync = GraphedSync(self.model, trainer)
            n = self._graphed_sync()
        else:
            n = sync_weights_(self.model, trainer, plain_trainer=True)  # plain: the preset's BF16 trainer
        self.num_syncs += 1
        self.last_sync_step = self.global_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the writes are queued: time them, not their launch
        self.seconds["sync"] += time.perf_counter() - start
        return n

    def _generation_config(self):
        gc = copy.deepcopy(self.generation_config)
        gc.return_dict_in_generate = True
        gc.output_scores = True
        gc.output_logits = False
        return gc

    def _use_decoder(self, gc, device: torch.device) -> bool:
        wanted = self.graphed if self.graphed is not None else device.type == "cuda"
        if not wanted:
            return False
        self.fallback_reason = unsupported_reason(gc)
        if self.fallback_reason:
            return False
        if self._decoder is None:
            try:
                self._decoder = GraphedDecoder(self.model, record_routing=self.record_routing)
            except ValueError as error:  # e.g. an attention implementation that needs its own mask
                self.fallback_reason = str(error)
                return False
        return True

    def _hf_generate(self, input_ids, attention_mask, gc, width):
        recording = self._recorder.appending(input_ids.shape[0]) if self._recorder else nullcontext()
        with recording as recorded:
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gc)
        self._routing = recorded[0] if recorded else None
        completion = out.sequences[:, width:]
        if out.scores:
            scores = torch.stack([s.float() for s in out.scores], dim=1)  # (B, T, V) processed logits
            logps = torch.log_softmax(scores, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        else:
            logps = completion.new_zeros(completion.shape, dtype=torch.float32)
        return completion, logps

    @torch.no_grad()
    def generate(self, prompts, images=None, num_generations: int = 1, profiler=None):
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("QuadsRolloutEngine: multimodal prompts are not supported")
        start = time.perf_counter()
        device = next(p for p in self.model.parameters()).device
        pad_id = self.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as TRL pads prompts for the trainer forward
            if len(p):
                input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                attention_mask[i, width - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        self.model.eval()
        gc = self._generation_config()
        with profiler if profiler is not None else nullcontext():
            if self._use_decoder(gc, device):
                spec = SamplingSpec.from_generation_config(gc, pad_token_id=pad_id)
                completion, logps = self._decoder.generate(input_ids, attention_mask, spec)
                self._routing = self._decoder.last_routing
            else:
                completion, logps = self._hf_generate(input_ids, attention_mask, gc, width)
        eos_ids = self.eos_token_ids
        completion_ids, logprobs = [], []
        rows, row_logps = completion.tolist(), logps.tolist()  # the host waits for the device here
        self.seconds["generate"] += time.perf_counter() - start
        for row, lp in zip(rows, row_logps, strict=True):
            n = len(row)
            for t, token in enumerate(row):
                if token in eos_ids:
                    n = t + 1
                    break
            completion_ids.append(row[:n])
            logprobs.append([[v] for v in lp[:n]])
        if self.record_routing:
            self.last_routing = _routing_rows(self._routing, width, prompts, completion_ids)
            self._routing = None  # held by last_routing's rows until the trainer takes them, no longer
            if self._decoder is not None:
                self._decoder.last_routing = None
        return [list(p) for p in prompts], completion_ids, logprobs, None


def _routing_rows(recorded: torch.Tensor, width: int, prompts, completions):
    """Per row: the prompt's routing (its slots of the left-padded batch) and the completion's
    (its fed tokens, then -1 for the last token, which is never fed)."""
    prompt_rows, completion_rows = [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_rows.append(recorded[i, width - len(p):width])
        fed = recorded[i, width:width + max(len(c) - 1, 0)]
        completion_rows.append(torch.cat([fed, fed.new_full((min(len(c), 1), *fed.shape[1:]), -1)]))
    return prompt_rows, completion_rows
