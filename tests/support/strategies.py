"""The strategies the tests tune with, defined once (test files import them from here)."""

from __future__ import annotations

import xpupack

#: eager only, through the default kind of strategy (its speed gate compares eager with eager and keeps it)
EAGER = xpupack.FirstWins([xpupack.EagerBackend()])
#: device graphs where they record, eager elsewhere, never timed: tiny models are noise to a speed gate, and the
#: emulated graph (support.emulated_graph) re-runs the module on every replay, slower than eager by construction
GRAPH = xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], min_speedup=None)
#: device graphs or the backend's own error: a test that must record, on a device that can
ONLY_GRAPH = xpupack.Only(xpupack.GraphBackend())
