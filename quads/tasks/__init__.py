"""Embedded tasks and the default model (self-contained: imports nothing else from ``quads``)."""

from .arithmetic import (
    MAX_NEW_TOKENS,
    held_out_accuracy,
    generate_completions,
    make_prompts,
    make_tokenizer,
    parse_answer,
    reward_exact_match,
)
from .default_model import DEFAULT_MODEL_DIR, default_model_config, load_default_model, load_default_tokenizer

__all__ = [
    "MAX_NEW_TOKENS",
    "DEFAULT_MODEL_DIR",
    "default_model_config",
    "generate_completions",
    "held_out_accuracy",
    "load_default_model",
    "load_default_tokenizer",
    "make_prompts",
    "make_tokenizer",
    "parse_answer",
    "reward_exact_match",
]
