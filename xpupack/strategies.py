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
    """A candidate backend was refused; the message is the reason, ``facts`` go into its report entry."""

    def __init__(self, reason: str, **facts: Any):
        super().__init__(reason)
        self.facts = facts


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
    for index in sorted(runner.supported):
        numbers = list(range(len(spec.samples[index])))
        if spec.signatures[index].state_slots:
            # a call with state may run for real first and be recorded on the next one: run the
            # first sample again, so that a recording is always among what gets checked
            numbers.append(0)
        for number in numbers:
            with spec.mode(index):
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


class _SpeedGate:
    """Times eager and a candidate on the recorded signatures of one module (README: "Tuning").

    Each signature's median (device-synchronized) is weighted by how often the
    samples called it; a signature the candidate cannot run costs what eager
    costs, since such calls fall back. Eager is timed once before any
    candidate is built (TorchAO changes the module in place), and again in
    alternating calls with each candidate that leaves the module as it is
    (`paired_times`): a burst of load on a shared machine during one of two
    separate timings once made Inductor look 8x faster than eager on a CPU.
    """

    def __init__(self, target: Target, spec: ModuleSpec, device: torch.device, iterations: int):
        self.target, self.spec, self.device, self.iterations = target, spec, device, iterations
        self._eager: dict[int, float] | None = None
        self._eager_runner: Runner | None = None

    def times(self, runner: Runner) -> dict[int, float]:
        """Median microseconds per call of each signature ``runner`` supports."""
        return {index: _timing.measure(_timed_call(runner, self.spec, index), self.device,
                                       iterations=self.iterations).median_us
                for index in sorted(runner.supported)}

    def paired_times(self, runner: Runner) -> tuple[dict[int, float], dict[int, float]]:
        """The candidate's and eager's median microseconds per call of each signature ``runner`` supports,
        timed in alternating calls. Only for a candidate that leaves the module as it was."""
        eager = self._eager_runner or self._build_eager()
        candidate_times, eager_times = {}, {}
        for index in sorted(runner.supported):
            candidate_times[index], eager_times[index] = (
                timing.median_us for timing in _timing.measure_pair(
                    _timed_call(runner, self.spec, index), _timed_call(eager, self.spec, index), self.device,
                    iterations=self.iterations))
        return candidate_times, eager_times

    def _build_eager(self) -> Runner:
        from .backends.eager import EagerBackend

        self._eager_runner = EagerBackend().build(self.target, self.spec, self.device)
        return self._eager_runner

    def per_call_us(self, times: dict[int, float], fill: dict[int, float] | None = None) -> float:
        """The mean time of one recorded call from per-signature ``times``; signatures missing there
        take their time from ``fill`` (eager's, for calls that would fall back) or are left out."""
        weights, fill = self.spec.signature_weights(), fill or {}
        pairs = [(weights[i], times[i] if i in times else fill[i])
                 for i in range(len(weights)) if i in times or i in fill]
        return sum(w * t for w, t in pairs) / max(1, sum(w for w, _ in pairs))

    def eager_times(self) -> dict[int, float]:
        if self._eager is None:
            self._eager = self.times(self._build_eager())
        return self._eager

    def compare(self, times: dict[int, float], paired_eager: dict[int, float] | None = None
                ) -> tuple[float, float, float]:
        """``(speedup, candidate µs, eager µs)`` per recorded call; a speedup above 1 is faster than eager.
        ``paired_eager``: eager's times from `paired_times`, used where given."""
        eager_times = {**self.eager_times(), **(paired_eager or {})}
        eager = self.per_call_us(eager_times)
        candidate = self.per_call_us(times, fill=eager_times)
        return eager / max(candidate, 1e-3), candidate, eager


def is_reference(backend: Backend) -> bool:
    """Eager is what every candidate is compared with: never gated, never timed against itself."""
    return backend.name == "eager"


def _attempt(strategy: "Strategy", backend: Backend, target: Target, spec: ModuleSpec,
             references: list[list[Any]], device: torch.device, report: list[dict],
             gate: _SpeedGate) -> tuple[Runner, dict] | None:
    """`check_candidate`, then the speed gate; returns the runner and the facts for its report entry
    (``median_us``, ``speedup``), or records the refusal in ``report`` and returns None."""
    gated = strategy.min_speedup is not None and not is_reference(backend)
    try:
        if gated and backend.available(device):
            gate.eager_times()  # before the candidate changes the module
        runner = check_candidate(backend, target, spec, references, device)
    except Rejected as exc:
        report.append({"backend": backend.label, "status": "rejected", "reason": str(exc), **exc.facts})
        return None
    facts: dict = {}
    paired_eager = None
    if gated or strategy.times_candidates:
        if gated and not _transforms_module(backend):
            times, paired_eager = gate.paired_times(runner)
        else:
            times = gate.times(runner)
        facts["median_us"] = round(gate.per_call_us(times), 2)
    if gated:
        speedup, candidate_us, eager_us = gate.compare(times, paired_eager)
        facts["speedup"] = round(speedup, 3)
        if not speedup > strategy.min_speedup:
            runner.undo()
            report.append({"backend": backend.label, "status": "rejected", **facts,
                           "reason": f"not faster than eager: {facts['speedup']}x eager's speed ({candidate_us:.1f} vs "
                                     f"{eager_us:.1f} µs per recorded call); min_speedup={strategy.min_speedup}"})
            return None
    return runner, facts


def _transforms_module(backend: Backend) -> bool:
    """Whether ``backend`` or a base under it changes the module in place (after which the module's own
    forward is no longer eager's)."""
    while backend is not None:
        if backend.transforms_module:
            return True
        backend = getattr(backend, "base", None)
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


class Strategy:
    """Base class: picks one backend per module from a list of candidates.

    Args:
        backends: the candidates, in order.
        min_speedup: a candidate other than eager is rejected unless it runs the
            recorded calls more than ``min_speedup`` times as fast as eager
            (device-synchronized medians per signature, weighted by how often
            the samples made each call). ``None`` switches the gate off.
        iterations: timed calls per signature.
    """

    #: whether every passing candidate is timed even with the speed gate off
    times_candidates = False

    def __init__(self, backends: Sequence[Backend], *, min_speedup: float | None = 1.0, iterations: int = 20):
        if not backends:
            raise ValueError(f"{type(self).__name__} needs at least one backend")
        if min_speedup is not None and (isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float))
                                        or not min_speedup > 0):
            raise ValueError(f"{type(self).__name__}(min_speedup={min_speedup!r}): give a positive number, "
                             "or None to keep candidates slower than eager")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"{type(self).__name__}(iterations={iterations!r}): give a positive integer")
        self.backends = list(backends)
        self.min_speedup = min_speedup
        self.iterations = iterations

    def choose(self, target: Target, spec: ModuleSpec, references: list[list[Any]],
               device: torch.device) -> tuple[Backend, Runner, list[dict]]:
        raise NotImplementedError

    def _options(self) -> dict:
        """Options that differ from their defaults, as `__repr__` shows them."""
        options: dict = {}
        if self.min_speedup != 1.0:
            options["min_speedup"] = self.min_speedup
        if self.iterations != 20:
            options["iterations"] = self.iterations
        return options

    def __repr__(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self._options().items())
        return f"{type(self).__name__}([{', '.join(map(repr, self.backends))}]{options})"


class FirstWins(Strategy):
    """The first backend, in order, that builds, matches eager and is faster than eager wins.

    Example:
        >>> xpupack.FirstWins([xpupack.GraphBackend(), xpupack.InductorBackend(), xpupack.EagerBackend()])
        >>> xpupack.FirstWins([xpupack.InductorBackend(), xpupack.EagerBackend()], min_speedup=1.2)
    """

    def choose(self, target, spec, references, device):
        report: list[dict] = []
        gate = _SpeedGate(target, spec, device, self.iterations)
        for backend in self.backends:
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is not None:
                runner, facts = attempt
                report.append({"backend": backend.label, "status": "chosen", "reason": "first to pass", **facts})
                return backend, runner, report
        raise NoCandidateError(_explain(target, report))


class Fastest(Strategy):
    """Builds every candidate that passes, times each (device-synchronized), keeps the fastest."""

    times_candidates = True

    def choose(self, target, spec, references, device):
        report: list[dict] = []
        timed = []
        gate = _SpeedGate(target, spec, device, self.iterations)
        for backend in self.backends:
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is not None:
                runner, facts = attempt
                entry = {"backend": backend.label, "status": "accepted", **facts}
                runner.undo()  # the next candidate starts from the original module
                report.append(entry)
                timed.append((entry, backend, runner))
        if not timed:
            raise NoCandidateError(_explain(target, report))
        entry, backend, runner = min(timed, key=lambda item: item[0]["median_us"])
        runner.redo()
        entry["status"], entry["reason"] = "chosen", "fastest"
        return backend, runner, report


def _timed_call(runner: Runner, spec: ModuleSpec, index: int) -> Callable[[], Any]:
    """One call of signature ``index`` to time; a call with state starts from the recorded state each
    time (a decode step must not run past the end of its KV cache). Other calls run on a copy of the
    sample, which a module that changes its inputs may change at will."""
    if spec.signatures[index].state_slots:
        mode = spec.mode  # inference mode where the state was made there: a call writes it

        def call() -> Any:
            with mode(index):
                args, kwargs = spec.sample(index, 0)
                return runner.run(index, args, kwargs, flatten(args, kwargs)[0])
        return call
    args, kwargs = snapshot(spec.example(index))
    leaves, _ = flatten(args, kwargs)
    return lambda: runner.run(index, args, kwargs, leaves)


class Only(Strategy):
    """Uses one backend and raises its error if it cannot tune a module; never timed against eager."""

    def __init__(self, backend: Backend):
        super().__init__([backend], min_speedup=None)

    def _options(self) -> dict:
        return {}

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
