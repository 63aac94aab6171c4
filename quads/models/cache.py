"""Where quads keeps what it builds once and reuses offline: ``$QUADS_CACHE`` or ``~/.cache/quads``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["quads_cache_dir"]


def quads_cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache root: ``override``, else ``$QUADS_CACHE``, else ``$XDG_CACHE_HOME/quads``
    (``~/.cache/quads``). Not created here."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("QUADS_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "quads"
