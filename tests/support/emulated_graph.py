"""A test-only stand-in for device graphs on CPU.

`capture` runs the function once into static outputs; `replay` runs it again
and copies the results into those same output tensors. The memory a capture
reports is the size of its static outputs: deterministic, so tests can set a
memory budget in bytes. The function reads
only the static input buffers, so the graph backend's static-buffer,
signature-dispatch, aliasing and invalidation logic runs exactly as on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable

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

    def capture(self, fn: Callable[[], Any], *, device: torch.device, pool: Any,
                warmup: int = 2) -> tuple[Callable[[], None], Any, int]:
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
