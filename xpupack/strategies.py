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
from .backends.base import Backend, ModuleSpec, Runner, Target, changes_module
from .errors import NoCandidateError
from .recorder import snapshot
from .signature import flatten

log = logging.getLogger("xpupack")


class Rejected(Exception):
    """A candidate backend was refused; the message is the reason, ``facts`` go into its report entry.

    Raised by `check_candidate`; a strategy turns it into a ``"rejected"`` report entry.

    Args:
        reason: why the candidate was refused (``xpupack inspect`` shows it).
        **facts: more entries for the candidate's report entry (timings, say).
    """

    def __init__(self, reason: str, **facts: Any):
        super().__init__(reason)
        self.facts = facts


def check_candidate(backend: Backend, target: Target, spec: ModuleSpec,
                    references: list[list[Any]], device: torch.device) -> Runner:
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
    """Times candidates against eager on the recorded signatures of one module (README: "Tuning").

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
        return self._per_call_us({index: _timing.measure(_timed_call(runner, self.spec, index), self.device,
                                                         iterations=self.iterations).median_us
                                  for index in sorted(runner.supported)})

    def compare(self, backend: Backend, runner: Runner, threshold: float | None) -> _timing.Comparison:
        """``runner`` against eager; while the result cannot tell whether it beats ``threshold``, more
        rounds are timed (up to 4x ``iterations``)."""
        eager = self._eager or self._build_eager()
        signatures = range(len(self.spec.signatures))
        transforms = changes_module(backend)
        return _timing.compare(
            [_timed_call(runner, self.spec, index) if index in runner.supported else None for index in signatures],
            [_timed_call(eager, self.spec, index) for index in signatures], self.device,
            weights=self.spec.signature_weights(), threshold=threshold, rounds=self.iterations,
            to_eager=runner.undo if transforms else None, to_candidate=runner.redo if transforms else None)

    def between(self, heavy: Runner, light: Runner, threshold: float) -> _timing.Comparison:
        """Two candidates timed in rounds as `compare` times one against eager: ``light`` takes eager's
        side, so the speedup is ``heavy``'s over ``light``'s. Neither may change the module (both run at
        once); a signature only ``light`` runs costs ``light``'s time on both sides."""
        signatures = range(len(self.spec.signatures))
        light_calls = [_timed_call(light, self.spec, index) if index in light.supported else None
                       for index in signatures]
        eager = self._eager or self._build_eager()
        fallback = [call or _timed_call(eager, self.spec, index) for index, call in zip(signatures, light_calls)]
        return _timing.compare(
            [_timed_call(heavy, self.spec, index) if index in heavy.supported else None for index in signatures],
            fallback, self.device, weights=self.spec.signature_weights(), threshold=threshold,
            rounds=self.iterations)

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


def _attempt(strategy: "Strategy", backend: Backend, target: Target, spec: ModuleSpec,
             references: list[list[Any]], device: torch.device, report: list[dict],
             gate: _SpeedGate) -> tuple[Runner, dict] | None:
    """`check_candidate`, then the speed gate; returns the runner and the facts for its report entry
    (``median_us``, and against eager ``speedup``, ``speedup_interval``, ``rounds``, ``noisy``), or records
    the refusal in ``report`` and returns None."""
    gated = strategy.min_speedup is not None and not is_reference(backend)
    try:
        runner = check_candidate(backend, target, spec, references, device)
    except Rejected as exc:
        report.append({"backend": backend.label, "status": "rejected", "reason": str(exc), **exc.facts})
        return None
    if not (gated or strategy.times_candidates):
        return runner, {}
    if is_reference(backend):
        return runner, {"median_us": round(gate.times(runner), 2)}
    result = gate.compare(backend, runner, strategy.min_speedup)
    facts = {"median_us": round(result.candidate.median_us, 2), **result.to_json()}
    verdict = result.verdict(strategy.min_speedup) if gated else "faster"
    if verdict != "faster":
        runner.undo()
        report.append({"backend": backend.label, "status": "rejected", **facts,
                       "reason": _too_slow(result, verdict, strategy.min_speedup)})
        return None
    return runner, facts


def _too_slow(result: _timing.Comparison, verdict: str, min_speedup: float) -> str:
    """Why a candidate did not pass the speed gate: slower, or timings that could not tell (which count
    as slower: a tuned module must never be slower than eager)."""
    numbers = (f"{round(result.speedup, 3)}x eager's speed ({result.candidate.median_us:.1f} vs "
               f"{result.eager.median_us:.1f} µs per recorded call, {result.interval()}); min_speedup={min_speedup}")
    if verdict == "slower":
        return f"not faster than eager: {numbers}"
    if result.noisy:
        return (f"could not tell whether it is faster than eager, timings too noisy: {numbers}; kept out, since a "
                "tuned module must not be slower than eager — build again on a quieter machine")
    return f"not clearly faster than eager: {numbers}"


def _noise_note(facts: dict) -> str:
    """Appended to a kept candidate's reason when its speedup stands on noisy timings."""
    if not facts.get("noisy"):
        return ""
    low, high = facts["speedup_interval"]
    return f"; noisy timings: {_timing.CONFIDENCE:.0%} interval {low}-{high}x eager's speed over {facts['rounds']} rounds"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


class Strategy:
    """Base class: picks one backend per module from a list of candidates.

    A strategy of your own subclasses this and implements `choose` (README: "Tuning").

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

    Raises:
        ValueError: no backends, or ``min_speedup``/``iterations`` not a positive number.

    Examples:
        >>> class PreferGraph(xpupack.Strategy):
        ...     def choose(self, target, spec, references, device):
        ...         from xpupack.strategies import Rejected, check_candidate
        ...         report = []
        ...         for backend in self.backends:
        ...             try:
        ...                 runner = check_candidate(backend, target, spec, references, device)
        ...             except Rejected as exc:
        ...                 report.append({"backend": backend.label, "status": "rejected", "reason": str(exc)})
        ...                 continue
        ...             report.append({"backend": backend.label, "status": "chosen", "reason": "first to pass"})
        ...             return backend, runner, report
        ...         raise xpupack.NoCandidateError(f"no backend could tune {target.path}")
        >>> xpupack.tune(model, samples, strategy=PreferGraph([xpupack.GraphBackend(), xpupack.EagerBackend()]))
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
        """Picks the backend for one module: the extension point of a strategy.

        `xpupack.tune` calls it once per selected module that recorded at least one signature, after
        running the samples through the original module. Every candidate must pass `check_candidate`
        (it builds, and matches eager's outputs) before it can be chosen; the runners of candidates not
        chosen must be taken back (`Runner.undo`), so that the module is as it was for the next one.

        Args:
            target: the module (its object path, the module, its original forward).
            spec: the recorded signatures and, while tuning, their samples (``spec.samples[i]``).
            references: eager's outputs, ``references[i][k]`` for sample ``k`` of signature ``i``
                (for a call with state, the output and the state after it).
            device: the device the module is tuned on.

        Returns:
            ``(backend, runner, report)``: the chosen backend, its runner (built, checked, the module
            changed as the backend changes it), and one report entry per candidate tried, a dict with
            ``"backend"`` (its label), ``"status"`` (``"chosen"``, ``"rejected"``, ``"accepted"``),
            ``"reason"`` and any timings; ``xpupack inspect`` shows them.

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
        return options

    def __repr__(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self._options().items())
        return f"{type(self).__name__}([{', '.join(map(repr, self.backends))}]{options})"


class FirstWins(Strategy):
    """The first backend, in order, that builds, matches eager and is faster than eager wins.

    Args:
        startup_margin: compiled code must pay for its start-up (README: "Cold start"). When the
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

    def __init__(self, backends: Sequence[Backend], *, min_speedup: float | None = 1.0, iterations: int = 20,
                 startup_margin: float | None = None):
        super().__init__(backends, min_speedup=min_speedup, iterations=iterations)
        if startup_margin is not None and (isinstance(startup_margin, bool)
                                           or not isinstance(startup_margin, (int, float)) or startup_margin < 1):
            raise ValueError(f"FirstWins(startup_margin={startup_margin!r}): give a number >= 1 (e.g. 1.05), "
                             "or None to let the first passing candidate win")
        self.startup_margin = startup_margin

    def _options(self) -> dict:
        options = super()._options()
        if self.startup_margin is not None:
            options["startup_margin"] = self.startup_margin
        return options

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
            (tuple[Backend, Runner, list[dict]]): the chosen backend, its runner and the report.

        Raises:
            NoCandidateError: no candidate passed.
        """
        report: list[dict] = []
        gate = _SpeedGate(target, spec, device, self.iterations)
        for position, backend in enumerate(self.backends):
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is not None:
                runner, facts = attempt
                entry = {"backend": backend.label, "status": "chosen",
                         "reason": "first to pass" + _noise_note(facts), **facts}
                if self.startup_margin is not None and backend.compiled_artifacts:
                    lighter = self._lighter_candidate(self.backends[position + 1:], target, spec, references,
                                                      device, report, gate)
                    if lighter is not None:
                        return self._weigh_startup((backend, runner, entry), lighter, gate, report)
                report.append(entry)
                return backend, runner, report
        raise NoCandidateError(_explain(target, report))

    def _lighter_candidate(self, later: Sequence[Backend], target, spec, references, device, report,
                           gate) -> tuple[Backend, Runner, dict] | None:
        """The first of ``later`` without compiled artifacts (eager aside) that passes, or None."""
        for backend in later:
            if backend.compiled_artifacts or is_reference(backend) or not backend.available(device):
                continue
            attempt = _attempt(self, backend, target, spec, references, device, report, gate)
            if attempt is not None:
                runner, facts = attempt
                return backend, runner, {"backend": backend.label, **facts}
        return None

    def _weigh_startup(self, compiled: tuple[Backend, Runner, dict], lighter: tuple[Backend, Runner, dict],
                       gate: "_SpeedGate", report: list[dict]) -> tuple[Backend, Runner, list[dict]]:
        """Keeps the compiled candidate only where it is `startup_margin` times as fast as the lighter one,
        both timed in alternating calls; the other is refused with both figures in its reason."""
        (heavy, heavy_runner, heavy_entry), (light, light_runner, light_entry) = compiled, lighter
        margin = self.startup_margin
        result = gate.between(heavy_runner, light_runner, margin)
        heavy_entry["startup_ratio"] = light_entry["startup_ratio"] = round(result.speedup, 3)
        heavy_entry["startup_ratio_interval"] = light_entry["startup_ratio_interval"] = [
            round(result.low, 3), round(result.high, 3)]
        ratio = result.speedup
        figures = (f"{heavy.label} {result.candidate.median_us:.1f} vs {light.label} {result.eager.median_us:.1f} µs "
                   f"per recorded call, {result.interval()}")
        margin = self.startup_margin
        # the compiled code must be clearly worth its start-up: timings that cannot tell keep the lighter one
        if result.verdict(margin) == "faster":
            light_entry["reason"] = (f"{heavy.label} is {ratio:.3f}x as fast ({figures}), at least the start-up "
                                     f"margin {margin}x that its compiled code must earn")
            heavy_entry["reason"] = f"first to pass; {ratio:.3f}x {light.label}'s speed (start-up margin {margin}x)"
            chosen, dropped = (heavy, heavy_runner, heavy_entry), (light_runner, light_entry)
        else:
            heavy_entry["reason"] = (f"{ratio:.3f}x as fast as {light.label} ({figures}), not clearly above the "
                                     f"start-up margin {margin}x: its compiled code costs seconds on a fresh server")
            light_entry["reason"] = f"as fast within the start-up margin {margin}x, with no compiled code"
            chosen, dropped = (light, light_runner, light_entry), (heavy_runner, heavy_entry)
        chosen[2]["status"], dropped[1]["status"] = "chosen", "rejected"
        dropped[0].release()
        dropped[0].undo()
        report += [heavy_entry, light_entry]
        return chosen[0], chosen[1], report


class Fastest(Strategy):
    """Builds every candidate that passes, times each against eager, keeps the fastest.

    Each candidate is timed in rounds alongside eager (device-synchronized), and
    the one with the highest speedup over eager wins (eager itself counts 1.0):
    ratios to eager timed at the same moments stay true under machine load,
    where candidates' own times, taken minutes apart, would not.

    Args:
        backends: the candidates; order only breaks ties.
        min_speedup: as for every `Strategy`.
        iterations: as for every `Strategy`.

    Raises:
        ValueError: an option is out of range.

    Examples:
        >>> xpupack.tune(model, samples, strategy=xpupack.Fastest(
        ...     [xpupack.GraphBackend(), xpupack.InductorBackend(), xpupack.EagerBackend()]))
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
            (tuple[Backend, Runner, list[dict]]): the fastest backend, its runner and the report.

        Raises:
            NoCandidateError: no candidate passed.
        """
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
        entry, backend, runner = max(timed, key=lambda item: item[0].get("speedup", 1.0))
        runner.redo()
        entry["status"], entry["reason"] = "chosen", "fastest" + _noise_note(entry)
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
        return backend, runner, [{"backend": backend.label, "status": "chosen", "reason": "only candidate"}]

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
            f"modules eager")


def _explain(target: Target, report: list[dict]) -> str:
    lines = [f"no backend could tune {target.path or '<model>'}:"]
    lines += [f"  {entry['backend']}: {entry.get('reason', '')}" for entry in report]
    lines.append("add EagerBackend() to the strategy to keep such modules untuned")
    return "\n".join(lines)


def default_backends(device: torch.device | None = None) -> list[Backend]:
    """The default candidates: on a GPU the Inductor-compiled module recorded as a device graph
    first (what ``torch.compile(mode="reduce-overhead")`` does, shipped), then the plain device graph,
    Inductor and eager; elsewhere graph, Inductor, eager (no device graphs on CPU).

    Args:
        device: the device tuned on; None gives the list for a CPU.

    Returns:
        New backend objects, in the order they are tried.
    """
    from .backends.eager import EagerBackend
    from .backends.graph import GraphBackend
    from .backends.inductor import InductorBackend

    backends: list[Backend] = [GraphBackend(), InductorBackend(), EagerBackend()]
    if device is not None and device.type in ("cuda", "xpu"):
        backends.insert(0, GraphBackend(base=InductorBackend()))
    return backends


#: how much faster than the plain device graph graph-over-Inductor must be to be the default's choice:
#: its compiled code costs seconds at load on a fresh server, the plain graph's capture milliseconds
DEFAULT_STARTUP_MARGIN = 1.05


def default_strategy(device: torch.device | None = None) -> Strategy:
    """The strategy `xpupack.tune` uses when given none (README: "Tuning").

    ``FirstWins(default_backends(device), startup_margin=DEFAULT_STARTUP_MARGIN)``.

    Args:
        device: the device tuned on (decides whether graph-over-Inductor is tried first).

    Returns:
        A new `FirstWins`.

    Examples:
        >>> default_strategy(torch.device("cuda")).backends
        [GraphBackend(base={'name': 'inductor', 'options': {}}), GraphBackend(), InductorBackend(), EagerBackend()]
    """
    return FirstWins(default_backends(device), startup_margin=DEFAULT_STARTUP_MARGIN)
