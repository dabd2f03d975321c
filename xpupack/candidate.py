"""`Candidate`: what tuning found about one backend it tried for a module (docs/tuning.md).

A strategy writes one per candidate it tried: chosen, accepted (it passed,
another won) or rejected, why, and how fast it ran the recorded calls. The
package stores them as the manifest's ``candidates`` (schemas/manifest.schema.json)
and ``xpupack inspect`` shows them. Torch-free: ``inspect`` reads them without
importing torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: what a strategy decided about a candidate
STATUSES = ("chosen", "accepted", "rejected")


@dataclass(frozen=True)
class Candidate:
    """One backend a strategy tried for one module, and its verdict.

    Args:
        backend: how reports name the backend, its settings included
            (``graph+inductor[coordinate_descent_tuning]``, ``torchao:int8-weight-only``).
        status: ``"chosen"``, ``"accepted"`` (it passed; another was chosen) or ``"rejected"``.
        reason: why it was chosen, lost or was refused.
        median_us: microseconds per recorded call (signatures weighted by how often they were called).
        speedup: eager's time over the candidate's, timed in rounds alongside eager (the median).
        speedup_interval: the confidence interval of ``speedup``.
        rounds: rounds that timed eager and the candidate in turn.
        noisy: the timings scattered widely.
        startup_ratio: a compiled candidate's speed over the lighter one it was weighed against
            (the start-up margin rule), timed side by side.
        startup_ratio_interval: the confidence interval of ``startup_ratio``.
        head_to_head: the two fastest of a `Fastest` search timed against each other, where that reversed
            their order by speedup over eager (``"a vs b: 0.67x (95% interval ...)"``).
        extra: entries of a stored candidate this xpupack does not know (a newer one wrote them),
            kept so that they are written back as they were.
    """

    backend: str
    status: str
    reason: str = ""
    median_us: float | None = None
    speedup: float | None = None
    speedup_interval: tuple[float, float] | None = None
    rounds: int | None = None
    noisy: bool | None = None
    startup_ratio: float | None = None
    startup_ratio_interval: tuple[float, float] | None = None
    head_to_head: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Candidate(status={self.status!r}): one of {', '.join(STATUSES)}")

    def to_json(self) -> dict[str, Any]:
        """The manifest's form: only the facts that are known, intervals as lists."""
        data: dict[str, Any] = {"backend": self.backend, "status": self.status}
        if self.reason:
            data["reason"] = self.reason
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                data[name] = list(value) if isinstance(value, tuple) else value
        return {**data, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Candidate:
        """A stored candidate (any xpupack's: a field it lacks stays None, one this xpupack does not know
        goes to ``extra``). The manifest's schema has checked the types of the known fields."""
        known = {name: data[name] for name in _FIELDS if name in data}
        for name in ("speedup_interval", "startup_ratio_interval"):
            if isinstance(known.get(name), list):
                known[name] = tuple(known[name])
        return cls(**known, extra={key: value for key, value in data.items() if key not in _FIELDS})

    def but(self, **changes: Any) -> Candidate:
        """This candidate with ``changes`` (a strategy revises its verdict: accepted, then chosen)."""
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line for `xpupack inspect`: ``graph+inductor: chosen — fastest (12.3 µs, 1.52x eager)``."""
        timing = []
        if self.median_us is not None:
            timing.append(f"{self.median_us:g} µs")
        if self.speedup is not None:
            interval = f", {self.speedup_interval[0]:g}-{self.speedup_interval[1]:g}x" if self.speedup_interval else ""
            timing.append(f"{self.speedup:g}x eager{interval}")
        return (
            f"{self.backend}: {self.status}"
            + (f" — {self.reason}" if self.reason else "")
            + (f" ({', '.join(timing)})" if timing else "")
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(Candidate) if f.name != "extra")
_OPTIONAL = tuple(name for name in _FIELDS if name not in ("backend", "status", "reason"))
