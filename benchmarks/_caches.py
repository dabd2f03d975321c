"""Empty compiler caches for a benchmark's fresh process: what a new server starts with."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def empty_compiler_caches(folder: Path | None = None) -> dict[str, str]:
    """The environment of a process whose Inductor and Triton caches start empty (in ``folder``, a new
    temporary folder by default): the caller's environment with ``TORCHINDUCTOR_CACHE_DIR`` and
    ``TRITON_CACHE_DIR`` pointing there. A warm local cache hides what a new server pays."""
    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="empty-caches-"))
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
    }
