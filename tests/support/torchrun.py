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


def run_ranks(
    script: str, *args, out: Path, nproc: int = 2, env: dict | None = None, timeout: float = 600
) -> list[dict]:
    """Starts ``nproc`` ranks of ``tests/support/<script>`` (``script PACKAGE OUT_DIR ...`` style: ``out`` is passed
    after the first argument) and returns the ranks' JSON results in rank order; fails on a non-zero exit,
    except a gloo abort in teardown after every rank wrote its results (see below)."""
    out.mkdir(parents=True, exist_ok=True)
    results = [out / f"rank{rank}.json" for rank in range(nproc)]
    for path in results:
        path.unlink(missing_ok=True)
    arguments = [str(a) for a in args]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(HERE, script),
        arguments[0],
        str(out),
        *arguments[1:],
    ]
    full_env = {
        **os.environ,
        **(env or {}),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout)
    # On a loaded 2-core CI machine a gloo rank once aborted ("terminate called without an active
    # exception", a C++ thread left running) after the work; a rank writes its results only after all
    # its checks, so with every result written such an abort is gloo's teardown, not the behaviour tested
    teardown_abort = "terminate called without an active exception" in result.stderr and all(
        path.exists() for path in results
    )
    assert result.returncode == 0 or teardown_abort, (
        f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return [json.loads(path.read_text()) for path in results]
