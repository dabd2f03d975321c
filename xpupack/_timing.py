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
    return _timings(_samples([fn], device, warmup, iterations, budget_s))[0]


def measure_pair(first: Callable[[], object], second: Callable[[], object], device: torch.device, *,
                 warmup: int = 3, iterations: int = 20, budget_s: float = 4.0) -> tuple[Timing, Timing]:
    """Times two functions in alternating calls (``first``, ``second``, ``first``...), so that a burst of
    load on a shared machine slows both alike and their ratio stays true; otherwise as `measure`."""
    first_timing, second_timing = _timings(_samples([first, second], device, warmup, iterations, budget_s))
    return first_timing, second_timing


def _samples(fns: list[Callable[[], object]], device: torch.device, warmup: int, iterations: int,
             budget_s: float) -> list[list[float]]:
    """Microseconds of each call of each of ``fns``, called in turn, device-synchronized."""
    samples: list[list[float]] = [[] for _ in fns]
    with torch.no_grad():
        for _ in range(warmup):
            for fn in fns:
                fn()
        _device.synchronize(device)
        deadline = time.perf_counter() + budget_s
        while len(samples[-1]) < iterations:
            for fn, own in zip(fns, samples):
                start = time.perf_counter()
                fn()
                _device.synchronize(device)
                end = time.perf_counter()
                own.append((end - start) * 1e6)
            if end > deadline and len(samples[-1]) >= 3:
                break
    return samples


def _timings(samples: list[list[float]]) -> list[Timing]:
    timings = []
    for own in samples:
        own.sort()
        p90 = own[min(len(own) - 1, int(round(0.9 * (len(own) - 1))))]
        timings.append(Timing(statistics.median(own), p90, len(own)))
    return timings
