"""Writing files safely: atomically, never through a planted symlink, with the usual modes.

Every file quads, its benchmarks and its examples write goes through this module:

* :func:`write_atomically` / :func:`atomic_path`: the data goes to a fresh temporary file in the
  target's directory (``tempfile.mkstemp``: ``O_CREAT | O_EXCL``, so an existing name, a symlink
  included, is never opened), is flushed and ``fsync``-ed, gets the mode an ordinary ``open``
  gives (``0666`` less the umask: ``0644`` under the usual ``022``, where ``mkstemp`` alone
  leaves ``0600``), and is renamed over the target with :func:`os.replace`. A reader sees the
  old file or the new one, never half of one; a symlink at the target's name is replaced, its
  destination never written; an interrupted write (Ctrl-C, a failed writer) leaves the old file
  and removes the temporary one. A missing directory is reported under its own name.
* :func:`open_for_append`: logs that grow line by line (``metrics.jsonl``, a child process's
  output), opened with ``O_NOFOLLOW``: a symlink at that name is refused, never followed.
* :func:`publish_modes`: the modes ``save_pretrained`` gives (files ``0666``, directories
  ``0777``, less the umask) for a directory tree built in a ``mkdtemp`` directory (``0700``)
  before it is renamed into place.
* :func:`move_files_into`: the files of a staging directory renamed one by one into an existing
  directory (each synced first; a symlink at a name is replaced, never written through): a
  writer that fills a folder it does not own (``save_pretrained``'s directory).
* :func:`lock_folder`: one writing process per output folder (an exclusive ``flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

__all__ = ["umask", "file_mode", "write_atomically", "atomic_path", "open_for_append", "publish_modes",
           "move_files_into", "existing_parent", "FolderInUse", "lock_folder", "LOCK_NAME"]


def umask() -> int:
    """The process umask, read without changing it where the system says (Linux:
    ``/proc/self/status``), else by setting and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0666`` less the umask."""
    return 0o666 & ~umask()


def existing_parent(path: str | os.PathLike, what: str = "write") -> Path:
    """The directory ``path`` goes into, which must exist (the error names it, not a temporary file)."""
    parent = Path(path).absolute().parent
    if not parent.exists():
        raise FileNotFoundError(f"{what}: cannot write {str(path)!r}: the directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise NotADirectoryError(f"{what}: cannot write {str(path)!r}: {str(parent)!r} is not a directory")
    return parent


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary(target: Path, parent: Path, suffix: str) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{suffix}", dir=parent)


def write_atomically(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], None],
                     *, what: str = "write") -> Path:
    """Write ``data`` (bytes, text as UTF-8, or a function given the open binary file) to
    ``path`` atomically and symlink-safely (see the module doc); returns the path."""
    target = Path(path)
    parent = existing_parent(target, what)
    fd, tmp = _temporary(target, parent, "")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), file_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(parent)
    return target


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str | None = None, what: str = "write") -> Iterator[Path]:
    """A fresh temporary path for writers that take a file name (safetensors' ``save_file``,
    ``savefig``); on leaving the block without an error it is synced, given the usual mode and
    renamed over ``path``; on any exception it is removed. ``suffix`` (default: ``path``'s)
    ends the temporary name, for writers that pick a format from it."""
    target = Path(path)
    parent = existing_parent(target, what)
    fd, tmp = _temporary(target, parent, target.suffix if suffix is None else suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)  # the writer's file, not a link swapped in
        try:
            os.fsync(fd)
            os.fchmod(fd, file_mode())
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(parent)


def open_for_append(path: str | os.PathLike, *, truncate: bool = False, what: str = "append"):
    """``path`` opened for appending text (created ``0666`` less the umask if new; emptied first
    with ``truncate``: a log a child process writes into); a symlink at ``path`` is refused
    (``O_NOFOLLOW``), never followed."""
    existing_parent(path, what)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if Path(path).is_symlink():
            raise OSError(err.errno, f"{what}: {str(path)!r} is a symbolic link; refusing to write through it") from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def publish_modes(root: str | os.PathLike) -> None:
    """``save_pretrained``'s modes on ``root`` and everything in it: files ``0666``,
    directories ``0777``, less the umask (``mkdtemp`` makes ``0700``, ``mkstemp`` ``0600``).
    Symlinks are left alone (``chmod`` would change their destination)."""
    mask = umask()
    root = Path(root)
    for path in sorted(root.rglob("*"), reverse=True):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    root.chmod(0o777 & ~mask)


def move_files_into(staging: str | os.PathLike, target: str | os.PathLike) -> list[str]:
    """Rename every file of ``staging`` (plain files only; made on this file system, e.g. a
    ``mkdtemp`` beside ``target``) into the existing directory ``target``, each ``fsync``-ed
    first: every file is the old one or the whole new one, and a symlink planted at a name is
    replaced, its destination never written. Returns the names moved."""
    staging, target = Path(staging), Path(target)
    entries = sorted(staging.iterdir())
    odd = [p.name for p in entries if p.is_symlink() or not p.is_file()]
    if odd:
        raise ValueError(f"move_files_into: {str(staging)!r} holds {odd[0]!r}, not a plain file")
    for path in entries:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(path, target / path.name)
    _fsync_dir(target)
    return [p.name for p in entries]


#: the lock file :func:`lock_folder` keeps in the folder it locks
LOCK_NAME = ".quads.lock"


class FolderInUse(OSError):
    """Another process holds :func:`lock_folder` on the folder."""


def lock_folder(folder: str | os.PathLike, what: str = "folder") -> int:
    """Hold an exclusive lock on ``folder`` (an existing directory) until the returned descriptor
    is closed or the process ends: two runs writing one output folder would interleave their files.
    A second holder gets :class:`FolderInUse` naming the folder and the first holder's pid."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if path.is_symlink():
            raise OSError(err.errno, f"{what}: {str(path)!r} is a symbolic link; refusing to write through it") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise FolderInUse(f"{what} {str(folder)!r} is in use by another running process (pid {holder}); "
                          "wait for it to end or choose another folder") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
