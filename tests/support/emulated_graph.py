"""A test-only stand-in for device graphs on CPU.

`capture` runs the function once into static outputs; `replay` runs it again
and copies the results into those same output tensors. The memory a capture
reports is the size of its static outputs: deterministic, so tests can set a
memory budget in bytes. The function reads
only the static input buffers, so the graph backend's static-buffer,
signature-dispatch, aliasing and invalidation logic runs exactly as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xpupack.signature import flatten


class EmulatedGraphs:
    device_type = "cpu"
    #: the capture runs the function (a real capture only records it), like the call it records
    capture_executes = True
    #: a replay runs the function again, so a sharded module's collectives really happen on every replay
    records_collectives = True

    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.fail_capture: Callable[[], bool] = lambda: False

    def available(self) -> bool:
        return True

    def shared_pool(self, device: torch.device) -> Any:
        return None

    def capture(
        self, fn: Callable[[], Any], *, device: torch.device, pool: Any, warmup: int = 2
    ) -> tuple[Callable[[], None], Any, int]:
        with torch.no_grad():
            for _ in range(warmup):
                fn()
            if self.fail_capture():
                raise RuntimeError("emulated capture failure")
            outputs = fn()
        self.captures += 1
        static_leaves, _ = flatten((outputs,), {})

        def replay() -> None:
            self.replays += 1
            with torch.no_grad():
                fresh, _ = flatten((fn(),), {})
            for static, value in zip(static_leaves, fresh):
                if isinstance(static, torch.Tensor):
                    # a real replay writes the outputs' memory whatever the caller's mode; outputs captured
                    # under inference mode are inference tensors, which copy_ writes only inside it
                    with torch.inference_mode(static.is_inference()):
                        static.copy_(value)

        memory = sum(leaf.untyped_storage().nbytes() for leaf in static_leaves if isinstance(leaf, torch.Tensor))
        return replay, outputs, memory


class TracedGraphs(EmulatedGraphs):
    """Device graphs on CPU that, like real ones, run a call's Python once: `capture` traces the function
    (``make_fx``) into its tensor operations, and `replay` runs that trace, so every Python value the
    call read (a counter, a branch taken) is baked in as a real recording bakes it. The tensors the
    function reads and updates in place (parameters, a KV cache) are the trace's by reference."""

    records_collectives = False

    def capture(
        self, fn: Callable[[], Any], *, device: torch.device, pool: Any, warmup: int = 2
    ) -> tuple[Callable[[], None], Any, int]:
        from torch.fx.experimental.proxy_tensor import make_fx

        with torch.no_grad():
            for _ in range(warmup):
                fn()
            if self.fail_capture():
                raise RuntimeError("emulated capture failure")
            traced_outputs: list = []
            trace = make_fx(lambda: _tensor_leaves(traced_outputs.append(fn()) or traced_outputs[-1]))()
        self.captures += 1
        outputs = traced_outputs[-1]
        static_leaves, _ = flatten((outputs,), {})

        def replay() -> None:
            self.replays += 1
            with torch.no_grad():
                fresh = trace()
            for static, value in zip(_tensor_leaves(outputs), fresh):
                static.copy_(value)

        memory = sum(leaf.untyped_storage().nbytes() for leaf in static_leaves if isinstance(leaf, torch.Tensor))
        return replay, outputs, memory


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in flatten((tree,), {})[0] if isinstance(leaf, torch.Tensor)]
