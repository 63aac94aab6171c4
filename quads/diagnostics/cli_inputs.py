"""Checked inputs for the command-line tools (``quads diagnose``, ``examples/``).

Every check runs before any work starts and fails with a :class:`UsageError` whose message is
one line naming the culprit (the CLI prints it and exits with status 2), instead of a traceback
from deep inside transformers or the tokenizer, or an error after a long run. Nothing here
changes the user's files: an output path is probed with a fresh temporary file in its
directory (``O_EXCL``: no planted name, no symlink is opened), removed again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch

__all__ = [
    "HelpFormatter",
    "UsageError",
    "int_at_least",
    "positive_int",
    "nonnegative_int",
    "positive_float",
    "nonnegative_float",
    "load_local_causal_lm",
    "read_prompts",
    "check_output_file",
    "check_output_dir",
    "check_new_output_dir",
    "regex",
    "device_name",
    "check_device",
    "seed_int",
    "thread_count",
    "check_tokenizer",
    "check_model_convertible",
    "atomic_write_text",
]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help for quads' tools: the description as written, and every option's default shown
    (``(default: X)``) unless its help already names one or it has no meaningful default."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings
                or default == []):
            return text
        return f"{text} (default: {default})".strip()


class UsageError(Exception):
    """A bad command-line input; its message is one line meant for the user."""


def int_at_least(low: int):
    """argparse type factory: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


#: seeds every RNG a run seeds accepts (numpy's and Python's: [0, 2**32))
SEED_LIMIT = 2**32


def seed_int(text: str) -> int:
    """argparse type: a seed in ``[0, 2**32)`` (numpy, which TRL and transformers seed, takes no other)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {value}")
    return value


def max_threads() -> int:
    """The most intra-op threads a CLI accepts: 4x the CPU count (more only oversubscribes the
    cores, and a huge count crashes OpenMP: ``--threads 100000`` segfaulted)."""
    return 4 * (os.cpu_count() or 1)


def thread_count(text: str) -> int:
    """argparse type: a thread count in ``[1, max_threads()]``."""
    value = positive_int(text)
    if value > max_threads():
        raise argparse.ArgumentTypeError(f"must be <= {max_threads()} (4x this machine's {os.cpu_count()} CPUs), "
                                         f"got {value}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _one_line(err: BaseException) -> str:
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0] if first else ''}".rstrip(": ")


def _check_model_dir(path: Path) -> None:
    if not path.exists():
        raise UsageError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise UsageError(f"{str(path)!r} is not a directory (expected a Hugging Face model directory)")
    config = path / "config.json"
    if not config.is_file():
        raise UsageError(f"{str(path)!r} has no config.json; not a Hugging Face model directory")
    try:
        json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{config}: not a readable JSON config ({_one_line(err)})") from None
    if not any((path / f).is_file() for f in _WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise UsageError(f"{str(path)!r} has no weights (none of {', '.join(_WEIGHT_FILES)})")


def _masters_config(where: Path) -> dict:
    """``{"config": ...}`` without the quantization config for a quads *trainer* checkpoint (its
    weights are the BF16 masters the commands take: loaded plain, as from ``save_pretrained`` of
    a plain model); ``{}`` for any other; a quads *rollout* checkpoint (packed weights) is refused."""
    raw = json.loads((where / "config.json").read_text()).get("quantization_config")
    if not isinstance(raw, dict) or raw.get("quant_method") != "quads":
        return {}
    side = (raw.get("policy") or {}).get("side")
    if side != "trainer":
        raise UsageError(f"{str(where)!r} holds a quads {side} checkpoint (packed NVFP4 weights); this command takes "
                         "BF16 masters: a plain checkpoint or a quads trainer's save_pretrained")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(where), local_files_only=True)
    del config.quantization_config
    return {"config": config}


def load_local_causal_lm(path: str, dtype, *, require_tokenizer: bool = True, set_pad: bool = True, prompts=None,
                         prompts_source: str | None = None):
    """``(model, tokenizer)`` from a local Hugging Face causal-LM directory, never the hub.

    The tokenizer gets a pad token (its EOS) when it has none, and must encode ``prompts`` (the
    ones the caller will run; without them a probe prompt) to ids inside the model's vocabulary
    (:func:`check_tokenizer`). Raises UsageError for a
    missing, empty or corrupt directory (no config, unreadable config or weights, weights that
    leave parameters missing) or tokenizer, naming the path and the underlying error in one
    line. ``require_tokenizer=False``: a directory without a usable tokenizer gives ``None``.
    ``set_pad=False`` leaves the tokenizer as stored (``quads export`` saves it unchanged).
    ``prompts_source``: the file ``prompts`` came from, named in the errors.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    where = Path(path)
    _check_model_dir(where)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would repeat, at length, what is checked below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(where), dtype=dtype, local_files_only=True, output_loading_info=True, **_masters_config(where)
        )
    except Exception as err:  # noqa: BLE001 - any failure to load the user's directory is reported as such
        raise UsageError(f"could not load a causal LM from {str(where)!r}: {_one_line(err)}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
    # transformers initialises missing weights randomly and only warns: refuse, a random layer
    # would make every number downstream meaningless
    missing = list(info.get("missing_keys") or []) + [str(k) for k in info.get("mismatched_keys") or []]
    if missing:
        raise UsageError(
            f"{str(where)!r}: the weights do not match the config: {len(missing)} missing or mismatched "
            f"tensor(s), e.g. {missing[0]}"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        if tok.pad_token_id is None and set_pad:
            if tok.eos_token is None:
                raise UsageError(f"the tokenizer in {str(where)!r} has neither a pad nor an EOS token")
            tok.pad_token = tok.eos_token
        check_tokenizer(tok, model, where, prompts, source=prompts_source)
    except UsageError:
        if require_tokenizer:
            raise
        return model, None
    except Exception as err:  # noqa: BLE001
        if not require_tokenizer:
            return model, None
        purpose = f" to encode the prompts of {prompts_source!r}" if prompts_source else ""
        raise UsageError(f"could not load the tokenizer from {str(where)!r}{purpose}: {_one_line(err)}") from err
    return model, tok


#: what :func:`check_tokenizer` encodes when the caller has no prompts of its own
PROBE_PROMPTS = ("1 + 2 =",)


def _prompt_name(prompts: list[str], i: int, source: str | None) -> str:
    return f"{prompts[i][:40]!r}" + (f" (prompt {i + 1} of {source!r})" if source else "")


def _encode_all(tok, prompts: list[str], where, source: str | None = None) -> list[list[int]]:
    try:
        return tok(prompts, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - find the prompt it fails on, below
        pass
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(tok(prompt, add_special_tokens=False)["input_ids"])
        except Exception as err:  # noqa: BLE001 - a tokenizer that cannot encode is reported as such
            raise UsageError(f"the tokenizer in {str(where)!r} cannot encode {_prompt_name(prompts, i, source)}: "
                             f"{_one_line(err)}") from err
    return out


def check_tokenizer(tok, model, where, prompts=None, *, allow_unknown: bool = False, source: str | None = None) -> None:
    """Raise UsageError unless every prompt of ``prompts`` (the user's own: a tokenizer must be
    checked on the text it will see; :data:`PROBE_PROMPTS` when None) tokenizes to at least one
    id the model's embedding has, and, unless ``allow_unknown`` (a tool's own default prompts,
    the probe), without any part of one becoming the unknown token (the model would see
    mangled text).

    transformers builds a tokenizer even from a directory without tokenizer files (a vocabulary
    of one special token); it encodes every prompt to nothing, and generation then fails deep
    inside ``generate`` with an IndexError. A tokenizer of another vocabulary (a word-level one
    without digits, say) encodes the user's data to ``[UNK]`` and every number downstream is
    meaningless. Checked up front, naming the directory and the prompt (and ``source``, the file
    the prompts came from).
    """
    strict = prompts is not None and not allow_unknown
    prompts = [str(p) for p in (PROBE_PROMPTS if prompts is None else prompts)]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    unk, unk_text = getattr(tok, "unk_token_id", None), getattr(tok, "unk_token", None)
    for i, (prompt, ids) in enumerate(zip(prompts, _encode_all(tok, prompts, where, source))):
        what = _prompt_name(prompts, i, source)
        if not ids:
            raise UsageError(
                f"the tokenizer in {str(where)!r} encodes {what} to no tokens (vocabulary of {len(tok)}; "
                "are its tokenizer files missing?)"
            )
        if vocab is not None and max(ids) >= vocab:
            raise UsageError(
                f"the tokenizer in {str(where)!r} gives token id {max(ids)} for {what}, "
                f"outside the model's vocabulary of {vocab}"
            )
        if strict and unk is not None and unk in ids and not (unk_text and unk_text in prompt):
            raise UsageError(
                f"the tokenizer in {str(where)!r} encodes part of {what} as its unknown token {unk_text!r}: "
                "the model would see mangled text (is it the model's own tokenizer?)"
            )


def check_model_convertible(model, policies, where) -> None:
    """Raise UsageError (one line, naming the layer) unless ``quantize_`` can convert ``model``
    with every policy of ``policies`` (K a multiple of 16, dtypes, expert layouts, ties): checked
    on metadata only, before any work, instead of a traceback once sampling has started."""
    from quads.policies.quantize import check_convertible

    seen = set()
    for policy in policies:
        if policy is None or policy in seen:
            continue
        seen.add(policy)
        try:
            check_convertible(model, policy)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise UsageError(f"{where}: cannot quantize this model ({policy.side} side): {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def atomic_write_text(path, text: str) -> None:
    """Write ``path`` atomically and symlink-safely, mode 0666 less the umask
    (:func:`quads.tensor.files.write_atomically`): a reader sees the old or the new content,
    never half; a symlink at ``path`` is replaced, never written through."""
    from quads.tensor.files import write_atomically

    write_atomically(path, text)


def regex(text: str) -> str:
    """argparse type: a valid Python regular expression."""
    import re

    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {text!r} ({err})") from None
    return text


def check_new_output_dir(path: str) -> Path:
    """Raise UsageError unless ``path`` can become a new directory: not a symlink, not an
    existing file or non-empty directory, and its nearest existing parent is a writable
    directory (probed with a temporary directory, removed again). Nothing is created."""
    import tempfile

    target = Path(path)
    if target.is_symlink():
        raise UsageError(f"--out {path!r} is a symbolic link; give a real new directory")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"--out {path!r} exists and is not an empty directory; choose a new --out")
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {path!r}: {str(parent)!r} is not a directory")
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as err:
        raise UsageError(f"--out {path!r}: cannot create a directory in {str(parent)!r} ({_one_line(err)})") from None
    return target


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file, one per non-empty line (``\\n`` escapes become newlines)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read prompts from {path!r}: {_one_line(err)}") from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"prompt file {path!r} has no prompts (every line is empty)")
    return prompts


def _probe_dir(directory: Path) -> None:
    """Create and remove a fresh temporary file in ``directory`` (OSError if it cannot be written)."""
    fd, probe = tempfile.mkstemp(prefix=".quads-write-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def check_output_file(path: str) -> None:
    """Raise UsageError unless ``path`` can be written: its directory exists and takes a new file
    (probed; the file is later written atomically beside and renamed over ``path``, so ``path``
    itself is never opened: a symlink there, dangling or not, is replaced, not followed)."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"output {path!r} is a directory, expected a file path")
    parent = target.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"cannot write {path!r}: the directory {str(parent)!r} does not exist")
    try:
        _probe_dir(parent)
    except OSError as err:
        raise UsageError(f"cannot write {path!r}: {_one_line(err)}") from None


def check_output_dir(path: str) -> Path:
    """Create ``path`` if needed and raise UsageError unless a file can be written in it."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"output directory {path!r} is a file")
    try:
        target.mkdir(parents=True, exist_ok=True)
        _probe_dir(target)
    except OSError as err:
        raise UsageError(f"cannot write into output directory {path!r}: {_one_line(err)}") from None
    return target


def device_name(text: str) -> str:
    """argparse type: a device string torch understands (``cpu``, ``cuda``, ``cuda:1``)."""
    try:
        torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} ({_one_line(err)})") from None
    return text


def check_device(text: str) -> torch.device:
    """Raise UsageError unless the device exists on this machine (CUDA available, index in range)."""
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise UsageError(f"--device {text}: only cpu and cuda are supported")
    return device
