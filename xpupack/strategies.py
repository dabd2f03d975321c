"""Strategies: which backend a module gets, and why the others were refused (README: "Tuning"; "What it does").

Every candidate must build and reproduce eager's outputs on the recorded
samples within its tolerances before it can be chosen; each refusal is kept
as a report entry that `xpupack inspect` shows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _timing
from .backends.base import Backend, ModuleSpec, Runner, Target
from .errors import NoCandidateError
from .recorder import snapshot
from .signature import flatten

log = logging.getLogger("xpupack")


class Rejected(Exception):
    """A candidate backend was refused; the message is the reason."""


def check_candidate(backend: Backend, target: Target, spec: ModuleSpec,
                    references: list[list[Any]], device: torch.device) -> Runner:
    """Builds ``backend`` for ``target`` and checks it against eager; raises `Rejected` with the reason."""
    if not backend.available(device):
        raise Rejected(backend.why_unavailable(device))
    try:
        runner = backend.build(target, spec, device)
    except Exception as exc:
        raise Rejected(f"build failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    try:
        _check_outputs(backend, runner, spec, references)
    except Rejected:
        runner.undo()  # a refused candidate must not leave the module changed
        raise
    return runner


def _check_outputs(backend: Backend, runner: Runner, spec: ModuleSpec, references: list[list[Any]]) -> None:
    if not runner.supported:
        raise Rejected("no recorded signature could be built")
    with torch.no_grad():
        for index in sorted(runner.supported):
            numbers = list(range(len(spec.samples[index])))
            if spec.signatures[index].state_slots:
                # a call with state may run for real first and be recorded on the next one: run the
                # first sample again, so that a recording is always among what gets checked
                numbers.append(0)
            for number in numbers:
                # a candidate that changes its inputs must not change the samples
                args, kwargs = snapshot(spec.sample(index, number))
                leaves, _ = flatten(args, kwargs)
                try:
                    actual = spec.observe(index, args, kwargs, runner.run(index, args, kwargs, leaves))
                except Exception as exc:
                    raise Rejected(f"running {spec.signatures[index].describe()} failed: "
                                   f"{type(exc).__name__}: {_first_line(exc)}") from exc
                problem = backend.compare(actual, references[index][number])
                if problem:
                    raise Rejected(f"{spec.signatures[index].describe()}: {problem}")


def _attempt(backend: Backend, target: Target, spec: ModuleSpec, references: list[list[Any]],
             device: torch.device, report: list[dict]) -> Runner | None:
    """`check_candidate`, with a refusal recorded in ``report`` instead of raised."""
    try:
        return check_candidate(backend, target, spec, references, device)
    except Rejected as exc:
        report.append({"backend": backend.label, "status": "rejected", "reason": str(exc)})
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


class Strategy:
    """Base class: picks one backend per module from a list of candidates."""

    def __init__(self, backends: Sequence[Backend]):
        if not backends:
            raise ValueError(f"{type(self).__name__} needs at least one backend")
        self.backends = list(backends)

    def choose(self, target: Target, spec: ModuleSpec, references: list[list[Any]],
               device: torch.device) -> tuple[Backend, Runner, list[dict]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}([{', '.join(map(repr, self.backends))}])"


class FirstWins(Strategy):
    """The first backend, in order, that builds and matches eager wins.

    Example:
        >>> xpupack.FirstWins([xpupack.GraphBackend(), xpupack.InductorBackend(), xpupack.EagerBackend()])
    """

    def choose(self, target, spec, references, device):
        report: list[dict] = []
        for backend in self.backends:
            runner = _attempt(backend, target, spec, references, device, report)
            if runner is not None:
                report.append({"backend": backend.label, "status": "chosen", "reason": "first to pass"})
                return backend, runner, report
        raise NoCandidateError(_explain(target, report))


class Fastest(Strategy):
    """Builds every candidate that passes, times each (device-synchronized), keeps the fastest."""

    def __init__(self, backends: Sequence[Backend], *, iterations: int = 20):
        super().__init__(backends)
        self.iterations = iterations

    def choose(self, target, spec, references, device):
        report: list[dict] = []
        timed = []
        for backend in self.backends:
            runner = _attempt(backend, target, spec, references, device, report)
            if runner is not None:
                entry = {"backend": backend.label, "status": "accepted",
                         "median_us": round(self._time(runner, spec, device), 2)}
                runner.undo()  # the next candidate starts from the original module
                report.append(entry)
                timed.append((entry, backend, runner))
        if not timed:
            raise NoCandidateError(_explain(target, report))
        entry, backend, runner = min(timed, key=lambda item: item[0]["median_us"])
        runner.redo()
        entry["status"], entry["reason"] = "chosen", "fastest"
        return backend, runner, report

    def _time(self, runner: Runner, spec: ModuleSpec, device: torch.device) -> float:
        total = 0.0
        for index in sorted(runner.supported):
            timing = _timing.measure(_timed_call(runner, spec, index), device, iterations=self.iterations)
            total += timing.median_us
        return total


def _timed_call(runner: Runner, spec: ModuleSpec, index: int) -> Callable[[], Any]:
    """One call of signature ``index`` to time; a call with state starts from the recorded state each
    time (a decode step must not run past the end of its KV cache)."""
    if spec.signatures[index].state_slots:
        def call() -> Any:
            args, kwargs = spec.sample(index, 0)
            return runner.run(index, args, kwargs, flatten(args, kwargs)[0])
        return call
    args, kwargs = spec.example(index)
    leaves, _ = flatten(args, kwargs)
    return lambda: runner.run(index, args, kwargs, leaves)


class Only(Strategy):
    """Uses one backend and raises its error if it cannot tune a module."""

    def __init__(self, backend: Backend):
        super().__init__([backend])

    def choose(self, target, spec, references, device):
        backend = self.backends[0]
        try:
            runner = check_candidate(backend, target, spec, references, device)
        except Rejected as exc:
            raise NoCandidateError(f"{target.path or '<model>'}: {backend.label} backend rejected: {exc}") from exc
        return backend, runner, [{"backend": backend.label, "status": "chosen", "reason": "only candidate"}]


def _explain(target: Target, report: list[dict]) -> str:
    lines = [f"no backend could tune {target.path or '<model>'}:"]
    lines += [f"  {entry['backend']}: {entry.get('reason', '')}" for entry in report]
    lines.append("add EagerBackend() to the strategy to keep such modules untuned")
    return "\n".join(lines)


def default_backends(device: torch.device | None = None) -> list[Backend]:
    """The default candidates: on a GPU the Inductor-compiled module recorded as a device graph
    first (what ``torch.compile(mode="reduce-overhead")`` does, shipped), then the plain device graph,
    Inductor and eager; elsewhere graph, Inductor, eager (no device graphs on CPU)."""
    from .backends.eager import EagerBackend
    from .backends.graph import GraphBackend
    from .backends.inductor import InductorBackend

    backends: list[Backend] = [GraphBackend(), InductorBackend(), EagerBackend()]
    if device is not None and device.type in ("cuda", "xpu"):
        backends.insert(0, GraphBackend(base=InductorBackend()))
    return backends


def default_strategy(device: torch.device | None = None) -> Strategy:
    """``FirstWins(default_backends(device))``."""
    return FirstWins(default_backends(device))
