"""The adapter to vLLM's humming library (humming-kernels 0.1.19): quads' NVFP4 weights as its GEMMs.

humming (github.com/vllm-project/humming) JIT-compiles (NVRTC) mixed-precision GEMMs; its ModelOpt
NVFP4 weight schema takes quads' packed parts as they are (``weight`` uint8 N x K/2,
``weight_scale`` e4m3 N x K/16, ``weight_scale_2`` = 1/S_w). On sm_90 the weight is decoded in
registers to the 16-bit activation dtype (``e2m1 * f32(s)`` is exact in fp16 and bf16), products
are summed in fp32 and ``weight_scale_2`` (read at run time) scales the sum before the store.
sm_90 has no 4-bit activation MMA, so quads hands over its exact fp16 operand rows.

**Output range.** An fp16 output of unscaled quads operands can overflow: :func:`output_shift`
picks on the device a power of two ``2^c`` under which the bound ``A * 96 * sum_b s_b / S_w``
stays below ``2^15``; the GEMM reads ``2^-c / S_w`` and the epilogue multiplies by ``2^c`` (exact).

**Configurations** (``mode``, :data:`HUMMING_MODES`): ``"default"`` (humming's M-interval table,
Stream-K: not deterministic run to run, measured max diff 0.0078 at 4096^2), ``"no_stream_k"``
(the same table without Stream-K: deterministic) and ``"batch_invariant"``; the first two take the
GPU's measured configurations on their M intervals where quads ships them (:mod:`.tuning`).

**JIT**: a layer's first call compiles its table (~1.5 s per shape; :meth:`HummingNVFP4.warmup`
before CUDA-graph capture), cached under quads' cache directory (``HUMMING_CACHE_DIR``).

**Refresh** (a weight sync): no new layer: one ``humming.ops.repack_weight`` launch per tensor writes
the repacked weight into the held tensor, the block-scale permutation and ``weight_scale_2`` are
copied in (shapes checked first: all or nothing); captured graphs stay valid. Layers are built on the
device. This module needs CUDA sm_90 and humming; nothing here imports humming at quads import time.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path

import torch

from quads.kernels.humming.layout import humming_padded_shape, pad_parts, unpad_parts
from quads.ops.backends.humming.tuning import HUMMING_REQUIREMENT, SHIPPED, merge_tuned, tuned_choice, tuned_intervals

__all__ = [
    "HUMMING_REQUIREMENT",
    "HUMMING_MODES",
    "HummingNVFP4",
    "check_humming_device",
    "device_name",
    "direct_repack",
    "humming_tensors",
    "humming_cache_dir",
    "humming_cache_root",
    "import_humming",
    "modelopt_tensors",
    "output_shift",
    "transform_into_",
]

HUMMING_MODES = ("default", "no_stream_k", "batch_invariant")
GROUPED = "grouped_contiguous"  # humming's MoE GEMM over rows sorted by expert (quads' Routing)
E2M1_BLOCK_L1_MAX = 96.0  # 16 values of |e2m1| <= 6 per block
FP16_OUTPUT_LIMIT = 2.0**15  # keep the bound of |o| below this (fp16 max 65504)


def humming_cache_root() -> Path:
    """``$QUADS_CACHE/humming``, else ``$XDG_CACHE_HOME/quads/humming``, else ``~/.cache/quads/humming``
    (the rule of :func:`quads.models.cache.cache_root`, restated: ops import nothing above them)."""
    env = os.environ.get("QUADS_CACHE")
    if env:
        return Path(env).expanduser() / "humming"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "quads" / "humming"


def humming_cache_dir() -> Path:
    """Where humming's JIT keeps compiled kernels (read at each compile): ``HUMMING_CACHE_DIR``,
    else ``cache`` under :func:`humming_cache_root`."""
    env = os.environ.get("HUMMING_CACHE_DIR")
    return Path(env).expanduser() if env else humming_cache_root() / "cache"


def import_humming():
    """Import humming (lazily: only the humming backend needs it), its JIT cache in
    :func:`humming_cache_dir` and its scratch under :func:`humming_cache_root` unless
    ``HUMMING_CACHE_DIR``/``HUMMING_TMP_DIR`` are set."""
    root = humming_cache_root()
    os.environ.setdefault("HUMMING_CACHE_DIR", str(humming_cache_dir()))
    os.environ.setdefault("HUMMING_TMP_DIR", str(root / "tmp"))
    try:
        import humming
        import humming.layer  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"the quads 'humming' backend needs humming: pip install {HUMMING_REQUIREMENT} "
            f"(or the extra: pip install 'quads-rl[humming]'); import failed: {err}"
        ) from err
    return humming


def check_humming_device(device: torch.device | str) -> torch.device:
    """``device`` if humming's GEMMs are measured there (CUDA sm_90), else a RuntimeError naming it."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"the quads 'humming' backend runs on CUDA sm_90 (Hopper) only, got device {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"the quads 'humming' backend is built and measured for sm_90 (H100/H200); {device} is "
            f"sm_{major}{minor}: use the 'hopper' (exact) or 'torch' backend there"
        )
    return device


def _check_parts(qdata: torch.Tensor, scale: torch.Tensor, global_encode_scale: torch.Tensor) -> tuple:
    if qdata.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 parts must be uint8 qdata and float8_e4m3fn scales, got {qdata.dtype}, {scale.dtype}")
    if qdata.dim() not in (2, 3) or scale.shape[:-1] != qdata.shape[:-1] or scale.shape[-1] * 8 != qdata.shape[-1]:
        raise ValueError(
            f"NVFP4 parts shapes do not match: qdata {tuple(qdata.shape)} (.., N, K/2), "
            f"scale {tuple(scale.shape)} (.., N, K/16)"
        )
    experts = qdata.shape[0] if qdata.dim() == 3 else None
    want = (experts,) if experts is not None else (1,)
    gs = global_encode_scale.reshape(-1)
    if gs.numel() != want[0]:
        raise ValueError(
            f"humming takes one global weight scale per {'expert' if experts else 'tensor'} "
            f"({want[0]} values); got {global_encode_scale.numel()} (row-granular global weight "
            "scales have no humming layout: quantize weights with granularity 'tensor'/'expert')"
        )
    return experts, gs


def max_row_l1(scale: torch.Tensor) -> torch.Tensor:
    """``96 * max_n sum_b s_nb`` (fp32, per expert or (1,)): the largest row's bound on
    ``sum_k |w_nk| * S_w``, what :func:`output_shift` scales."""
    return (E2M1_BLOCK_L1_MAX * scale.to(torch.float32).sum(dim=-1)).amax(dim=-1).reshape(-1)


def output_shift(scale: torch.Tensor, global_encode_scale: torch.Tensor,
                 operand_max: float | torch.Tensor) -> torch.Tensor:
    """``c`` (fp32, per expert or (1,)): the power of two of the module doc's output-range rule
    for operands with ``|a| <= operand_max``: the smallest ``c >= 0`` with
    ``operand_max * 96 * max_n sum_b s_nb / S_w / 2^c <= 2^15``. Computed on the device, one pass
    over the scales; ``operand_max`` a (ranges, 1) fp32 tensor: every range at once, (ranges, experts)."""
    row_l1_max = max_row_l1(scale)
    bound = operand_max * row_l1_max / global_encode_scale.reshape(-1).to(torch.float32)
    c = torch.ceil(torch.log2(torch.clamp(bound / FP16_OUTPUT_LIMIT, min=1.0)))
    return torch.nan_to_num(c, nan=0.0, posinf=0.0)  # inf/NaN weights: the output is inf/NaN anyway


def modelopt_tensors(qdata: torch.Tensor, scale: torch.Tensor, global_encode_scale: torch.Tensor,
                     shift: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The tensors of humming's ModelOpt NVFP4 schema for quads' parts: ``weight`` = qdata,
    ``weight_scale`` = scale (as they are), ``weight_scale_2`` = ``2^-shift / S_w`` (fp32, (1,) or
    (E,)); ``shift`` None = 0."""
    _, gs = _check_parts(qdata, scale, global_encode_scale)
    one = torch.ones((), dtype=torch.float32, device=gs.device)
    ws2 = one / gs.to(torch.float32)
    if shift is not None:
        ws2 = ws2 * torch.exp2(-shift.to(device=ws2.device, dtype=torch.float32).reshape(-1))
    return {"weight": qdata.contiguous(), "weight_scale": scale.contiguous(), "weight_scale_2": ws2.contiguous()}


def _json_value(v):
    """Enums and numpy scalars of humming's tuning tables as JSON values."""
    if hasattr(v, "value"):
        return v.value
    if hasattr(v, "item"):
        return v.item()
    raise TypeError(f"humming tuning value {v!r} is not JSON-serializable")


def _no_stream_k(table):
    table = copy.deepcopy(table)
    entries = [table] if isinstance(table, dict) else [entry[2] for entry in table]
    for cfg in entries:
        cfg["use_stream_k"] = False
    return table


def prune_table(table: list, rows) -> list:
    """Only the entries of humming's M-interval table that serve one of ``rows`` (humming picks
    entry ``[lo, hi, cfg]`` for ``lo < M <= hi``), stretched to cover every M: the same kernel for
    each of ``rows``, fewer kernels to compile (a benchmark over a few M; the backend keeps all)."""
    kept = [entry for entry in table if any(entry[0] < m <= entry[1] for m in rows)]
    if not kept:
        raise ValueError(f"no entry of the tuning table serves rows {sorted(rows)}")
    out, lo = [], 0
    for entry in kept:
        out.append([lo, entry[1], copy.deepcopy(entry[2])])
        lo = entry[1]
    out[-1][1] = 1 << 30
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name (the key of :mod:`quads.ops.backends.humming.tuning`'s tables); ``str(device)`` off CUDA."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def _cuda_device(device: torch.device):
    """``torch.cuda.device(device)`` on CUDA; nothing on CPU (tests)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def humming_tensors(qdata: torch.Tensor, scale: torch.Tensor, global_encode_scale: torch.Tensor) -> dict:
    """quads' parts as humming's own NVFP4 tensors (what ``HummingLayer.transform`` converts the
    ModelOpt schema to: ``weight`` = qdata viewed as int32, ``weight_scale`` = the e4m3 scales,
    ``weight_scale_2`` = ``1/S_w`` fp32 ((1,) or (E,)))."""
    t = modelopt_tensors(qdata, scale, global_encode_scale)
    experts = qdata.shape[0] if qdata.dim() == 3 else 1
    return {"weight": t["weight"].view(torch.int32), "weight_scale": t["weight_scale"],
            "weight_scale_2": t["weight_scale_2"].reshape(experts).float()}


def direct_repack(cfg) -> bool:
    """Whether humming's transform of this layer configuration is one ``repack_weight`` launch
    (float 4-bit weight, 16-bit activations, e4m3 group scales, a tensor ``weight_scale_2``, no
    padding, zero point, bias, fused/int scales or block-scaled MMA): the case
    :func:`transform_into_` writes straight into the held tensors, and the one
    :mod:`quads.kernels.humming.layout` restates."""
    from humming import dtypes
    from humming.config import WeightScale2Type, WeightScaleType

    return (cfg.b_dtype == dtypes.float4e2m1 and cfg.a_dtype.num_bits == 16 and cfg.bs_dtype == dtypes.float8e4m3
            and cfg.weight_scale_type == WeightScaleType.GROUP and cfg.weight_scale_group_size == 16
            and cfg.weight_scale_2_type == WeightScale2Type.TENSOR
            and not (cfg.pad_shape_n or cfg.pad_shape_k or cfg.has_zero_point or cfg.has_bias)
            and not (cfg.use_raw_weight or cfg.use_flat_weight or cfg.use_ldmatrix_dequant or cfg.use_native_dequant
                     or cfg.use_packed_k_layout or cfg.use_fused_e8m0_scale or cfg.use_int_weight_scale
                     or cfg.use_block_scaled_mma))


def transform_into_(layer, qdata, scale, global_encode_scale) -> None:
    """Rewrite a transformed ``HummingLayer``'s tensors from new parts, in place, through humming's
    own transform under the layer's configuration (module doc, **Refresh**). Every shape and dtype
    is checked before the first write."""
    from humming import ops
    from humming.transform import transform_humming_tensors

    from quads.kernels.humming.layout import scale_layout

    cfg = layer.humming_config
    held = dict(layer.named_parameters())
    t = humming_tensors(qdata, scale, global_encode_scale)
    if direct_repack(cfg):
        # quads' restatement of humming's scale transform (same bytes, tested against it): humming's
        # builds its permutation from a host list per call, which a CUDA-graph capture refuses
        new = {"weight_scale": scale_layout(t["weight_scale"], bool(cfg.should_apply_bs_on_c)),
               "weight_scale_2": t["weight_scale_2"]}
        ws2 = held.get("weight_scale_2")
        if ws2 is not None and ws2.numel() == new["weight_scale_2"].numel():  # (E,) held as humming shaped it
            new["weight_scale_2"] = new["weight_scale_2"].reshape(ws2.shape)
        weight = held.get("weight")
        n, k = qdata.shape[-2], qdata.shape[-1] * 2
        want = (*qdata.shape[:-2], k // 16, 2 * n)  # humming's repacked shape for 16-bit activations
        if weight is None or tuple(weight.shape) != want or weight.dtype != torch.int32 or not weight.is_contiguous():
            raise RuntimeError(f"humming's held weight is not the {want} int32 layout of this configuration")
    else:
        new = transform_humming_tensors(cfg, t)
        weight = None
    if set(new) | ({"weight"} if weight is not None else set()) != set(held):
        raise RuntimeError(f"humming's transformed tensors changed kind on refresh: {sorted(new)} vs {sorted(held)}")
    for name, v in new.items():
        if held[name].shape != v.shape or held[name].dtype != v.dtype:
            raise RuntimeError(f"humming parameter {name!r} changed shape/dtype on refresh")
    if weight is not None:  # one launch for all experts, straight into the held tensor
        ops.repack_weight(t["weight"], weight_bits=4, activation_bits=cfg.a_dtype.num_bits, is_weight_packed=True,
                          interleave_mode=3, outputs=weight.data)
    for name, v in new.items():
        held[name].data.copy_(v)


#: (experts, N, K, dtype, mode, rows_hint, tuned, device) -> (humming_config, compute_config, tuning_config) of the
#: layers built in this process: what a layer made back from a compiled call's tensors runs under
_LAYER_CONFIGS: dict[tuple, tuple] = {}


class _LayerTensors:
    """A transformed humming layer's configuration and tensors, as :class:`HummingNVFP4` reads them."""

    def __init__(self, humming_config, params: dict, buffers: dict):
        self.humming_config, self._params, self._buffers = humming_config, params, buffers
        self.__dict__.update(params)
        self.__dict__.update(buffers)

    def named_parameters(self):
        return iter(self._params.items())

    def named_buffers(self):
        return iter(self._buffers.items())

    def parameters(self):
        return iter(self._params.values())

    def buffers(self):
        return iter(self._buffers.values())


class HummingNVFP4:
    """One NVFP4 weight (N, K), or experts (E, N, K), as a transformed humming layer, its GEMM configuration and the
    fp32 tensors the kernel reads at run time (``weight_scale_2`` per operand range, the
    epilogue's ``2^c``), all refreshable in place.

    ``dtype``: the activation dtype the layer multiplies (fp16 for quads' operands; bf16/fp16
    for direct W4A16). Held in the layout of its padded shape ``(pad_n, pad_k)``
    (:func:`~quads.kernels.humming.layout.pad_parts`: zeros) where humming cannot tile its own; its
    inputs, outputs and packed parts are of the weight's ``(shape_n, shape_k)``: a call pads the
    activations in K where K needs it (one copy) and gives the output's N columns as a view.
    ``operand_max``: the operand bound of the output-range rule for each named
    scaling (``{"unit": None}`` = no shift: weight_scale_2 = 1/S_w, for inputs whose outputs fit).
    ``tuned``: which tuned table the configuration reads (:func:`~.tuning.tuned_choice`; the
    backend's, default the shipped one): looked up here, once."""

    def __init__(self, qdata, scale, global_encode_scale, *, dtype=torch.float16, mode: str = "default",
                 operand_max: dict[str, float | None] | None = None, rows_hint=None, tuned=SHIPPED):
        if mode not in HUMMING_MODES:
            raise ValueError(f"humming mode must be one of {HUMMING_MODES}, got {mode!r}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"humming layers multiply fp16 or bf16 activations, got {dtype}")
        self.num_experts, _ = _check_parts(qdata, scale, global_encode_scale)
        self.device = check_humming_device(qdata.device)
        self.humming = import_humming()
        self.dtype, self.mode, self.tuned = dtype, mode, tuned_choice(tuned)
        self.rows_hint = tuple(sorted(set(rows_hint))) if rows_hint else None
        self.shape_n, self.shape_k = qdata.shape[-2], qdata.shape[-1] * 2
        self.pad_n, self.pad_k = humming_padded_shape(self.shape_n, self.shape_k)
        self.operand_max = dict(operand_max or {"unit": None})
        self.layer = self._build(*pad_parts(qdata, scale), global_encode_scale)
        self.shared = False  # True: the transformed tensors are another layer's (share_layout_)
        self.shift: dict[str, torch.Tensor] = {}
        self.ws2: dict[str, torch.Tensor] = {}
        self.unshift: dict[str, torch.Tensor] = {}
        self._write_scales(scale, global_encode_scale)
        self.compute_config, self.tuning_config = self._configs()
        self._remember_configs()

    # -- building and refreshing ------------------------------------------------------------------
    def _build(self, qdata, scale, gs):
        """A transformed ``HummingLayer`` of parts in the padded shape (:func:`pad_parts`)."""
        from humming.layer import HummingLayer

        with _cuda_device(self.device):
            # its parameters allocated on the device (torch.device context, around the constructor
            # only): HummingLayer creates them with torch.empty, which would otherwise land in host
            # memory and be copied over by .to() (then a no-op)
            with torch.device(self.device):
                layer = HummingLayer(shape_n=self.pad_n, shape_k=self.pad_k, torch_dtype=self.dtype,
                                     num_experts=self.num_experts,
                                     weight_config={"quant_method": "modelopt", "quant_algo": "nvfp4"})
            layer = layer.to(self.device)
            layer.load_from_tensors(modelopt_tensors(qdata, scale, gs))
            layer.transform()
        return layer

    def _write_scales(self, scale, gs):
        """Each operand range's ``c``, ``weight_scale_2 = 2^-c / S_w`` and ``2^c`` (module doc, **Output
        range**), computed for every range in one pass, then written into each range's own tensors
        in place (captured graphs read these addresses; humming takes each ``weight_scale_2`` at a
        16-byte-aligned address: one allocation per range, never a row of a shared tensor)."""
        names = list(self.operand_max)
        gs32 = gs.reshape(-1).to(torch.float32)
        if any(self.operand_max[name] is not None for name in names):
            # one shift for all experts (the epilogue's 2^c does not depend on the row's expert); an
            # unshifted range's bound 0 gives c = 0; no indexing by a host list (a captured write
            # must copy nothing from the host)
            amax = self._operand_amax(tuple(self.operand_max[name] or 0.0 for name in names))
            c = output_shift(scale, gs, amax).amax(dim=-1, keepdim=True)  # (ranges, experts) -> (ranges, 1)
        else:
            c = torch.zeros(len(names), 1, device=self.device)
        one = torch.ones(1, dtype=torch.float32, device=self.device)
        ws2 = one / gs32 * torch.exp2(-c)  # (ranges, experts or 1)
        unshift = torch.exp2(c)
        for i, name in enumerate(names):
            if name in self.ws2:  # in place
                self.shift[name].copy_(c[i])
                self.ws2[name].copy_(ws2[i])
                self.unshift[name].copy_(unshift[i])
            else:
                self.shift[name], self.ws2[name], self.unshift[name] = c[i].clone(), ws2[i].clone(), unshift[i].clone()

    def _operand_amax(self, bounds: tuple) -> torch.Tensor:
        """The operand bounds as a (ranges, 1) device tensor, made once (a write captured in a CUDA
        graph copies nothing from the host)."""
        held = self.__dict__.get("_amax")
        if held is None or held[0] != bounds:
            held = self.__dict__["_amax"] = (bounds, torch.tensor([[b] for b in bounds], dtype=torch.float32,
                                                                  device=self.device))
        return held[1]

    def refresh_(self, qdata, scale, global_encode_scale) -> None:
        """Rewrite the held layout from new parts of the same shapes, in place, on the device (module
        doc): humming's own transform under the held configuration, no new layer; the padding is
        written as zeros again (:func:`pad_parts`)."""
        _check_parts(qdata, scale, global_encode_scale)
        experts = qdata.shape[0] if qdata.dim() == 3 else None
        if (experts, qdata.shape[-2], qdata.shape[-1] * 2) != (self.num_experts, self.shape_n, self.shape_k):
            raise ValueError(f"refresh_ got a {tuple(qdata.shape[:-1])} x {qdata.shape[-1] * 2} weight for a "
                             f"({self.num_experts or ''}, {self.shape_n}, {self.shape_k}) humming layer")
        if not self.shared:  # a layout shared with another dtype's layer is rewritten by its owner
            with _cuda_device(self.device):
                transform_into_(self.layer, *pad_parts(qdata, scale), global_encode_scale)
        self._write_scales(scale, global_encode_scale)

    def share_layout_(self, owner: "HummingNVFP4") -> bool:
        """Hold ``owner``'s transformed tensors instead of this layer's own when they are the same
        bits (fp16 and bf16 activations read the same NVFP4 layout in humming 0.1.19: its repack
        depends on the activation width only; compared here on the tensors themselves, not assumed).
        Frees this layer's copy: one layout per weight. True when shared."""
        mine, theirs = dict(self.layer.named_parameters()), dict(owner.layer.named_parameters())
        if mine.keys() != theirs.keys() or owner.num_experts != self.num_experts:
            return False
        for name, p in mine.items():
            q = theirs[name]
            if p.shape != q.shape or p.dtype != q.dtype or not torch.equal(
                    p.data.contiguous().view(torch.uint8), q.data.contiguous().view(torch.uint8)):
                return False
        for name, q in theirs.items():  # the owner's tensors (refreshed once, by the owner)
            setattr(self.layer, name, q if isinstance(q, torch.nn.Parameter) else torch.nn.Parameter(q, False))
        self.shared = True
        return True

    def written_tensors(self) -> list[torch.Tensor]:
        """The tensors :meth:`refresh_` writes in place (the layout's parameters, the run-time
        scales): copies of them undo a refresh."""
        return [p.data for p in self.layer.parameters()] + [*self.shift.values(), *self.ws2.values(),
                                                            *self.unshift.values()]

    def packed_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """quads' packed ``(qdata, scale)`` derived from the held layout (the inverse permutations of
        :mod:`quads.kernels.humming.layout`): what export or a fallback needs when only humming's
        layout is kept. The global scale is quads' own (not held here)."""
        from quads.kernels.humming.layout import scale_unlayout, unrepack_reference

        cfg = self.layer.humming_config
        if not direct_repack(cfg):
            raise NotImplementedError(f"packed parts from a humming layout of this configuration: {cfg.to_str()}")
        qdata = unrepack_reference(self.layer.weight.data)
        scale = scale_unlayout(self.layer.weight_scale.data, bool(cfg.should_apply_bs_on_c))
        return unpad_parts(qdata, scale, self.shape_n, self.shape_k)

    # -- configuration ----------------------------------------------------------------------------
    def _configs(self) -> tuple[str | None, str | None]:
        compute = {"gemm_type": GROUPED} if self.num_experts else {}
        if self.mode == "batch_invariant":
            compute["use_batch_invariant"] = True
        compute_str = json.dumps(compute) if compute else None
        tuned = tuned_intervals(device_name(self.device), self.pad_n, self.pad_k,
                                str(self.dtype).removeprefix("torch."), self.mode, self.num_experts, self.tuned)
        if self.mode != "no_stream_k" and self.rows_hint is None and not tuned:
            return compute_str, None  # humming resolves its own table (the same call as below)
        from humming.tune import get_heuristics_config

        table = get_heuristics_config(self.layer.humming_config, shape_m=None, device=self.device,
                                      use_batch_invariant=self.mode == "batch_invariant",
                                      **({"gemm_type": GROUPED} if self.num_experts else {}))
        if tuned:  # this GPU's measured configurations on their M intervals (quads.ops.backends.humming.tuning)
            table = merge_tuned(table, tuned)
        if self.mode == "no_stream_k":
            table = _no_stream_k(table)
        if self.rows_hint is not None:
            table = prune_table(table, self.rows_hint)
        return compute_str, json.dumps(table, default=_json_value)

    def with_mode(self, mode: str) -> "HummingNVFP4":
        """A view running this layout (same tensors, refreshed together) under another ``mode``."""
        if mode not in HUMMING_MODES:
            raise ValueError(f"humming mode must be one of {HUMMING_MODES}, got {mode!r}")
        view = copy.copy(self)
        view.mode = mode
        view.compute_config, view.tuning_config = view._configs()
        view._remember_configs()
        return view

    # -- as a custom op's arguments (torch.compile) ------------------------------------------------
    def _key(self) -> tuple:
        return (self.num_experts, self.shape_n, self.shape_k, self.dtype, self.mode, self.rows_hint, self.tuned,
                str(self.device))

    def _remember_configs(self) -> None:
        _LAYER_CONFIGS[self._key()] = (self.layer.humming_config, self.compute_config, self.tuning_config)

    def op_fields(self, with_layout: bool) -> tuple[list[torch.Tensor], dict]:
        """This layer as plain tensors and a static description (JSON values): its layout (with
        ``with_layout``; a layer sharing another's layout leaves it out), its buffers (Stream-K
        locks, left as found by each call) and each scaling's run-time ``weight_scale_2`` and
        ``2^c``. :meth:`from_op_fields` makes the layer back from them."""
        params = dict(self.layer.named_parameters()) if with_layout else {}
        buffers = dict(self.layer.named_buffers())
        scalings = list(self.ws2)
        tensors = [*params.values(), *buffers.values(), *(self.ws2[n] for n in scalings),
                   *(self.unshift[n] for n in scalings)]
        spec = {"dtype": str(self.dtype).removeprefix("torch."), "mode": self.mode, "tuned": self.tuned,
                "shared": self.shared,
                "rows_hint": list(self.rows_hint) if self.rows_hint else None, "params": list(params),
                "buffers": list(buffers), "scalings": scalings}
        return tensors, spec

    @classmethod
    def from_op_fields(cls, spec: dict, tensors, layout: dict | None, shape: tuple) -> "HummingNVFP4":
        """A layer over ``tensors`` (an iterator, consumed in :meth:`op_fields`' order; ``layout``:
        the owner's layout tensors by name, for a layer sharing them) of a weight of packed shape
        ``shape``, under the configuration built in this process for the same shape, dtype, mode and tuned table."""
        self = cls.__new__(cls)
        self.dtype, self.mode, self.shared = getattr(torch, spec["dtype"]), spec["mode"], spec["shared"]
        self.tuned = spec["tuned"]
        self.rows_hint = tuple(spec["rows_hint"]) if spec["rows_hint"] else None
        self.num_experts = shape[0] if len(shape) == 3 else None
        self.shape_n, self.shape_k = shape[-2], shape[-1] * 2
        self.pad_n, self.pad_k = humming_padded_shape(self.shape_n, self.shape_k)
        params = {name: next(tensors) for name in spec["params"]} if not spec["shared"] else dict(layout)
        buffers = {name: next(tensors) for name in spec["buffers"]}
        ws2 = {name: next(tensors) for name in spec["scalings"]}
        self.unshift = {name: next(tensors) for name in spec["scalings"]}
        self.ws2, self.shift, self.operand_max = ws2, {}, {}
        self.device = next(iter(ws2.values())).device
        try:
            humming_config, self.compute_config, self.tuning_config = _LAYER_CONFIGS[self._key()]
        except KeyError:
            raise RuntimeError(f"no humming layer of {self._key()} was built in this process") from None
        self.humming = None
        self.layer = _LayerTensors(humming_config, params, buffers)
        return self

    # -- running ----------------------------------------------------------------------------------
    def __call__(self, a: torch.Tensor, scaling: str = "unit", out: torch.Tensor | None = None,
                 expert_layout: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ DQ(W)^T * 2^-c`` (M, N) in ``self.dtype`` (c of ``scaling``; 0 for ``"unit"``): a
        view of the GEMM's (M, N_pad) output where N is padded (:meth:`logical_output`); ``a`` (M, K)
        padded in K where K is (:meth:`padded_input`); ``out``: (M, N_pad).

        Experts: ``expert_layout`` (E+1,) int32/int64 row offsets, rows ``[off[e], off[e+1])`` of
        ``a`` multiplied by expert ``e`` (humming's grouped-contiguous MoE GEMM; quads'
        :class:`~quads.ops.experts_op.Routing` offsets); rows from ``off[E]`` on are not written."""
        from humming.forward import humming_forward

        layer = self.layer
        if a.dtype != self.dtype:
            raise TypeError(f"this humming layer multiplies {self.dtype} rows, got {a.dtype}")
        if (expert_layout is None) != (self.num_experts is None):
            raise ValueError("expert_layout goes with (and only with) a 3-D experts layer")
        o = humming_forward(layer.humming_config, inputs=self.padded_input(a), weight=layer.weight,
                            weight_scale=layer.weight_scale, weight_scale_2=self.ws2[scaling],
                            outputs=out, locks=layer.locks, expert_layout=expert_layout,
                            compute_config=self.compute_config, tuning_config=self.tuning_config)
        return self.logical_output(o)

    def padded_input(self, a: torch.Tensor) -> torch.Tensor:
        """``a`` (M, K) as the GEMM's (M, K_pad) rows: zero columns appended, one copy (``a`` itself
        where K is humming's multiple)."""
        if a.shape[-1] != self.shape_k:
            raise ValueError(f"this humming layer multiplies rows of K={self.shape_k}, got {tuple(a.shape)}")
        return a if self.pad_k == self.shape_k else torch.nn.functional.pad(a, (0, self.pad_k - self.shape_k))

    def logical_output(self, o: torch.Tensor) -> torch.Tensor:
        """The GEMM's (M, N_pad) output as the weight's (M, N): a view (row stride N_pad), no copy."""
        return o if self.pad_n == self.shape_n else o[:, : self.shape_n]

    def warmup(self, ms=(1,)) -> None:
        """Compile (first call: every kernel of the M-interval table) and run once per M in ``ms``:
        call before CUDA-graph capture."""
        for m in ms:
            layout = None
            if self.num_experts:  # all rows to expert 0
                layout = torch.full((self.num_experts + 1,), m, dtype=torch.int64, device=self.device)
                layout[0] = 0
            self(torch.zeros(m, self.shape_k, dtype=self.dtype, device=self.device), expert_layout=layout)
        torch.cuda.synchronize(self.device)

    def storages(self) -> dict[int, int]:
        """data_ptr -> bytes of each tensor this layer holds (its layout, Stream-K locks; shared ones
        under the owner's address: count a weight's memory over the union)."""
        return {t.data_ptr(): t.numel() * t.element_size()
                for t in (*self.layer.parameters(), *self.layer.buffers())}

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this layer holds (its layout, or the one it shares, and its locks)."""
        return sum(self.storages().values())
