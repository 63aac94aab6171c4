"""MoE experts for transformers-5 fused expert modules: routing, the trainer-side loop, the rollout op and its custom op.

transformers 5 MoE blocks (Qwen3-MoE, Mixtral, OLMoE, ...) call their experts module as
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` with 3-D parameters
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``.

* :func:`route_by_expert` groups the (token, choice) rows by expert (stable sort; static shapes,
  no host synchronisation), shared by every path so all see the same row order;
* :func:`experts_loop` is the trainer's skeleton (each expert's MLP on its rows, outputs weighted
  and summed over the k choices in transformers' order), also used by the FP8 reference;
* :class:`ExpertsKernel` is the experts kernels' base (one per rollout experts module, made when
  its weights are set; the backends' subclasses live in :mod:`quads.ops.backends`), itself the
  generic kernel over a backend's ``grouped_linear``: ``apply`` routes, runs the grouped
  ``gate_up`` GEMM, the module's gate, the grouped ``down`` GEMM and combines; inside
  ``torch.compile`` each projection is the ``quads::experts_gemm`` custom op. :func:`grouped_linear`
  is one projection through such a kernel; :func:`rollout_experts` the op for callers that keep no
  kernel. Per row they compute what :func:`experts_loop` computes with rollout linears (tested).
"""

from __future__ import annotations

from typing import Callable

import torch

import quads.ops.grouped_linear_op  # noqa: F401  (registers the quads::grouped_linear custom op)
from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import KERNEL_OPS, Backend, KernelHandle, KernelObject, LinearArgs, select_backend
from quads.ops.compile_alignment import align_this_compile
from quads.ops.kernel_op_args import KernelOpArgs
from quads.tensor.nvfp4_math import NVFP4Parts
from quads.tensor.nvfp4_tensor import NVFP4Tensor

__all__ = ["act_and_mul", "compiled_gemm", "ExpertsKernel", "Routing", "combine_top_k", "grouped_linear",
           "route_by_expert", "experts_loop", "rollout_experts"]

ExpertMLP = Callable[[torch.Tensor, int], torch.Tensor]


class Routing:
    """(token, choice) rows grouped by expert: ``order`` (sorted position -> flat row),
    ``offsets`` (E+1,) int64 bounds of each expert's rows, ``token_of_row`` (sorted position ->
    token). Ids outside ``[0, E)`` (expert-parallel sentinels) sort last and belong to no expert.
    On CUDA a problem one program holds (decode) is one Triton launch
    (:mod:`quads.kernels.moe_routing`), otherwise torch ops; the same bits either way."""

    __slots__ = ("order", "counts", "offsets", "token_of_row", "num_rows", "top_k")

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        flat = top_k_index.reshape(-1)
        self.top_k = top_k_index.shape[-1]
        self.num_rows = flat.numel()
        if _routing_kernel_applies(flat, num_experts):
            from quads.kernels.moe_routing import moe_routing

            self.order, counts, self.offsets, self.token_of_row = moe_routing(flat, num_experts, self.top_k)
            self.counts = counts[:num_experts]
            return
        valid = (flat >= 0) & (flat < num_experts)
        key = torch.where(valid, flat, num_experts)
        self.order = torch.argsort(key, stable=True)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        self.counts = counts[:num_experts]
        # exclusive prefix sum over the E+1 counts (the sentinels' last): 0, c0, c0+c1, ... (exact
        # int64); two kernels, no zero-filled buffer and slice assignment (host time per call)
        self.offsets = torch.cumsum(counts, 0) - counts
        self.token_of_row = self.order // self.top_k

    @classmethod
    def of_rows(cls, rows: torch.Tensor | None, offsets: torch.Tensor, num_rows: int) -> "Routing":
        """Rows grouped by expert already: ``rows`` (sorted position -> activation row, None =
        identity), ``offsets`` (E+1,); no ``order`` (one projection, no combine)."""
        r = cls.__new__(cls)
        r.order = r.counts = r.top_k = None
        r.offsets, r.token_of_row, r.num_rows = offsets, rows, num_rows
        return r


def _routing_kernel_applies(flat: torch.Tensor, num_experts: int) -> bool:
    """The one-launch routing kernel: CUDA int64 ids one program holds, eagerly (compiled code
    traces the torch ops); CPU tensors (the interpreter too) take the torch ops."""
    if not flat.is_cuda or flat.dtype != torch.int64 or torch.compiler.is_compiling():
        return False
    from quads.kernels.moe_routing import routing_fits

    return routing_fits(flat.numel(), num_experts)


def route_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)`` of :class:`Routing` (stable sort by expert id; counts per expert)."""
    r = Routing(top_k_index, num_experts)
    return r.order, r.counts


def act_and_mul(act_fn: Callable[[torch.Tensor], torch.Tensor], gate_up_out: torch.Tensor) -> torch.Tensor:
    """The common gate of fused experts: ``act(gate) * up`` over the two halves of the gate_up output."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return act_fn(gate) * up


def experts_loop(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    expert_mlp: ExpertMLP,
) -> torch.Tensor:
    """Run ``expert_mlp(rows, e)`` for every expert that received tokens; combine top-k.

    Expert ids outside ``[0, num_experts)`` (expert-parallel sentinels) contribute nothing.
    A host loop over experts (``counts.tolist()``): the trainer side, not CUDA-graph capturable.
    """
    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_index.shape[-1]
    order, counts = route_by_expert(top_k_index, num_experts)
    out = hidden.new_zeros(num_tokens * top_k, hidden_dim)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        out = out.index_put((rows,), expert_mlp(hidden[rows // top_k], expert).to(out.dtype))
    weighted = out.view(num_tokens, top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


class ExpertsKernel(KernelObject):
    """One experts module's kernel over two 3-D weights (:class:`~quads.ops.backend_registry.LinearArgs`),
    made once when the weights are set (``Backend.experts_kernel``); ``down=None`` makes a kernel
    of one projection (:func:`grouped_linear`: rows routed already, no combine).

    :meth:`apply` is the one experts loop of every backend: the route, the ``gate_up`` projection,
    the gate, the ``down`` projection, the top-k combine. The backend's grouped GEMM is its only
    varying part: :meth:`gemm` (one projection over rows grouped by expert). This generic base
    runs it through the backend's ``grouped_linear`` (a backend that has only that entry); the
    built-in backends' kernels override :meth:`gemm`. Inside ``torch.compile`` each projection is
    one custom op (:func:`compiled_gemm`) whose body runs :meth:`gemm` eagerly."""

    def __init__(self, backend: Backend, gate_up: LinearArgs, down: LinearArgs | None = None):
        self.backend, self.gate_up, self.down = backend, gate_up, down
        self.projections = (gate_up,) if down is None else (gate_up, down)
        # resolved once: the packed parts' tensors (every write through the product API rewrites them in place)
        self.parts = tuple(None if a.weight is None else a.parts() for a in self.projections)
        w = self.parts[0]
        self.h = None if w is None else w.qdata.shape[-1] * 2
        self.num_experts = None if w is None else w.qdata.shape[0]
        self.out_features = tuple(None if p is None else p.qdata.shape[-2] for p in self.parts)
        self._init_handle()

    def check_input(self, hidden: torch.Tensor) -> None:
        """Raise unless ``hidden``'s last dim is the experts' H (grouped GEMMs may read only the first H columns)."""
        if self.h is not None and hidden.shape[-1] != self.h:
            raise ValueError(f"quads experts: hidden of shape {tuple(hidden.shape)} has H={hidden.shape[-1]}, "
                             f"the experts' weights have H={self.h}")

    def apply(self, hidden, top_k_index, top_k_weights, apply_gate, biases=(None, None)) -> torch.Tensor:
        """``hidden (T, H)`` routed by ``top_k_index``/``top_k_weights`` (T, k) -> (T, H);
        ``apply_gate`` maps the gate_up output (rows, 2I) to (rows, I). ``top_k_index`` may be a
        :class:`Routing` already; ``top_k_weights`` None: the projections' output rows in expert
        order (no combine)."""
        compiling = torch.compiler.is_compiling()
        if not compiling and hidden.shape[-1] != self.h:
            self.check_input(hidden)
        route = top_k_index if isinstance(top_k_index, Routing) else Routing(top_k_index, self.num_experts)
        x, rows = hidden, route.token_of_row
        for i in range(len(self.out_features)):
            if i:
                x, rows = apply_gate(x), None
            x = compiled_gemm(self, i, x, rows, route, biases[i]) if compiling else self.gemm(i, x, rows, route,
                                                                                              biases[i])
        return combine_top_k(x, route, top_k_weights, hidden)

    def gemm(self, i: int, x, rows, route: Routing, bias, w: NVFP4Parts | None = None) -> torch.Tensor:
        """Projection ``i`` over the rows grouped by expert: ``(route.num_rows, N)``, row ``p`` =
        ``linear(x[rows[p]], W[e(p)])`` (``rows`` None = identity), rows of no expert zero. ``w``:
        read instead of the kernel's parts (the fast kernels' exact path)."""
        a = self.projections[i]
        return self.backend.grouped_linear(x, rows, route.offsets, self.parts[i] if w is None else w, bias, a.act,
                                           a.static_mask, route.num_rows, prepared=a.prepared if w is None else None)

    def op_args(self, i: int, x, rows, route: Routing, bias) -> tuple:
        """Projection ``i`` as the ``quads::grouped_linear`` custom op's plain arguments (a torch
        without opaque objects)."""
        a, w = self.projections[i], self.parts[i]
        if getattr(a.prepared, "backend_name", None) == "humming":  # not run over a humming layout
            raise NotImplementedError("torch.compile of humming-prepared experts (kernel='fast' MoE) needs a torch "
                                      "with opaque custom-op objects: run the experts eagerly, or kernel='exact'")
        fields = KernelOpArgs.of(self.backend, w, a.act, a.static_mask, a.prepared)
        return (x, rows, route.offsets, bias, route.num_rows, self.out_features[i], *fields.to_op_args())


def compiled_gemm(kernel: ExpertsKernel, i: int, x, rows, route: Routing, bias) -> torch.Tensor:
    """Projection ``i`` of ``kernel`` as ``torch.compile`` traces it: one opaque custom op over the
    kernel object (``quads::experts_gemm``: :meth:`ExpertsKernel.gemm` eagerly in its body), or
    where this torch has no opaque objects ``quads::grouped_linear`` over its plain arguments."""
    if KERNEL_OPS:
        return torch.ops.quads.experts_gemm(x, rows, route.offsets, bias, kernel.op_handle, i, route.num_rows,
                                            kernel.out_features[i])
    return torch.ops.quads.grouped_linear(*kernel.op_args(i, x, rows, route, bias))


if KERNEL_OPS:
    @torch.library.custom_op("quads::experts_gemm", mutates_args=())
    def experts_gemm_op(x: torch.Tensor, rows: torch.Tensor | None, offsets: torch.Tensor, bias: torch.Tensor | None,
                        kernel: KernelHandle, projection: int, num_rows: int, out_features: int) -> torch.Tensor:
        """(num_rows, N): an experts kernel's projection (:meth:`ExpertsKernel.gemm`) as an op opaque to
        ``torch.compile``, run eagerly on the module's own kernel (the reference's host loop inside it)."""
        return kernel.kernel.gemm(projection, x, rows, Routing.of_rows(rows, offsets, num_rows), bias)

    @experts_gemm_op.register_fake
    def _(x, rows, offsets, bias, kernel, projection, num_rows, out_features):
        align_this_compile()
        return x.new_empty(num_rows, out_features)


def combine_top_k(y: torch.Tensor, route: Routing, top_k_weights: torch.Tensor | None,
                  hidden: torch.Tensor) -> torch.Tensor:
    """The rows' outputs (sorted by expert) back in token order, weighted and summed over the k
    choices; ``top_k_weights`` None: ``y`` as it is (one projection's rows)."""
    if top_k_weights is None:
        return y
    num_tokens, hidden_dim = hidden.shape
    out = torch.zeros(route.num_rows, hidden_dim, dtype=hidden.dtype, device=hidden.device)
    out.index_copy_(0, route.order, y.to(hidden.dtype))
    weighted = out.view(num_tokens, route.top_k, hidden_dim) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


def grouped_linear(backend: Backend, x, rows, offsets, weight: NVFP4Parts, bias, act, static_mask, num_rows: int,
                   prepared=None) -> torch.Tensor:
    """(num_rows, N): one projection over rows grouped by expert (row ``p`` = ``linear(x[rows[p]],
    W[e(p)])``, ``rows`` None = identity, rows from ``offsets[E]`` on zero) through a one-projection
    :class:`ExpertsKernel` of ``backend``: the built-in backends' ``grouped_linear`` entry (the
    ``quads::grouped_linear`` custom op's body)."""
    kernel = backend.experts_kernel(LinearArgs(weight, act, static_mask, prepared), None)
    return kernel.gemm(0, x, rows, Routing.of_rows(rows, offsets, num_rows), bias)


def rollout_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: NVFP4Tensor | NVFP4Parts,
    down: NVFP4Tensor | NVFP4Parts,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    act: ActivationQuant | None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    static_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    backend: Backend | None = None,
    prepared: tuple = (None, None),
) -> torch.Tensor:
    """Experts forward with packed NVFP4 ``gate_up (E, 2I, H)`` and ``down (E, H, I)`` weights
    (``NVFP4Tensor`` or their parts), for callers that keep no kernel (a rollout module applies its
    :class:`ExpertsKernel`). ``backend``: None picks one for ``hidden``'s device. ``prepared``: what
    ``backend.prepare_weight`` derived from each, if the caller has it. ``apply_gate`` maps the
    gate_up output (rows, 2I) to (rows, I) (the module's ``_apply_gate``, e.g. ``silu(gate) * up``)."""
    backend = backend or select_backend(hidden.device)
    kernel = backend.experts_kernel(LinearArgs(gate_up, act, static_masks[0], prepared[0]),
                                    LinearArgs(down, act, static_masks[1], prepared[1]))
    return kernel.apply(hidden, top_k_index, top_k_weights, apply_gate, (gate_up_bias, down_bias))
