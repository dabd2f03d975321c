"""How a candidate is checked against eager and timed against it: `check_candidate`, `Rejected`, the speed
gate (`SpeedGate`), and the progress they report while a module is tuned (`reporting`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _timing
from ..backends.base import Backend, Runner, changes_module
from ..errors import error_line
from ..module_spec import ModuleSpec, Target
from ..recorder import snapshot
from ..signature import flatten

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


def say(message: str) -> None:
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
        say(f"building {backend.label} and checking it against eager")
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


def is_reference(backend: Backend) -> bool:
    """Whether ``backend`` is eager, what every candidate is compared with: never gated, never timed against itself.

    Args:
        backend: a candidate.

    Returns:
        True for the eager backend.
    """
    return backend.name == "eager"


class SpeedGate:
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
        say(f"timing {backend.label} against eager")
        eager = self._eager or self._build_eager()
        return self._rounds(runner, eager, threshold, heavy_changes_module=changes_module(backend))

    def between(
        self, heavy: Runner, light: Runner, threshold: float, *, heavy_changes_module: bool = False
    ) -> _timing.Comparison:
        """Two candidates timed in rounds as `compare` times one against eager: ``light`` takes eager's
        side, so the speedup is ``heavy``'s over ``light``'s. ``light`` must not change the module;
        ``heavy`` may (TorchAO under it: taken back for ``light``'s turns, as for eager's in `compare`).
        A signature only ``light`` runs costs ``light``'s time on both sides."""
        return self._rounds(heavy, light, threshold, heavy_changes_module=heavy_changes_module)

    def _rounds(
        self, heavy: Runner, light: Runner, threshold: float | None, *, heavy_changes_module: bool
    ) -> _timing.Comparison:
        """``heavy`` against ``light`` (eager for `compare`) in rounds, eager standing in for a signature
        ``light`` does not run; a module ``heavy`` changes is taken back for ``light``'s turns."""
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
        from ..backends.eager import EagerBackend

        self._eager = EagerBackend().build(self.target, self.spec, self.device)
        return self._eager

    def _per_call_us(self, times: dict[int, float]) -> float:
        weights = self.spec.signature_weights()
        return sum(weights[i] * t for i, t in times.items()) / max(1, sum(weights[i] for i in times))


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
