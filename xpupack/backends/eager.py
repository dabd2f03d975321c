"""The eager backend: the original module, the reference for correctness."""

from __future__ import annotations

import torch

from .base import Backend, CallableRunner, ModuleSpec, Runner, Target, register_backend


@register_backend
class EagerBackend(Backend):
    """Runs the original module unchanged; always available, always accepted."""

    name = "eager"
    supports_autograd = True
    supports_autocast = True

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        return CallableRunner(target.forward, set(range(len(spec.signatures))))
