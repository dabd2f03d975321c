"""Empty compiler caches for a benchmark's fresh process (what a new server starts with), and what the compile
stack did in a process."""

from __future__ import annotations

import os
import sys
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


def compiler_counters() -> dict:
    """Dynamo compiles and the benchmarks Inductor ran in this process (0 when the compile stack never loaded)."""
    if "torch._dynamo.utils" not in sys.modules:
        return {"dynamo_unique_graphs": 0, "autotune_benchmarks": 0, "coordinate_descent_benchmarks": 0}
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {
        "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        "fxgraph_cache_hit": inductor["fxgraph_cache_hit"],
        "fxgraph_cache_miss": inductor["fxgraph_cache_miss"],
        "autotune_benchmarks": sum(v for k, v in inductor.items() if "autotune" in k and "bench" in k),
        "coordinate_descent_benchmarks": sum(v for k, v in inductor.items() if k.startswith("coordesc")),
    }


def watch_coordinate_descent() -> list[str]:
    """From now on, the name of each Triton kernel that coordinate descent tunes in this process, in order (a
    load that runs it repeats a tuning its package should have carried). Reads the tuner's debug log, kept
    out of the process's own log output."""
    import logging

    names: list[str] = []

    class Names(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == "= Do coordinate descent tuning for %s =" and record.args:
                names.append(str(record.args[0]))

    tuner = logging.getLogger("torch._inductor.runtime.coordinate_descent_tuner")
    tuner.addHandler(Names())
    tuner.setLevel(logging.DEBUG)
    tuner.propagate = False
    return names


def compile_seconds() -> dict[str, float]:
    """Seconds the compile stack spent so far in this process, by its own timers (Dynamo's
    ``compilation_time_metrics``), summed per timer; empty when the compile stack never loaded. The
    difference of two readings says where a stretch of time went: tracing (``bytecode_tracing``), the
    backend (``OutputGraph.call_user_compiler``), Inductor's code generation or cache loads."""
    if "torch._dynamo.utils" not in sys.modules:
        return {}
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def compile_seconds_since(before: dict[str, float], at_least: float = 0.05) -> dict[str, float]:
    """`compile_seconds` now less ``before``: the timers that grew by ``at_least`` seconds, longest first."""
    grown = {name: seconds - before.get(name, 0.0) for name, seconds in compile_seconds().items()}
    return {
        name: round(seconds, 3)
        for name, seconds in sorted(grown.items(), key=lambda item: -item[1])
        if seconds >= at_least
    }
