"""A clock for timing tests: time passes only when a metered call spends it (`models.Metered`), so a
test chooses the timings (clean, a burst of load, scattered) and asserts the decisions taken on them,
never a speed."""

from __future__ import annotations

import math
import random
from collections.abc import Callable


class FakeClock:
    """Seconds, as ``time.perf_counter`` gives them; ``load(n)`` scales the cost of the ``n``-th call."""

    def __init__(self, load: Callable[[int], float] | None = None):
        self.now = 0.0
        self.load = load or (lambda n: 1.0)
        #: which side ("eager" or "candidate") made each call, in order
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def spend(self, side: str, us: float) -> None:
        self.log.append(side)
        self.now += us * self.load(len(self.log)) / 1e6


def burst(calls: int, factor: float) -> Callable[[int], float]:
    """The first ``calls`` calls run ``factor`` times slower: other work on the machine, then none."""
    return lambda n: factor if n <= calls else 1.0


def scattered(seed: int, spread: float) -> Callable[[int], float]:
    """Each call ``spread`` times slower or faster at most, at random (log-uniform): a busy shared machine."""
    rng = random.Random(seed)
    return lambda n: math.exp(rng.uniform(-math.log(spread), math.log(spread)))
