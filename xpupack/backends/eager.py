"""The eager backend: the original module, the reference for correctness."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import Backend, ModuleSpec, Runner, Target, register_backend


class EagerRunner(Runner):
    def __init__(self, forward: Callable[..., Any], supported: set[int]):
        super().__init__(supported)
        self._forward = forward

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        return self._forward(*args, **kwargs)


@register_backend
class EagerBackend(Backend):
    """Runs the original module unchanged; always available, always accepted."""

    name = "eager"
    supports_autograd = True
    supports_autocast = True

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        return EagerRunner(target.forward, set(range(len(spec.signatures))))
