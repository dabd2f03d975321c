"""The device layer: everything that differs between XPU, CUDA and CPU.

Kept tiny on purpose: the graph backend, the timing code and the loader call
these few functions and share everything else across device types.
"""

from __future__ import annotations

import contextlib
import functools
import gc
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


def model_device(model: torch.nn.Module, default: torch.device | None = None) -> torch.device:
    """The device of the model's first parameter or buffer that holds data (its local shard's, for a DTensor):
    an empty model's parameters (``accelerate.init_empty_weights``, on the meta device) say nothing of where
    its weights go; ``default`` (CPU if None) for a model without such tensors."""
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return default if default is not None else torch.device("cpu")


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

    #: a capture only records the work; the recorded call runs on the first replay
    capture_executes = False
    #: whether a tensor-parallel module's collectives can be recorded. Not by default: on two H200s
    #: (torch 2.11, NCCL) capturing a DTensor block's all-reduce failed with "CUDA error: invalid
    #: argument", by hand as through xpupack, and left the ranks' communicator hung afterwards
    records_collectives = False

    def __init__(self, device_type: str, graph_class: str):
        self.device_type = device_type
        self._module = _device_module(device_type)
        self._graph_class = graph_class
        self._pools: dict[torch.device, Any] = {}
        #: pools a failed capture left unusable (`_retire_pool`), kept alive with the graphs recorded in them
        self._retired_pools: list[Any] = []
        self._streams: dict[torch.device, Any] = {}

    def available(self) -> bool:
        return (
            self._module.is_available() and hasattr(self._module, self._graph_class) and hasattr(self._module, "graph")
        )

    def _side_stream(self, device: torch.device) -> Any:
        """One warm-up and capture stream per device: libraries such as cuBLAS keep a
        workspace per stream, so a new stream per recording would hold a new workspace each."""
        if device not in self._streams:
            with on_device(device):
                self._streams[device] = self._module.Stream()
        return self._streams[device]

    def shared_pool(self, device: torch.device) -> Any:
        """The one memory pool all recordings on ``device`` share.

        A ``MemPool`` kept for the life of the process holds the pool: a bare ``graph_pool_handle`` is
        freed with the last graph recorded into it, and a capture into that handle afterwards (every
        recording dropped, then one made again: a decode step over compiled code after one over the
        original module) failed on the H200 with ``use_count > 0 INTERNAL ASSERT FAILED`` in the
        caching allocator."""
        if device not in self._pools:
            with on_device(device):
                self._pools[device] = (
                    self._module.MemPool() if hasattr(self._module, "MemPool") else self._module.graph_pool_handle()
                )
        return _pool_id(self._pools[device])

    def _retire_pool(self, device: torch.device, pool: Any) -> None:
        """After a failed capture into ``device``'s shared pool, later captures get a new pool: torch ends a
        capture's allocation to its pool only when the capture ends well, so every later capture into that
        pool would fail (on the H200: ``beginAllocateToPool: already recording to mempool_id`` for each
        signature after one capture that failed). The old pool is kept, as the graphs recorded in it are."""
        shared = self._pools.get(device)
        if shared is not None and _pool_id(shared) == pool:
            self._retired_pools.append(self._pools.pop(device))

    def _end_allocation_to_pool(self, index: int, pool: Any) -> None:
        """Ends a failed capture's allocation to ``pool``, which torch ends only for a capture that ends
        well. Left open, the allocator counts the capture as under way for good, and the next release of
        cached memory (``empty_cache``, or the pool's own release as the process exits) aborts the
        process: on the H200, ``captures_underway.empty() INTERNAL ASSERT FAILED`` and exit code 134
        after a run whose one failed capture had fallen back cleanly."""
        end = getattr(torch._C, f"_{self.device_type}_endAllocateToPool", None)
        if end is None:
            return
        with contextlib.suppress(RuntimeError):  # raised where this torch ended it with the capture
            end(index, pool)

    def capture(
        self, fn: Callable[[], Any], *, device: torch.device, pool: Any, warmup: int = 2
    ) -> tuple[Callable[[], None], Any, int]:
        """Warms ``fn`` up on a side stream, records it once, returns ``(replay, outputs, memory)``.

        ``memory`` is what the capture added to ``pool``: the growth of the device's reserved
        memory while capturing (every allocation of a capture comes from its pool; taken inside
        the capture block, after its entry has emptied the allocator's cache). A capture into a
        shared pool reuses blocks that earlier captures freed, so record larger calls first.

        Warm-up runs first because lazy initialisation (cuBLAS/oneDNN handles,
        autotuning) must not happen during capture. The last warm-up run raises
        on any host synchronisation (``.item()``, data-dependent shapes) where the
        device supports that check, so most unrecordable modules are refused
        before a capture starts. ``warmup=0`` captures at once (a call that
        updates state in place must run once only); a host synchronisation then
        fails the capture itself. A capture that fails leaves the device's
        random generator and current stream as they were before it.
        """
        module = self._module
        with module.device(device):
            stream = self._side_stream(device)
            stream.wait_stream(module.current_stream())
            with module.stream(stream), torch.no_grad():
                for run in range(warmup):
                    with _host_syncs_raise(module, enabled=run == warmup - 1):
                        fn()
            module.current_stream().wait_stream(stream)
            graph = getattr(module, self._graph_class)()
            generator_states = _generator_states(module, device)
            previous_stream = module.current_stream()
            try:
                with _collector_paused(), torch.no_grad(), module.graph(graph, pool=pool, stream=stream):
                    reserved = module.memory_reserved(device)
                    outputs = fn()
            except BaseException:
                _restore_after_failed_capture(module, previous_stream, generator_states)
                self._end_allocation_to_pool(module.current_device(), pool)
                self._retire_pool(device, pool)
                # now, not whenever the exception's frames are collected: a graph's destructor resets it,
                # and a reset during another capture spoils that capture
                with contextlib.suppress(RuntimeError):
                    graph.reset()
                raise
            memory = max(0, int(module.memory_reserved(device)) - int(reserved))
        return graph.replay, outputs, memory


@contextlib.contextmanager
def _collector_paused():
    """Python's garbage collector stays off inside the block: a graph it frees there (one of a dropped
    recording, held in a reference cycle) resets itself, which the device refuses during a capture and
    which spoils the capture ("operation not permitted when stream is capturing", seen on the H200)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _pool_id(pool: Any) -> Any:
    """What a capture takes as its pool: a ``MemPool``'s id, or a ``graph_pool_handle`` itself."""
    return pool.id if hasattr(pool, "id") else pool


@contextlib.contextmanager
def _host_syncs_raise(module: Any, *, enabled: bool):
    """Makes synchronising operations raise inside the block: CUDA's sync debug mode, or, on a device
    without one (XPU: ``torch.xpu`` has no ``set_sync_debug_mode``), a dispatch mode that raises on the
    same operations (`_host_sync_probe`)."""
    if not enabled:
        yield
        return
    if not hasattr(module, "set_sync_debug_mode"):
        with _host_sync_probe()():
            yield
        return
    previous = module.get_sync_debug_mode()
    module.set_sync_debug_mode("error")
    try:
        yield
    finally:
        module.set_sync_debug_mode(previous)


class HostSyncError(RuntimeError):
    """A warm-up run read a device value on the host, which a device graph cannot record."""


@functools.cache
def _host_sync_probe() -> type:
    """The dispatch mode `_host_syncs_raise` uses where a device has no sync debug mode (made once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    #: operations whose result the host must wait for: a value (``.item()``, ``bool(t)``) or a shape
    #: that depends on the data
    reads_device = {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
        aten.unique_dim.default,
    }
    copies = {aten._to_copy.default, aten.copy_.default}
    #: indexing with a boolean mask selects a data-dependent number of elements (a hidden ``nonzero``)
    masked = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}

    class Probe(TorchDispatchMode):
        """Raises `HostSyncError` on the operations CUDA's sync debug mode reports: those that read a
        device value on the host, and copies between host and device memory."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (
                func in reads_device
                or (func in copies and _crosses_host(args, kwargs))
                or (func in masked and _has_mask(args))
            ):
                raise HostSyncError(
                    f"{func} waits for the device on the host, which a device graph cannot "
                    "record (.item(), bool(tensor), data-dependent shapes, copies to or from "
                    "host memory)"
                )
            return func(*args, **kwargs)

    return Probe


def _has_mask(args: tuple) -> bool:
    """Whether an indexing operation's indices hold a boolean mask."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _crosses_host(args: tuple, kwargs: dict) -> bool:
    """Whether a copy moves data between host (CPU) and device memory."""
    devices = {x.device.type == "cpu" for x in args if isinstance(x, torch.Tensor)}
    if kwargs.get("device") is not None:
        devices.add(torch.device(kwargs["device"]).type == "cpu")
    return len(devices) > 1


def _generator_states(module: Any, device: torch.device) -> list:
    """Copies of the device's default random generator state, taken before a capture.

    Empty where the generator keeps no graph-safe state (an XPU generator of a torch whose
    ``XPUGeneratorImpl`` lacks ``graphsafe_get_state`` raises): nothing is then put back after a
    failed capture but the stream.
    """
    generators = getattr(module, "default_generators", ())
    index = device.index or 0
    if index >= len(generators) or not hasattr(generators[index], "graphsafe_get_state"):
        return []
    generator = generators[index]
    try:
        return [(generator, generator.graphsafe_get_state().clone_state())]
    except RuntimeError:
        return []


def _restore_after_failed_capture(module: Any, stream: Any, generator_states: list) -> None:
    """A capture that raised leaves its stream current and the generator in capture mode: undo both."""
    module.set_stream(stream)
    for generator, state in generator_states:
        generator.graphsafe_set_state(state)


#: device type -> graph API: the device types xpupack records graphs on. Tests add an emulated
#: one for "cpu" while they run (tests/support/emulated_graph.py).
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


#: tensors from this size on get host memory written by all of torch's threads before the copy (`host_copy`)
_PREFAULT_BYTES = 32 << 20


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, strides kept.

    The first write to each page of new memory costs the kernel a fault and a page to clear, and a copy
    from an accelerator makes those writes from one thread: an H100 host copied 4 GB of 1 GB tensors to
    new memory at 1.39 GB/s (11.5 s of an 8B model's 16 GB: most of its load's weights phase, the copy of
    the old values a rollback needs; a save makes the same copies), against 19.4 GB/s to zero new memory
    from all cores and 12.6 GB/s to copy into memory written once
    (docs/benchmarks.md, "Weights at disk speed"). Large tensors are therefore zeroed first (`Tensor.zero_`
    writes from torch's threads); glibc hands smaller ones memory it has used before.
    """
    copy = torch.empty_like(tensor, device="cpu")
    if copy.untyped_storage().nbytes() >= _PREFAULT_BYTES:
        copy.zero_()
    copy.copy_(tensor)
    return copy


def host_bytes_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous tensor in host memory: itself if it is one, else a `host_copy`."""
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    return host_copy(tensor.contiguous())
