"""Host time of a replayed call: a tuned graph call against a hand-written ``copy_`` + ``replay()``
(docs/benchmarks.md).

The same model (``TinyTransformer``, h512×6, batch 1, 16 tokens: the issue's
anchor) is recorded by xpupack and by hand; each call is timed on the host
only (the clock stops when the call returns, then the device is synchronized
outside the timed region), so the numbers are what each call costs the
Python thread that serves it. Variants: the tuned call with copies out (the
default) and with aliases (``copy_outputs=False``), the hand-written replay
returning its static output, and the same with a ``clone()``. Rounds
alternate between variants, medians are compared.

On a CPU, which has no device graphs, a stand-in whose replay does nothing
measures xpupack's own work per call (fit check, storage watch, input copy,
output copy) against the same hand-written steps.

    python benchmarks/replay_overhead.py --device cuda > benchmarks/results/h200_replay_overhead.json
    python benchmarks/replay_overhead.py --device cpu --hidden 64
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import xpupack
from xpupack import _device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_latency import VOCAB, hand_written_graph, make_model  # noqa: E402


class NoReplay:
    """Device graphs whose replay does nothing: only the host's work per call remains."""

    device_type = "cpu"
    capture_executes = True

    def available(self) -> bool:
        return True

    def shared_pool(self, device):
        return None

    def capture(self, fn, *, device, pool, warmup=2):
        with torch.no_grad():
            outputs = fn()
        return (lambda: None), outputs, 0


def hand_written_noop(model, ids):
    static = ids.clone()
    with torch.inference_mode():
        out = model(static)

    def run():
        static.copy_(ids)
        return out

    return run


def host_us(fn, device: torch.device, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
        _device.synchronize(device)
    return total / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args(argv)
    device = _device.resolve(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type in ("cuda", "xpu") else "float32"))
    real = _device.graphs_for(device) is not None
    if not real:
        _device.GRAPH_APIS[device.type] = NoReplay()

    base = make_model(args.hidden, args.layers, dtype, str(device))
    ids = torch.randint(0, VOCAB, (1, args.seq), device=device)
    variants = {}
    for name, copies in (("tuned_copy", True), ("tuned_alias", False)):
        model = copy.deepcopy(base)
        xpupack.tune(model, [ids], strategy=xpupack.Only(xpupack.GraphBackend(copy_outputs=copies)))
        variants[name] = (lambda m: lambda: m(ids))(model)
    hand = hand_written_graph(base, ids, device) if real else hand_written_noop(base, ids)
    variants["hand_alias"] = hand
    variants["hand_copy"] = lambda: hand().clone()

    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for fn in variants.values():
            host_us(fn, device, 20)  # warm-up
        for _ in range(args.rounds):
            for name, fn in variants.items():
                samples[name].append(host_us(fn, device, args.calls))
    medians = {name: round(statistics.median(values), 2) for name, values in samples.items()}
    result = {
        "what": "host microseconds per call (the clock stops when the call returns; the device is synchronized "
        "between calls, outside the timed region); medians over rounds that alternate between variants",
        "config": {
            "device": str(device),
            "device_name": _device.device_name(device),
            "dtype": str(dtype),
            "hidden": args.hidden,
            "layers": args.layers,
            "batch": 1,
            "seq": args.seq,
            "real_graphs": real,
            "rounds": args.rounds,
            "calls_per_round": args.calls,
            "torch": torch.__version__,
        },
        "host_us": medians,
        "extra_us": {
            "copy": round(medians["tuned_copy"] - medians["hand_copy"], 2),
            "alias": round(medians["tuned_alias"] - medians["hand_alias"], 2),
        },
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
