"""`FirstWins`: the first candidate, in order, that passes."""

from __future__ import annotations

from collections.abc import Sequence

from ..backends.base import Backend
from ..candidate import Candidate
from .base import Passed, Strategy, is_lighter, no_candidate, noise_note, try_candidate, weigh_startup
from .checks import SpeedGate


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
        gate = SpeedGate(target, spec, device, self.iterations)
        for position, backend in enumerate(self.backends):
            attempt = try_candidate(self, backend, target, spec, references, device, report, gate)
            if attempt is None:
                continue
            runner, entry = attempt
            entry = entry.but(status="chosen", reason="first to pass" + noise_note(entry))
            if self.startup_margin is not None and backend.compiled_artifacts:
                lighter = self._lighter_candidate(
                    self.backends[position + 1 :], target, spec, references, device, report, gate
                )
                if lighter is not None:
                    chosen, (_, dropped_runner, dropped_entry) = weigh_startup(
                        self.startup_margin, (backend, runner, entry), lighter, gate, "first to pass"
                    )
                    dropped_runner.release()
                    dropped_runner.undo()
                    # the compiled candidate's entry first, as it was tried first
                    report += sorted([chosen[2], dropped_entry], key=lambda e: e.backend != backend.label)
                    return chosen[0], chosen[1], report
            report.append(entry)
            return backend, runner, report
        raise no_candidate(target, report)

    def _lighter_candidate(
        self, later: Sequence[Backend], target, spec, references, device, report, gate
    ) -> Passed | None:
        """The first of ``later`` without compiled artifacts (eager aside) that passes, or None."""
        for backend in later:
            if not is_lighter(backend) or not backend.available(device):
                continue
            attempt = try_candidate(self, backend, target, spec, references, device, report, gate)
            if attempt is not None:
                return backend, *attempt
        return None
