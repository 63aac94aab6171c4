"""Running-sum task with worked steps, for GRPO on the real model (SmolLM2-135M-Instruct).

A problem is a list of ``n`` one-digit numbers; the answer adds them one at a time, one line
per step, then states the total::

    Numbers: 7, 3, 9, 4, 6
    Step 1: 7 + 3 = 10. The running total is now 10.
    Step 2: 10 + 9 = 19. The running total is now 19.
    Step 3: 19 + 4 = 23. The running total is now 23.
    Step 4: 23 + 6 = 29. The running total is now 29.
    Answer: 29

The reference completion is ~85 tokens with the SmolLM2 tokenizer (5 numbers: 4 steps of ~20
tokens and the answer line); the prompt is the model's chat template with one worked example of
the same length. SmolLM2-135M-Instruct partly solves it: greedy, 21% of held-out problems
exactly and 44% of the step lines (8 numbers: 0%; 4 numbers: 67%; see ``docs/real_model.md``).

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

#: Numbers per problem (4 worked steps).
NUM_NUMBERS = 5
#: Numbers are drawn from 1..MAX_VALUE.
MAX_VALUE = 9
#: Enough for the worked solution (~85 tokens with the SmolLM2 tokenizer) with slack.
MAX_NEW_TOKENS = 128
_HELDOUT_BUCKETS = 10

SYSTEM_PROMPT = "You add lists of numbers step by step. Write one line per step, then the answer."
_EXAMPLE = (4, 9, 2, 6, 3, 8, 1, 5)

_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def format_question(numbers: Sequence[int]) -> str:
    return "Numbers: " + ", ".join(str(n) for n in numbers)


def _step_lines(numbers: Sequence[int]) -> list[str]:
    lines, total = [], numbers[0]
    for k, n in enumerate(numbers[1:], start=1):
        lines.append(f"Step {k}: {total} + {n} = {total + n}. The running total is now {total + n}.")
        total += n
    return lines


def worked_solution(numbers: Sequence[int]) -> str:
    """The reference completion: one ``Step k: a + b = c. The running total is now c.`` line per
    step, then ``Answer: total``."""
    return "\n".join(_step_lines(numbers) + [f"Answer: {sum(numbers)}"])


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
    example = _EXAMPLE[: len(numbers)]  # a worked example of the same length
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": format_question(example)},
        {"role": "assistant", "content": worked_solution(example)},
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
    """``{"final": 0/1, "steps": fraction of correct leading step lines, "reward": ...}``.

    A step line counts when it equals the reference line exactly (after stripping spaces);
    counting stops at the first line that does not. ``final`` reads the first ``Answer:``."""
    text = _text(text)
    expected = _step_lines(numbers)
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    good = 0
    for line, want in zip(lines, expected):
        if line != want:
            break
        good += 1
    answers = _ANSWER.findall(text)
    final = float(bool(answers) and int(answers[0]) == sum(numbers))
    steps = good / max(len(expected), 1)
    return {"final": final, "steps": steps, "reward": 0.5 * final + 0.5 * steps}


def reward_chain_sum(completions: Iterable[Any], numbers: Iterable[Sequence[int]], **kwargs: Any) -> list[float]:
    """TRL-style reward function (``numbers`` is the dataset column)."""
    return [score_completion(c, n)["reward"] for c, n in zip(completions, numbers)]


def final_answer_correct(completion: str, numbers: Sequence[int]) -> bool:
    return score_completion(completion, numbers)["final"] == 1.0
