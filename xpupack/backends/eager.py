"""The eager backend: the original module, the reference for correctness."""

from __future__ import annotations

import torch

from ..module_spec import ModuleSpec, Target
from .base import Backend, CallableRunner, Runner, register_backend


@register_backend
class EagerBackend(Backend):
    """Runs the original module unchanged; always available, always accepted.

    The reference every candidate is compared with, and the last resort of a strategy: with it in
    the list, a module no other backend can take stays untuned instead of failing `xpupack.tune`.

    Examples:
        >>> xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()])
    """

    name = "eager"
    supports_autograd = True
    supports_autocast = True

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        """A runner that calls the original forward for every signature. See `Backend.build`.

        Args:
            target: the module.
            spec: its signatures (all are supported).
            device: unused: the module runs where it is.

        Returns:
            A `CallableRunner` over ``target.forward``.
        """
        return CallableRunner(target.forward, set(range(len(spec.signatures))))
