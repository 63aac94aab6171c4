"""Synthetic integer-addition task with an exact-match (verifiable) reward.

A problem is ``"<a>+<b>="`` and its answer is the decimal sum, e.g. ``"37+485="`` -> ``"522"``.
Operands have 1 to ``MAX_DIGITS`` digits (the digit count is drawn uniformly, then the number),
so the answer has at most ``MAX_DIGITS + 1`` digits.

The tokenizer is character level (one token per character) and adds ``<bos>`` in front of every
encoded text, so a prompt ``"37+485="`` becomes ``<bos> 3 7 + 4 8 5 =``; the model then answers
``5 2 2 <eos>``.  Train and held-out problems are disjoint: a problem belongs to the held-out split
iff a CRC32 of its *unordered* operand pair falls in a fixed bucket, so ``a+b`` and ``b+a`` are
always in the same split.

This module depends only on ``torch``, ``tokenizers`` and ``transformers`` (nothing else in
``quads``).
"""

from __future__ import annotations

import random
import zlib
from typing import Any, Iterable, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

__all__ = [
    "MAX_DIGITS",
    "HELDOUT_BUCKETS",
    "PAD_TOKEN",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "UNK_TOKEN",
    "SPECIAL_TOKENS",
    "CHARS",
    "MAX_NEW_TOKENS",
    "make_tokenizer",
    "format_prompt",
    "is_heldout",
    "sample_problem",
    "make_prompts",
    "parse_answer",
    "reward_exact_match",
    "generate_completions",
    "held_out_accuracy",
]

# ---------------------------------------------------------------------------------------------
# Task definition
# ---------------------------------------------------------------------------------------------

#: Operands have 1..MAX_DIGITS digits.
MAX_DIGITS = 4
#: One problem in HELDOUT_BUCKETS (by CRC32 of the unordered pair) is held out.
HELDOUT_BUCKETS = 10
#: Longest answer (MAX_DIGITS + 1 digits) plus ``<eos>``; enough for generation.
MAX_NEW_TOKENS = MAX_DIGITS + 2

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3
#: Ordinary characters (ids 4..31).  Only digits, "+", "=" are used by the task; the rest are
#: spare so the vocabulary is 32 (a multiple of 16, convenient for the LM head).
CHARS = "0123456789+-*/=()[].,:;? \nx_"
assert len(SPECIAL_TOKENS) + len(CHARS) == 32 and len(set(CHARS)) == len(CHARS)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: 32 tokens, ``<bos>`` prepended, left padding/truncation.

    Works as a TRL ``processing_class`` for plain-text prompts:
    ``tok(prompts, padding=True, return_tensors="pt")`` and ``tok.batch_decode(ids, skip_special_tokens=True)``.
    """
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    # A BPE model without merges splits every word into single characters; with no
    # pre-tokenizer and no normalizer the whole text (spaces and newlines included) is one word.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    tok.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        truncation_side="left",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------------------------------------
# Problems and splits
# ---------------------------------------------------------------------------------------------


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def is_heldout(a: int, b: int) -> bool:
    """Deterministic split: depends only on the unordered pair {a, b}."""
    lo, hi = (a, b) if a <= b else (b, a)
    return zlib.crc32(f"{lo}+{hi}".encode()) % HELDOUT_BUCKETS == 0


def _rand_operand(rng: random.Random, max_digits: int) -> int:
    d = rng.randint(1, max_digits)
    lo = 0 if d == 1 else 10 ** (d - 1)
    return rng.randint(lo, 10**d - 1)


def sample_problem(rng: random.Random, split: str = "train", max_digits: int = MAX_DIGITS) -> tuple[int, int]:
    """Draw one (a, b) from ``split`` ("train" or "heldout") by rejection sampling."""
    want_heldout = _check_split(split)
    while True:
        a, b = _rand_operand(rng, max_digits), _rand_operand(rng, max_digits)
        if is_heldout(a, b) == want_heldout:
            return a, b


def _check_split(split: str) -> bool:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return split == "heldout"


def make_prompts(n: int, seed: int = 0, split: str = "train", max_digits: int = MAX_DIGITS) -> list[dict[str, str]]:
    """``n`` distinct problems ``{"prompt": "37+485=", "answer": "522"}`` from ``split``.

    Deterministic in (n, seed, split, max_digits); the two splits never share a problem.
    Usable directly as a TRL dataset: ``datasets.Dataset.from_list(make_prompts(...))``; the
    ``answer`` column reaches :func:`reward_exact_match` as a keyword argument.
    """
    _check_split(split)
    rng = random.Random(f"quads-arith-{split}-{seed}-{max_digits}")
    seen: set[tuple[int, int]] = set()
    out: list[dict[str, str]] = []
    tries = 0
    while len(out) < n:
        a, b = sample_problem(rng, split, max_digits)
        tries += 1
        if (a, b) in seen:
            if tries > 50 * n + 1000:
                raise ValueError(f"cannot draw {n} distinct {split} problems with max_digits={max_digits}")
            continue
        seen.add((a, b))
        out.append({"prompt": format_prompt(a, b), "answer": str(a + b)})
    return out


# ---------------------------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------------------------


def _completion_text(c: Any) -> str:
    # Plain text (the intended use), or a conversational completion [{"role":..., "content":...}].
    if isinstance(c, str):
        return c
    if isinstance(c, Sequence) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    if isinstance(c, dict):
        return str(c.get("content", ""))
    return str(c)


def parse_answer(text: str) -> str:
    """The answer part of a completion: up to the first ``<eos>`` or newline, pads removed, stripped."""
    text = text.split(EOS_TOKEN, 1)[0].split("\n", 1)[0]
    return text.replace(PAD_TOKEN, "").replace(BOS_TOKEN, "").strip()


def reward_exact_match(completions: Iterable[Any], answer: Iterable[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 where the parsed completion equals the answer exactly, else 0.0."""
    return [
        1.0 if parse_answer(_completion_text(c)) == str(a).strip() else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 256,
    seed: int | None = 0,
) -> list[str]:
    """Generate completions (decoded with ``skip_special_tokens=True``, as TRL does)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outs: list[str] = []
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            for i in range(0, len(prompts), batch_size):
                batch = list(prompts[i : i + batch_size])
                enc = tokenizer(batch, padding=True, padding_side="left", return_tensors="pt")
                enc = {k: v.to(device) for k, v in enc.items()}
                gen_kwargs: dict[str, Any] = dict(
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.bos_token_id,
                )
                if greedy:
                    gen_kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
                else:
                    gen_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                seq = model.generate(**enc, **gen_kwargs)
                outs.extend(tokenizer.batch_decode(seq[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outs


def held_out_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    n: int = 512,
    greedy: bool = True,
    max_new_tokens: int = MAX_NEW_TOKENS,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 256,
    max_digits: int = MAX_DIGITS,
) -> float:
    """Exact-match accuracy of ``model.generate`` on ``n`` held-out problems (greedy or sampled)."""
    probs = make_prompts(n, seed=seed, split="heldout", max_digits=max_digits)
    comps = generate_completions(
        model,
        tokenizer,
        [p["prompt"] for p in probs],
        greedy=greedy,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
    )
    rewards = reward_exact_match(comps, [p["answer"] for p in probs])
    return sum(rewards) / max(len(rewards), 1)
