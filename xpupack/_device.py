"""The device layer: everything that differs between XPU, CUDA and CPU.

Kept tiny on purpose: the graph backend, the timing code and the loader call
these few functions and share everything else across device types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


def resolve(device: str | torch.device | None, *, default: torch.device | None = None) -> torch.device:
    """A concrete device: ``"cuda"`` becomes ``cuda:<current index>``; None gives ``default`` or the best here."""
    if device is None:
        if default is not None:
            return default
        device = best_available()
    device = torch.device(device)
    if device.type in ("cuda", "xpu") and device.index is None:
        device = torch.device(device.type, _device_module(device.type).current_device())
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model without tensors)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def best_available() -> torch.device:
    """XPU, then CUDA, then CPU."""
    for device_type in ("xpu", "cuda"):
        module = getattr(torch, device_type, None)
        if module is not None and module.is_available():
            return torch.device(device_type)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Waits for all work queued on ``device`` (a no-op on CPU)."""
    if device.type in ("cuda", "xpu"):
        _device_module(device.type).synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type in ("cuda", "xpu"):
        return _device_module(device.type).get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def _device_module(device_type: str) -> Any:
    return getattr(torch, device_type)


class DeviceGraphs:
    """Record/replay of device graphs through ``torch.cuda`` or ``torch.xpu``.

    Both modules expose the same API (``CUDAGraph``/``XPUGraph``, ``graph``,
    ``graph_pool_handle``, ``Stream``), so one class serves both.
    """

    def __init__(self, device_type: str, graph_class: str):
        self.device_type = device_type
        self._module = _device_module(device_type)
        self._graph_class = graph_class
        self._pools: dict[torch.device, Any] = {}

    def available(self) -> bool:
        return (self._module.is_available() and hasattr(self._module, self._graph_class)
                and hasattr(self._module, "graph"))

    def shared_pool(self, device: torch.device) -> Any:
        """The one memory pool all recordings on ``device`` share."""
        if device not in self._pools:
            with on_device(device):
                self._pools[device] = self._module.graph_pool_handle()
        return self._pools[device]

    def capture(self, fn: Callable[[], Any], *, device: torch.device, pool: Any,
                warmup: int = 2) -> tuple[Callable[[], None], Any]:
        """Warms ``fn`` up on a side stream, records it once, returns ``(replay, outputs)``.

        Warm-up runs first because lazy initialisation (cuBLAS/oneDNN handles,
        autotuning) must not happen during capture.
        """
        module = self._module
        with module.device(device):
            stream = module.Stream()
            stream.wait_stream(module.current_stream())
            with module.stream(stream), torch.no_grad():
                for _ in range(warmup):
                    fn()
            module.current_stream().wait_stream(stream)
            graph = getattr(module, self._graph_class)()
            with torch.no_grad(), module.graph(graph, pool=pool):
                outputs = fn()
        return graph.replay, outputs

    def memory_in_use(self, device: torch.device) -> int:
        return int(self._module.memory_allocated(device))


# device type -> graph API. Tests register an emulated one for "cpu".
GRAPH_APIS: dict[str, DeviceGraphs] = {
    "cuda": DeviceGraphs("cuda", "CUDAGraph"),
    "xpu": DeviceGraphs("xpu", "XPUGraph"),
}


def graphs_for(device: torch.device) -> DeviceGraphs | None:
    """The graph API for ``device``, or None where device graphs cannot run (CPU)."""
    api = GRAPH_APIS.get(device.type)
    return api if api is not None and api.available() else None


@contextlib.contextmanager
def on_device(device: torch.device):
    """Makes ``device`` current for the block (device index matters for graphs and streams)."""
    if device.type in ("cuda", "xpu"):
        with _device_module(device.type).device(device):
            yield
    else:
        yield
