"""Atomic directory replacement for `save`."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


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

    An existing destination is swapped out in one atomic step where the OS
    allows it, so there is no moment without a complete package; elsewhere it
    is renamed aside first. The old directory is deleted only afterwards.
    """
    if not destination.exists():
        os.rename(new, destination)
        return
    if _exchange(new, destination):
        shutil.rmtree(new)  # ``new`` now holds the old package
        return
    aside = destination.with_name(f".{destination.name}.xpupack-old-{os.getpid()}")
    os.rename(destination, aside)
    os.rename(new, destination)
    shutil.rmtree(aside)


def temporary_sibling(destination: Path) -> Path:
    """A fresh hidden directory next to ``destination``; stale ones of dead savers are removed."""
    prefix = f".{destination.name}.xpupack-tmp-"
    for stale in destination.parent.glob(prefix + "*"):
        pid = stale.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    path = destination.parent / f"{prefix}{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(parents=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
