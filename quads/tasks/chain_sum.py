"""Running-sum task with worked steps, for GRPO on the real model (SmolLM2-135M-Instruct).

A problem is a list of ``n`` small numbers; the answer adds them one at a time, one line per
step, then states the total::

    Numbers: 7, 3, 9, 4, 6, 2, 8, 5
    7 + 3 = 10
    10 + 9 = 19
    ...
    37 + 5 = 42
    Answer: 42

Completions are 64+ tokens (8 numbers: 7 steps of ~10 tokens plus the answer line), the
prompt is the model's chat template with one worked example, and the 135M instruct model
partly solves it (it copies the format and makes arithmetic slips; see ``docs/real_model.md``).

Reward (verifiable, in [0, 1]): ``0.5 * final + 0.5 * steps``, where ``final`` is 1 when the
``Answer:`` line holds the true total and ``steps`` the fraction of the ``n - 1`` expected step
lines that appear, correct, in order at the start of the completion (partial credit that GRPO
can climb). Held-out accuracy is the exact final answer under greedy decoding. Train and
held-out problems are disjoint: a problem is held out iff a CRC32 of its number list falls in a
fixed bucket. Depends only on the standard library and ``torch``.
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any, Iterable, Sequence

__all__ = [
    "NUM_NUMBERS",
    "MAX_VALUE",
    "MAX_NEW_TOKENS",
    "SYSTEM_PROMPT",
    "format_question",
    "worked_solution",
    "is_heldout",
    "sample_numbers",
    "make_problems",
    "chat_prompt",
    "score_completion",
    "reward_chain_sum",
    "final_answer_correct",
]

#: Numbers per problem (7 worked steps).
NUM_NUMBERS = 8
#: Numbers are drawn from 1..MAX_VALUE.
MAX_VALUE = 20
#: Enough for the worked solution (~75 tokens with the SmolLM2 tokenizer) with slack.
MAX_NEW_TOKENS = 128
_HELDOUT_BUCKETS = 10

SYSTEM_PROMPT = "You add lists of numbers step by step. Write one line per step, then the answer."
_EXAMPLE = (4, 9, 2, 6)

_STEP = re.compile(r"^\s*(-?\d+)\s*\+\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def format_question(numbers: Sequence[int]) -> str:
    return "Numbers: " + ", ".join(str(n) for n in numbers)


def worked_solution(numbers: Sequence[int]) -> str:
    """The reference completion: one ``a + b = c`` line per step, then ``Answer: total``."""
    lines, total = [], numbers[0]
    for n in numbers[1:]:
        lines.append(f"{total} + {n} = {total + n}")
        total += n
    return "\n".join(lines + [f"Answer: {total}"])


def is_heldout(numbers: Sequence[int]) -> bool:
    return zlib.crc32(",".join(map(str, numbers)).encode()) % _HELDOUT_BUCKETS == 0


def sample_numbers(rng: random.Random, split: str = "train", n: int = NUM_NUMBERS) -> tuple[int, ...]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want = split == "heldout"
    while True:
        numbers = tuple(rng.randint(1, MAX_VALUE) for _ in range(n))
        if is_heldout(numbers) == want:
            return numbers


def make_problems(count: int, seed: int = 0, split: str = "train", n: int = NUM_NUMBERS) -> list[dict[str, Any]]:
    """``count`` problems ``{"numbers", "question", "answer", "solution"}`` (deterministic in ``seed``)."""
    rng = random.Random(f"chain-sum/{split}/{seed}")
    out = []
    for _ in range(count):
        numbers = sample_numbers(rng, split, n)
        out.append({"numbers": list(numbers), "question": format_question(numbers),
                    "answer": str(sum(numbers)), "solution": worked_solution(numbers)})
    return out


def chat_prompt(tokenizer, numbers: Sequence[int]) -> str:
    """The chat-templated prompt text (system, one worked example, the question)."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": format_question(_EXAMPLE)},
        {"role": "assistant", "content": worked_solution(_EXAMPLE)},
        {"role": "user", "content": format_question(numbers)},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _text(c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):  # conversational completion
        return str(c[-1].get("content", ""))
    return str(c)


def score_completion(text: str, numbers: Sequence[int]) -> dict[str, float]:
    """``{"final": 0/1, "steps": fraction of correct leading steps, "reward": ...}``."""
    text = _text(text)
    expected, total = [], numbers[0]
    for n in numbers[1:]:
        expected.append((total, n, total + n))
        total += n
    lines = [l for l in text.strip().splitlines() if l.strip()]
    good = 0
    for line, want in zip(lines, expected):
        m = _STEP.match(line)
        if m is None or tuple(int(g) for g in m.groups()) != want:
            break
        good += 1
    answers = _ANSWER.findall(text)
    final = float(bool(answers) and int(answers[0]) == total)
    steps = good / max(len(expected), 1)
    return {"final": final, "steps": steps, "reward": 0.5 * final + 0.5 * steps}


def reward_chain_sum(completions: Iterable[Any], numbers: Iterable[Sequence[int]], **kwargs: Any) -> list[float]:
    """TRL-style reward function (``numbers`` is the dataset column)."""
    return [score_completion(c, n)["reward"] for c, n in zip(completions, numbers)]


def final_answer_correct(completion: str, numbers: Sequence[int]) -> bool:
    return score_completion(completion, numbers)["final"] == 1.0
