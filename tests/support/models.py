"""Small models for the tests (the demo transformer lives in `xpupack.examples`)."""

from __future__ import annotations

import time

import torch
from torch import nn


class ScaledMLP(nn.Module):
    """An MLP with a constant keyword (``scale``) and an optional tensor (``bias``)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x, scale: float = 1.0, bias=None):
        y = self.down(torch.relu(self.up(x))) * scale
        return y if bias is None else y + bias


class Stack(nn.Module):
    """Two sibling MLPs with the same class: ``layers.0.mlp`` and ``layers.1.mlp``."""

    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": ScaledMLP(width)}) for _ in range(depth))

    def forward(self, x, scale: float = 1.0):
        for layer in self.layers:
            x = x + layer["mlp"](x, scale=scale)
        return x


def make_stack(seed: int = 0, width: int = 8) -> Stack:
    torch.manual_seed(seed)
    return Stack(width).eval()


def stack_samples() -> list:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 8, generator=generator), torch.randn(4, 8, generator=generator)]


class RunningCache:
    """A user's own state object: a running sum and a step counter, both updated in place."""

    def __init__(self, width: int = 8):
        self.total = torch.zeros(1, width)
        self.steps = torch.zeros((), dtype=torch.int64)


class Accumulator(nn.Module):
    """Adds each input (through a linear layer) to a `RunningCache` and returns the running mean."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x, cache: RunningCache):
        cache.total.add_(self.linear(x))
        cache.steps.add_(1)
        return cache.total / cache.steps


class Metered(nn.Module):
    """A linear layer that spends ``eager_us`` of a `clock.FakeClock`'s time per call, or ``fast_us`` once
    `backends.MeteredBackend` has switched it (in place, as TorchAO quantizes a module); ``shortcut``
    (`backends.ShortcutBackend`) spends ``fast_us`` without switching it."""

    def __init__(self, clock, eager_us: float, fast_us: float, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.clock, self.eager_us, self.fast_us = clock, eager_us, fast_us
        self.switched = False

    def forward(self, x):
        if self.switched:
            return self.shortcut(x)
        self.clock.spend("eager", self.eager_us)
        return self.linear(x)

    def shortcut(self, x):
        self.clock.spend("candidate", self.fast_us)
        return self.linear(x)


class SlowEager(nn.Module):
    """A linear layer whose forward waits ``delay`` seconds first; ``shortcut`` gives the same without waiting."""

    def __init__(self, width: int = 8, delay: float = 0.005):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return self.shortcut(x)

    def shortcut(self, x):
        return self.linear(x)
