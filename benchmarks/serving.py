"""Serving a stream of batch sizes: eager, exact recordings, and a ladder with padding (docs/benchmarks.md).

A seeded stream of calls with batch sizes drawn uniformly from 1 to
``--max-batch`` (fixed sequence length ``--seq``) runs through the demo
transformer (``xpupack.examples.TinyTransformer``, h1024×12 by default, the
whole model one tuned unit) in three variants, side by side in one process:

- ``eager``: the model as it is;
- ``exact``: one recording for every batch size the stream holds;
- ``ladder``: recordings of 1, 2, 4 and every multiple of 8 up to the largest
  batch (vLLM's default ladder, cut at ``--max-batch``), made from one sample
  (of the largest batch) with ``xpupack.tune(..., batch_sizes=...)``, saved
  and loaded again (the load records the ladder: its time is the capture time
  a server pays); the other batches are padded up. The ladder is tuned first,
  so its recording memory (measured then) is its own: later captures in the
  process's shared pool reuse blocks that earlier ones freed.

The stream runs in chunks, the variants taking turns on each chunk, so drift
on the machine hits all three alike. Each call is timed to its result
(device-synchronized). Printed as JSON: per variant the fraction of calls
replayed exactly, padded and fallen back, p50/p99 latency, the total stream
time, recording memory; ratios against eager and against exact.

    python benchmarks/serving.py --device cuda > benchmarks/results/h200_serving_bf16.json
    python benchmarks/serving.py --smoke          # tiny sizes, a few calls; seconds on a CPU

On a CPU, which has no device graphs, ``--smoke`` uses the tests' emulated
graph (``tests/support/emulated_graph.py``: a replay runs the model again), which
checks the script end to end in seconds; its timings mean nothing.
``--backend inductor`` compiles instead (minutes on a small CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import xpupack
from xpupack import _device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_latency import VOCAB, make_model  # noqa: E402  (the same stack as graph_latency's h1024x12)

SMOKE = {"hidden": 64, "layers": 2, "calls": 24, "max_batch": 4, "seq": 8, "chunk": 8}


def default_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (vLLM's default capture sizes), up to ``max_batch`` (always included)."""
    sizes = [size for size in (1, 2, 4, *range(8, max_batch + 1, 8)) if size <= max_batch]
    return sorted({*sizes, max_batch})


def make_backend(name: str, recordings: int):
    if name in ("graph", "emulated-graph"):
        return xpupack.GraphBackend(max_recordings=max(recordings, 16))
    return xpupack.InductorBackend()


def counters(model) -> tuple[int, int, int]:
    entry = xpupack.stats(model)[""]
    return entry["calls"], entry["padded"], entry["fallbacks"]


def run_chunk(model, inputs: list[torch.Tensor], device: torch.device, latencies: list[float]) -> None:
    with torch.inference_mode():
        for ids in inputs:
            start = time.perf_counter()
            model(ids)
            _device.synchronize(device)
            latencies.append((time.perf_counter() - start) * 1e6)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda (or xpu) where there is one, else cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32, help="tokens per row, the same for every call")
    parser.add_argument("--chunk", type=int, default=100, help="calls per turn of each variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        choices=["graph", "inductor", "emulated-graph"],
        default=None,
        help="default: graph where the device has device graphs; else emulated-graph with --smoke, inductor without",
    )
    parser.add_argument("--smoke", action="store_true", help=f"tiny sizes and few calls: {SMOKE}")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    device = _device.resolve(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type in ("cuda", "xpu") else "float32"))
    backend = args.backend or (
        "graph" if _device.graphs_for(device) is not None else "emulated-graph" if args.smoke else "inductor"
    )
    if backend == "emulated-graph":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from support.emulated_graph import EmulatedGraphs

        _device.GRAPH_APIS[device.type] = EmulatedGraphs()

    generator = torch.Generator().manual_seed(args.seed)
    batches = torch.randint(1, args.max_batch + 1, (args.calls,), generator=generator).tolist()
    inputs = [torch.randint(0, VOCAB, (batch, args.seq), generator=generator).to(device) for batch in batches]
    distinct = sorted(set(batches))
    ladder = default_ladder(args.max_batch)
    # the ladder's one sample has the largest batch, so that no size outside the ladder is recorded
    ladder_sample = torch.randint(0, VOCAB, (ladder[-1], args.seq), generator=generator).to(device)

    eager = make_model(args.hidden, args.layers, dtype, str(device))
    facts: dict[str, dict] = {"eager": {}}

    # the ladder first: its recordings are the first in this process's shared pool, so their memory is
    # their own (a later capture reuses blocks that earlier ones freed there)
    tuned_ladder = copy.deepcopy(eager)
    started = time.perf_counter()
    xpupack.tune(
        tuned_ladder, [ladder_sample], strategy=xpupack.Only(make_backend(backend, len(ladder))), batch_sizes=ladder
    )
    tune_s = time.perf_counter() - started
    memory_bytes = xpupack.stats(tuned_ladder)[""].get("memory_bytes", 0)
    with tempfile.TemporaryDirectory() as folder:
        package = xpupack.save(tuned_ladder, Path(folder) / "ladder", weights=False)
        xpupack.deactivate(tuned_ladder)
        del tuned_ladder
        loaded = copy.deepcopy(eager)
        _device.synchronize(device)
        started = time.perf_counter()
        # records the ladder again (a server's capture time), compiled before it returns: the stream below
        # times the compiled code (benchmarks/cold_start.py times a new server's start, empty caches and all)
        xpupack.load(loaded, package, device=device, defer_compile=False)
        _device.synchronize(device)
        load_s = time.perf_counter() - started
    facts["ladder"] = {
        "tune_s": round(tune_s, 3),
        "load_s": round(load_s, 3),
        # this process compiled the package: a new server's start is benchmarks/cold_start.py's
        "load_caches": "warm (the tuning process's own compiler caches)",
        "memory_bytes": memory_bytes,
    }

    exact = copy.deepcopy(eager)
    started = time.perf_counter()
    xpupack.tune(
        exact,
        [next(ids for ids in inputs if ids.shape[0] == b) for b in distinct],
        strategy=xpupack.Only(make_backend(backend, len(distinct))),
    )
    facts["exact"] = {
        "tune_s": round(time.perf_counter() - started, 3),
        "memory_bytes": xpupack.stats(exact)[""].get("memory_bytes", 0),
    }
    models = {"eager": eager, "exact": exact, "ladder": loaded}

    latencies: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():  # warm-up: every distinct batch once, untimed
        run_chunk(model, [next(ids for ids in inputs if ids.shape[0] == b) for b in distinct], device, [])
    warm = {name: counters(model) for name, model in models.items() if name != "eager"}
    for start in range(0, len(inputs), args.chunk):
        for name, model in models.items():
            run_chunk(model, inputs[start : start + args.chunk], device, latencies[name])

    variants = {}
    for name, model in models.items():
        values = latencies[name]
        entry = {
            "p50_us": round(statistics.median(values), 1),
            "p99_us": round(percentile(values, 0.99), 1),
            "mean_us": round(statistics.fmean(values), 1),
            "total_s": round(sum(values) / 1e6, 4),
        }
        if name == "eager":
            entry.update(replayed_exact=0.0, padded=0.0, fallen_back=1.0)
        else:
            calls, padded, fallbacks = (now - then for now, then in zip(counters(model), warm[name]))
            stats = xpupack.stats(model)[""]
            entry.update(
                backend=stats["backend"],
                replayed_exact=round((calls - padded - fallbacks) / calls, 4),
                padded=round(padded / calls, 4),
                fallen_back=round(fallbacks / calls, 4),
                signatures=stats["signatures"],
                **facts[name],
            )
        variants[name] = entry

    def ratios(name: str, reference: str) -> dict:
        a, b = variants[name], variants[reference]
        return {key: round(a[key] / b[key], 3) for key in ("p50_us", "p99_us", "total_s")}

    ladder_entry = variants["ladder"]
    result = {
        "what": f"a seeded stream of calls through TinyTransformer, every call {args.seq} tokens per row; "
        "per-call latency to the result (device-synchronized); ratios are the variant's time over the "
        "reference's (below 1: faster); the exact variant's memory_bytes is measured after the ladder's "
        "recordings were made and released, so its captures reuse their pool blocks (an underestimate)",
        "config": {
            "device": str(device),
            "device_name": _device.device_name(device),
            "dtype": str(dtype),
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": VOCAB,
            "seq": args.seq,
            "calls": args.calls,
            "batch_sizes": f"uniform 1..{args.max_batch}",
            "seed": args.seed,
            "backend": backend,
            "distinct_batches": len(distinct),
            "ladder": ladder,
            "torch": torch.__version__,
            "smoke": args.smoke,
        },
        "variants": variants,
        "ratios": {
            "exact_vs_eager": ratios("exact", "eager"),
            "ladder_vs_eager": ratios("ladder", "eager"),
            "ladder_vs_exact": ratios("ladder", "exact"),
        },
        "ladder_recording": {
            "memory_bytes": ladder_entry["memory_bytes"],
            "capture_s": facts["ladder"]["load_s"],
            "recordings": len(ladder),
        },
        "device_memory_reserved_bytes": (
            int(getattr(torch, device.type).memory_reserved(device)) if device.type in ("cuda", "xpu") else None
        ),
        "targets": {
            "replayed_or_padded_at_least_99pct": ladder_entry["replayed_exact"] + ladder_entry["padded"] >= 0.99,
            "ladder_total_within_10pct_of_exact": ladder_entry["total_s"] <= 1.1 * variants["exact"]["total_s"],
            "ladder_total_below_eager": ladder_entry["total_s"] < variants["eager"]["total_s"],
        },
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
