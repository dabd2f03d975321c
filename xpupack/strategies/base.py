"""The `Strategy` base class, and what the built-in strategies share: a candidate tried (`try_candidate`: checked,
then timed against eager), a compiled candidate weighed against a lighter one for its start-up
(`weigh_startup`), the error when none passed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _timing
from ..backends.base import Backend, Runner, changes_module
from ..candidate import Candidate
from ..errors import NoCandidateError
from ..module_spec import ModuleSpec, Target
from .checks import Rejected, SpeedGate, check_candidate, is_reference


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


def try_candidate(
    strategy: Strategy,
    backend: Backend,
    target: Target,
    spec: ModuleSpec,
    references: list[list[Any]],
    device: torch.device,
    report: list[Candidate],
    gate: SpeedGate,
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


def noise_note(entry: Candidate) -> str:
    """Appended to a kept candidate's reason when its speedup stands on noisy timings."""
    if not entry.noisy or entry.speedup_interval is None:
        return ""
    low, high = entry.speedup_interval
    return f"; noisy timings: {_timing.CONFIDENCE:.0%} interval {low}-{high}x eager's speed over {entry.rounds} rounds"


#: a candidate as a strategy holds it while choosing: the backend, its runner, its entry
Passed = tuple[Backend, Runner, Candidate]


def is_lighter(backend: Backend) -> bool:
    """Whether ``backend`` can be what a compiled candidate is weighed against for its start-up: no
    compiled artifacts, not eager (the speed gate compares with that), and it leaves the module as it
    is (both run side by side)."""
    return not (backend.compiled_artifacts or is_reference(backend) or changes_module(backend))


def weigh_startup(margin: float, compiled: Passed, lighter: Passed, gate: SpeedGate, won: str) -> tuple[Passed, Passed]:
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


def no_candidate(target: Target, report: list[Candidate]) -> NoCandidateError:
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
