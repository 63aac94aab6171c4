"""Tiny checkpoints for the vLLM tests, built from config with random weights (no hub access).

vLLM's CPU attention needs head_dim >= 32, so these differ from ``tests/tiny_models.py``.
Every linear input dim is a multiple of 16 (NVFP4 blocks). Weights are scaled up so the
output distributions are peaked enough for greedy decoding and log-prob checks to mean
something (default init is near-uniform).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from quads.tasks.arithmetic import make_tokenizer

KINDS = ("qwen3_moe", "qwen3", "llama")

_COMMON = dict(
    vocab_size=32,  # quads.tasks.arithmetic's character tokenizer
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build(kind: str, seed: int = 0, scale: float = 3.0, head_scale: float = 8.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**_COMMON, intermediate_size=128))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON, intermediate_size=96))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
        model.lm_head.weight.mul_(head_scale)  # peaked next-token distributions
    return model.to(torch.bfloat16).eval()


def save(model: torch.nn.Module, path: Path) -> Path:
    path = Path(path)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# Engine helpers
# ---------------------------------------------------------------------------------------------

ENGINE_KWARGS = dict(dtype="bfloat16", max_model_len=64, enforce_eager=True, max_num_seqs=8, seed=0)
PROMPTS = ["12+34=", "7+8=", "999+1=", "45+67=", "3+3=", "120+5="]


_LIVE: list = []


def make_llm(path, **kwargs):
    """An in-process vLLM engine on ``path`` (the quads plugin registered). One engine lives at
    a time: an engine still alive is released first (see :func:`release`)."""
    from vllm import LLM

    from quads.integrations.vllm import register

    register()
    while _LIVE:
        release(_LIVE[-1])
    llm = LLM(model=str(path), **{**ENGINE_KWARGS, **kwargs})
    _LIVE.append(llm)
    return llm


def greedy(llm, prompts=PROMPTS, max_tokens: int = 12):
    """[(prompt_ids, completion_ids, completion_logprobs)] from greedy decoding."""
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        result.append((list(o.prompt_token_ids), ids, [lp[t].logprob for lp, t in zip(c.logprobs, ids)]))
    return result


@torch.no_grad()
def teacher_forced(model, prompt_ids, completion_ids):
    """(log-probs of ``completion_ids`` (T,), argmax ids (T,), max log-prob (T,)) under ``model``."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = logp[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(completion_ids)]
    target = torch.tensor(completion_ids)
    return rows.gather(1, target[:, None])[:, 0], rows.argmax(-1), rows.max(-1).values


def release(llm) -> None:
    """Shut an in-process engine down so that the next one (another architecture) can start.

    vLLM keeps its process-global parallel state (world/TP/EP groups) after an ``LLM`` is
    dropped; an MoE engine started after a dense one then finds no expert-parallel group.
    """
    if not any(x is llm for x in _LIVE):
        return  # already released
    _LIVE[:] = [x for x in _LIVE if x is not llm]
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort, the engine may be half-built
        pass
    del llm
    reset_parallel_state()


def reset_parallel_state() -> None:
    """Drop vLLM's process-global parallel state (after a release, or an engine that failed to start)."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


#: A greedy token may differ from the reference model's argmax only if the reference puts it
#: within this many nats of its maximum (a near-tie broken differently by different kernels).
NEAR_TIE = 0.6


def agreement(llm, rollout, max_tokens: int = 12) -> dict:
    """Greedy tokens and per-token log-probs of the engine vs the transformers model."""
    diffs, exact, near, total = [], 0, 0, 0
    for prompt_ids, comp, vlp in greedy(llm, PROMPTS, max_tokens):
        lp, argmax, best = teacher_forced(rollout, prompt_ids, comp)
        diffs.append((torch.tensor(vlp) - lp).abs())
        exact += int((argmax == torch.tensor(comp)).sum())
        near += int(((best - lp) <= NEAR_TIE).sum())
        total += len(comp)
    d = torch.cat(diffs)
    return dict(max=d.max().item(), mean=d.mean().item(), exact=exact / total, near=near / total, tokens=total)
