"""Runs a script of tests/ as N ranks under torchrun (``python -m torch.distributed.run``) and collects what
each rank wrote to ``OUT_DIR/rank<RANK>.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))  # the rank scripts
TESTS = os.path.dirname(HERE)  # on the ranks' path, for ``support.*``


def run_ranks(script: str, *args, out: Path, nproc: int = 2, env: dict | None = None,
              timeout: float = 600) -> list[dict]:
    """Starts ``nproc`` ranks of ``tests/support/<script>`` (``script PACKAGE OUT_DIR ...`` style: ``out`` is passed
    after the first argument) and returns the ranks' JSON results in rank order; fails on a non-zero exit."""
    out.mkdir(parents=True, exist_ok=True)
    arguments = [str(a) for a in args]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(HERE, script), arguments[0], str(out), *arguments[1:]]
    full_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n" \
                                   f"{result.stderr[-8000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]
