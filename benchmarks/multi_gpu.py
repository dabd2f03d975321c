"""Bigger than one GPU, on two GPUs: a model split over both devices, and tensor parallel over two ranks.

The model is the h1024x12 transformer of graph_latency.py (bf16, sequence 32,
batch 1 and 8). Printed as one JSON object:

- ``split``: its 12 blocks as two stages, one per GPU (embedding, norm and the
  tied head on the first), each stage tuned as a device graph on its own GPU
  (``tune(device=None)``), against the same split run eagerly, and against the
  same model on one GPU (eager and tuned the same way);
- ``tensor_parallel``: two ranks under torchrun (this script starts them),
  each block's MLP column-/row-parallel (one all-reduce per block), the blocks
  tuned as device graphs with their all-reduce recorded, against eager tensor
  parallel and against one GPU. Rank 0's timings; every rank runs the same
  number of calls (collectives), so timing uses a fixed count, not a budget.

Each variant is timed in the same process, device-synchronized on every GPU
it uses, median of many calls; ratios are computed from those numbers.

    python benchmarks/multi_gpu.py > multi_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import xpupack
from xpupack.tuned import session_of

sys.path.insert(0, str(Path(__file__).parent))
from graph_latency import make_model  # noqa: E402 (the h1024x12 model of the single-GPU benchmark)

HIDDEN, LAYERS, SEQ, BATCHES = 1024, 12, 32, (1, 8)
_START = time.perf_counter()


def progress(message: str) -> None:
    """One line on stderr per step, so a long run shows where it is (stdout carries only the JSON)."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


class Split(nn.Module):
    """The transformer's blocks in one stage per device; embedding, final norm and the tied head on the first."""

    def __init__(self, base: nn.Module, devices: list[str]):
        super().__init__()
        self.embed, self.norm, self.head = base.embed, base.norm, base.head
        for part in (self.embed, self.norm, self.head):
            part.to(devices[0])
        per_stage = len(base.layers) // len(devices)
        self.stages = nn.ModuleList(nn.Sequential(*base.layers[i * per_stage:(i + 1) * per_stage]).to(device)
                                    for i, device in enumerate(devices))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for stage in self.stages:
            x = stage(x.to(next(stage.parameters()).device))
        return self.head(self.norm(x.to(self.embed.weight.device)))


def timed_us(fn, devices: list[torch.device], *, warmup: int = 20, iterations: int = 200) -> float:
    """Median microseconds per call, waiting for every device in ``devices`` before each clock read."""
    def sync():
        for device in devices:
            torch.cuda.synchronize(device)

    samples = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        sync()
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _ids(batch: int, device: str) -> torch.Tensor:
    return torch.randint(0, 32000, (batch, SEQ), generator=torch.Generator().manual_seed(batch)).to(device)


def _graph_strategy() -> xpupack.Strategy:
    # never timed against eager: the benchmark shows the ratio, and tensor-parallel ranks must choose alike
    return xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], min_speedup=None)


def _backends(model) -> dict:
    stats = xpupack.stats(model)
    return {"backends": sorted({s["backend"] for s in stats.values()}),
            "fallbacks": sum(s["fallbacks"] for s in stats.values())}


def _eager_and_tuned(model, modules, devices, sample_device) -> dict:
    """Eager and tuned latency of ``model`` for each batch size (tuned in place, device=None)."""
    ids = {batch: _ids(batch, sample_device) for batch in BATCHES}
    progress(f"eager on {', '.join(map(str, devices))}")
    eager = {batch: timed_us(lambda b=batch: model(ids[b]), devices) for batch in BATCHES}
    with torch.inference_mode():
        expected = {batch: model(ids[batch]).float() for batch in BATCHES}
    progress("tuning")
    xpupack.tune(model, list(ids.values()), modules=modules, strategy=_graph_strategy())
    progress("timing the tuned model")
    tuned = {batch: timed_us(lambda b=batch: model(ids[b]), devices) for batch in BATCHES}
    with torch.inference_mode():
        error = max(float((model(ids[b]).float() - expected[b]).abs().max()) for b in BATCHES)
    return {"eager_us": eager, "tuned_us": tuned, "max_abs_diff": error, **_backends(model)}


def bench_split(dtype: torch.dtype) -> dict:
    two = ["cuda:0", "cuda:1"]
    split = _eager_and_tuned(Split(make_model(HIDDEN, LAYERS, dtype, "cpu"), two), ["stages.*"],
                             [torch.device(d) for d in two], "cuda:0")
    one = _eager_and_tuned(Split(make_model(HIDDEN, LAYERS, dtype, "cpu"), ["cuda:0"]), ["stages.*"],
                           [torch.device("cuda:0")], "cuda:0")
    result = {"backends": split["backends"], "fallbacks": split["fallbacks"],
              "max_abs_diff_vs_eager": split["max_abs_diff"]}
    for batch in BATCHES:
        row = {"split_eager_us": split["eager_us"][batch], "split_tuned_us": split["tuned_us"][batch],
               "one_gpu_eager_us": one["eager_us"][batch], "one_gpu_tuned_us": one["tuned_us"][batch]}
        row["split_tuned_speedup_vs_split_eager"] = row["split_eager_us"] / row["split_tuned_us"]
        row["split_tuned_vs_one_gpu_tuned"] = row["one_gpu_tuned_us"] / row["split_tuned_us"]
        result[f"batch{batch}"] = {k: round(v, 3) for k, v in row.items()}
    return result


def tp_rank(dtype: torch.dtype, out: Path) -> None:
    """One rank of the tensor-parallel run (started by torchrun from `bench_tensor_parallel`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (world,))
    result: dict = {}
    if rank == 0:  # one GPU, while the other ranks wait
        one = _eager_and_tuned(make_model(HIDDEN, LAYERS, dtype, str(device)), ["layers.*"], [device], str(device))
        result["one_gpu"] = one
    dist.barrier()
    model = make_model(HIDDEN, LAYERS, dtype, str(device))
    for block in model.layers:
        parallelize_module(block, mesh, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    result["tensor_parallel"] = _eager_and_tuned(model, ["layers.*"], [device], str(device))
    rejected = {path: [e.get("reason") for e in tuned.report if e["status"] == "rejected"]
                for path, tuned in session_of(model).modules.items()}
    result["tensor_parallel"]["rejected"] = {p: r for p, r in rejected.items() if r}
    if rank == 0:
        out.write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


def bench_tensor_parallel(dtype_name: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rank0.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, "--dtype", dtype_name, "--tp-rank-out", str(out)]
        subprocess.run(command, check=True, stdout=sys.stderr)
        raw = json.loads(out.read_text())
    tp, one = raw["tensor_parallel"], raw["one_gpu"]
    result = {"backends": tp["backends"], "fallbacks": tp["fallbacks"], "rejected": tp["rejected"],
              "max_abs_diff_vs_eager_tp": tp["max_abs_diff"]}
    for batch in BATCHES:
        key = str(batch)
        row = {"tp_eager_us": tp["eager_us"][key], "tp_tuned_us": tp["tuned_us"][key],
               "one_gpu_eager_us": one["eager_us"][key], "one_gpu_tuned_us": one["tuned_us"][key]}
        row["tp_tuned_speedup_vs_tp_eager"] = row["tp_eager_us"] / row["tp_tuned_us"]
        row["tp_tuned_speedup_vs_one_gpu_eager"] = row["one_gpu_eager_us"] / row["tp_tuned_us"]
        row["tp_tuned_speedup_vs_one_gpu_tuned"] = row["one_gpu_tuned_us"] / row["tp_tuned_us"]
        result[f"batch{batch}"] = {k: round(v, 3) for k, v in row.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--only", choices=["split", "tensor_parallel"], default=None)
    parser.add_argument("--tp-rank-out", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    dtype = getattr(torch, options.dtype)
    if options.tp_rank_out is not None:
        tp_rank(dtype, options.tp_rank_out)
        return
    if torch.cuda.device_count() < 2:
        sys.exit("needs two CUDA devices")
    report = {"torch": torch.__version__, "xpupack": xpupack.__version__, "device": torch.cuda.get_device_name(0),
              "model": f"h{HIDDEN}x{LAYERS}, seq {SEQ}", "dtype": options.dtype}
    if options.only in (None, "split"):
        report["split"] = bench_split(dtype)
    if options.only in (None, "tensor_parallel"):
        report["tensor_parallel"] = bench_tensor_parallel(options.dtype)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
