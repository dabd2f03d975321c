"""Strategies: which backend a module gets, and why the others were refused (docs/tuning.md; README: "What it does").

Every candidate must build and reproduce eager's outputs on the recorded
samples within its tolerances before it can be chosen; each refusal is kept
as a report entry that `xpupack inspect` shows.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import _timing
from .backends.base import Backend, Runner, changes_module
from .candidate import Candidate
from .errors import NoCandidateError, error_line
from .module_spec import ModuleSpec, Target
from .recorder import snapshot
from .signature import flatten

log = logging.getLogger("xpupack")


#: where `check_candidate` and the speed gate say what they are doing for the module being tuned (`reporting`)
_progress: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "xpupack_strategy_progress", default=None
)


@contextlib.contextmanager
def reporting(progress: Callable[[str], None] | None) -> Iterator[None]:
    """Inside the block, each candidate's check and timing is announced to ``progress`` (`xpupack.tune`
    sets it around `Strategy.choose`, so that a strategy of one's own reports through `check_candidate`
    too: a module's search can take minutes)."""
    token = _progress.set(progress)
    try:
        yield
    finally:
        _progress.reset(token)


def _say(message: str) -> None:
    progress = _progress.get()
    if progress is not None:
        progress(message)


class Rejected(Exception):
    """A candidate backend was refused; the message is the reason.

    Raised by `check_candidate`; a strategy turns it into a ``"rejected"`` `Candidate` entry.
    """


def check_candidate(
    backend: Backend, target: Target, spec: ModuleSpec, references: list[list[Any]], device: torch.device
) -> Runner:
    """Builds ``backend`` for ``target`` and checks it against eager; raises `Rejected` with the reason.

    The building block of every `Strategy.choose`: the candidate must be available on ``device``, build,
    and reproduce ``references`` on every recorded sample of the signatures it supports, within
    `Backend.compare`. A refused candidate's changes to the module are taken back (`Runner.undo`).

    Args:
        backend: the candidate.
        target: the module being tuned.
        spec: its recorded signatures and samples.
        references: eager's outputs, ``references[i][k]`` for sample ``k`` of signature ``i``.
        device: the device tuned on.

    Returns:
        The candidate's runner, the module changed as the backend changes it (TorchAO).

    Raises:
        Rejected: unavailable here, the build failed, or an output differs from eager's.
    """
    if not backend.available(device):
        raise Rejected(backend.why_unavailable(device))
    if not is_reference(backend):  # eager is what the others are checked against
        _say(f"building {backend.label} and checking it against eager")
    try:
        runner = backend.build(target, spec, device)
    except Exception as exc:
        raise Rejected(f"build failed: {error_line(exc)}") from exc
    try:
        _check_outputs(backend, runner, spec, references)
    except Rejected:
        runner.undo()  # a refused candidate must not leave the module changed
        raise
    return runner


def _check_outputs(backend: Backend, runner: Runner, spec: ModuleSpec, references: list[list[Any]]) -> None:
    if not runner.supported:
        raise Rejected("no recorded signature could be built")
    samples = spec.samples
    for index in sorted(runner.supported):
        numbers = list(range(samples.count(index)))
        if spec.signatures[index].state_slots:
            # a call with state may run for real first and be recorded on the next one: run the
            # first sample again, so that a recording is always among what gets checked
            numbers.append(0)
        for number in numbers:
            with samples.mode(index):
                # a candidate that changes its inputs must not change the samples
                args, kwargs = snapshot(samples.sample(index, number))
                leaves, _ = flatten(args, kwargs)
                try:
                    actual = samples.observe(index, args, kwargs, runner.run(index, args, kwargs, leaves))
                except Exception as exc:
                    raise Rejected(f"running {spec.signatures[index].describe()} failed: {error_line(exc)}") from exc
            problem = backend.compare(actual, references[index][number])
            if problem:
                raise Rejected(f"{spec.signatures[index].describe()}: {problem}")


class _SpeedGate:
    """Times candidates against eager on the recorded signatures of one module (docs/tuning.md).

    Eager and the candidate take turns in rounds (`_timing.compare`), each
    signature weighted by how often the samples called it; a signature the
    candidate cannot run costs what eager costs, since such calls fall back. A
    candidate that changes the module in place (TorchAO) takes that back for
    eager's turns and reapplies it for its own, so it too is compared with eager
    timed alongside it, never with eager timed before it was built.
    """

    def __init__(self, target: Target, spec: ModuleSpec, device: torch.device, iterations: int):
        self.target, self.spec, self.device, self.iterations = target, spec, device, iterations
        self._eager: Runner | None = None

    def times(self, runner: Runner) -> float:
        """Microseconds per recorded call of ``runner`` timed alone (eager's own entry in `Fastest`)."""
        return self._per_call_us(
            {
                index: _timing.measure(
                    _timed_call(runner, self.spec, index), self.device, iterations=self.iterations
                ).median_us
                for index in sorted(runner.supported)
            }
        )

    def compare(self, backend: Backend, runner: Runner, threshold: float | None) -> _timing.Comparison:
        """``runner`` against eager; while the result cannot tell whether it beats ``threshold``, more
        rounds are timed (up to 4x ``iterations``)."""
        _say(f"timing {backend.label} against eager")
        eager = self._eager or self._build_eager()
        signatures = range(len(self.spec.signatures))
        transforms = changes_module(backend)
        return _timing.compare(
            [_timed_call(runner, self.spec, index) if index in runner.supported else None for index in signatures],
            [_timed_call(eager, self.spec, index) for index in signatures],
            self.device,
            weights=self.spec.signature_weights(),
            threshold=threshold,
            rounds=self.iterations,
            to_eager=runner.undo if transforms else None,
            to_candidate=runner.redo if transforms else None,
        )

    def between(
        self, heavy: Runner, light: Runner, threshold: float, *, heavy_changes_module: bool = False
    ) -> _timing.Comparison:
        """Two candidates timed in rounds as `compare` times one against eager: ``light`` takes eager's
        side, so the speedup is ``heavy``'s over ``light``'s. ``light`` must not change the module;
        ``heavy`` may (TorchAO under it: taken back for ``light``'s turns, as for eager's in `compare`).
        A signature only ``light`` runs costs ``light``'s time on both sides."""
        signatures = range(len(self.spec.signatures))
        light_calls = [
            _timed_call(light, self.spec, index) if index in light.supported else None for index in signatures
        ]
        eager = self._eager or self._build_eager()
        fallback = [call or _timed_call(eager, self.spec, index) for index, call in zip(signatures, light_calls)]
        return _timing.compare(
            [_timed_call(heavy, self.spec, index) if index in heavy.supported else None for index in signatures],
            fallback,
            self.device,
            weights=self.spec.signature_weights(),
            threshold=threshold,
            rounds=self.iterations,
            to_eager=heavy.undo if heavy_changes_module else None,
            to_candidate=heavy.redo if heavy_changes_module else None,
        )

    def _build_eager(self) -> Runner:
        from .backends.eager import EagerBackend

        self._eager = EagerBackend().build(self.target, self.spec, self.device)
        return self._eager

    def _per_call_us(self, times: dict[int, float]) -> float:
        weights = self.spec.signature_weights()
        return sum(weights[i] * t for i, t in times.items()) / max(1, sum(weights[i] for i in times))


def is_reference(backend: Backend) -> bool:
    """Whether ``backend`` is eager, what every candidate is compared with: never gated, never timed against itself.

    Args:
        backend: a candidate.

    Returns:
        True for the eager backend.
    """
    return backend.name == "eager"


def _attempt(
    strategy: Strategy,
    backend: Backend,
    target: Target,
    spec: ModuleSpec,
    references: list[list[Any]],
    device: torch.device,
    report: list[Candidate],
    gate: _SpeedGate,
) -> tuple[Runner, Candidate] | None:
    """`check_candidate`, then the speed gate; returns the runner and its ``"accepted"`` entry (with
    ``median_us`` and, against eager, ``speedup``, ``speedup_interval``, ``rounds``, ``noisy``), or
    records the refusal in ``report`` and returns None."""
    gated = strategy.min_speedup is not None and not is_reference(backend)
    try:
        runner = check_candidate(backend, target, spec, references, device)
    except Rejected as exc:
        report.append(Candidate(backend.label, "rejected", str(exc)))
        return None
    if not (gated or strategy.times_candidates):
        return runner, Candidate(backend.label, "accepted")
    if is_reference(backend):
        return runner, Candidate(backend.label, "accepted", median_us=round(gate.times(runner), 2))
    result = gate.compare(backend, runner, strategy.min_speedup)
    timed = Candidate(
        backend.label,
        "accepted",
        median_us=round(result.candidate.median_us, 2),
        speedup=round(result.speedup, 3),
        speedup_interval=(round(result.low, 3), round(result.high, 3)),
        rounds=result.rounds,
        noisy=result.noisy,
    )
    verdict = result.verdict(strategy.min_speedup) if gated else "faster"
    if verdict != "faster":
        runner.undo()
        report.append(timed.but(status="rejected", reason=_too_slow(result, verdict, strategy.min_speedup)))
        return None
    return runner, timed


def _too_slow(result: _timing.Comparison, verdict: str, min_speedup: float) -> str:
    """Why a candidate did not pass the speed gate: slower, or timings that could not tell (which count
    as slower: a tuned module must never be slower than eager)."""
    numbers = (
        f"{round(result.speedup, 3)}x eager's speed ({result.candidate.median_us:.1f} vs "
        f"{result.eager.median_us:.1f} µs per recorded call, {result.interval()}); the speed gate asks for more "
        f"than {min_speedup}x"
    )
    if verdict == "slower":
        return f"not faster than eager: {numbers}"
    if result.noisy:
        return (
            f"could not tell whether it is faster than eager, timings too noisy: {numbers}; kept out, since a "
            "tuned module must not be slower than eager — build again on a quieter machine"
        )
    return f"not clearly faster than eager: {numbers}"


def _noise_note(entry: Candidate) -> str:
    """Appended to a kept candidate's reason when its speedup stands on noisy timings."""
    if not entry.noisy or entry.speedup_interval is None:
        return ""
    low, high = entry.speedup_interval
    return f"; noisy timings: {_timing.CONFIDENCE:.0%} interval {low}-{high}x eager's speed over {entry.rounds} rounds"


class Strategy:
    """Base class: picks one backend per module from a list of candidates.

    A strategy of your own subclasses this and implements `choose` (docs/tuning.md).

    Args:
        backends: the candidates, in order.
        min_speedup: a candidate other than eager is rejected unless it runs the
            recorded calls more than ``min_speedup`` times as fast as eager:
            timed in rounds alongside eager (device-synchronized, each signature
            weighted by how often the samples made it), the whole confidence
            interval of the median speedup must lie above ``min_speedup``; one
            that timings cannot tell is rejected too, marked noisy where they
            scattered. ``None`` switches the gate off.
        iterations: timed rounds per comparison with eager; up to 4x as many while
            the timings cannot tell.
        startup_margin: compiled code must pay for its start-up (docs/cold-start.md). When the
            candidate a strategy would choose carries compiled artifacts (seconds of loading on a fresh
            server) and a candidate without them passes too (the plain device graph after graph over
            Inductor), the two are timed side by side and the compiled one is kept only when it runs
            the recorded calls at least ``startup_margin`` times as fast. None: no such weighing.

    Raises:
        ValueError: no backends, or ``min_speedup``/``iterations`` not a positive number.

    Examples:
        >>> class PreferGraph(xpupack.Strategy):
        ...     def choose(self, target, spec, references, device):
        ...         from xpupack.candidate import Candidate
        ...         from xpupack.strategies import Rejected, check_candidate
        ...         report = []
        ...         for backend in self.backends:
        ...             try:
        ...                 runner = check_candidate(backend, target, spec, references, device)
        ...             except Rejected as exc:
        ...                 report.append(Candidate(backend.label, "rejected", str(exc)))
        ...                 continue
        ...             report.append(Candidate(backend.label, "chosen", "first to pass"))
        ...             return backend, runner, report
        ...         raise xpupack.NoCandidateError(f"no backend could tune {target.path}")
        >>> xpupack.tune(model, samples, strategy=PreferGraph([xpupack.GraphBackend(), xpupack.EagerBackend()]))
    """

    #: whether every passing candidate is timed even with the speed gate off
    times_candidates = False

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        min_speedup: float | None = 1.0,
        iterations: int = 20,
        startup_margin: float | None = None,
    ):
        name = type(self).__name__
        if not backends:
            raise ValueError(f"{name} needs at least one backend")
        if min_speedup is not None and (
            isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup > 0
        ):
            raise ValueError(
                f"{name}(min_speedup={min_speedup!r}): give a positive number, "
                "or None to keep candidates slower than eager"
            )
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"{name}(iterations={iterations!r}): give a positive integer")
        if startup_margin is not None and (
            isinstance(startup_margin, bool) or not isinstance(startup_margin, (int, float)) or startup_margin < 1
        ):
            raise ValueError(
                f"{name}(startup_margin={startup_margin!r}): give a number >= 1 (e.g. 1.05), "
                "or None to leave compiled candidates unweighed against lighter ones"
            )
        self.backends = list(backends)
        self.min_speedup = min_speedup
        self.iterations = iterations
        self.startup_margin = startup_margin

    def choose(
        self, target: Target, spec: ModuleSpec, references: list[list[Any]], device: torch.device
    ) -> tuple[Backend, Runner, list[Candidate]]:
        """Picks the backend for one module: the extension point of a strategy.

        `xpupack.tune` calls it once per selected module that recorded at least one signature, after
        running the samples through the original module. Every candidate must pass `check_candidate`
        (it builds, and matches eager's outputs) before it can be chosen; the runners of candidates not
        chosen must be taken back (`Runner.undo`), so that the module is as it was for the next one.

        Args:
            target: the module (its object path, the module, its original forward).
            spec: the recorded signatures and, while tuning, their samples (``spec.samples``, a `Samples`).
            references: eager's outputs, ``references[i][k]`` for sample ``k`` of signature ``i``
                (for a call with state, the output and the state after it).
            device: the device the module is tuned on.

        Returns:
            ``(backend, runner, report)``: the chosen backend, its runner (built, checked, the module
            changed as the backend changes it), and one `Candidate` per candidate tried (its label,
            status ``"chosen"``, ``"rejected"`` or ``"accepted"``, the reason and any timings);
            ``xpupack inspect`` shows them.

        Raises:
            NoCandidateError: no candidate passed; the message lists each refusal.
        """
        raise NotImplementedError

    def check_unrecorded(self, target: Target, spec: ModuleSpec) -> None:
        """Called for a module the samples called but none of whose calls could be recorded (so no
        backend can take them and it stays eager); `Only` raises there.

        Args:
            target: the module.
            spec: what recording saw: ``spec.calls`` calls, ``spec.unrecordable`` why each kind could not be recorded.

        Raises:
            NoCandidateError: where the strategy must not keep such a module eager (`Only`).
        """

    def _options(self) -> dict:
        """Options that differ from their defaults, as `__repr__` shows them."""
        options: dict = {}
        if self.min_speedup != 1.0:
            options["min_speedup"] = self.min_speedup
        if self.iterations != 20:
            options["iterations"] = self.iterations
        if self.startup_margin is not None:
            options["startup_margin"] = self.startup_margin
        return options

    def __repr__(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self._options().items())
        return f"{type(self).__name__}([{', '.join(map(repr, self.backends))}]{options})"


#: a candidate as a strategy holds it while choosing: the backend, its runner, its entry
_Passed = tuple[Backend, Runner, Candidate]


def _is_lighter(backend: Backend) -> bool:
    """Whether ``backend`` can be what a compiled candidate is weighed against for its start-up: no
    compiled artifacts, not eager (the speed gate compares with that), and it leaves the module as it
    is (both run side by side)."""
    return not (backend.compiled_artifacts or is_reference(backend) or changes_module(backend))


def _weigh_startup(
    margin: float, compiled: _Passed, lighter: _Passed, gate: _SpeedGate, won: str
) -> tuple[_Passed, _Passed]:
    """``(chosen, dropped)``: the compiled candidate when it runs the recorded calls `margin` times as fast as
    the lighter one, both timed in alternating calls, else the lighter one; each entry says why, with both
    figures. ``won``: why the compiled one was the candidate to weigh (``"first to pass"``, ``"fastest"``).
    The compiled candidate's changes to the module must be applied when this is called."""
    (heavy, heavy_runner, heavy_entry), (light, light_runner, light_entry) = compiled, lighter
    result = gate.between(heavy_runner, light_runner, margin, heavy_changes_module=changes_module(heavy))
    ratio = result.speedup
    measured = {
        "startup_ratio": round(ratio, 3),
        "startup_ratio_interval": (round(result.low, 3), round(result.high, 3)),
    }
    figures = (
        f"{heavy.label} {result.candidate.median_us:.1f} vs {light.label} {result.eager.median_us:.1f} µs "
        f"per recorded call, {result.interval()}"
    )
    # the compiled code must be clearly worth its start-up: timings that cannot tell keep the lighter one
    if result.verdict(margin) == "faster":
        heavy_entry = heavy_entry.but(
            status="chosen", **measured, reason=f"{won}; {ratio:.3f}x {light.label}'s speed (start-up margin {margin}x)"
        )
        light_entry = light_entry.but(
            status="rejected",
            **measured,
            reason=f"{heavy.label} is {ratio:.3f}x as fast ({figures}), at least the "
            f"start-up margin {margin}x that its compiled code must earn",
        )
        return (heavy, heavy_runner, heavy_entry), (light, light_runner, light_entry)
    heavy_entry = heavy_entry.but(
        status="rejected",
        **measured,
        reason=f"{ratio:.3f}x as fast as {light.label} ({figures}), not clearly above the "
        f"start-up margin {margin}x: its compiled code costs seconds on a fresh server",
    )
    light_entry = light_entry.but(
        status="chosen", **measured, reason=f"as fast within the start-up margin {margin}x, with no compiled code"
    )
    return (light, light_runner, light_entry), (heavy, heavy_runner, heavy_entry)


class FirstWins(Strategy):
    """The first backend, in order, that builds, matches eager and is faster than eager wins.

    Args:
        startup_margin: compiled code must pay for its start-up (docs/cold-start.md). When the
            first candidate to pass carries compiled artifacts (seconds of loading on a fresh server)
            and a later candidate without them passes too (the plain device graph after graph over
            Inductor), the two are timed side by side and the compiled one is kept only when it runs
            the recorded calls at least ``startup_margin`` times as fast. None: the first to pass wins.
        backends: the candidates, in order.
        min_speedup: as for every `Strategy`.
        iterations: as for every `Strategy`.

    Raises:
        ValueError: an option is out of range.

    Examples:
        >>> xpupack.FirstWins([xpupack.GraphBackend(), xpupack.InductorBackend(), xpupack.EagerBackend()])
        >>> xpupack.FirstWins([xpupack.InductorBackend(), xpupack.EagerBackend()], min_speedup=1.2)
        >>> xpupack.FirstWins([xpupack.GraphBackend(base=xpupack.InductorBackend()), xpupack.GraphBackend(),
        ...                    xpupack.EagerBackend()], startup_margin=1.05)
    """

    def choose(self, target, spec, references, device):
        """The first candidate, in order, that builds, matches eager and passes the speed gate.

        With ``startup_margin``, a first winner with compiled artifacts is weighed against the next
        passing candidate without them (see the class). See `Strategy.choose`.

        Args:
            target (Target): the module.
            spec (ModuleSpec): its recorded signatures and samples.
            references (list[list[Any]]): eager's outputs per signature and sample.
            device (torch.device): the device tuned on.

        Returns:
            (tuple[Backend, Runner, list[Candidate]]): the chosen backend, its runner and the report.

        Raises:
            NoCandidateError: no candidate passed.
        """
        report: list[Candidate] = []
        gate = _SpeedGate(target, spec, device, self.iterations)
        for position, backend in enumerate(self.backends):
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is None:
                continue
            runner, entry = attempt
            entry = entry.but(status="chosen", reason="first to pass" + _noise_note(entry))
            if self.startup_margin is not None and backend.compiled_artifacts:
                lighter = self._lighter_candidate(
                    self.backends[position + 1 :], target, spec, references, device, report, gate
                )
                if lighter is not None:
                    chosen, (_, dropped_runner, dropped_entry) = _weigh_startup(
                        self.startup_margin, (backend, runner, entry), lighter, gate, "first to pass"
                    )
                    dropped_runner.release()
                    dropped_runner.undo()
                    # the compiled candidate's entry first, as it was tried first
                    report += sorted([chosen[2], dropped_entry], key=lambda e: e.backend != backend.label)
                    return chosen[0], chosen[1], report
            report.append(entry)
            return backend, runner, report
        raise _no_candidate(target, report)

    def _lighter_candidate(
        self, later: Sequence[Backend], target, spec, references, device, report, gate
    ) -> _Passed | None:
        """The first of ``later`` without compiled artifacts (eager aside) that passes, or None."""
        for backend in later:
            if not _is_lighter(backend) or not backend.available(device):
                continue
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is not None:
                return backend, *attempt
        return None


class Fastest(Strategy):
    """Builds every candidate that passes, times each against eager, keeps the fastest.

    Each candidate is timed in rounds alongside eager (device-synchronized), and
    the one with the highest speedup over eager wins (eager itself counts 1.0):
    ratios to eager timed at the same moments stay true under machine load,
    where candidates' own times, taken minutes apart, would not; the fastest is
    then timed head to head against the runner-up and against the quickest by its
    own time, as eager's own time drifts with the machine's load.
    Every candidate that passed and lost says so, with its speedup and the fastest one's.

    Args:
        backends: the candidates; order only breaks ties.
        startup_margin: when the fastest carries compiled artifacts, it is weighed against the fastest
            candidate without them that passed (`Strategy`); None: the fastest wins.
        min_speedup: as for every `Strategy`.
        iterations: as for every `Strategy`.

    Raises:
        ValueError: an option is out of range.

    Examples:
        >>> xpupack.Fastest([xpupack.GraphBackend(base=xpupack.InductorBackend()),
        ...                  xpupack.GraphBackend(base=xpupack.InductorBackend("max-autotune-no-cudagraphs")),
        ...                  xpupack.GraphBackend(), xpupack.EagerBackend()], startup_margin=1.05)
    """

    times_candidates = True

    def choose(self, target, spec, references, device):
        """Every candidate that passes is timed against eager; the highest speedup wins.

        See `Strategy.choose`.

        Args:
            target (Target): the module.
            spec (ModuleSpec): its recorded signatures and samples.
            references (list[list[Any]]): eager's outputs per signature and sample.
            device (torch.device): the device tuned on.

        Returns:
            (tuple[Backend, Runner, list[Candidate]]): the fastest backend, its runner and the report.

        Raises:
            NoCandidateError: no candidate passed.
        """
        report: list[Candidate] = []
        gate = _SpeedGate(target, spec, device, self.iterations)
        # report index -> the backend and runner of a passing candidate that may still be chosen: the
        # fastest so far and the fastest lighter one; the others are released as soon as they lose
        alive: dict[int, tuple[Backend, Runner]] = {}
        for backend in self.backends:
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is None:
                continue
            runner, entry = attempt
            runner.undo()  # the next candidate starts from the original module
            report.append(entry)
            alive[len(report) - 1] = (backend, runner)
            best = _fastest(report, alive)
            keep = {
                best,
                _fastest(report, {i: c for i, c in alive.items() if i != best}),
                _quickest(report, alive),  # a challenger in the runoff too (`_runoff`)
                _fastest(report, alive, lighter=True),
            }
            for index in set(alive) - keep:
                alive.pop(index)[1].release()
        if not alive:
            raise _no_candidate(target, report)
        best = _runoff(report, alive, gate)
        backend, runner = alive[best]
        runner.redo()
        won = ("fastest timed head to head" if report[best].head_to_head else "fastest") + _noise_note(report[best])
        light = _fastest(report, alive, lighter=True)
        if self.startup_margin is None or not backend.compiled_artifacts or light is None:
            chosen_index = best
            report[best] = report[best].but(status="chosen", reason=won)
        else:
            chosen, dropped = _weigh_startup(
                self.startup_margin, (backend, runner, report[best]), (*alive[light], report[light]), gate, won
            )
            report[best], report[light] = (chosen[2], dropped[2]) if chosen[0] is backend else (dropped[2], chosen[2])
            dropped[1].undo()
            chosen_index = best if chosen[0] is backend else light
            backend, runner = chosen[0], chosen[1]
            runner.redo()
        for index, (_, other) in alive.items():
            if index != chosen_index:
                other.release()
        _say_why_they_lost(report, report[best])
        return backend, runner, report


def _runoff(report: list[Candidate], alive: dict[int, tuple[Backend, Runner]], gate: _SpeedGate) -> int:
    """The report index of the fastest of ``alive``: the best by speedup over eager, unless a challenger
    beats it timed head to head (alternating calls of the two). The challengers are the runner-up by
    speedup and the quickest by its own median time, where that is another candidate.

    Speedups over eager are timed minutes apart, each beside its own eager turns, and eager — launching
    every kernel from Python — slows with the machine's CPU load far more than a device graph does (on the
    H200 eager's step took from 13 to 29 ms across one thorough search, which ranked a graph at 3.0 ms per
    call above one at 2.2 ms, and the runner-up by speedup was neither). The head-to-head needs no
    yardstick. A challenger that changes the module (TorchAO) is skipped: only the first of two may
    (`_SpeedGate.between`)."""
    champion = _fastest(report, alive)
    assert champion is not None  # the caller has at least one candidate alive
    quickest = _quickest(report, alive)
    runner_up = _fastest(report, {index: candidate for index, candidate in alive.items() if index != champion})
    for challenger in dict.fromkeys(index for index in (runner_up, quickest) if index not in (None, champion)):
        if changes_module(alive[challenger][0]) or any(is_reference(alive[i][0]) for i in (champion, challenger)):
            continue
        (champion_backend, champion_runner), (_, challenger_runner) = alive[champion], alive[challenger]
        champion_runner.redo()
        try:
            result = gate.between(
                champion_runner, challenger_runner, 1.0, heavy_changes_module=changes_module(champion_backend)
            )
        finally:
            champion_runner.undo()
        pair = f"{report[champion].backend} vs {report[challenger].backend}"
        figure = f"{pair}: {result.speedup:.3f}x ({result.interval()})"  # below 1: the challenger was faster
        report[champion] = report[champion].but(head_to_head=figure)
        report[challenger] = report[challenger].but(head_to_head=figure)
        if result.verdict(1.0) == "slower":
            champion = challenger
    return champion


def _fastest(report: list[Candidate], alive: dict[int, tuple[Backend, Runner]], *, lighter: bool = False) -> int | None:
    """The report index of the fastest of ``alive`` (the first of equals), among the `_is_lighter` ones
    with ``lighter``; None when there is none."""
    indices = [index for index, (backend, _) in alive.items() if not lighter or _is_lighter(backend)]
    return max(indices, key=lambda index: _speedup(report[index]), default=None)


def _quickest(report: list[Candidate], alive: dict[int, tuple[Backend, Runner]]) -> int | None:
    """The report index of the candidate of ``alive`` with the lowest median time per call (None: none timed)."""
    timed = [index for index in alive if report[index].median_us is not None]
    return min(timed, key=lambda index: report[index].median_us, default=None)


def _speedup(entry: Candidate) -> float:
    return entry.speedup if entry.speedup is not None else 1.0  # eager's own entry has none


def _say_why_they_lost(report: list[Candidate], fastest: Candidate) -> None:
    """Gives each candidate that passed but was not chosen its reason: the fastest was faster."""
    for index, entry in enumerate(report):
        if entry.status == "accepted" and entry.head_to_head:
            report[index] = entry.but(
                reason=f"passed at {_speedup(entry):g}x eager's speed, but {fastest.backend} "
                f"was faster timed head to head ({entry.head_to_head})"
            )
        elif entry.status == "accepted":
            report[index] = entry.but(
                reason=f"passed at {_speedup(entry):g}x eager's speed; {fastest.backend} "
                f"was faster ({_speedup(fastest):g}x)"
            )


def _timed_call(runner: Runner, spec: ModuleSpec, index: int) -> Callable[[], Any]:
    """One call of signature ``index`` to time; a call with state starts from the recorded state each
    time (a decode step must not run past the end of its KV cache). Other calls run on a copy of the
    sample, which a module that changes its inputs may change at will."""
    if spec.signatures[index].state_slots:
        samples = spec.samples  # inference mode where the state was made there: a call writes it

        def call() -> Any:
            with samples.mode(index):
                args, kwargs = samples.sample(index, 0)
                return runner.run(index, args, kwargs, flatten(args, kwargs)[0])

        return call
    args, kwargs = snapshot(spec.example(index))
    leaves, _ = flatten(args, kwargs)
    return lambda: runner.run(index, args, kwargs, leaves)


class Only(Strategy):
    """Uses one backend and raises its error if it cannot tune a module; never timed against eager.

    Args:
        backend: the backend every module gets.

    Examples:
        >>> xpupack.tune(model, samples, strategy=xpupack.Only(xpupack.GraphBackend()))
    """

    def __init__(self, backend: Backend):
        super().__init__([backend], min_speedup=None)

    def _options(self) -> dict:
        return {}

    def choose(self, target, spec, references, device):
        """The one backend, if it builds and matches eager. See `Strategy.choose`.

        Args:
            target (Target): the module.
            spec (ModuleSpec): its recorded signatures and samples.
            references (list[list[Any]]): eager's outputs per signature and sample.
            device (torch.device): the device tuned on.

        Returns:
            (tuple[Backend, Runner, list[dict]]): the backend, its runner and a one-entry report.

        Raises:
            NoCandidateError: the backend was refused; the message says why.
        """
        backend = self.backends[0]
        try:
            runner = check_candidate(backend, target, spec, references, device)
        except Rejected as exc:
            raise NoCandidateError(f"{target.path or '<model>'}: {backend.label} backend rejected: {exc}") from exc
        return backend, runner, [Candidate(backend.label, "chosen", "only candidate")]

    def check_unrecorded(self, target, spec):
        """Raises unless the backend is eager or the module was never called. See `Strategy.check_unrecorded`.

        Args:
            target (Target): the module.
            spec (ModuleSpec): what recording saw.

        Raises:
            NoCandidateError: the module was called, and none of its calls could be recorded.
        """
        backend = self.backends[0]
        if is_reference(backend) or not spec.calls:
            return
        reasons = "; ".join(f"{count} x {reason}" for reason, count in spec.unrecordable.items())
        raise NoCandidateError(
            f"{target.path or '<model>'}: the {backend.label} backend can take none of its {spec.calls} calls "
            f"(none could be recorded): {reasons}. Make those calls recordable (an object of your own: "
            f"xpupack.register_state), or tune with FirstWins([{backend!r}, EagerBackend()]) to keep such "
            f"modules eager"
        )


def _no_candidate(target: Target, report: list[Candidate]) -> NoCandidateError:
    """The error of a strategy that tried ``report``'s candidates and kept none; it carries the refusals,
    so that the command line can say the same in its own options' names."""
    too_slow = any(entry.status == "rejected" and entry.speedup is not None for entry in report)  # timed: the gate
    lines = [f"no backend could tune {target.path or '<model>'}:"]
    lines += [f"  {entry.backend}: {entry.reason}" for entry in report]
    lines.append(
        "add EagerBackend() to the strategy to keep such modules untuned"
        + (", or pass min_speedup=None to keep candidates slower than eager" if too_slow else "")
    )
    return NoCandidateError(
        "\n".join(lines),
        path=target.path,
        refusals=tuple((entry.backend, entry.reason) for entry in report),
        too_slow=too_slow,
    )
