"""Atomic directory replacement for `save`."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: ``.NAME.xpupack-tmp-PID-RANDOM`` (a save in progress) and ``.NAME.xpupack-old-PID`` (a package moved aside)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.xpupack-(?P<kind>tmp|old)-(?P<pid>\d+)(-[0-9a-f]+)?$")


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths in one step (Linux ``renameat2``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def replace_dir(new: Path, destination: Path) -> None:
    """Puts the complete directory ``new`` at ``destination``.

    ``new`` is flushed to disk first, so that a power cut after the swap
    cannot leave empty files behind. An existing destination is swapped out
    in one atomic step where the OS allows it (Linux ``renameat2``), so there
    is no moment without a complete package; elsewhere it is renamed aside
    first, and a save killed in between leaves it at ``.NAME.xpupack-old-PID``,
    where the next save (`temporary_sibling`) puts it back. The old directory
    is deleted only afterwards.
    """
    _sync_tree(new)
    if not destination.exists():
        os.rename(new, destination)
    elif _exchange(new, destination):
        shutil.rmtree(new)  # ``new`` now holds the old package
    else:
        aside = destination.with_name(f".{destination.name}.xpupack-old-{os.getpid()}")
        os.rename(destination, aside)
        os.rename(new, destination)
        shutil.rmtree(aside)
    _sync(destination.parent)


def temporary_sibling(destination: Path) -> Path:
    """A fresh hidden directory next to ``destination``.

    Leftovers of dead savers are cleared first: their temporary directories
    are removed, and a package one of them had moved aside is put back at
    ``destination`` if nothing took its place. Only directories are leftovers:
    a link or file of such a name is none of a saver's (it is left alone, never
    put in the package's place nor followed).
    """
    for stale, match in _leftovers(destination):
        if _alive(int(match["pid"])):
            continue
        if match["kind"] == "old" and not destination.exists() and not destination.is_symlink():
            os.rename(stale, destination)
        else:
            shutil.rmtree(stale, ignore_errors=True)
    path = destination.parent / f".{destination.name}.xpupack-tmp-{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(parents=True)
    return path


def moved_aside(destination: Path) -> list[Path]:
    """Packages that interrupted saves moved aside from ``destination`` (see `replace_dir`)."""
    return sorted(path for path, match in _leftovers(destination) if match["kind"] == "old")


def _leftovers(destination: Path) -> list[tuple[Path, re.Match[str]]]:
    """The temporary directories of saves to ``destination``, with their names parsed (`_TEMPORARY`); links
    and files named alike are none of them."""
    return [
        (path, match)
        for path in destination.parent.glob(f".{destination.name}.xpupack-*")
        if (match := _TEMPORARY.match(path.name))
        and match["name"] == destination.name
        and path.is_dir()
        and not path.is_symlink()
    ]


def _sync_tree(root: Path) -> None:
    for folder, _dirs, files in os.walk(root):
        for name in files:
            _sync(Path(folder) / name)
        _sync(Path(folder))


def _sync(path: Path) -> None:
    """``fsync`` of a file or directory; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) * path.is_dir())
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def interrupted_save_of(path: Path) -> Path | None:
    """The package a save's temporary directory ``path`` belongs to; None for any other path."""
    match = _TEMPORARY.match(path.name)
    return path.with_name(match["name"]) if match else None
