"""The device layer's XPU path against ``torch.xpu`` as torch ships it (docs/hardware.md).

No Intel GPU is reachable, but torch's CPU build ships the Python side of the XPU graph API
(``XPUGraph``, ``graph``, ``graph_pool_handle``, streams, memory statistics). `StandInXPU` stands
in for ``torch.xpu``: it offers only names the real module has, checks every call against the real
function's signature, and fails on any name it does not stand in for, so a new call the device
layer makes on XPU must be checked against torch's XPU API here first.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any

import pytest
import torch

from xpupack import _device

REAL = torch.xpu
XPU = torch.device("xpu", 0)


def _checked(calls: list, name: str, real: Any, result: Any = None):
    """A stand-in for ``real`` that records its calls under ``name`` after binding them to ``real``'s signature."""
    signature = inspect.signature(real)

    def call(*args, **kwargs):
        signature.bind(*args, **kwargs)  # raises TypeError on a parameter torch.xpu does not have
        calls.append(name)
        return result(*args, **kwargs) if callable(result) else result

    return call


class _MemPool:
    def __init__(self, id):
        self.id = id


class _Context:
    def __init__(self, enter=lambda: None, leave=lambda: None):
        self._enter, self._leave = enter, leave

    def __enter__(self):
        self._enter()

    def __exit__(self, *exc):
        self._leave()


class StandInXPU:
    """``torch.xpu`` for the device layer on a machine without an XPU; see the module docstring."""

    def __init__(self, generator: Any = None):
        self.calls: list[str] = []
        self.reserved = 1 << 20
        self.capturing = False
        self.graphs: list = []
        calls, module = self.calls, self
        self.current = self._stream("default")

        class Graph:
            def __init__(self, *args, **kwargs):
                inspect.signature(REAL.XPUGraph.__new__).bind(REAL.XPUGraph, *args, **kwargs)
                calls.append("XPUGraph")
                self.instantiated = False
                module.graphs.append(self)

            capture_begin = _method(calls, "capture_begin")
            capture_end = _method(calls, "capture_end")
            instantiate = _method(calls, "instantiate")
            replay = _method(calls, "replay")
            reset = _method(calls, "reset")

        def graph(*args, **kwargs):
            inspect.signature(REAL.graph.__init__).bind(None, *args, **kwargs)
            calls.append("graph")
            bound = inspect.signature(REAL.graph.__init__).bind(None, *args, **kwargs).arguments

            def enter():  # what torch.xpu.graph.__enter__ does: synchronize, empty the cache, capture_begin
                module.previous, module.current = module.current, bound["stream"]
                module.capturing = True
                bound["xpu_graph"].capture_begin(bound.get("pool"))

            def leave():
                bound["xpu_graph"].capture_end()
                module.reserved += 4096  # what the capture took from the pool
                module.capturing = False
                module.current = module.previous

            return _Context(enter, leave)

        def memory_reserved(device=None):
            return self.reserved

        self._names = {
            "is_available": _checked(calls, "is_available", REAL.is_available, True),
            "XPUGraph": Graph,
            "graph": graph,
            "graph_pool_handle": _checked(calls, "graph_pool_handle", REAL.graph_pool_handle, ("pool", 1)),
            "MemPool": _checked(
                calls, "MemPool", REAL.MemPool, lambda *a, **k: _MemPool(("pool", calls.count("MemPool")))
            ),
            "Stream": lambda *a, **k: self._stream("side"),
            "current_stream": _checked(calls, "current_stream", REAL.current_stream, lambda *a: self.current),
            "set_stream": _checked(
                calls, "set_stream", REAL.set_stream, lambda stream: setattr(self, "current", stream)
            ),
            "stream": _checked(
                calls,
                "stream",
                REAL.stream,
                lambda stream: _Context(
                    lambda: setattr(self, "outer", self.current) or setattr(self, "current", stream),
                    lambda: setattr(self, "current", self.outer),
                ),
            ),
            "device": lambda device: (
                inspect.signature(REAL.device.__init__).bind(None, device),
                calls.append("device"),
                _Context(),
            )[-1],
            "memory_reserved": _checked(calls, "memory_reserved", REAL.memory_reserved, memory_reserved),
            "synchronize": _checked(calls, "synchronize", REAL.synchronize),
            "current_device": _checked(calls, "current_device", REAL.current_device, 0),
            "get_device_name": _checked(calls, "get_device_name", REAL.get_device_name, "Intel(R) Data Center GPU"),
            "default_generators": (generator,) if generator is not None else (),
        }

    def _stream(self, name: str) -> Any:
        calls = self.calls

        class Stream:
            wait_stream = _method(calls, "wait_stream", REAL.Stream.wait_stream)

            def __repr__(self):
                return name

        return Stream()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(REAL, name):
            raise AttributeError(name)  # as torch.xpu: no set_sync_debug_mode, for one
        if name not in self._names:
            raise AssertionError(
                f"the device layer calls torch.xpu.{name}, which this test does not stand in "
                "for: check it against torch's XPU API, then add it here"
            )
        return self._names[name]


def _method(calls: list, name: str, real: Any = None):
    signature = inspect.signature(real if real is not None else getattr(REAL.XPUGraph, name))

    def method(self, *args, **kwargs):
        signature.bind(self, *args, **kwargs)
        calls.append(name)

    return method


def _use(monkeypatch, stand_in: StandInXPU) -> StandInXPU:
    """The device layer reaches torch.xpu through `_device._device_module` only: that is where it is stood in for
    (torch's own modules keep the real one)."""
    module_of = _device._device_module
    monkeypatch.setattr(_device, "_device_module", lambda kind: stand_in if kind == "xpu" else module_of(kind))
    return stand_in


@pytest.fixture
def xpu(monkeypatch):
    return _use(monkeypatch, StandInXPU())


def test_the_xpu_graph_api_has_what_the_device_layer_calls():
    """torch.xpu as shipped: the names and parameters the device layer relies on, and the one CUDA name it lacks."""
    assert {"capture_begin", "capture_end", "instantiate", "replay", "reset", "pool"} <= set(dir(REAL.XPUGraph))
    assert list(inspect.signature(REAL.XPUGraph.capture_begin).parameters) == ["self", "pool"]
    assert list(inspect.signature(REAL.graph.__init__).parameters) == ["self", "xpu_graph", "pool", "stream"]
    assert inspect.signature(REAL.XPUGraph.__new__).parameters["keep_graph"].default is False  # instantiated
    for name in (
        "graph_pool_handle",
        "Stream",
        "stream",
        "set_stream",
        "current_stream",
        "memory_reserved",
        "synchronize",
        "device",
        "current_device",
        "get_device_name",
        "is_available",
        "MemPool",
    ):
        assert hasattr(REAL, name), name
    assert not hasattr(REAL, "set_sync_debug_mode")  # CUDA's check for host syncs: XPU has none
    assert "default_generators" in vars(REAL)


def test_a_capture_on_xpu_makes_only_calls_torch_xpu_takes(xpu):
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    assert graphs.available()
    pool = graphs.shared_pool(XPU)
    assert pool == ("pool", 1) and xpu.calls.count("MemPool") == 1  # a pool that outlives every graph in it
    assert graphs.shared_pool(XPU) == pool and xpu.calls.count("MemPool") == 1
    x = torch.randn(4, 8)
    replay, outputs, memory = graphs.capture(lambda: x * 2, device=XPU, pool=pool)
    torch.testing.assert_close(outputs, x * 2)
    assert memory == 4096
    [graph] = xpu.graphs
    assert replay.__self__ is graph and replay.__func__.__name__ == "method"  # the graph's own replay
    replay()
    # keep_graph=False: capture_end instantiates the graph, so replay needs no instantiate() first
    assert "instantiate" not in xpu.calls and xpu.calls.count("capture_begin") == xpu.calls.count("capture_end") == 1
    assert xpu.calls[-1] == "replay" and repr(xpu.current) == "default"


def test_the_device_functions_on_xpu(xpu):
    assert _device.resolve("xpu") == XPU
    assert _device.device_name(XPU) == "Intel(R) Data Center GPU"
    _device.synchronize(XPU)
    assert {"current_device", "get_device_name", "synchronize"} <= set(xpu.calls)


def test_a_host_sync_is_refused_before_an_xpu_capture_without_a_sync_debug_mode(xpu):
    """CUDA's sync debug mode makes ``.item()`` raise in the last warm-up; XPU has none, so a dispatch mode
    raises on the same operations, before any capture starts."""
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    x = torch.randn(4, 8)
    for unrecordable in (lambda: x * x.sum().item(), lambda: x[x > 0], lambda: x.nonzero()):
        with pytest.raises(_device.HostSyncError, match="device graph cannot record"):
            graphs.capture(unrecordable, device=XPU, pool=graphs.shared_pool(XPU))
    assert "capture_begin" not in xpu.calls
    graphs.capture(lambda: x * 2, device=XPU, pool=graphs.shared_pool(XPU))  # the probe is gone again
    assert x.sum().item() == pytest.approx(float(x.sum()))


class _Generator:
    """An XPU generator: with graph-safe state (torch's newer XPUGeneratorImpl) or without (older ones raise)."""

    def __init__(self, graph_safe: bool):
        self.graph_safe, self.restored = graph_safe, []

    def graphsafe_get_state(self):
        if not self.graph_safe:
            raise RuntimeError("graphsafe_get_state is not implemented for XPUGeneratorImpl")
        return self

    def clone_state(self):
        return "state"

    def graphsafe_set_state(self, state):
        self.restored.append(state)


@pytest.mark.parametrize("graph_safe", [True, False])
def test_a_failed_xpu_capture_puts_the_stream_and_generator_back(monkeypatch, graph_safe):
    generator = _Generator(graph_safe)
    xpu = _use(monkeypatch, StandInXPU(generator))
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    runs = []

    def fails_in_capture():
        runs.append(xpu.capturing)
        if xpu.capturing:
            raise RuntimeError("not capturable")
        return torch.ones(1)

    with pytest.raises(RuntimeError, match="not capturable"):
        graphs.capture(fails_in_capture, device=XPU, pool=graphs.shared_pool(XPU))
    assert runs == [False, False, True] and repr(xpu.current) == "default"
    assert generator.restored == (["state"] if graph_safe else [])


def _fails_while_captured(xpu, error: Exception | None = None):
    """A call that runs when warmed up and raises ``error`` inside a capture, as a host sync does."""

    def call():
        if xpu.capturing:
            raise error or RuntimeError("operation not permitted when stream is capturing")
        return torch.ones(2)

    return call


def test_a_capture_that_fails_leaves_later_captures_a_new_shared_pool(xpu):
    """torch ends a capture's allocation to its pool only when the capture ends well: on the H200 one
    failed capture made every later capture into the shared pool fail ("already recording to mempool_id")."""
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    pool = graphs.shared_pool(XPU)

    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.capture(_fails_while_captured(xpu), device=XPU, pool=pool)
    fresh = graphs.shared_pool(XPU)
    assert fresh != pool and xpu.calls.count("MemPool") == 2
    replay, outputs, _ = graphs.capture(lambda: torch.ones(2) * 3, device=XPU, pool=fresh)
    torch.testing.assert_close(outputs, torch.full((2,), 3.0))
    assert graphs.shared_pool(XPU) == fresh  # a capture that ends well keeps its pool


def test_a_capture_that_fails_ends_its_allocation_to_the_pool(xpu, monkeypatch):
    """Regression (H200): torch leaves a failed capture's allocation to its pool open, and the allocator then
    aborts the process at its next release of cached memory, at the latest as the process exits
    (``captures_underway.empty() INTERNAL ASSERT FAILED``, exit code 134). The device layer ends it."""
    ended = []
    end = _checked(ended, "end", torch._C._xpu_endAllocateToPool, lambda index, pool: ended.append((index, pool)))
    monkeypatch.setattr(torch._C, "_xpu_endAllocateToPool", end, raising=False)
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    pool = graphs.shared_pool(XPU)

    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.capture(_fails_while_captured(xpu), device=XPU, pool=pool)
    assert ended == ["end", (0, pool)]
    graphs.capture(lambda: torch.ones(2), device=XPU, pool=graphs.shared_pool(XPU))
    assert ended == ["end", (0, pool)]  # a capture that ends well: torch ends it itself


def test_a_capture_runs_with_the_garbage_collector_off(xpu):
    """Regression (H200): a graph that the collector frees during another capture resets itself there, which
    the device refuses and which spoils that capture ("operation not permitted when stream is capturing"):
    a module's recording failed and fell back after an earlier capture had failed."""
    seen = []

    def call():
        if xpu.capturing:
            seen.append(gc.isenabled())
        return torch.ones(2)

    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    assert gc.isenabled()
    graphs.capture(call, device=XPU, pool=graphs.shared_pool(XPU))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.capture(_fails_while_captured(xpu), device=XPU, pool=graphs.shared_pool(XPU))
    assert gc.isenabled()


def test_a_capture_leaves_a_disabled_garbage_collector_disabled(xpu):
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    gc.disable()
    try:
        graphs.capture(lambda: torch.ones(2), device=XPU, pool=graphs.shared_pool(XPU))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_capture_resets_its_graph_at_once(xpu):
    """Its graph would otherwise be freed whenever the exception's frames are collected: maybe during a
    later capture, which the reset in its destructor would spoil."""
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.capture(_fails_while_captured(xpu), device=XPU, pool=graphs.shared_pool(XPU))
    assert xpu.calls[xpu.calls.index("capture_begin") :].count("reset") == 1
    graphs.capture(lambda: torch.ones(2), device=XPU, pool=graphs.shared_pool(XPU))
    assert xpu.calls.count("reset") == 1  # a capture that ends well keeps its graph


def test_ending_a_failed_captures_allocation_tolerates_a_torch_that_ended_it(xpu, monkeypatch):
    """A torch that ends the allocation with the failed capture raises on a second end; the capture's own
    error is what the caller sees."""

    def not_under_way(index, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_xpu_endAllocateToPool", not_under_way, raising=False)
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")

    with pytest.raises(ValueError, match="own error"):
        failing = _fails_while_captured(xpu, ValueError("the capture's own error"))
        graphs.capture(failing, device=XPU, pool=graphs.shared_pool(XPU))


def test_a_warm_up_that_fails_before_the_capture_keeps_the_shared_pool(xpu):
    graphs = _device.DeviceGraphs("xpu", "XPUGraph")
    pool = graphs.shared_pool(XPU)
    with pytest.raises(ZeroDivisionError):
        graphs.capture(lambda: 1 / 0, device=XPU, pool=pool)
    assert graphs.shared_pool(XPU) == pool and xpu.calls.count("MemPool") == 1
