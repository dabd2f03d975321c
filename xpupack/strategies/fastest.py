"""`Fastest`: every candidate is tried, the fastest that passes wins (a run-off settles near ties)."""

from __future__ import annotations

from ..backends.base import Backend, Runner, changes_module
from ..candidate import Candidate
from .base import Strategy, is_lighter, no_candidate, noise_note, try_candidate, weigh_startup
from .checks import SpeedGate, is_reference


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
        gate = SpeedGate(target, spec, device, self.iterations)
        # report index -> the backend and runner of a passing candidate that may still be chosen: the
        # fastest so far and the fastest lighter one; the others are released as soon as they lose
        alive: dict[int, tuple[Backend, Runner]] = {}
        for backend in self.backends:
            attempt = try_candidate(self, backend, target, spec, references, device, report, gate)
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
            raise no_candidate(target, report)
        best = _runoff(report, alive, gate)
        backend, runner = alive[best]
        runner.redo()
        won = ("fastest timed head to head" if report[best].head_to_head else "fastest") + noise_note(report[best])
        light = _fastest(report, alive, lighter=True)
        if self.startup_margin is None or not backend.compiled_artifacts or light is None:
            chosen_index = best
            report[best] = report[best].but(status="chosen", reason=won)
        else:
            chosen, dropped = weigh_startup(
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


def _runoff(report: list[Candidate], alive: dict[int, tuple[Backend, Runner]], gate: SpeedGate) -> int:
    """The report index of the fastest of ``alive``: the best by speedup over eager, unless a challenger
    beats it timed head to head (alternating calls of the two). The challengers are the runner-up by
    speedup and the quickest by its own median time, where that is another candidate.

    Speedups over eager are timed minutes apart, each beside its own eager turns, and eager — launching
    every kernel from Python — slows with the machine's CPU load far more than a device graph does (on the
    H200 eager's step took from 13 to 29 ms across one thorough search, which ranked a graph at 3.0 ms per
    call above one at 2.2 ms, and the runner-up by speedup was neither). The head-to-head needs no
    yardstick. A challenger that changes the module (TorchAO) is skipped: only the first of two may
    (`SpeedGate.between`)."""
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
    """The report index of the fastest of ``alive`` (the first of equals), among the `is_lighter` ones
    with ``lighter``; None when there is none."""
    indices = [index for index, (backend, _) in alive.items() if not lighter or is_lighter(backend)]
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
