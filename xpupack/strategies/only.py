"""`Only`: one candidate, which must pass, or tuning fails."""

from __future__ import annotations

from ..backends.base import Backend
from ..candidate import Candidate
from ..errors import NoCandidateError
from .base import Strategy
from .checks import Rejected, check_candidate, is_reference


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
