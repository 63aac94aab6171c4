"""The ``humming`` backend: rollout linears and experts through vLLM's humming GEMMs on Hopper (the fast path).

quads keeps its NVFP4 parts, its one quantizer and its Triton activation quantization, and hands
humming (:mod:`quads.ops.backends.humming.library`) the packed weight and 16-bit activation operands:
W4A16 feeds the bf16/fp16 activations directly; W4A4 (+ residual) feeds quads' exact fp16 operand
rows, ``stacked`` (main then residual rows) or ``summed`` (``fp16(main + residual)``), and unscales
the output rows (:class:`HummingLinearKernel` states the error bounds; docs/humming.md).

``mode`` (``QUADS_HUMMING_MODE``, :data:`~quads.ops.backends.humming.library.HUMMING_MODES`): ``"default"``
is humming's fastest (Stream-K: not deterministic run to run; the deterministic modes measured
35-60% slower on the dense linears on the H200).

Experts (:class:`HummingExpertsKernel`): humming's grouped-contiguous MoE GEMM over quads' routing,
the token rows quantized once and gathered per expert into the summed operand. Sibling sets
(:class:`HummingSiblingKernel`): one GEMM over a stacked copy of the members' layouts where they
share one global scale (group mode). Not on humming (the exact Hopper kernels serve them): weights
with per-row global scales, experts with one global scale for all, fp32 activations, biased
experts, ``"tensor"`` activation scales in experts. Every shape an NVFP4 weight has (K % 16 == 0,
:func:`humming_shape_problem`) runs on humming: one whose N is not a multiple of 128 or K of 64 is
held padded (:func:`humming_padded_shape`, zeros; memory: :func:`humming_padding_cost`).

Weight memory: one humming layout per weight (1.0x the packed bytes; a sibling set's stacked copy
once more), shared by the fp16 and bf16 layers; :class:`HummingWeight` derives the packed parts
back from it, so the layout is the weight's storage (``NVFP4Tensor.to_layout_``). Under
``torch.compile`` ``quads::linear`` takes the layout's tensors (:attr:`HummingWeight.op_tensors`).
"""

from __future__ import annotations

import copy
import functools
import json
import os

import torch

from quads.kernels.humming.layout import (HUMMING_K_MULTIPLE, HUMMING_N_MULTIPLE, humming_padded_shape,
                                          humming_padding_cost)
from quads.ops.activation_quant import as_operands, operand_row_args, per_row_scales, summed_row_args
from quads.ops.backend_registry import LinearArgs, LinearKernel, register_backend
from quads.ops.backends.hopper import (HopperBackend, HopperExpertsKernel, HopperLinearKernel, HopperSiblingKernel,
                                       prepare_weight_hopper, stack_prepared_hopper)
from quads.ops.backends.humming.tuning import SHIPPED, tuned_choice, tuned_from_env
from quads.ops.linear_op import compiled_linear
from quads.tensor.nvfp4_math import NVFP4Parts

__all__ = ["HUMMING_K_BLOCK", "HUMMING_K_MULTIPLE", "HUMMING_N_MULTIPLE", "HummingBackend", "HummingLinearKernel",
           "HummingExpertsKernel", "HummingSiblingKernel", "HummingStack", "HummingWeight", "RESIDUAL_LAYOUTS", "SUMMED_FROM_ROWS",
           "humming_padded_shape", "humming_padding_cost", "humming_residual_layout", "humming_shape_problem",
           "stack_prepared_humming"]

RESIDUAL_LAYOUTS = ("auto", "stacked", "summed")
#: from this many tokens on, ``auto`` uses the summed operand (measured on the H200: stacked faster at
#: M = 1 on all shapes and at M = 16 on the N, K <= 4096 ones; summed faster at M = 64, 256, 2048)
SUMMED_FROM_ROWS = 64
#: operand bounds of the output-range rule: one exact operand row, and the sum of two
_OPERAND_MAX = {"w4a4": 6.0 * 448.0, "summed": 2 * 6.0 * 448.0}


def humming_residual_layout(rows: int, layout: str = "auto", mode: str = "default") -> str:
    """``"stacked"`` or ``"summed"`` for ``rows`` tokens under ``layout`` (the backend's
    ``residual_layout``: ``QUADS_HUMMING_RESIDUAL`` is read once, when the backend is made).

    ``auto`` switches layout with the token count, which changes a row's bits with the batch: under
    the ``batch_invariant`` humming mode it keeps ``stacked`` at every M instead."""
    if layout == "auto" and mode == "batch_invariant":
        return "stacked"
    if layout == "auto":
        return "summed" if rows >= SUMMED_FROM_ROWS else "stacked"
    return layout


def humming_supports(weight: NVFP4Parts) -> bool:
    """Whether humming serves this weight: 2-D with one global scale, or 3-D experts with one per
    expert (else the Hopper kernels)."""
    dim = weight.qdata.dim()
    return dim in (2, 3) and weight.global_encode_scale.numel() == (1 if dim == 2 else weight.qdata.shape[0])


def humming_serves(args: LinearArgs, experts: bool = False) -> bool:
    """The exact-vs-fast rule of one weight, decided once, when its kernel is made: humming serves
    it (:func:`humming_supports`) in a humming layout (or none yet); an experts projection also
    needs per-row activation scales. Per call only the input decides: fp32 activations (and
    biased experts projections) take the exact kernels. Every NVFP4 shape gets here
    (:func:`humming_shape_problem`: the padding of shapes humming cannot tile as they are is the
    layout's, :func:`humming_padded_shape`)."""
    prepared = args.prepared
    if not (prepared is None or isinstance(prepared, HummingWeight)) or not humming_supports(args.parts()):
        return False
    return not experts or args.act is None or args.act.granularity == "row"


#: the K multiple humming needs of a weight: the NVFP4 block (every NVFP4 weight has it)
HUMMING_K_BLOCK = 16


def humming_shape_problem(n: int, k: int) -> str | None:
    """Why humming cannot serve a weight of ``n`` outputs by ``k`` inputs, or None: the one
    exact-vs-fast rule of a shape (:meth:`HummingBackend.shape_problem`).

    Any ``n`` and any ``k`` of whole NVFP4 blocks: the layout pads the rest
    (:func:`humming_padded_shape`). humming 0.1.19 itself tiles N in multiples of 128 and K of 64:
    its sm_90 heuristics (``tune/sm90_policies.py``, ``build_sm90_seed_config``) start the block N
    at 128 or 256 (512 for wide MoE tiles) and halve it until it divides N, asserting it stays four
    warps of 32 columns for 16-bit activations (``block_shape_n >= min_warp_shape_n * 4``: N = 576,
    960 and 2880 fail it on the H200); its block K halves until it divides K with a warp K of at
    least 32 (``kernel/humming.py``, ``check_shape``), and quads' in-place refresh and parts
    read-back restate its repack on 64 x 64 tiles (:mod:`quads.kernels.humming.layout`)."""
    if n < 1 or k < HUMMING_K_BLOCK or k % HUMMING_K_BLOCK:
        return f"humming needs N >= 1 and K a positive multiple of {HUMMING_K_BLOCK} (the NVFP4 block), got N={n} K={k}"
    return None


class HummingWeight:
    """What the humming backend prepares for one weight: its humming layers (fp16 for quads' W4A4
    operands, built here; ``x.dtype`` for W4A16, built on first use and sharing the fp16 layer's
    layout when the bits agree), refreshed in place by weight syncs. Build (and JIT-compile)
    before graph capture: a first forward or :meth:`warmup` does it.

    Holds no reference to the packed parts it was built from: :meth:`packed_parts` derives them
    back from the layout, which is then the weight's storage (``NVFP4Tensor.to_layout_``: one
    layout per weight, 1.0x the packed bytes).

    Compiled code passes it to ``quads::linear`` as :attr:`op_tensors` (every layer's tensors) and
    :attr:`op_config` (their static description, a JSON string); :meth:`from_op_fields` makes it
    back from them inside the op. ``tuned``: the tuned table its layers read (the backend's,
    :func:`~quads.ops.backends.humming.tuning.tuned_choice`; default the shipped one)."""

    backend_name = "humming"

    def __init__(self, weight: NVFP4Parts, mode: str, rows_hint=None, tuned=SHIPPED):
        self.mode, self.tuned = mode, tuned_choice(tuned)
        self.rows_hint = rows_hint  # benchmarks: compile only the kernels of these row counts
        self.shape = tuple(weight.qdata.shape)
        self.device = weight.qdata.device
        self.global_encode_scale = weight.global_encode_scale  # quads' own (the layout holds 2^-c / S_w)
        self.layers: dict[torch.dtype, object] = {}
        self._build(torch.float16, weight)  # the owner of the layout, built from the parts given
        # a layout the parts cannot be read back from (another humming configuration): keep them
        self._parts = None if self.can_hold_parts else weight
        self.holds_parts = self._parts is None  # whether the layout is all a weight needs (compiled calls)

    def fits(self, weight: NVFP4Parts) -> bool:
        return (humming_supports(weight) and tuple(weight.qdata.shape) == self.shape
                and weight.qdata.device == self.device)

    def _build(self, dtype: torch.dtype, parts: NVFP4Parts):
        from quads.ops.backends.humming.library import HummingNVFP4

        operand_max = {"unit": None}
        if dtype == torch.float16:
            operand_max.update(_OPERAND_MAX)
        held = HummingNVFP4(parts.qdata, parts.scale, parts.global_encode_scale, dtype=dtype, mode=self.mode,
                            operand_max=operand_max, rows_hint=self.rows_hint, tuned=self.tuned)
        owner = next((lay for lay in self.layers.values() if not lay.shared), None)
        if owner is not None:
            held.share_layout_(owner)  # one layout for both activation dtypes when the bits agree
        self.layers[dtype] = held
        self._set_op_fields()
        return held

    def _set_op_fields(self) -> None:
        tensors, specs = [], []
        for lay in self.layers.values():
            t, spec = lay.op_fields(with_layout=not lay.shared)
            tensors += t
            specs.append(spec)
        self.op_tensors: list[torch.Tensor] = tensors
        self.op_config = json.dumps({"shape": list(self.shape), "mode": self.mode, "tuned": self.tuned,
                                     "layers": specs, "rows_hint": list(self.rows_hint) if self.rows_hint else None})

    @classmethod
    def from_op_fields(cls, tensors, config: str, global_encode_scale, parts: NVFP4Parts | None = None):
        """The prepared weight of :attr:`op_tensors` / :attr:`op_config` (a compiled call's arguments):
        layers over those tensors under the configurations built in this process for the same shapes,
        dtypes, modes and tuned tables (nothing looked up by identity). ``parts``: the weight's packed
        parts where the layout cannot give them back."""
        spec = _op_spec(config)
        self = cls.__new__(cls)
        self.shape, self.mode, self.tuned = tuple(spec["shape"]), spec["mode"], spec["tuned"]
        self.rows_hint = tuple(spec["rows_hint"]) if spec["rows_hint"] else None
        self.global_encode_scale, self._parts, self.holds_parts = global_encode_scale, parts, parts is None
        self.layers, layout, it = {}, None, iter(tensors)
        from quads.ops.backends.humming.library import HummingNVFP4

        for lay_spec in spec["layers"]:
            lay = HummingNVFP4.from_op_fields(lay_spec, it, layout, self.shape)
            layout = layout if layout is not None or lay.shared else dict(lay.layer.named_parameters())
            self.layers[lay.dtype] = lay
        self.device = lay.device
        self.op_tensors, self.op_config = list(tensors), config
        return self

    def layer(self, dtype: torch.dtype):
        held = self.layers.get(dtype)
        if held is None:
            parts = self._parts
            if parts is None:
                q, s = self.packed_parts()  # transient: the new layer's layout is built from them
                parts = NVFP4Parts(q, s, self.global_encode_scale)
            held = self._build(dtype, parts)
        return held

    def _owner(self):
        return next(lay for lay in self.layers.values() if not lay.shared)

    @property
    def padded_shape(self) -> tuple[int, int]:
        """``(N, K)`` of the humming layout held: :func:`humming_padded_shape` of the weight's (its own
        where humming tiles it as it is); bytes: :func:`humming_padding_cost` x the packed bytes."""
        return humming_padded_shape(self.shape[-2], self.shape[-1] * 2)

    @property
    def can_hold_parts(self) -> bool:
        """Whether :meth:`packed_parts` can give the packed parts back (humming's direct repack layout)."""
        from quads.ops.backends.humming.library import direct_repack

        return direct_repack(self._owner().layer.humming_config)

    def packed_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """quads' packed ``(qdata, scale)``, derived from the held layout (new tensors, bit-exact:
        the inverse of humming's repack, :mod:`quads.kernels.humming.layout`)."""
        if getattr(self, "_parts", None) is not None:
            return self._parts.qdata, self._parts.scale
        return self._owner().packed_parts()

    @property
    def shape_parts(self) -> NVFP4Parts:
        """Meta placeholders of the packed parts' shapes, and quads' global scale: what the
        backend's entries read of a weight whose parts this layout holds."""
        q = torch.empty(self.shape, dtype=torch.uint8, device="meta")
        s = torch.empty((*self.shape[:-1], self.shape[-1] // 8), dtype=torch.float8_e4m3fn, device="meta")
        return NVFP4Parts(q, s, self.global_encode_scale)

    def real_parts(self, weight: NVFP4Parts) -> NVFP4Parts:
        """``weight`` with real ``qdata``/``scale`` (derived here when the module holds meta placeholders)."""
        if weight.qdata.device.type != "meta":
            return weight
        q, s = self.packed_parts()
        return NVFP4Parts(q, s, weight.global_encode_scale)

    @property
    def nbytes(self) -> int:
        """Bytes of the humming layouts held for this weight (shared tensors counted once)."""
        seen: dict[int, int] = {}
        for layer in self.layers.values():
            seen.update(layer.storages())
        return sum(seen.values())

    def written_tensors(self) -> list[torch.Tensor]:
        """Every tensor :meth:`write_parts_` writes in place, each once (``NVFP4Tensor.storage_snapshot``)."""
        seen: dict[tuple, torch.Tensor] = {}
        for layer in self.layers.values():
            for t in layer.written_tensors():
                seen.setdefault((t.data_ptr(), t.dtype, tuple(t.shape)), t)
        return list(seen.values())

    def write_parts_(self, weight: NVFP4Parts) -> "HummingWeight":
        """Rewrite the layouts from new parts of the same shapes, in place (a sync, ``load_state_dict``)."""
        self.global_encode_scale = weight.global_encode_scale
        if self._parts is not None:
            self._parts = weight
        for layer in sorted(self.layers.values(), key=lambda lay: lay.shared):  # owners first
            layer.refresh_(weight.qdata, weight.scale, weight.global_encode_scale)
        return self

    def with_mode(self, mode: str) -> "HummingWeight":
        """The layers built so far, run under another humming ``mode`` (views: one layout)."""
        view = copy.copy(self)
        view.mode = mode
        view.layers = {dtype: layer.with_mode(mode) for dtype, layer in self.layers.items()}
        view._set_op_fields()
        return view

    def warmup(self, dtypes=(torch.float16,), ms=(1,)) -> None:
        for dtype in dtypes:
            self.layer(dtype).warmup(ms)

    def warmup_key(self, dtype: torch.dtype) -> tuple:
        """What the kernels :meth:`warmup` compiles for ``dtype`` depend on (the layer, compute and
        tuning configurations humming caches them under follow from it): weights of one key share
        their kernels, so warming one compiles them for all."""
        experts = self.shape[0] if len(self.shape) == 3 else None
        return (experts, self.padded_shape, dtype, self.mode, self.rows_hint, self.tuned, str(self.device))


@functools.lru_cache(maxsize=None)
def _op_spec(config: str) -> dict:
    """:attr:`HummingWeight.op_config` parsed (once per distinct configuration: it is static)."""
    return json.loads(config)


class HummingLinearKernel(HopperLinearKernel):
    """One weight's linear on humming (see the module doc). Activations of other dtypes than
    :attr:`humming_dtypes` take the exact Hopper kernel it extends (the parts derived from the layout); compiled
    code calls ``quads::linear`` with the layout's tensors, whose body runs this kernel eagerly.

    * W4A16 (``act=None``): the layer of ``x.dtype``; output = ``fp32 sum of exact products *
      (1/S_w)``, rounded once to ``x.dtype``.
    * W4A4 (+ residual): the fp16 layer on the exact operand rows ``e2m1 * f32(block scale)``
      (main and residual under the row's ``S_x``), the fp16 output rows unscaled by ``2^c / S_x``
      (:func:`~quads.kernels.humming.operands.unscale_rows`). ``stacked`` (2M rows, summed in fp32
      in the epilogue): error vs the exact path = the fp16 rounding of each output row (relative
      2^-11, plus ``2^(c-25)/S_x`` below fp16's normal range) and the final rounding. ``summed``
      (M rows): one more rounding per operand element, ``|Δy_n| <= 2^-11 * sum_k |x̂+r̂|_k |w_nk|``.
      :func:`humming_residual_layout` picks (``auto``: stacked below :data:`SUMMED_FROM_ROWS` rows)."""

    humming_dtypes = (torch.float16, torch.bfloat16)
    fixed_row_args = False

    def __init__(self, backend, args: LinearArgs):
        super().__init__(backend, args)
        if args.act is None and isinstance(args.prepared, HummingWeight) and not torch.compiler.is_compiling():
            # W4A16 reads the layer of x.dtype: both are made now (one shared layout), so that a
            # compiled call finds the one it reads among quads::linear's tensors
            for dtype in self.humming_dtypes:
                args.prepared.layer(dtype)

    def apply(self, x, bias=None, operands=None):
        if torch.compiler.is_compiling():
            return compiled_linear(self, x, bias)
        if x.shape[-1] != self.k:
            self.check_input(x)
        if x.dtype not in self.humming_dtypes:  # the one per-call choice: the exact kernels, on the parts
            held = self.prepared is not None  # (derived from the layout, which is the weight's storage)
            return super().apply(x, bias, operands, self.prepared.real_parts(self.parts) if held else self.parts, None)
        prepared = self.prepared if self.prepared is not None else self.backend.prepare_weight(self.parts)
        act = self.act
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        m = x2.shape[0]
        if act is None:  # a padded layout's (M, N) view copied once: the op's output is contiguous (its fake's)
            y = prepared.layer(x2.dtype)(x2).contiguous()
            return (y if bias is None else y + bias.to(y.dtype)).reshape(*x.shape[:-1], y.shape[-1])
        from quads.kernels.humming.operands import sum_stacked_rows, unscale_rows
        from quads.kernels.quantize_activations import quantize_rows

        layer = prepared.layer(torch.float16)
        summed = act.has_residual and humming_residual_layout(m, self.backend.residual_layout, layer.mode) == "summed"
        stacked = False
        if summed and operands is None:  # the quantization kernel writes fp16(main + residual) itself
            q = quantize_rows(x2, **summed_row_args(x2, act, self.static_mask))
            op, scale = q.summed_operand, per_row_scales(q.main.global_encode_scale, m)
        else:
            ops = operands if operands is not None else as_operands(
                quantize_rows(x2, **operand_row_args(x2, act, self.static_mask)), m)
            scale = ops.main_scale
            if ops.residual is None:
                op = ops.main
            elif not summed:
                op, stacked = ops.stacked, True
            else:  # operands shared by a sibling group arrive stacked: summed here (the fused kernel's bits)
                op = sum_stacked_rows(ops.stacked, m)
        scaling = "summed" if summed else "w4a4"
        o = layer(op, scaling)
        y = unscale_rows(o, m, layer.unshift[scaling], scale, bias, x2.dtype, stacked=stacked)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class _OneLayer:
    """A single humming layer where :class:`HummingLinearKernel` reads a :class:`HummingWeight`."""

    def __init__(self, layer):
        self._layer = layer

    def layer(self, dtype):
        return self._layer


class HummingExpertsKernel(HopperExpertsKernel):
    """One experts module on humming's grouped MoE GEMM (see the module doc): per projection the
    token operands quantized once, gathered per expert row, into the summed operand (W4A4) or the
    16-bit rows themselves (W4A16). A projection humming does not serve (:func:`humming_serves`,
    decided here once: Hopper-laid weights, ``"tensor"`` activation scales, one global scale for
    all experts) or an input it does not take (expert biases, fp32 activations: the one per-call
    branch) runs the exact :class:`~quads.ops.backends.hopper.HopperExpertsKernel` GEMM on its packed
    parts (derived from a humming layout)."""

    def __init__(self, backend, gate_up: LinearArgs, down: LinearArgs | None = None):
        super().__init__(backend, gate_up, down)
        self.fast = tuple(humming_serves(a, experts=True) for a in self.projections)

    def gemm(self, i, x, rows, route, bias, w=None):
        a = self.projections[i]
        if not self.fast[i] or bias is not None or x.dtype not in HummingLinearKernel.humming_dtypes:
            held = isinstance(a.prepared, HummingWeight)
            return HopperExpertsKernel.gemm(self, i, x, rows, route, bias,
                                            a.prepared.real_parts(self.parts[i]) if held else None)
        from quads.kernels.humming.operands import unscale_rows
        from quads.kernels.quantize_activations import quantize_rows

        num_rows = route.num_rows
        x = x if x.stride(-1) == 1 else x.contiguous()
        prepared = a.prepared if a.prepared is not None else self.backend.prepare_weight(self.parts[i])
        if a.act is None:
            y = prepared.layer(x.dtype)(x if rows is None else x.index_select(0, rows),
                                        expert_layout=route.offsets).contiguous()  # padded N: one copy
        else:  # one kernel: the rows gathered per expert quantized straight into the summed operand (row-local:
            # a gathered row has its token's bits)
            q = quantize_rows(x, **summed_row_args(x, a.act, a.static_mask, rows))
            layer, scaling = prepared.layer(torch.float16), "summed" if a.act.has_residual else "w4a4"
            o = layer(q.summed_operand, scaling, expert_layout=route.offsets)
            y = unscale_rows(o, num_rows, layer.unshift[scaling], per_row_scales(q.main.global_encode_scale, num_rows),
                             None, x.dtype, stacked=False)
        valid = torch.arange(num_rows, device=y.device) < route.offsets[-1]  # rows of no expert give 0
        return y.masked_fill_(~valid[:, None], 0)


class HummingStack:
    """Sibling weights sharing one global scale as one humming weight of N = the members' sum:
    the set's own copy (humming's layout of the stacked weight is the members' layouts side by
    side along its last dim, but a member's columns are not contiguous, which humming's GEMM and
    repack need), so each member keeps its own layout and :meth:`write_member_` copies a
    member's written layout into its columns. The output-range shift is the members' largest
    (the stacked weight's own: the shift rises with the largest row sum, one global scale)."""

    def __init__(self, weight: HummingWeight, members: list[HummingWeight], offsets: list[int]):
        self.weight, self.members, self.offsets = weight, members, offsets

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def write_member_(self, i: int) -> None:
        """Member ``i``'s layout (written by a sync) into its columns, in place; the run-time scales
        of every layer of the stack (fp16: the shifts from all members'; a W4A16 layer of another
        dtype, sharing the fp16 layout: ``1 / S_w``, unshifted)."""
        dst, src = self.weight.layer(torch.float16), self.members[i].layer(torch.float16)
        lo, hi = self.offsets[i], self.offsets[i + 1]  # (a padded member's own columns: its first hi - lo)
        dst.layer.weight.data[..., 2 * lo:2 * hi].copy_(src.layer.weight.data[..., :2 * (hi - lo)])
        dst.layer.weight_scale.data[..., lo:hi].copy_(src.layer.weight_scale.data[..., :hi - lo])
        gs = self.members[i].global_encode_scale
        self.weight.global_encode_scale = gs
        one = torch.ones(1, dtype=torch.float32, device=dst.ws2[next(iter(dst.ws2))].device)
        for dtype, lay in self.weight.layers.items():
            for name in lay.ws2:
                if lay.operand_max.get(name) is None:  # an unshifted range (c = 0)
                    c = torch.zeros(1, dtype=torch.float32, device=one.device)
                else:
                    c = torch.stack([m.layer(dtype).shift[name].reshape(()) for m in self.members]).amax().reshape(1)
                lay.shift[name].copy_(c)
                lay.ws2[name].copy_(one / gs.reshape(-1).to(torch.float32) * torch.exp2(-c))
                lay.unshift[name].copy_(torch.exp2(c))


def _layer_fields(w: HummingWeight):
    lay = w.layer(torch.float16)
    return lay.layer.weight, lay.layer.weight_scale, getattr(lay.layer.humming_config, "should_apply_bs_on_c", None)


def stack_prepared_humming(prepared, shared_scale: bool):
    """A :class:`HummingStack` of sibling humming weights (one K, mode, tuned table and device,
    humming's direct layout, one global scale by construction: ``shared_scale``; each N a multiple
    of 64, so that a member's layout is whole 64-row blocks of the stacked one, padded or not), and
    the members' own weights as their views; None when they do not qualify."""
    if not shared_scale or not all(isinstance(p, HummingWeight) and len(p.shape) == 2 for p in prepared):
        return None
    first = prepared[0]
    if any(p.shape[0] % 64 or p.shape[1] != first.shape[1] or p.device != first.device or p.mode != first.mode
           or p.rows_hint != first.rows_hint or p.tuned != first.tuned or not p.can_hold_parts for p in prepared):
        return None
    parts = [p.packed_parts() for p in prepared]  # transient: the stacked layout is built from them
    weight = HummingWeight(NVFP4Parts(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]),
                                      first.global_encode_scale), first.mode, first.rows_hint, first.tuned)
    del parts
    offsets = [0]
    for p in prepared:
        offsets.append(offsets[-1] + p.shape[0])
    stacked = HummingStack(weight, list(prepared), offsets)
    w, ws, on_c = _layer_fields(weight)
    fields = [_layer_fields(p) for p in prepared]
    n_pad = humming_padded_shape(offsets[-1], 2 * first.shape[1])[0]
    if (not weight.can_hold_parts or any(f[2] != on_c for f in fields)
            or tuple(w.shape[:-1]) != tuple(fields[0][0].shape[:-1]) or w.shape[-1] != 2 * n_pad
            or ws.shape[-1] != n_pad
            or any(f[1].shape[-1] != humming_padded_shape(p.shape[0], 2 * p.shape[1])[0]
                   for f, p in zip(fields, prepared))):
        return None  # not the column-concatenated layout the member writes rely on
    for i in range(len(prepared)):
        stacked.write_member_(i)  # the members' shifts (one for all)
    return stacked, list(prepared)


class HummingSiblingKernel(HopperSiblingKernel):
    """The humming backend's sibling-set kernel: over a :class:`HummingStack`, for 16-bit inputs
    where no member has a bias, one humming GEMM over the stacked weight, its columns to the
    members: W4A4 (+ residual) with the input quantized once (:class:`HummingLinearKernel`'s steps
    and bits, inline: the launchers three calls below a member's forward), W4A16 on the input as it
    is (the layer of its dtype, ``1 / S_w`` for all members: their one global scale); W4A16
    without a stacked weight: nothing to share with a humming-laid member (:meth:`serves`); else
    the operands once for the members' own kernels; over a Hopper-laid stack the Hopper decode GEMM
    (:class:`~quads.ops.backends.hopper.HopperSiblingKernel`'s)."""

    def __init__(self, siblings):
        super().__init__(siblings)
        self.layer, self.layers = None, {}
        if isinstance(self.stacked, HummingStack):  # (a Hopper-laid stack: the Hopper decode GEMM)
            if self.act is None:  # W4A16: a layer per activation dtype, made now (one shared layout)
                self.layers = {dtype: self.stacked.weight.layer(dtype) for dtype in HummingLinearKernel.humming_dtypes}
            else:
                self.layer = self.stacked.weight.layer(torch.float16)
            self.stacked = None

    def serves(self, own) -> bool:
        # W4A16 without a stacked weight: a member's humming GEMM reads the input as it is
        return not (self.act is None and not self.layers and isinstance(own, HummingLinearKernel))

    def apply(self, x, i=None, bias=None):
        if self.layers and x.dtype in self.layers:
            return self._weight_only(x, i, bias)
        if self.layer is None or x.dtype not in HummingLinearKernel.humming_dtypes:
            return super().apply(x, i, bias)
        hit, biased = self.siblings.begin(i, x, bias)
        if hit is not None:
            return hit
        from quads.kernels.humming.operands import unscale_rows
        from quads.kernels.quantize_activations import quantize_rows

        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        m, layer, act = x2.shape[0], self.layer, self.act
        summed = act.has_residual and humming_residual_layout(m, self.backend.residual_layout, layer.mode) == "summed"
        if summed and not (i is not None and biased):  # the quantization writes fp16(main + residual) itself
            q = quantize_rows(x2, **summed_row_args(x2, act, None))
            op, scale, stacked = q.summed_operand, per_row_scales(q.main.global_encode_scale, m), False
        else:
            ops = as_operands(quantize_rows(x2, **operand_row_args(x2, act)), m)
            if i is not None and biased:  # the operands once, for the members' own kernels
                return self.siblings.keep(i, x, None, ops)
            stacked = ops.residual is not None
            op, scale = (ops.stacked if stacked else ops.main), ops.main_scale
        scaling = "summed" if summed else "w4a4"
        y = unscale_rows(layer(op, scaling), m, layer.unshift[scaling], scale, bias, x2.dtype, stacked=stacked)
        return self.siblings.keep(i, x, y, None)

    def _weight_only(self, x, i, bias):
        """W4A16: one GEMM over the stacked weight in ``x.dtype`` (each column ``fp32 sum of exact
        products * (1/S_w)``, rounded once: a member's own kernel's arithmetic); with a bias
        anywhere, each member computes alone."""
        hit, biased = self.siblings.begin(i, x, bias)
        if hit is not None:
            return hit
        if biased:
            return self.siblings.keep(i, x, None, None)
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        return self.siblings.keep(i, x, self.layers[x2.dtype](x2), None)


class HummingBackend(HopperBackend):
    """See the module doc. Every setting is read once, here, and stored on the backend (the
    registered backend reads the environment when this module is imported: on first use of
    ``humming``); kernels read the stored values. ``mode``/``residual_layout`` default to
    ``QUADS_HUMMING_MODE`` / ``QUADS_HUMMING_RESIDUAL``, then ``"default"``/``"auto"``; ``tuned``
    (the tuned table its layers read: ``True``/``"shipped"``, ``False``/``"off"`` or a file's path,
    :func:`~quads.ops.backends.humming.tuning.tuned_choice`) defaults to ``QUADS_HUMMING_TUNED``
    (unset: the shipped table); ``stack_siblings`` (default on; ``QUADS_HUMMING_STACK_SIBLINGS=0``
    turns it off): a sibling set of one global scale runs one GEMM over a stacked copy of its members'
    layouts (:class:`HummingStack`: the members' bytes once more, and each member's output under
    the set's output-range shift, within the bound, not the member GEMM's bits). On because the one
    GEMM is measured 1.4-2.8x faster than the members' GEMMs at 1-64 rows (docs/humming.md)."""

    name = "humming"
    fallback = "hopper"
    linear_kernel_class = HummingLinearKernel
    experts_kernel_class = HummingExpertsKernel
    sibling_kernel_class = HummingSiblingKernel

    def shape_problem(self, n: int, k: int) -> str | None:
        return humming_shape_problem(n, k)

    def __init__(self, mode: str | None = None, residual_layout: str | None = None, stack_siblings: bool | None = None,
                 tuned=None):
        from quads.ops.backends.humming.library import HUMMING_MODES

        if stack_siblings is None:
            stack_siblings = os.environ.get("QUADS_HUMMING_STACK_SIBLINGS", "1") != "0"
        self.stack_siblings = stack_siblings

        self.mode = mode or os.environ.get("QUADS_HUMMING_MODE", "default")
        if self.mode not in HUMMING_MODES:
            raise ValueError(f"QUADS_HUMMING_MODE must be one of {HUMMING_MODES}, got {self.mode!r}")
        if residual_layout is None:
            residual_layout = os.environ.get("QUADS_HUMMING_RESIDUAL", "auto")
        if residual_layout not in RESIDUAL_LAYOUTS:
            raise ValueError(f"QUADS_HUMMING_RESIDUAL / residual_layout must be one of {RESIDUAL_LAYOUTS}, "
                             f"got {residual_layout!r}")
        self.residual_layout = residual_layout
        self.tuned = tuned_from_env() if tuned is None else tuned_choice(tuned)

    def prepare_weight(self, weight: NVFP4Parts, out=None):
        if not humming_supports(weight):
            return prepare_weight_hopper(weight, out if not isinstance(out, HummingWeight) else None)
        if isinstance(out, HummingWeight) and out.fits(weight) and out.mode == self.mode and out.tuned == self.tuned:
            return out.write_parts_(weight)
        return HummingWeight(weight, self.mode, tuned=self.tuned)

    def op_prepared(self, prepared):
        if isinstance(prepared, HummingWeight):
            return prepared.op_tensors, prepared.op_config
        return super().op_prepared(prepared)

    def prepared_from_op(self, tensors, config, weight, global_encode_scale):
        if config.startswith("{"):  # HummingWeight.op_config
            return HummingWeight.from_op_fields(tensors, config, global_encode_scale, weight)
        return super().prepared_from_op(tensors, config, weight, global_encode_scale)

    def stack_prepared(self, prepared, shared_scale=False, weight_only=False):
        """One humming weight over sibling humming weights of one global scale (W4A4 and W4A16);
        siblings in the Hopper layout stacked as on the Hopper backend."""
        return (stack_prepared_humming(prepared, shared_scale and self.stack_siblings)
                or stack_prepared_hopper(prepared, weight_only=weight_only))

    def linear_kernel(self, args: LinearArgs) -> LinearKernel:
        """:class:`HummingLinearKernel` where :func:`humming_serves` the weight, the exact Hopper
        kernel for the rest (per-row global scales: its layout is the Hopper one)."""
        return (HummingLinearKernel if humming_serves(args) else HopperLinearKernel)(self, args)


def humming_w4a4(x2d, layer, bias, act, static_mask=None, residual_layout: str = "auto", operands=None) -> torch.Tensor:
    """W4A4 (+ residual) through one fp16 humming layer in any activation dtype (fp32: the GEMM's
    error without the final rounding): one call of :class:`HummingLinearKernel`."""
    kernel = HummingLinearKernel(HummingBackend(layer.mode, residual_layout, stack_siblings=False, tuned=layer.tuned),
                                 LinearArgs(None, act, static_mask, _OneLayer(layer)))
    kernel.humming_dtypes = (x2d.dtype,)
    return kernel.apply(x2d, bias, operands)


register_backend(HummingBackend())
