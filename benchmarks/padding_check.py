"""Cost of ``verify_padding="always"``: a padded call with and without its check against the original module.

An MLP tuned with Inductor over a batch ladder (1, 2, 4, 8, 16, 32) serves calls of 24 rows, padded up to the
recorded 32. ``first`` (the default for a freshly tuned model: checked on the samples, no padded call runs the
original) and ``always`` (every padded call also runs the original module and compares its rows) take turns
in rounds; the medians are compared, so machine noise hits both alike. Prints JSON (microseconds per call).

    python benchmarks/padding_check.py [--width 1024] [--rounds 20] [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import xpupack


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def per_call_us(model: nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        model(x)
    return (time.perf_counter() - start) / calls * 1e6


def main(width: int = 1024, rounds: int = 20, calls: int = 50) -> dict:
    torch.manual_seed(0)
    samples = [torch.randn(1, width)]
    eager = MLP(width).eval()
    models = {}
    for mode in ("first", "always"):
        model = MLP(width).eval()
        model.load_state_dict(eager.state_dict())
        models[mode] = xpupack.tune(
            model,
            samples,
            batch_sizes=[1, 2, 4, 8, 16, 32],
            strategy=xpupack.Only(xpupack.InductorBackend()),
            verify_padding=mode,
        )
    x = torch.randn(24, width)
    sides = {"eager_24_rows_us": eager, "padded_first_us": models["first"], "padded_always_us": models["always"]}
    timings: dict[str, list[float]] = {name: [] for name in sides}
    with torch.no_grad():
        for model in sides.values():
            model(x)  # warm
        for _ in range(rounds):
            for name, model in sides.items():
                timings[name].append(per_call_us(model, x, calls))
    medians = {name: round(statistics.median(values), 1) for name, values in timings.items()}
    checked = xpupack.stats(models["always"])[""]
    assert checked["padded"] == checked["padding_checks"] > 0 and checked["fallbacks"] == 0
    assert xpupack.stats(models["first"])[""]["padding_checks"] == 0
    result = {
        **medians,
        "always_vs_first": round(medians["padded_always_us"] / medians["padded_first_us"], 2),
        "width": width,
        "rounds": rounds,
        "calls_per_round": calls,
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    options = parser.parse_args()
    main(options.width, options.rounds, options.calls)
