"""The GRPO tasks of the main example, each with the model it fits and its training defaults.

* ``arithmetic`` (:mod:`.arithmetic`): integer addition in the embedded tiny MoE's
  character-level format (``12+34=``), exact-match reward. It fits the embedded model only: a
  real tokenizer turns the prompt into tokens the model never saw in that role.
* ``chain-sum`` (:mod:`.chain_sum`): a running sum with worked steps in the model's chat
  template, reward ``0.5 * final + 0.5 * steps``. It fits a chat (instruct) model such as
  SmolLM2-135M-Instruct, which partly solves it before training (21% final, 44% step lines).

:func:`choose_task` picks one for a model (``auto``): the embedded model gets ``arithmetic``, a
model whose tokenizer has a chat template ``chain-sum``. A task that does not fit its model gives
every completion reward 0, so GRPO's group-normalised advantages are all 0 and nothing is learned;
:func:`no_signal_hint` is the one line the example prints then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import arithmetic, chain_sum

__all__ = ["GRPOTask", "TASKS", "choose_task", "no_signal_hint"]


@dataclass(frozen=True)
class GRPOTask:
    """A task: its TRL reward, prompts, greedy held-out accuracy and training defaults."""

    name: str
    fits: str  # the models it fits, for messages
    reward: Callable[..., list[float]]
    max_new_tokens: int
    learning_rate: float
    prompts_per_step: int
    eval_n: int
    train_micro_batch: int | None  # sequences per forward/backward (None: the whole batch)

    def rows(self, tokenizer, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` training rows for TRL (``prompt`` plus the reward's columns), deterministic in ``seed``."""
        if self.name == "arithmetic":
            return arithmetic.make_prompts(n, seed=seed, split="train")
        return [{"prompt": chain_sum.chat_prompt(tokenizer, p["numbers"]), "numbers": p["numbers"]}
                for p in chain_sum.make_problems(n, seed=seed, split="train")]

    def held_out_accuracy(self, model, tokenizer, n: int, max_new_tokens: int, seed: int) -> float:
        """Greedy accuracy on ``n`` held-out problems (disjoint from training): exact match for
        ``arithmetic``, the exact final answer for ``chain-sum``."""
        if self.name == "arithmetic":
            return arithmetic.held_out_accuracy(model, tokenizer, n=n, max_new_tokens=max_new_tokens, seed=seed)
        problems = chain_sum.make_problems(n, seed=seed, split="heldout")
        prompts = [chain_sum.chat_prompt(tokenizer, p["numbers"]) for p in problems]
        texts = arithmetic.generate_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                                batch_size=64, seed=seed)
        return sum(chain_sum.final_answer_correct(t, p["numbers"]) for t, p in zip(texts, problems)) / max(n, 1)


TASKS: dict[str, GRPOTask] = {
    "arithmetic": GRPOTask("arithmetic", "the embedded tiny MoE (its character-level tokenizer)",
                           arithmetic.reward_exact_match, arithmetic.MAX_NEW_TOKENS, 1e-4, 16, 512, None),
    "chain-sum": GRPOTask("chain-sum", "chat models (the prompt is the model's chat template)",
                          chain_sum.reward_chain_sum, chain_sum.MAX_NEW_TOKENS, 3e-6, 8, 64, 16),
}


def choose_task(name: str, tokenizer, embedded_model: bool) -> GRPOTask:
    """The task ``name``, or for ``"auto"`` the one that fits the model (see the module doc)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    if name == "auto":
        return TASKS["chain-sum" if chat and not embedded_model else "arithmetic"]
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose auto or one of {sorted(TASKS)}")
    if name == "chain-sum" and not chat:
        raise ValueError("task 'chain-sum' prompts in the model's chat template, and this tokenizer has none")
    return TASKS[name]


def no_signal_hint(task: GRPOTask, model_name: str, tokenizer, quantized_rollout: str | None = None) -> str:
    """One line for a first step where every completion earned reward 0. ``quantized_rollout``:
    the preset's name when its rollout is quantized (a 4-bit rollout of a small model can earn
    nothing at first where the BF16 one earns some: on SmolLM2 every NVFP4 preset starts at 0)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    fix = "--task chain-sum" if task.name == "arithmetic" and chat else "a model the task fits"
    rollout = (f", or the {quantized_rollout} rollout cannot earn it yet (compare --policy bf16)"
               if quantized_rollout else "")
    return (f"every completion of the first step earned reward 0, so every GRPO advantage is 0 and nothing is "
            f"learned from it; if this repeats, task {task.name!r} (for {task.fits}) does not fit {model_name}"
            f"{rollout}: try {fix}")
