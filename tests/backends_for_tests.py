"""Backends that exist only for tests: they make visible which path a call took."""

from __future__ import annotations

import torch

from xpupack.backends.base import Backend, Runner, register_backend


class CountingRunner(Runner):
    def __init__(self, forward, supported, offset=0.0, fail=False):
        super().__init__(supported)
        self.forward = forward
        self.runs = 0
        self.offset = offset
        self.fail = fail

    def run(self, index, args, kwargs, leaves):
        self.runs += 1
        if self.fail:
            raise RuntimeError("backend broke")
        out = self.forward(*args, **kwargs)
        return out + self.offset if self.offset else out


@register_backend
class CountingBackend(Backend):
    """Runs the original forward and counts; ``offset`` makes it wrong, ``fail`` makes it raise at call time."""

    name = "counting"

    def __init__(self, offset: float = 0.0, fail: bool = False, build_error: str | None = None):
        self.offset, self.fail, self.build_error = offset, fail, build_error

    def options(self):
        return {"offset": self.offset, "fail": self.fail}

    def build(self, target, spec, device):
        if self.build_error:
            raise RuntimeError(self.build_error)
        return CountingRunner(target.forward, set(range(len(spec.signatures))), self.offset, self.fail)


@register_backend
class CpuOnlyNever(Backend):
    name = "never"

    def available(self, device: torch.device) -> bool:
        return False

    def why_unavailable(self, device):
        return f"never available (asked for {device.type})"
