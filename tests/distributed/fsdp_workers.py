"""Per-rank bodies of the FSDP2 tests (run by ``launch.run_on_ranks`` on 2 gloo processes).

Every rank builds the same seeded model twice: once sharded with ``fully_shard`` and once as a
plain single-process reference, feeds both the same batch and compares bit for bit. The
results are JSON dicts of booleans and diagnostics; ``test_fsdp.py`` asserts on them.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import quads
import quads.policies.ste as quads_ste
import quads.policies.trainer_experts as quads_trainer_experts
from quads.policies import build_rollout_model
from quads.policies.sharded_sync import ShardedSyncError, sync_sharded_weights_
from quads.tensor import NVFP4Tensor
from tests.distributed.launch import device_type
from tests.tiny_models import COMMON
from tests.tiny_models import build as build_on_cpu

TRAINER = quads.QuadsPolicy(side="trainer")
ROLLOUT = quads.QuadsPolicy(side="rollout")
PRECISIONS = ("autocast", "fsdp-bf16")  # TRL's fp32 masters + bf16 autocast | accelerate's FSDP2 param_dtype
KINDS = ("llama", "qwen3_moe")


# -- helpers ---------------------------------------------------------------------------------


def device() -> torch.device:
    """This rank's device: the CPU, or its GPU under ``QUADS_DIST_DEVICE=cuda``."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")


def build(kind: str, seed: int = 0, dtype=torch.bfloat16) -> nn.Module:
    return build_on_cpu(kind, seed, dtype).to(device())


def token_ids(seed: int) -> torch.Tensor:
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))
    return ids.to(device())


def shard(model: nn.Module, precision: str) -> nn.Module:
    """fully_shard every decoder layer, then the root (the usual FSDP2 wrapping)."""
    kwargs = {}
    if precision == "fsdp-bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def trainer_pair(kind: str, precision: str):
    """(single-process reference, FSDP2 model): the same seeded trainer-quantized model."""
    ref = quads.quantize_(build(kind, seed=0, dtype=torch.float32), TRAINER)
    sharded = shard(quads.quantize_(build(kind, seed=0, dtype=torch.float32), TRAINER), precision)
    if precision == "fsdp-bf16":  # what FSDP's param_dtype cast gives every forward, on one process
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
    return ref, sharded


def compute_context(precision: str):
    if precision == "autocast":
        return torch.autocast(device_type(), dtype=torch.bfloat16)
    return contextlib.nullcontext()


class ForwardWeightSpy:
    """Records what every quads trainer layer's fake quantizer received and returned in the forward,
    by parameter name.

    Wraps the backends' fake quantizers (``quads.policies.ste.fake_quantizer``, as the trainer
    linear and the grouped experts look it up; they still compute the forward) and identifies the
    parameter through a forward pre-hook on each quads trainer module. Only the first call for
    each weight is recorded (one forward per spy); the backward's recomputations are not.
    """

    _USERS = (quads_ste, quads_trainer_experts)

    def __init__(self, model: nn.Module):
        self.model = model
        self.outputs: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, tuple[bool, tuple[int, ...]]] = {}
        self._current: tuple[str, nn.Module] | None = None

    def __enter__(self):
        self._real = quads_ste.fake_quantizer
        self._hooks = []
        for name, module in quads.quantized_modules(self.model).items():
            self._hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter(n, m)))
        for user in self._USERS:
            user.fake_quantizer = self._spy
        return self

    def _enter(self, name, module):
        self._current = (name, module)

    def _spy(self, backend):
        real = self._real(backend)

        def spied(weight, dtype=None, global_encode_scale=None, block_scaling="6"):
            out, scale = real(weight, dtype, global_encode_scale, block_scaling)
            name, module = self._current
            pname = next((n for n, p in module.named_parameters(recurse=False) if p is weight), None)
            key = f"{name}.{pname}"
            # the first call for a weight of the module being run is its forward (with a sibling
            # group's scale in group mode); later ones are the backward's recomputation
            if pname is not None and key not in self.outputs:
                self.inputs[key] = (isinstance(weight, DTensor), tuple(weight.shape))
                self.outputs[key] = out.detach().clone()
            return out, scale

        return spied

    def __exit__(self, *exc):
        for user in self._USERS:
            user.fake_quantizer = self._real
        for h in self._hooks:
            h.remove()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_reference(ref: nn.Module, sharded: nn.Module, precision: str) -> nn.Module:
    """``ref`` (an unsharded model of the same architecture) loaded with the sharded model's
    current masters (gathered), in the dtype its forward computes in: the single-process twin."""
    masters = {n: full(p.detach()) for n, p in sharded.named_parameters()}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            src = masters[name]
            p.data = src.to(torch.bfloat16) if precision == "fsdp-bf16" else src.clone()
    return ref


def rollout_state(model: nn.Module) -> dict[str, tuple[torch.Tensor, ...]]:
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, NVFP4Tensor):
            out[name] = (p.qdata.clone(), p.scale.view(torch.uint8).clone(), p.global_encode_scale.clone())
        else:
            out[name] = (p.detach().clone(),)
    return out


def differing(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bitwise) between two rollout_state dicts."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return sorted(n for n in a if not all(torch.equal(x, y) for x, y in zip(a[n], b[n], strict=True)))


# -- trainer forward / backward ----------------------------------------------------------------


def trainer_case(kind: str, precision: str) -> dict:
    ref, sharded = trainer_pair(kind, precision)
    ids = token_ids(1)
    results = {}
    outs, spies = [], []
    for model in (ref, sharded):
        with ForwardWeightSpy(model) as spy, compute_context(precision):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append(out)
        spies.append(spy)
    ref_w, sh_w = spies[0].outputs, spies[1].outputs
    results["n_forward_weights"] = len(sh_w)
    results["forward_weight_names_match"] = sorted(ref_w) == sorted(sh_w)
    results["forward_weights_plain_and_whole"] = all(
        not is_d and shape == tuple(dict(sharded.named_parameters())[n].shape) for n, (is_d, shape) in spies[1].inputs.items()
    )
    results["forward_weights_differ"] = sorted(n for n in ref_w if not torch.equal(ref_w[n], sh_w.get(n, torch.empty(0))))
    results["forward_weight_dtypes"] = sorted({str(t.dtype) for t in sh_w.values()})
    results["logits_equal"] = torch.equal(outs[0].logits, outs[1].logits)
    results["logits_max_diff"] = (outs[0].logits.float() - outs[1].logits.float()).abs().max().item()
    results["loss_equal"] = torch.equal(outs[0].loss, outs[1].loss)
    ref_params = dict(ref.named_parameters())
    grads_differ, n_sharded = [], 0
    for name, p in sharded.named_parameters():
        n_sharded += isinstance(p, DTensor) and p.placements == (Shard(0),)
        g = full(p.grad)
        if not torch.equal(g, ref_params[name].grad.to(g.dtype)):
            grads_differ.append(name)
    results["grads_differ"] = grads_differ
    results["n_params"] = len(ref_params)
    results["n_sharded_params"] = n_sharded
    return results, ref, sharded


def sync_case(kind: str, precision: str, sharded: nn.Module) -> dict:
    """Optimizer step on the sharded trainer, sharded sync into a rollout replica, compare with the
    single-process sync from the gathered masters; then the trainer's next forward weights."""
    torch.optim.AdamW(sharded.parameters(), lr=1e-2).step()
    rollout = quads.quantize_(build(kind, seed=5, dtype=torch.bfloat16), ROLLOUT)  # other init: all overwritten
    before = rollout_state(rollout)
    n = quads.sync_weights_(rollout, sharded)  # dispatches to the sharded sync
    reference = gathered_reference(quads.quantize_(build(kind, seed=0, dtype=torch.float32), TRAINER), sharded, precision)
    ref_rollout = quads.quantize_(build(kind, seed=5, dtype=torch.bfloat16), ROLLOUT)
    quads.sync_weights_(ref_rollout, reference)
    got, want = rollout_state(rollout), rollout_state(ref_rollout)
    ids = token_ids(2)
    with ForwardWeightSpy(sharded) as spy, compute_context(precision), torch.no_grad():
        sharded(input_ids=ids)
    packed = {nm: p for nm, p in rollout.named_parameters() if isinstance(p, NVFP4Tensor)}
    misaligned = sorted(nm for nm, fq in spy.outputs.items() if not torch.equal(packed[nm].dequantize(fq.dtype), fq))
    return {
        "n_synced": n,
        "n_rollout_params": len(got),
        "n_packed": len(packed),
        "differ_from_single_process": differing(got, want),
        "n_changed_by_sync": len(differing(before, got)),
        "n_aligned_checked": len(spy.outputs),
        "rollout_vs_trainer_forward_misaligned": misaligned,
    }


# -- uneven shards, buckets, empty shards ------------------------------------------------------


class TinyExperts(nn.Module):
    """A fused-experts module as transformers 5 lays it out (3 experts: uneven over 2 ranks)."""

    def __init__(self, experts=3, hidden=64, inter=16):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter))


class Uneven(nn.Module):
    """Parameters whose dim 0 does not split evenly over 2 ranks (one leaves a rank empty)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(97, 64)  # dense, 49 / 48 rows
        self.one_row = nn.Linear(64, 1, bias=False)  # packed, 1 / 0 rows
        self.odd = nn.Linear(64, 33)  # packed 17 / 16 rows, dense bias
        self.experts = TinyExperts()  # packed 3-D, 2 / 1 experts
        self.norm = nn.LayerNorm(48)  # dense 1-D, even


def uneven_case(rank: int, backend: str) -> dict:
    """Sharded sync of uneven / empty shards, with the rollout modules on ``backend`` (``hopper``:
    the Triton quantizer with given global scales; under TRITON_INTERPRET=1 on CPU)."""
    torch.manual_seed(0)
    model = Uneven().to(device())
    with quads.use_backend(backend):
        rollout = quads.quantize_(copy.deepcopy(model).to(torch.bfloat16), ROLLOUT)
    ref_rollout = copy.deepcopy(rollout)
    quads.quantize_(model, TRAINER)
    reference = copy.deepcopy(model)
    for m in (model.odd, model.one_row, model.experts, model.embed):
        fully_shard(m)
    fully_shard(model)
    locals_ = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # move the masters (a local op on each shard)
    out = {"local_shapes": locals_, "backends": sorted({m.quads_backend.name for m in quads.quantized_modules(rollout).values()})}
    small = copy.deepcopy(ref_rollout) if backend == "torch" else None  # buckets: backend-independent
    sync_sharded_weights_(rollout, model)
    if small is not None:
        sync_sharded_weights_(small, model, bucket_bytes=700)  # many buckets, entries split across them
    gathered_reference(reference, model, "autocast")
    quads.sync_weights_(ref_rollout, reference)
    want = rollout_state(ref_rollout)
    out["differ_from_single_process"] = differing(rollout_state(rollout), want)
    out["small_buckets_differ"] = differing(rollout_state(small), want) if small is not None else None
    return out


def tied_case() -> dict:
    """Tied input/output embeddings: one FSDP parameter under two names, synced once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make():
        torch.manual_seed(0)
        cfg = LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, intermediate_size=96)
        return quads.quantize_(LlamaForCausalLM(cfg).to(device()), TRAINER)

    sharded = shard(make(), "autocast")
    with torch.no_grad():
        for p in sharded.parameters():
            p.mul_(1.5)
    rollout = build_rollout_model(make(), ROLLOUT)  # from another (unsharded) init: all overwritten
    n = quads.sync_weights_(rollout, sharded)
    reference = gathered_reference(make(), sharded, "autocast")
    want = build_rollout_model(reference, ROLLOUT)
    return {
        "tied": rollout.lm_head.weight is rollout.model.embed_tokens.weight,
        "n_synced": n,
        "n_rollout_params": len(list(rollout.named_parameters())),
        "differ_from_single_process": differing(rollout_state(rollout), rollout_state(want)),
    }


def build_rollout_case() -> dict:
    """build_rollout_model straight from a sharded trainer (gathers for the copy, then syncs)."""
    _, sharded = trainer_pair("qwen3_moe", "autocast")
    rollout = build_rollout_model(sharded, ROLLOUT)
    reference = gathered_reference(quads.quantize_(build("qwen3_moe", seed=0, dtype=torch.float32), TRAINER), sharded, "autocast")
    want = build_rollout_model(reference, ROLLOUT)
    return {"differ_from_single_process": differing(rollout_state(rollout), rollout_state(want))}


# -- collectives -------------------------------------------------------------------------------

_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_reduce", "broadcast")


@contextlib.contextmanager
def count_collectives():
    """Count calls (and bytes) of torch.distributed collectives (spies that call through)."""
    counts: dict[str, list[int]] = {}
    real = {}
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        real[name] = fn

        def spy(*args, _name=name, _fn=fn, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            size = sum(t.numel() * t.element_size() for t in tensors)
            counts.setdefault(_name, [0, 0])
            counts[_name][0] += 1
            counts[_name][1] += size
            return _fn(*args, **kwargs)

        setattr(dist, name, spy)
    try:
        yield counts
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def collectives_case(kind: str) -> dict:
    """Collectives of one training forward+backward: plain FSDP2 BF16 vs FSDP2 + quads QAT."""
    ids = token_ids(1)
    out = {}
    for label, quantize in (("plain", False), ("quads", True)):
        model = build(kind, seed=0, dtype=torch.float32)
        if quantize:
            quads.quantize_(model, TRAINER)
        shard(model, "autocast")
        with count_collectives() as counts, compute_context("autocast"):
            model(input_ids=ids, labels=ids).loss.backward()
        out[label] = counts
    return out


# -- entry points ------------------------------------------------------------------------------


def fsdp_checks(rank: int, world: int) -> dict:
    results = {}
    for kind in KINDS:
        for precision in PRECISIONS:
            trainer, _, sharded = trainer_case(kind, precision)
            results[f"trainer/{kind}/{precision}"] = trainer
            results[f"sync/{kind}/{precision}"] = sync_case(kind, precision, sharded)
        results[f"collectives/{kind}"] = collectives_case(kind)
    results["uneven"] = uneven_case(rank, "torch")
    results["uneven_hopper"] = uneven_case(rank, "hopper")
    results["build_rollout"] = build_rollout_case()
    results["tied"] = tied_case()
    return results


def _expect_failure(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test inspects type and message
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None, "message": ""}


def failure_checks(rank: int, world: int) -> dict:
    """Every failure raises on every rank and leaves every rank's rollout untouched."""
    results = {}

    def fresh():
        _, sharded = trainer_pair("llama", "autocast")
        rollout = build_rollout_model(sharded, ROLLOUT)
        with torch.no_grad():  # move the masters so a sync would change the rollout
            for p in sharded.parameters():
                p.mul_(1.25)
        return sharded, rollout

    def case(name, sharded, rollout, fn):
        before = rollout_state(rollout)
        results[name] = _expect_failure(fn)
        results[name]["changed"] = differing(before, rollout_state(rollout))

    # 1. a NaN in rank 1's shard of a packed weight
    sharded, rollout = fresh()
    if rank == 1:
        with torch.no_grad():
            sharded.model.layers[1].mlp.up_proj.weight.to_local()[3, 5] = float("nan")
    case("nan_on_one_rank", sharded, rollout, lambda: quads.sync_weights_(rollout, sharded))

    # 2. rank 1's rollout replica has another architecture (vocabulary size)
    sharded, rollout = fresh()
    if rank == 1:
        from transformers import LlamaConfig, LlamaForCausalLM

        rollout = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": 80}, intermediate_size=96))
        rollout = rollout.to(device=device(), dtype=torch.bfloat16)
        quads.quantize_(rollout, ROLLOUT)
    case("mismatch_on_one_rank", sharded, rollout, lambda: quads.sync_weights_(rollout, sharded))

    # 3. quantization fails on rank 1 while staging (injected into its backend)
    sharded, rollout = fresh()
    if rank == 1:
        module = rollout.model.layers[0].self_attn.o_proj

        class Failing(type(module.quads_backend)):
            def quantize_weight(self, *a, **k):
                raise RuntimeError("injected staging failure")

        module.quads_backend = Failing()
    case("staging_failure_on_one_rank", sharded, rollout, lambda: quads.sync_weights_(rollout, sharded))

    # 4. a tensor-parallel style placement the sync cannot reassemble (same on every rank)
    plain = quads.quantize_(build("llama", seed=0, dtype=torch.float32), TRAINER)
    rollout = build_rollout_model(plain, ROLLOUT)
    layer = plain.model.layers[0].mlp.gate_proj
    mesh = init_device_mesh(device_type(), (world,))
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(1)]))
    case("unsupported_placement", plain, rollout, lambda: quads.sync_weights_(rollout, plain))

    # 5. a quads trainer layer called outside its FSDP root's forward sees a DTensor weight
    model = quads.quantize_(build("llama", seed=0, dtype=torch.float32), TRAINER)
    fully_shard(model)
    x = torch.randn(3, COMMON["hidden_size"], device=device())
    results["dtensor_in_forward"] = _expect_failure(lambda: model.model.layers[0].self_attn.q_proj(x))

    # 6. an unsharded trainer passed to the sharded sync directly
    plain = quads.quantize_(build("llama", seed=0, dtype=torch.float32), TRAINER)
    results["not_sharded"] = _expect_failure(lambda: sync_sharded_weights_(rollout, plain))
    results["sharded_sync_error_is"] = ShardedSyncError.__name__
    return results
