"""Device-synchronized timing, shared by `Fastest` and `xpupack bench`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _device


@dataclass(frozen=True)
class Timing:
    median_us: float
    p90_us: float
    iterations: int

    def to_json(self) -> dict:
        return {"median_us": round(self.median_us, 2), "p90_us": round(self.p90_us, 2),
                "iterations": self.iterations}


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int = 3,
            iterations: int = 20, budget_s: float = 2.0) -> Timing:
    """Times ``fn`` per call, waiting for the device before each clock read.

    Stops early once ``budget_s`` is spent (at least 3 timed calls), so a slow
    module cannot stall tuning.
    """
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        _device.synchronize(device)
        samples: list[float] = []
        deadline = time.perf_counter() + budget_s
        while len(samples) < iterations:
            start = time.perf_counter()
            fn()
            _device.synchronize(device)
            end = time.perf_counter()
            samples.append((end - start) * 1e6)
            if end > deadline and len(samples) >= 3:
                break
    samples.sort()
    p90 = samples[min(len(samples) - 1, int(round(0.9 * (len(samples) - 1))))]
    return Timing(statistics.median(samples), p90, len(samples))
