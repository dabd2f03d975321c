"""Graph backend latency on a GPU: a loaded package vs eager vs torch.compile vs a hand-written graph.

All variants run in one process on the same model and input, timed the same
way (device-synchronized per call, median and p90 over many calls); ratios are
computed from those side-by-side numbers. Also measured: a fresh process's
time from package on disk to first output (beyond ``import torch``), and the
fit-check cost per call.

    python benchmarks/graph_latency.py --device cuda --dtype bfloat16 > graph_latency.json
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import xpupack
from xpupack import _device, _timing
from xpupack.examples import TinyTransformer
from xpupack.signature import fit_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _caches import empty_compiler_caches  # noqa: E402

SIZES = [  # the sizes of the table in docs/benchmarks.md: hidden × layers, batch, sequence
    {"name": "h512x6_b1_s16", "hidden": 512, "layers": 6, "batch": 1, "seq": 16},
    {"name": "h1024x12_b1_s32", "hidden": 1024, "layers": 12, "batch": 1, "seq": 32},
]
VOCAB = 32000


def make_model(hidden: int, layers: int, dtype: torch.dtype, device: str, seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(vocab=VOCAB, hidden=hidden, layers=layers, heads=hidden // 64).to(device, dtype).eval()


def hand_written_graph(model, ids, device):
    """What a user would write by hand: static input, warm-up on a side stream, capture, replay."""
    api = getattr(torch, device.type)
    static = ids.clone()
    stream = api.Stream()
    stream.wait_stream(api.current_stream())
    with api.stream(stream), torch.inference_mode():
        for _ in range(3):
            model(static)
    api.current_stream().wait_stream(stream)
    graph = api.CUDAGraph() if device.type == "cuda" else api.XPUGraph()
    with torch.inference_mode(), api.graph(graph):
        out = model(static)

    def run():
        static.copy_(ids)
        graph.replay()
        return out

    return run


def time_call(fn, device, iterations):
    with torch.inference_mode():
        return _timing.measure(fn, device, warmup=10, iterations=iterations, budget_s=30.0)


def fresh_process_load(package: Path, size: dict, dtype: str, device: str) -> dict:
    code = textwrap.dedent(f"""
        import json, sys, time
        import torch
        marks = [time.perf_counter()]
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import xpupack
        from graph_latency import make_model
        torch.zeros(1, device={device!r})  # device context creation, which any GPU program pays
        marks.append(time.perf_counter())
        with torch.device({device!r}):  # the user's model, built where it runs
            model = make_model({size["hidden"]}, {size["layers"]}, torch.{dtype}, {device!r}, seed=1)
        marks.append(time.perf_counter())
        model = xpupack.load(model, {str(package)!r}, device={device!r})
        marks.append(time.perf_counter())
        ids = torch.zeros({size["batch"]}, {size["seq"]}, dtype=torch.long, device={device!r})
        with torch.inference_mode():
            out = model(ids)
        getattr(torch, torch.device({device!r}).type).synchronize()
        marks.append(time.perf_counter())
        steps = ["import_xpupack_and_device_init_s", "build_model_s", "xpupack_load_s", "first_output_s"]
        report = {{name: round(b - a, 3) for name, a, b in zip(steps, marks, marks[1:])}}
        report["load_to_first_output_s"] = round(marks[-1] - marks[0], 3)
        report["package_to_first_output_s"] = round(marks[-1] - marks[2], 3)
        report["fallbacks"] = sum(s["fallbacks"] for s in xpupack.stats(model).values())
        print(json.dumps(report))
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=empty_compiler_caches()
    )  # as on a new server
    if result.returncode:
        return {"error": result.stderr[-2000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def fit_check_us(ids, iterations=20000) -> float:
    table = {fit_key((ids,), {})[0]: 0}
    start = time.perf_counter()
    for _ in range(iterations):
        table.get(fit_key((ids,), {})[0])
    return (time.perf_counter() - start) / iterations * 1e6


def bench_size(size: dict, dtype: torch.dtype, device: torch.device, iterations: int, skip_compile: bool) -> dict:
    model = make_model(size["hidden"], size["layers"], dtype, str(device))
    ids = torch.randint(0, VOCAB, (size["batch"], size["seq"]), device=device)
    results: dict = {"size": size["name"], "dtype": str(dtype).removeprefix("torch.")}

    with torch.inference_mode():
        expected = model(ids)
    results["eager"] = time_call(lambda: model(ids), device, iterations).to_json()

    graph = hand_written_graph(model, ids, device)
    results["hand_written_graph"] = time_call(graph, device, iterations).to_json()

    if not skip_compile:
        compiled = torch.compile(copy.deepcopy(model))
        started = time.perf_counter()
        with torch.inference_mode():
            compiled(ids)
        results["torch_compile_first_call_s"] = round(time.perf_counter() - started, 2)
        results["torch_compile"] = time_call(lambda: compiled(ids), device, iterations).to_json()
        torch._dynamo.reset()
        overhead = torch.compile(copy.deepcopy(model), mode="reduce-overhead")
        with torch.inference_mode():
            for _ in range(3):
                overhead(ids)
        results["compile_reduce_overhead"] = time_call(lambda: overhead(ids), device, iterations).to_json()
        torch._dynamo.reset()

    with tempfile.TemporaryDirectory() as tmp:
        for variant, backend in (
            ("xpupack_graph", xpupack.GraphBackend()),
            ("xpupack_graph_alias", xpupack.GraphBackend(copy_outputs=False)),
        ):
            tuned = xpupack.tune(copy.deepcopy(model), [ids], strategy=xpupack.Only(backend))
            package = xpupack.save(tuned, Path(tmp) / variant)
            started = time.perf_counter()
            loaded = xpupack.load(make_model(size["hidden"], size["layers"], dtype, str(device), seed=1), package)
            results[f"{variant}_load_s"] = round(time.perf_counter() - started, 3)
            with torch.inference_mode():
                torch.testing.assert_close(loaded(ids), expected, rtol=2e-2, atol=2e-2)
            results[variant] = time_call(lambda model=loaded: model(ids), device, iterations).to_json()
            results[f"{variant}_fallbacks"] = sum(s["fallbacks"] for s in xpupack.stats(loaded).values())
        results["fresh_process"] = fresh_process_load(
            Path(tmp) / "xpupack_graph", size, str(dtype).removeprefix("torch."), str(device)
        )

    hand = results["hand_written_graph"]["median_us"]
    results["ratios"] = {
        "xpupack_graph_vs_hand_written": round(results["xpupack_graph"]["median_us"] / hand, 3),
        "xpupack_graph_alias_vs_hand_written": round(results["xpupack_graph_alias"]["median_us"] / hand, 3),
        "eager_vs_xpupack_graph": round(results["eager"]["median_us"] / results["xpupack_graph"]["median_us"], 2),
    }
    if "compile_reduce_overhead" in results:
        results["ratios"]["reduce_overhead_vs_xpupack_graph"] = round(
            results["compile_reduce_overhead"]["median_us"] / results["xpupack_graph"]["median_us"], 3
        )
    results["fit_check_us"] = round(fit_check_us(ids), 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or xpu (default: the one here)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--skip-compile", action="store_true", help="skip the torch.compile variants")
    args = parser.parse_args()
    device = _device.resolve(args.device)
    if device.type not in ("cuda", "xpu"):
        sys.exit("graph_latency needs a CUDA or XPU device")
    dtype = getattr(torch, args.dtype)
    report = {
        "device": _device.device_name(device),
        "torch": torch.__version__,
        "results": [bench_size(size, dtype, device, args.iterations, args.skip_compile) for size in SIZES],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
