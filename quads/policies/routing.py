"""MoE routing: record the rollout's expert choices, compare the trainer's, replay them (R3).

An MoE rollout (quantized activations, other kernels, incremental decoding) can pick other
experts than the trainer's forward for some tokens, and one flipped expert moves a token's
log-prob far more than rounding. Three pieces, all working through forward hooks on the
transformers routers (``router(hidden) -> (router_logits, scores, indices)``):

* :func:`moe_routers` / :func:`routing_problem`: the routers in layer order, or one line saying
  why a model's routers are not supported (a normalisation this module does not know is refused,
  not guessed).
* :class:`RoutingRecorder` (rollout side): each router's top-k ids, int16, written into
  per-layer device buffers at the current forward's cache slots (``index_copy_``: no host sync,
  so it is captured inside a CUDA-graph decode step), or appended per forward (``generate``).
* :class:`RoutingCheck` (trainer side): armed with a recorded routing ``(B, T, L, k)`` aligned
  to the forward's ``input_ids`` (-1: nothing recorded, route freely), it counts on device, per
  layer, the recorded tokens whose top-k set / top-1 differ from the router's own, and with
  ``replay`` routes by the recorded ids (rollout routing replay, R3, arXiv 2510.11370): the gate
  weights are the trainer's own softmax gathered at the recorded ids and normalised as the router
  normalises (:func:`scores_at`), so the router keeps its gradient. Disarmed, or with replay off,
  the hooks return nothing: the forward's bits are unchanged.

Cost: the recorded routing is ``layers x k x 2`` bytes per token.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["NORMALISATIONS", "RoutingCheck", "RoutingRecorder", "flip_counts", "flip_shares", "moe_routers",
           "routing_differences", "routing_problem", "scores_at"]

#: router class -> (top-k weights renormalised: True / False / the attribute that says, scores cast
#: back to the logits' dtype). What each transformers router's forward does after its float32 softmax.
NORMALISATIONS: dict[str, tuple[bool | str, bool]] = {
    "MixtralTopKRouter": (True, False),
    "Qwen2MoeTopKRouter": ("norm_topk_prob", True),
    "Qwen3MoeTopKRouter": ("norm_topk_prob", True),
    "OlmoeTopKRouter": ("norm_topk_prob", True),
}


def _router_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, router) of every MoE block (a module with ``experts`` and a ``gate`` / ``router``), in order."""
    found = []
    for name, module in model.named_modules():
        if not hasattr(module, "experts"):
            continue
        router = getattr(module, "gate", None)
        if router is None:
            router = getattr(module, "router", None)
        if isinstance(router, nn.Module):
            found.append((name, router))
    return found


def routing_problem(model: nn.Module) -> str | None:
    """None when every MoE router of ``model`` is supported; else one line saying why not."""
    found = _router_candidates(model)
    if not found:
        return f"{type(model).__name__} has no MoE routers"
    for name, router in found:
        cls = type(router).__name__
        if cls not in NORMALISATIONS:
            return (f"{name}: router class {cls} is not supported (known: {', '.join(sorted(NORMALISATIONS))}); "
                    "its top-k normalisation is not guessed")
        if not isinstance(getattr(router, "top_k", None), int):
            return f"{name}: router {cls} has no integer top_k"
    if len({r.top_k for _, r in found}) != 1:
        return "the MoE routers have different top_k"
    return None


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of ``model`` in layer order; ValueError (one line) when unsupported."""
    problem = routing_problem(model)
    if problem is not None:
        raise ValueError(f"routing: {problem}")
    return [router for _, router in _router_candidates(model)]


def scores_at(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The gate weights ``router`` gives experts ``ids`` (N, k) from its ``logits`` (N, E): the
    float32 softmax over all experts gathered at ``ids``, normalised and cast as the router does
    (equal to the router's own scores when ``ids`` are its own top-k)."""
    norm, cast = NORMALISATIONS[type(router).__name__]
    if isinstance(norm, str):
        norm = bool(getattr(router, norm))
    values = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if norm:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype) if cast else values


def routing_differences(own: torch.Tensor, recorded: torch.Tensor):
    """``(recorded, set_differs, top1_differs)`` masks over tokens of two (..., k) id tensors (the
    router's own top-k, highest first, and the recorded; -1 rows: nothing recorded, never counted)."""
    valid = recorded[..., 0] >= 0
    set_differs = (own.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1) & valid
    top1_differs = (own[..., 0] != recorded[..., 0]) & valid
    return valid, set_differs, top1_differs


def flip_counts(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """(3, L) float64 on the device: per layer, the recorded tokens, those whose top-k set differs,
    those whose top-1 differs; ``own`` / ``recorded``: (..., L, k) routings of the same tokens."""
    masks = routing_differences(own.long(), recorded.long())
    return torch.stack([m.reshape(-1, m.shape[-1]).sum(0) for m in masks]).to(torch.float64)


def flip_shares(counts: torch.Tensor) -> dict[str, float]:
    """The shares of :func:`flip_counts` (summed over batches): ``flip_topk`` (mean over layers
    of the share of recorded tokens whose top-k set differs), ``flip_topk_max`` and
    ``flip_topk_max_layer`` (the worst layer), ``flip_top1`` (mean), ``recorded`` (tokens per layer)."""
    counts = counts.cpu()
    recorded = counts[0].clamp(min=1)
    topk, top1 = counts[1] / recorded, counts[2] / recorded
    worst = int(topk.argmax())
    return {"flip_topk": float(topk.mean()), "flip_topk_max": float(topk[worst]),
            "flip_topk_max_layer": float(worst), "flip_top1": float(top1.mean()), "recorded": float(counts[0].max())}


class RoutingRecorder:
    """Records each router's top-k ids (int16) while one of its contexts is active (rollout side).

    ``layers`` / ``top_k``: the shape of one token's routing.
    """

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        self.layers = len(self.routers)
        self.top_k = self.routers[0].top_k

    def buffer(self, batch: int, length: int, device) -> torch.Tensor:
        """A recording buffer (L, B, length, k) int16, filled with -1."""
        return torch.full((self.layers, batch, length, self.top_k), -1, dtype=torch.int16, device=device)

    @contextlib.contextmanager
    def into(self, buffer: torch.Tensor, slots: Callable[[], torch.Tensor]):
        """Write each forward's ids into ``buffer`` (L, B, S, k) at the slots ``slots()`` returns
        (one per token of the forward's sequence dim): one ``index_copy_`` per router, no host sync."""
        def hook(layer):
            def write(module, args, output):
                ids = output[2]
                buffer[layer].index_copy_(1, slots(), ids.view(buffer.shape[1], -1, ids.shape[-1]).to(torch.int16))
            return write

        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        try:
            yield buffer
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def appending(self, batch: int):
        """Append each forward's ids; yields a list whose element 0 becomes, on exit, the
        recording (B, S_total, L, k) int16 (the forwards' sequences concatenated)."""
        per_layer: list[list[torch.Tensor]] = [[] for _ in self.routers]

        def hook(layer):
            def keep(module, args, output):
                ids = output[2]
                per_layer[layer].append(ids.view(batch, -1, ids.shape[-1]).to(torch.int16))
            return keep

        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        result: list[torch.Tensor] = []
        try:
            yield result
        finally:
            for h in handles:
                h.remove()
            if per_layer[0]:
                result.append(torch.stack([torch.cat(p, dim=1) for p in per_layer], dim=2))


class RoutingCheck:
    """Trainer side: compares (and with ``replay``, imposes) a recorded routing in armed forwards.

    Hooks stay on ``model`` (a forward pre-hook on its decoder, a forward hook per router) and do
    nothing while disarmed. :meth:`armed` takes the recorded routing ``(B, T, L, k)`` of the
    ``input_ids`` (B, T) the next forwards of ``model`` see, in order, chunked along the batch
    (each forward takes its next rows). A forward's recorded rows stay current after it (so a
    gradient-checkpointing recompute in backward routes the same way) until the next forward of
    ``model``. Counts (device tensors, summed over armed ``count=True`` forwards) are read and
    reset by :meth:`take`.
    """

    def __init__(self, model: nn.Module, *, replay: bool = False):
        self.model = model
        self.replay = bool(replay)
        self.routers = moe_routers(model)
        self.layers = len(self.routers)
        self.top_k = self.routers[0].top_k
        self._routing: torch.Tensor | None = None
        self._row = 0
        self._count = False
        self._current: torch.Tensor | None = None  # (b*t, L, k) long: the current forward's rows
        self._counted: set[int] = set()
        self._attended: torch.Tensor | None = None
        self._sums: dict[str, torch.Tensor] | None = None
        entry = model.get_decoder() if hasattr(model, "get_decoder") else model  # also what liger's loss calls
        self._handles = [entry.register_forward_pre_hook(self._pre, with_kwargs=True)]
        self._handles += [r.register_forward_hook(self._router_hook(i)) for i, r in enumerate(self.routers)]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def release(self) -> None:
        """Drop the last armed forward's rows (kept for a backward's recompute) once its step is over."""
        self._current = self._attended = None

    @contextlib.contextmanager
    def armed(self, routing: torch.Tensor, *, count: bool = True):
        """Compare (and replay) ``routing`` (B, T, L, k) in the model's forwards inside the block."""
        if routing.dim() != 4 or routing.shape[2:] != (self.layers, self.top_k):
            raise ValueError(f"RoutingCheck: routing must be (batch, tokens, {self.layers}, {self.top_k}), "
                             f"got {tuple(routing.shape)}")
        self._routing, self._row, self._count = routing, 0, count
        try:
            yield self
        finally:
            self._routing = None

    def _pre(self, module, args, kwargs):
        self._counted = set()
        if self._routing is None:
            self._current = None
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("RoutingCheck: an armed forward must take input_ids (batch, tokens) to align the "
                             "recorded routing with")
        b, t = ids.shape
        rows = self._routing[self._row:self._row + b]
        if rows.shape[:2] != (b, t):
            raise ValueError(f"RoutingCheck: the forward's input_ids {tuple(ids.shape)} do not match the recorded "
                             f"routing rows {self._row}:{self._row + b} of {tuple(self._routing.shape)}")
        self._row += b
        self._current = rows.to(ids.device, torch.long).reshape(b * t, self.layers, self.top_k)
        mask = kwargs.get("attention_mask")
        self._attended = mask.reshape(-1).bool() if mask is not None and mask.dim() == 2 else None
        if self._count:
            tokens = mask.sum() if self._attended is not None else torch.tensor(b * t, device=ids.device)
            self._add("tokens", tokens.reshape(1).to(torch.float64))
        return None

    def _add(self, name: str, value: torch.Tensor) -> None:
        if self._sums is None:
            self._sums = {}
        old = self._sums.get(name)
        self._sums[name] = value if old is None else old + value

    def _router_hook(self, layer: int):
        def hook(module, args, output):
            current = self._current
            if current is None:
                return None
            logits, _, own = output
            recorded = current[:, layer]
            if recorded.shape != own.shape:
                raise ValueError(f"RoutingCheck: router {layer} routed {tuple(own.shape)} tokens x experts, "
                                 f"the recorded rows are {tuple(recorded.shape)}")
            valid = recorded[:, 0] >= 0
            if self._count and layer not in self._counted:
                self._counted.add(layer)
                valid, set_diff, top1_diff = routing_differences(own, recorded)
                counts = torch.zeros(3, self.layers, dtype=torch.float64, device=own.device)
                counts[0, layer] = valid.sum()
                counts[1, layer] = set_diff.sum()
                counts[2, layer] = top1_diff.sum()
                self._add("layers", counts)
                if self.replay and layer == 0:
                    replayed = valid if self._attended is None else valid & self._attended
                    self._add("replayed", replayed.sum().reshape(1).to(torch.float64))
            if not self.replay:
                return None
            ids = torch.where(valid[:, None], recorded, own)
            return logits, scores_at(module, logits, ids), ids
        return hook

    def take(self) -> dict[str, float] | None:
        """The counts since the last call as shares (one host sync), then reset; None when nothing
        was counted. Keys: those of :func:`flip_shares`, and with replay ``replayed`` (share of
        the forwards' attended tokens routed by replay)."""
        sums, self._sums = self._sums, None
        if not sums or "layers" not in sums:
            return None
        out = flip_shares(sums["layers"])
        if "replayed" in sums:
            out["replayed"] = float(sums["replayed"].cpu()[0] / sums["tokens"].cpu()[0].clamp(min=1))
        return out
