"""Cost of the fit check and dispatch per call, against a bare module call (microseconds).

A tiny module makes the overhead visible: both sides call ``module(x, scale=2.0)``
through ``nn.Module.__call__``; the tuned side runs the fit check and
dispatches to the eager backend. Rounds alternate between the two sides and
the medians are compared, so machine noise hits both alike.

    python benchmarks/fit_overhead.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from torch import nn

import xpupack
from xpupack.signature import fit_key


class Tiny(nn.Module):
    def forward(self, x, scale: float = 1.0):
        return x


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(rounds: int = 30, calls: int = 20000) -> None:
    x = torch.randn(1, 16, 64)
    bare = Tiny().eval()
    tuned = xpupack.tune(
        Tiny(),
        [((x,), {"scale": 2.0})],
        run=lambda m, s: m(*s[0], **s[1]),
        strategy=xpupack.Only(xpupack.EagerBackend()),
    )
    table = {fit_key((x,), {"scale": 2.0})[0]: 0}

    def fit_check():  # what a tuned call does before dispatching: key, lookup
        return table.get(fit_key((x,), {"scale": 2.0})[0])

    sides = {
        "bare_call_us": lambda: bare(x, scale=2.0),
        "tuned_call_us": lambda: tuned(x, scale=2.0),
        "fit_check_us": fit_check,
    }
    samples = {name: [] for name in sides}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in sides.items():
                samples[name].append(per_call_us(fn, calls))
    medians = {name: round(statistics.median(values), 3) for name, values in samples.items()}
    assert xpupack.stats(tuned)[""]["fallbacks"] == 0
    print(
        json.dumps(
            {
                **medians,
                "dispatch_overhead_us": round(medians["tuned_call_us"] - medians["bare_call_us"], 3),
                "tuned_vs_bare": round(medians["tuned_call_us"] / medians["bare_call_us"], 2),
                "rounds": rounds,
                "calls_per_round": calls,
                "torch": torch.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
