"""A model whose layers sit on several devices, for the multi-device tests (tests/test_multi_gpu.py)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """An MLP block: ``up``, ReLU, ``down`` (tests/support/tp_worker.py shards these two)."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Residual(Block):
    def forward(self, x):
        return x + super().forward(x)


class Chain(nn.Module):
    """Residual MLP layers; with ``move_inputs`` its forward hands each layer its input on that layer's device
    (as a hand-split model does), without it something else must (accelerate's hooks)."""

    def __init__(self, width: int = 64, depth: int = 4, move_inputs: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.move_inputs = move_inputs

    def forward(self, x):
        for layer in self.layers:
            x = layer(x.to(layer.up.weight.device) if self.move_inputs else x)
        return x


def make_chain(seed: int = 0, *, devices=("cpu",), move_inputs: bool = True, width: int = 64) -> Chain:
    """The chain with deterministic weights, its layers spread over ``devices`` in equal consecutive parts."""
    torch.manual_seed(seed)
    model = Chain(width, move_inputs=move_inputs).eval()
    per_device = -(-len(model.layers) // len(devices))
    for index, layer in enumerate(model.layers):
        layer.to(devices[index // per_device])
    return model


def chain_samples(device="cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 64, generator=generator).to(device) for batch in (2, 4)]
