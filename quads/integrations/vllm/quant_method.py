"""The ``quads`` quantization method for vLLM (linear layers and fused MoE experts).

Select it with ``LLM(model, quantization="quads")``, or a ``quantization_config`` in the
checkpoint's ``config.json`` (or ``hf_overrides``) with the rollout keys of :class:`quads.QuadsPolicy`
(``activations``, ``residual_fraction``, ``weight_global_scale``, ``scope``, ...);
:func:`quads_quantization_config` builds the dict.

* **Weights arrive in BF16**; ``process_weights_after_loading`` packs them with quads' quantizer
  through the layer's backend (chosen there once, ``layer.quads_backend``), so ``DQ(engine weight)
  == nvfp4_fake_quantize(master)`` bit for bit, and keeps only the packed parts (``weight``,
  ``weight_scale``, ``weight_global_scale``; MoE: ``w13_*``/``w2_*``, one global scale per expert).
* **Merged layers** (``qkv_proj``, ``gate_up_proj``): packed per logical weight with the group's
  global scale (``weight_global_scale="group"``) or their own (``"tensor"``), served by one
  :class:`~quads.ops.sibling_linear.SiblingSet`: the operands once, one GEMM over the stacked
  shards where the backend has one, else each shard's kernel: the transformers rollout's bits.
* **Forward**: the layer's kernels, made after loading (``Backend.linear_kernel``, the set's;
  ``Backend.experts_kernel``), W4A4 + residual, or W4A16 with ``activations="bf16"``.
* **Not quantized** (as on the trainer side, :mod:`quads.policies.scope`): embeddings, ``lm_head``,
  MoE routers, ``extra_skip_patterns``, every linear with ``scope="routed_experts"``, and the
  ``skip_first_layers`` / ``skip_last_layers`` decoder layers: vLLM's unquantized methods run them.
* **Weight reload**: ``process_weights_after_loading`` writes the packed values into the
  parameters the kernels read and the layouts in place: the kernels stay, a forward compares nothing.

Limits: tensor/expert parallel size 1 (global scales are per whole logical weight),
``residual_selection="per_token"`` only, linear inputs a multiple of 16.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from quads.extras import require

require("quads.integrations.vllm.quant_method", "vllm")

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, GateLinear, RoutedExperts
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from quads.ops.activation_quant import ActivationQuant
from quads.ops.backend_registry import Backend, LinearArgs, gemm_shape, select_backend
from quads.ops.linear_op import linear_op_args
from quads.ops.sibling_linear import SiblingSet
from quads.policies.policy import QuadsPolicy
from quads.policies.quantize import pack_weight
from quads.policies.scope import boundary_layer, layer_index
from quads.tensor.nvfp4_math import BLOCK_SIZE, NVFP4Parts, shared_global_encode_scale
from quads.tensor.nvfp4_tensor import NVFP4Tensor

logger = init_logger(__name__)

__all__ = [
    "QUADS_CONFIG_KEYS",
    "QuadsConfig",
    "QuadsLinearMethod",
    "QuadsFusedMoEMethod",
    "quads_quantization_config",
    "dequantize_linear_weight",
    "dequantize_moe_weights",
]

#: Keys of the ``quantization_config`` dict (besides ``quant_method``), with their defaults:
#: the rollout side of :class:`QuadsPolicy` (one place for the defaults).
_ROLLOUT_DEFAULTS = QuadsPolicy(side="rollout")
QUADS_CONFIG_KEYS: dict[str, Any] = {
    "activations": _ROLLOUT_DEFAULTS.activations,
    "residual_fraction": _ROLLOUT_DEFAULTS.residual_fraction,
    "residual_selection": _ROLLOUT_DEFAULTS.residual_selection,
    "activation_granularity": _ROLLOUT_DEFAULTS.activation_granularity,
    "extra_skip_patterns": list(_ROLLOUT_DEFAULTS.extra_skip_patterns),
    "kernel": _ROLLOUT_DEFAULTS.kernel,  # "exact" | "fast" (humming on sm_90: docs/humming.md)
    "weight_global_scale": _ROLLOUT_DEFAULTS.weight_global_scale,
    "scope": _ROLLOUT_DEFAULTS.scope,
    "skip_first_layers": _ROLLOUT_DEFAULTS.skip_first_layers,
    "skip_last_layers": _ROLLOUT_DEFAULTS.skip_last_layers,
    "weight_block_scaling": _ROLLOUT_DEFAULTS.weight_block_scaling,  # "6" | "4over6" (the trainer's)
    "activation_block_scaling": _ROLLOUT_DEFAULTS.activation_block_scaling,  # "6" | "4over6"
}


def quads_quantization_config(**overrides: Any) -> dict[str, Any]:
    """The ``quantization_config`` dict selecting the quads method (for config.json or hf_overrides)."""
    unknown = set(overrides) - set(QUADS_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown quads quantization_config keys {sorted(unknown)}; known: {sorted(QUADS_CONFIG_KEYS)}")
    cfg = {"quant_method": "quads", **QUADS_CONFIG_KEYS, **overrides}
    cfg["extra_skip_patterns"] = list(cfg["extra_skip_patterns"])
    QuadsConfig.from_config(cfg)  # validate
    return cfg


@register_quantization_config("quads")
class QuadsConfig(QuantizationConfig):
    """vLLM quantization config of the quads rollout side (see the module doc)."""

    def __init__(
        self,
        activations: str = QUADS_CONFIG_KEYS["activations"],
        residual_fraction: float = QUADS_CONFIG_KEYS["residual_fraction"],
        residual_selection: str = QUADS_CONFIG_KEYS["residual_selection"],
        activation_granularity: str = QUADS_CONFIG_KEYS["activation_granularity"],
        extra_skip_patterns: tuple[str, ...] | list[str] = (),
        kernel: str = QUADS_CONFIG_KEYS["kernel"],
        weight_global_scale: str = QUADS_CONFIG_KEYS["weight_global_scale"],
        scope: str = QUADS_CONFIG_KEYS["scope"],
        skip_first_layers: int = QUADS_CONFIG_KEYS["skip_first_layers"],
        skip_last_layers: int = QUADS_CONFIG_KEYS["skip_last_layers"],
        weight_block_scaling: str = QUADS_CONFIG_KEYS["weight_block_scaling"],
        activation_block_scaling: str = QUADS_CONFIG_KEYS["activation_block_scaling"],
    ) -> None:
        super().__init__()
        if residual_selection != "per_token":
            raise NotImplementedError(
                "the vLLM quads method supports residual_selection='per_token' only (static "
                "channel masks from calibrate_residual_channels have no checkpoint format yet)"
            )
        self.policy = QuadsPolicy(
            side="rollout",
            activations=activations,
            residual_fraction=float(residual_fraction),
            residual_selection=residual_selection,
            activation_granularity=activation_granularity,
            extra_skip_patterns=tuple(extra_skip_patterns),
            kernel=kernel,
            weight_global_scale=weight_global_scale,
            scope=scope,
            skip_first_layers=skip_first_layers,
            skip_last_layers=skip_last_layers,
            weight_block_scaling=weight_block_scaling,
            activation_block_scaling=activation_block_scaling,
        )
        self._num_layers: int | None = None

    # -- QuantizationConfig interface ----------------------------------------------------

    @classmethod
    def get_name(cls) -> str:
        return "quads"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # The torch reference runs anywhere; quads.ops picks Triton kernels where they exist.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # no separate file: config.json's quantization_config, or the defaults

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuadsConfig":
        config = dict(config)
        method = config.pop("quant_method", "quads")
        if method != "quads":
            raise ValueError(f"QuadsConfig got quant_method={method!r}")
        unknown = set(config) - set(QUADS_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in the quads quantization_config; known: {sorted(QUADS_CONFIG_KEYS)}")
        return cls(**{k: config.get(k, v) for k, v in QUADS_CONFIG_KEYS.items()})

    def to_dict(self) -> dict[str, Any]:
        p = self.policy
        return {
            "quant_method": "quads",
            "activations": p.activations,
            "residual_fraction": p.residual_fraction,
            "residual_selection": p.residual_selection,
            "activation_granularity": p.activation_granularity,
            "extra_skip_patterns": list(p.extra_skip_patterns),
            "kernel": p.kernel,
            "weight_global_scale": p.weight_global_scale,
            "scope": p.scope,
            "skip_first_layers": p.skip_first_layers,
            "skip_last_layers": p.skip_last_layers,
            "weight_block_scaling": p.weight_block_scaling,
            "activation_block_scaling": p.activation_block_scaling,
        }

    @property
    def activation_quant(self) -> ActivationQuant | None:
        return self.policy.activation_quant

    def _skips(self, prefix: str) -> bool:
        """Whether the layer at ``prefix`` stays high precision; a merged vLLM layer is checked
        through its logical shard names (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``)."""
        head, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        if not shards:
            return self.policy.skips(prefix)
        names = [f"{head}.{s}" if head else s for s in shards]
        skipped = [self.policy.skips(n) for n in names]
        if all(skipped) or self.policy.skips(prefix):
            return True
        if any(skipped):
            raise ValueError(
                f"quads: the skip patterns match only some shards of the merged vLLM layer {prefix} "
                f"({[n for n, s in zip(names, skipped) if s]}); vLLM runs them as one layer, skip all or none"
            )
        return False

    def num_layers(self) -> int:
        """The model's decoder-layer count (``num_hidden_layers`` of the config vLLM is building)."""
        if self._num_layers is None:
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
            hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
            text = hf_config.get_text_config() if hf_config is not None else None
            count = getattr(text, "num_hidden_layers", None)
            if not isinstance(count, int):
                raise ValueError("quads: skip_first_layers / skip_last_layers need the model config's "
                                 "num_hidden_layers, and no vLLM model config is being built")
            p = self.policy
            if p.skip_first_layers + p.skip_last_layers >= count:
                raise ValueError(f"quads: skip_first_layers={p.skip_first_layers} + skip_last_layers="
                                 f"{p.skip_last_layers} keep all {count} decoder layers unquantized")
            self._num_layers = count
        return self._num_layers

    def _in_boundary_layer(self, prefix: str) -> bool:
        """Whether ``prefix`` lies in a decoder layer the policy keeps in high precision."""
        if not self.policy.skips_boundary_layers:
            return False
        return boundary_layer(layer_index(prefix), self.num_layers(), self.policy)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            if (isinstance(layer, GateLinear) or self.policy.scope == "routed_experts" or self._skips(prefix)
                    or self._in_boundary_layer(prefix)):
                return UnquantizedLinearMethod()
            return QuadsLinearMethod(self)
        if isinstance(layer, RoutedExperts):
            if self._skips(prefix) or self._in_boundary_layer(prefix):
                return None  # vLLM falls back to its unquantized MoE method
            return QuadsFusedMoEMethod(self, layer.moe_config)
        return None  # embeddings, lm_head, attention: unquantized


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _check_k(k: int, what: str) -> None:
    if k % BLOCK_SIZE:
        raise ValueError(
            f"quads: {what} has input dim {k}, not a multiple of {BLOCK_SIZE}; NVFP4 cannot quantize it "
            "(add the layer to extra_skip_patterns)"
        )


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _write_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Set the layer's parameter ``name`` to ``value``, written into the parameter quads set there
    before (``layer.quads_storage``) where shape, dtype and device match, else a new one. vLLM's
    reload processes fresh parameters and then puts the ones it had back (copying the processed
    values into them): writing into the held ones keeps the tensors the layer's kernels read, so
    the kernels follow a reload without being remade or compared per forward."""
    storage = layer.__dict__.setdefault("quads_storage", {})
    held = storage.get(name)
    if held is not None and (held.shape, held.dtype, held.device) == (value.shape, value.dtype, value.device):
        if held is not value:
            held.data.copy_(value)
    else:
        held = storage[name] = _frozen(value)
    if name in layer._parameters:
        delattr(layer, name)
    layer.register_parameter(name, held)


def _refresh_kernels(layer: torch.nn.Module, name: str, sources: tuple, make) -> None:
    """``layer.<name> = make()`` unless the kernels there were made over these same ``sources``
    (compared by identity, held with them: no id is reused). Called by the writes
    (``process_weights_after_loading``), never by a forward: a reload writes its values into the
    held tensors in place, so the kernels stay."""
    held = layer.__dict__.get(f"{name}_sources")
    if held is None or len(held) != len(sources) or any(a is not b for a, b in zip(held, sources)):
        layer.__dict__[name] = make()
        layer.__dict__[f"{name}_sources"] = sources


def _packed(layer: torch.nn.Module, prefix: str, dtype: torch.dtype) -> NVFP4Tensor:
    return NVFP4Tensor(
        getattr(layer, prefix),
        getattr(layer, f"{prefix}_scale"),
        getattr(layer, f"{prefix}_global_scale"),
        orig_dtype=dtype,
        check_values=False,  # packed by pack_weight at load; rebuilt every forward
    )


# ---------------------------------------------------------------------------------------------
# Linear layers
# ---------------------------------------------------------------------------------------------


class QuadsLinearMethod(LinearMethodBase):
    """W4A4 + residual (or W4A16) linear; each logical shard of a merged layer has its own
    NVFP4 global scale (see the module doc)."""

    def __init__(self, config: QuadsConfig):
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        if input_size_per_partition != input_size or sum(output_partition_sizes) != output_size:
            raise NotImplementedError(
                f"quads: tensor parallelism is not supported ({getattr(layer, 'prefix', '?')}: "
                f"input {input_size_per_partition}/{input_size}, output {sum(output_partition_sizes)}/{output_size}); "
                "NVFP4 global scales are per whole logical weight"
            )
        _check_k(input_size_per_partition, getattr(layer, "prefix", "a linear layer"))
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        layer.quads_output_partition_sizes = list(output_partition_sizes)
        layer.quads_orig_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight.data
        if weight.dtype == torch.uint8:
            return  # already packed
        prefix = getattr(layer, "prefix", "linear")
        shards = weight.split(layer.quads_output_partition_sizes, dim=0)
        layer.quads_backend = select_backend(weight.device, self.config.policy.kernel, [gemm_shape(s) for s in shards])
        # group mode: a merged layer's shards (q/k/v, gate/up) are one sibling group, one global scale
        block_scaling = self.config.policy.weight_block_scaling
        group_scale = (shared_global_encode_scale(shards, block_scaling)
                       if self.config.policy.weight_global_scale == "group" and len(shards) > 1 else None)
        packed = [pack_weight(shard, layer.quads_backend, f"{prefix} shard {i}", group_scale, block_scaling)
                  for i, shard in enumerate(shards)]
        _write_parameter(layer, "weight", torch.cat([p.qdata for p in packed]))
        _write_parameter(layer, "weight_scale", torch.cat([p.scale for p in packed]))
        _write_parameter(layer, "weight_global_scale", torch.stack([p.global_encode_scale for p in packed]))
        # what the backend's GEMMs read (the Hopper layout), once per load, in place on reload
        layer.quads_prepared = layer.quads_backend.refresh_prepared(
            getattr(layer, "quads_prepared", ()), [p.parts for p in packed])
        if len(packed) > 1:
            self._stack_shards(layer, packed)
        siblings = layer.__dict__.get("quads_siblings")
        sibling_kernel = None if siblings is None else siblings.kernel()
        _refresh_kernels(layer, "quads_kernels", (layer.quads_backend, layer.weight, layer.weight_scale,
                                                  layer.weight_global_scale, *layer.quads_prepared, sibling_kernel),
                         lambda: (self._shard_kernels(layer), sibling_kernel))

    def _stack_shards(self, layer: torch.nn.Module, packed: list[NVFP4Tensor]) -> None:
        """The merged layer's :class:`SiblingSet` (``layer.quads_siblings``): the shards' layouts
        stacked where the backend has a stacked GEMM (their views become ``layer.quads_prepared``,
        rewritten in place by a reload), their global scales mirrored per row."""
        siblings = layer.__dict__.get("quads_siblings")
        if siblings is not None and siblings.backend is layer.quads_backend and all(
                siblings.holds(i, p) for i, p in enumerate(layer.quads_prepared)):
            for i, p in enumerate(packed):
                siblings.write_scale(i, p.global_encode_scale)
            return
        siblings = SiblingSet(layer.quads_backend, self.config.activation_quant, layer.quads_output_partition_sizes)
        shared = self.config.policy.weight_global_scale == "group"  # one global scale for all shards
        views = siblings.stack(layer.quads_prepared, [p.global_encode_scale for p in packed], shared_scale=shared)
        if views is not None:
            layer.quads_prepared = tuple(views)
        layer.quads_siblings = siblings

    def kernels(self, layer: torch.nn.Module) -> tuple[list, Any]:
        """``(one linear kernel per shard, the merged layer's sibling kernel or None)``: made by
        ``process_weights_after_loading``, again only when it replaced one of their sources (the
        backend, a parameter, a prepared layout, the sibling set); a reload writes in place."""
        return layer.quads_kernels

    def _shard_kernels(self, layer: torch.nn.Module) -> list:
        """One linear kernel per logical shard, over row slices of the layer's parameters."""
        act, kernels, start = self.config.activation_quant, [], 0
        for i, n in enumerate(layer.quads_output_partition_sizes):
            parts = NVFP4Parts(layer.weight[start:start + n], layer.weight_scale[start:start + n],
                               layer.weight_global_scale[i])
            kernels.append(layer.quads_backend.linear_kernel(LinearArgs(parts, act, None, layer.quads_prepared[i])))
            start += n
        return kernels

    def shards(self, layer: torch.nn.Module) -> list[NVFP4Tensor]:
        """The packed logical weights of ``layer`` (views of its parameters)."""
        out, start = [], 0
        for i, n in enumerate(layer.quads_output_partition_sizes):
            rows = slice(start, start + n)
            out.append(
                NVFP4Tensor(
                    layer.weight[rows],
                    layer.weight_scale[rows],
                    layer.weight_global_scale[i],
                    orig_dtype=layer.quads_orig_dtype,
                    check_values=False,  # packed by pack_weight at load; rebuilt every forward
                )
            )
            start += n
        return out

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # vLLM's default engine: torch.compile + CUDA graphs
            return compiled_shard_linear(layer, x, bias, self.config.activation_quant)
        kernels, siblings = layer.quads_kernels  # made by the writes: nothing compared here
        if siblings is None:  # one weight: its kernel
            return kernels[0].apply(x, bias)
        y, operands = siblings.apply(x, bias=bias)  # the operands once; the stacked GEMM where it runs
        if y is not None:
            return y
        sizes = layer.quads_output_partition_sizes
        biases = [None] * len(sizes) if bias is None else bias.split(sizes)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.cat([k.apply(x2, b, operands) for k, b in zip(kernels, biases)], dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def shard_linear(
    x: torch.Tensor,
    shards: list[NVFP4Tensor],
    bias: torch.Tensor | None,
    act: ActivationQuant | None,
    backend: Backend | None = None,
    prepared: tuple | None = None,
) -> torch.Tensor:
    """``cat_i`` of each shard's linear kernel on ``x`` (with its bias) along the output dim, for
    callers that keep no kernels (a layer's forward uses those made at loading).

    The shards read one input: a :class:`SiblingSet`'s kernel computes the operands once and every
    shard's kernel runs on them (the bits of one call per shard: the quantization depends on ``x``
    only). ``backend``: None picks one for ``x``'s device. ``prepared``: one
    ``backend.prepare_weight`` result per shard (None: built per call).
    """
    backend = backend or select_backend(x.device)
    prepared = prepared or (None,) * len(shards)
    kernels = [backend.linear_kernel(LinearArgs(s.parts, act, None, p)) for s, p in zip(shards, prepared)]
    if len(shards) == 1:
        return kernels[0].apply(x, bias)
    sizes = [s.shape[0] for s in shards]
    _, operands = SiblingSet(backend, act, sizes).kernel().apply(x)
    biases = [None] * len(shards) if bias is None else list(bias.split(sizes))
    x2 = x.reshape(-1, x.shape[-1])
    outs = [k.apply(x2, b, operands) for k, b in zip(kernels, biases)]
    return torch.cat(outs, dim=-1).reshape(*x.shape[:-1], sum(sizes))


def compiled_shard_linear(
    layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act: ActivationQuant | None
) -> torch.Tensor:
    """:func:`shard_linear` as dynamo traces it: one ``quads::linear`` custom op per shard, on
    plain tensors (row slices of ``weight`` / ``weight_scale``, one ``weight_global_scale``).

    Why a separate path: no :class:`NVFP4Tensor` may be built inside the traced forward (dynamo
    cannot wrap a tensor subclass made from fake tensors: "Unexpected type in sourceless
    builder"); the custom op is opaque to the compiler and runs the layer's backend, so each
    shard's output has the eager bits. The torch backend quantizes the activation once per
    shard here (same bits as the eager path's one shared quantization, more work).
    """
    sizes = layer.quads_output_partition_sizes
    prepared = getattr(layer, "quads_prepared", None) or (None,) * len(sizes)
    biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
    x2 = x.reshape(-1, x.shape[-1])
    outs, start = [], 0
    for i, n in enumerate(sizes):
        parts = NVFP4Parts(layer.weight[start:start + n], layer.weight_scale[start:start + n],
                           layer.weight_global_scale[i])
        held = getattr(prepared[i], "holds_parts", False)  # humming (kernel="fast"): its layout holds them
        outs.append(torch.ops.quads.linear(*linear_op_args(layer.quads_backend, x2, None if held else parts,
                                                           biases[i], prepared[i], act, None)))
        start += n
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dequantize_linear_weight(layer: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """The dequantized logical weights of a quads linear layer (one per shard), for checks."""
    return [s.dequantize(dtype) for s in layer.quant_method.shards(layer)]


# ---------------------------------------------------------------------------------------------
# Fused MoE experts
# ---------------------------------------------------------------------------------------------

_GATED = {
    "silu": F.silu,
    "gelu": lambda t: F.gelu(t),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


class QuadsFusedMoEMethod(FusedMoEMethodBase):
    """Routed experts with packed NVFP4 ``w13`` (E, 2I, H) and ``w2`` (E, H, I), one global
    scale per expert (= transformers-5 ``gate_up_proj``/``down_proj`` on the trainer side)."""

    def __init__(self, config: QuadsConfig, moe: FusedMoEConfig):
        super().__init__(moe)
        self.config = config
        activation = getattr(moe.activation, "value", str(moe.activation))
        if activation not in _GATED:
            raise NotImplementedError(
                f"quads: MoE activation {activation!r} is not supported (supported: gated {sorted(_GATED)})"
            )
        self._act_fn = _GATED[activation]
        if moe.tp_size != 1 or moe.ep_size != 1:
            raise NotImplementedError(
                f"quads: MoE with tensor/expert parallelism (tp={moe.tp_size}, ep={moe.ep_size}) is not supported"
            )

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        _check_k(hidden_size, "MoE w13 (gate_up_proj)")
        _check_k(intermediate_size_per_partition, "MoE w2 (down_proj)")
        w13 = _frozen(torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size, dtype=params_dtype))
        layer.register_parameter("w13_weight", w13)
        set_weight_attrs(w13, extra_weight_attrs)
        w2 = _frozen(torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype))
        layer.register_parameter("w2_weight", w2)
        set_weight_attrs(w2, extra_weight_attrs)
        if self.moe.has_bias:
            b13 = _frozen(torch.zeros(num_experts, 2 * intermediate_size_per_partition, dtype=params_dtype))
            layer.register_parameter("w13_bias", b13)
            set_weight_attrs(b13, extra_weight_attrs)
            b2 = _frozen(torch.zeros(num_experts, hidden_size, dtype=params_dtype))
            layer.register_parameter("w2_bias", b2)
            set_weight_attrs(b2, extra_weight_attrs)
        layer.quads_orig_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weights = {name: getattr(layer, name).data for name in ("w13_weight", "w2_weight")}
        dense = [w for w in weights.values() if w.dtype != torch.uint8]
        if dense:  # one backend for both weights, chosen for both shapes
            layer.quads_backend = select_backend(dense[0].device, self.config.policy.kernel, [gemm_shape(w) for w in dense])
        for name, weight in weights.items():
            if weight.dtype == torch.uint8:
                continue  # already packed
            packed = pack_weight(weight, layer.quads_backend, f"MoE {name}",  # 3-D: one global scale per expert
                                 block_scaling=self.config.policy.weight_block_scaling)
            _write_parameter(layer, name, packed.qdata)
            _write_parameter(layer, f"{name}_scale", packed.scale)
            _write_parameter(layer, f"{name}_global_scale", packed.global_encode_scale)
        if layer.w13_weight.dtype == torch.uint8 and layer.w2_weight.dtype == torch.uint8:
            gate_up, down = self.packed_weights(layer)
            layer.quads_prepared = layer.quads_backend.refresh_prepared(
                getattr(layer, "quads_prepared", ()), [gate_up.parts, down.parts])
            sources = (layer.quads_backend, layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_global_scale,
                       layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_global_scale, *layer.quads_prepared)
            _refresh_kernels(layer, "quads_experts_kernel", sources, lambda: self._make_experts_kernel(layer))

    def experts_kernel(self, layer: torch.nn.Module):
        """The layer's experts kernel: made by ``process_weights_after_loading``, again only when it
        replaced one of its sources (the backend, a parameter, a prepared layout); a reload writes
        in place."""
        return layer.quads_experts_kernel

    def _make_experts_kernel(self, layer: torch.nn.Module):
        """Over plain parts, no NVFP4Tensor: ``apply`` also runs inside vLLM's torch.compile (see
        :func:`compiled_shard_linear`)."""
        gate_up = NVFP4Parts(layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_global_scale)
        down = NVFP4Parts(layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_global_scale)
        act, prepared = self.config.activation_quant, layer.quads_prepared
        return layer.quads_backend.experts_kernel(LinearArgs(gate_up, act, None, prepared[0]),
                                                  LinearArgs(down, act, None, prepared[1]))

    def packed_weights(self, layer: torch.nn.Module) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        dtype = layer.quads_orig_dtype
        return _packed(layer, "w13_weight", dtype), _packed(layer, "w2_weight", dtype)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        return None  # no modular kernel: apply() runs quads' experts op

    def _apply_gate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self._act_fn(gate) * up

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts=None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Shared experts (if any) run in vLLM's MoE runner (no overlap without a modular kernel).
        if layer.apply_router_weight_on_input:
            raise NotImplementedError("quads: apply_router_weight_on_input MoE models are not supported")
        return layer.quads_experts_kernel.apply(x, topk_ids.long(),
                            topk_weights.to(x.dtype),  # as transformers' routers hand them to the experts
                            self._apply_gate, (getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)))


def dequantize_moe_weights(layer: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized ``(w13 (E, 2I, H), w2 (E, H, I))`` of a quads MoE layer, for checks."""
    gate_up, down = layer.quant_method.packed_weights(layer)
    return gate_up.dequantize(dtype), down.dequantize(dtype)
