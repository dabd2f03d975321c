"""Device-synchronized timing, shared by the speed gate (`strategies`) and ``xpupack bench`` (docs/tuning.md).

`compare` times a candidate against eager in interleaved rounds: each round
calls every recorded signature once on each side, the sides alternating and
taking turns to go first, so that a burst of load on a shared machine slows
both alike and lands in few rounds. The speedup is the median over rounds of
eager's time over the candidate's, with a distribution-free confidence
interval (order statistics of the per-round ratios). While that interval holds
the threshold a decision is taken against, more rounds are timed, a bounded
number; a comparison still holding it cannot tell.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch

from . import _device

#: coverage of the speedup's interval
CONFIDENCE = 0.95
#: fewest rounds a comparison times, however slow the calls: with 5, the interval is the range of the ratios
#: (coverage 94%)
MIN_ROUNDS = 5
#: an interval whose ends differ by more than this factor marks the timings as noisy
NOISY_SPREAD = 1.25


@dataclass(frozen=True)
class Timing:
    median_us: float
    p90_us: float
    iterations: int

    def to_json(self) -> dict:
        return {"median_us": round(self.median_us, 2), "p90_us": round(self.p90_us, 2), "iterations": self.iterations}


@dataclass(frozen=True)
class Comparison:
    """A candidate against eager, timed in interleaved rounds (`compare`).

    ``candidate`` and ``eager`` are per recorded call (signatures weighted by how
    often they were called), one value per round; ``speedup`` is the median over
    rounds of eager's time over the candidate's (above 1: the candidate is
    faster), ``low``-``high`` its `CONFIDENCE` interval.
    """

    candidate: Timing
    eager: Timing
    speedup: float
    low: float
    high: float
    rounds: int

    @property
    def noisy(self) -> bool:
        """Whether the timings scattered so much that the speedup is known only roughly."""
        return self.high > self.low * NOISY_SPREAD

    def verdict(self, threshold: float) -> Literal["faster", "slower", "unsure"]:
        """``"faster"`` when the whole interval is above ``threshold``, ``"slower"`` when none of it is,
        else ``"unsure"``: the timings cannot tell."""
        if self.low > threshold:
            return "faster"
        if self.high <= threshold:
            return "slower"
        return "unsure"

    def interval(self) -> str:
        """``"95% interval 0.91-1.13x over 80 rounds"``."""
        return f"{CONFIDENCE:.0%} interval {self.low:.3g}-{self.high:.3g}x over {self.rounds} rounds"

    def to_json(self) -> dict:
        return {
            "speedup": round(self.speedup, 3),
            "speedup_interval": [round(self.low, 3), round(self.high, 3)],
            "rounds": self.rounds,
            "noisy": self.noisy,
        }


def measure(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iterations: int = 20, budget_s: float = 2.0
) -> Timing:
    """Times ``fn`` per call, waiting for the device before each clock read.

    Stops early once ``budget_s`` is spent (at least 3 timed calls), so a slow
    module cannot stall tuning.
    """
    samples: list[float] = []
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        _device.synchronize(device)
        deadline = time.perf_counter() + budget_s
        while len(samples) < iterations:
            start = time.perf_counter()
            fn()
            _device.synchronize(device)
            end = time.perf_counter()
            samples.append((end - start) * 1e6)
            if end > deadline and len(samples) >= 3:
                break
    return _timing_of(samples)


def compare(
    candidate: Sequence[Callable[[], object] | None],
    eager: Sequence[Callable[[], object]],
    device: torch.device,
    *,
    weights: Sequence[float] | None = None,
    threshold: float | None = None,
    rounds: int = 20,
    max_rounds: int | None = None,
    warmup: int = 3,
    budget_s: float = 4.0,
    to_eager: Callable[[], object] | None = None,
    to_candidate: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Comparison:
    """Times ``candidate`` against ``eager`` in interleaved rounds, each call device-synchronized.

    Args:
        candidate: one call per signature; None for a signature the candidate
            cannot run (such calls fall back, so they cost eager's time of the
            same round).
        eager: one call per signature.
        weights: how often each signature was called; default: all alike.
        threshold: the speedup a decision will be taken against. While the
            interval holds it, ``rounds`` more rounds are timed, up to
            ``max_rounds`` (default ``4 * rounds``). None: ``rounds`` rounds.
        rounds: the rounds timed first.
        warmup: untimed rounds before them.
        budget_s: the first rounds stop once this is spent (after at least
            `MIN_ROUNDS`), the added ones once twice this is, so that a slow
            module cannot stall tuning.
        to_eager, to_candidate: called, untimed, whenever the turn passes to
            that side (e.g. a candidate that changed the module in place takes
            that back for eager's turn). The candidate's side is current when
            `compare` is called and when it returns.
        clock: seconds on a monotonic clock.
    """
    if len(candidate) != len(eager):
        raise ValueError(f"compare: {len(candidate)} candidate calls but {len(eager)} eager calls")
    weights = list(weights) if weights is not None else [1.0] * len(eager)
    max_rounds = max(rounds, max_rounds if max_rounds is not None else 4 * rounds)
    turns = _Turns(eager, candidate, to_eager, to_candidate, device, clock)
    per_round: list[tuple[list[float], list[float | None]]] = []
    try:
        with torch.no_grad():
            for number in range(warmup):
                turns.round(number, timed=False)
            start = clock()
            target, deadline = rounds, start + budget_s
            while True:
                while len(per_round) < target and not (len(per_round) >= MIN_ROUNDS and clock() > deadline):
                    per_round.append(turns.round(len(per_round), timed=True))
                result = _summarize(per_round, weights)
                if (
                    threshold is None
                    or result.verdict(threshold) != "unsure"
                    or len(per_round) >= max_rounds
                    or clock() > start + 2 * budget_s
                ):
                    return result
                target, deadline = min(max_rounds, len(per_round) + rounds), start + 2 * budget_s
    finally:
        turns.give_back()


class _Turns:
    """Runs rounds of `compare`: each side's calls in turn, switching sides through the caller's hooks."""

    def __init__(self, eager, candidate, to_eager, to_candidate, device, clock):
        self.calls = {"eager": list(eager), "candidate": list(candidate)}
        self.hooks = {"eager": to_eager, "candidate": to_candidate}
        self.device, self.clock = device, clock
        self.current = "candidate"

    def round(self, number: int, *, timed: bool) -> tuple[list[float], list[float | None]]:
        # which side goes first alternates, so that neither always runs on caches the other warmed
        order = ("eager", "candidate") if number % 2 == 0 else ("candidate", "eager")
        times = {side: self._turn(side, timed) for side in order}
        return cast("list[float]", times["eager"]), times["candidate"]  # eager runs every call: no None

    def _turn(self, side: str, timed: bool) -> list[float | None]:
        self._switch(side)
        times: list[float | None] = []
        for call in self.calls[side]:
            if call is None:
                times.append(None)
                continue
            start = self.clock()
            call()
            _device.synchronize(self.device)
            times.append((self.clock() - start) * 1e6 if timed else None)
        return times

    def _switch(self, side: str) -> None:
        if self.current != side:
            if self.hooks[side] is not None:
                self.hooks[side]()
            self.current = side

    def give_back(self) -> None:
        self._switch("candidate")


def _summarize(per_round: list[tuple[list[float], list[float | None]]], weights: list[float]) -> Comparison:
    total = max(sum(weights), 1e-12)
    eager_us, candidate_us, ratios = [], [], []
    for eager, candidate in per_round:
        eager_call = sum(w * t for w, t in zip(weights, eager)) / total
        # a signature the candidate cannot run falls back: it costs eager's time of this round
        candidate_call = sum(w * (c if c is not None else e) for w, c, e in zip(weights, candidate, eager)) / total
        eager_us.append(eager_call)
        candidate_us.append(candidate_call)
        ratios.append(eager_call / max(candidate_call, 1e-3))
    low, high = _median_interval(ratios)
    return Comparison(_timing_of(candidate_us), _timing_of(eager_us), statistics.median(ratios), low, high, len(ratios))


def _median_interval(values: list[float]) -> tuple[float, float]:
    """A `CONFIDENCE` interval of the median of ``values`` from their order statistics: the ``k``-th
    smallest and largest, ``k`` the largest for which fewer than ``k`` values fall below the true median
    with probability at most (1 - CONFIDENCE) / 2. Assumes nothing about how the values are spread."""
    ordered, n = sorted(values), len(values)
    tail = (1 - CONFIDENCE) / 2
    k, below = 1, 0.0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2 + 1:
        below += math.comb(n, k - 1) / 2**n
        if below + math.comb(n, k) / 2**n > tail:
            break
        k += 1
    return ordered[k - 1], ordered[n - k]


def _timing_of(samples: list[float]) -> Timing:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return Timing(statistics.median(ordered), p90, len(ordered))
