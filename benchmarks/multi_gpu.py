"""Bigger than one GPU, on two GPUs: a model split over both devices, and tensor parallel over two ranks.

The model is the h1024x12 transformer of graph_latency.py (bf16, sequence 32,
batch 1 and 8). Printed as one JSON object:

- ``split``: its 12 blocks as two stages, one per GPU (embedding, norm and the
  tied head on the first), each stage tuned as a device graph on its own GPU
  (``tune(device=None)``), against the same split run eagerly, and against the
  same model on one GPU (eager and tuned the same way);
- ``tensor_parallel``: two ranks under torchrun (this script starts them),
  each block's MLP column-/row-parallel (one all-reduce per block), the blocks
  tuned graph first, then Inductor, then eager, against eager tensor parallel
  and against one GPU (tuned graph first). The graph backend refuses sharded
  modules on GPUs (their all-reduce cannot be recorded on torch 2.11: README,
  "Bigger than one GPU"), so ``rejected`` says why and "tuned" is Inductor.
  Rank 0's timings; every rank runs the same number of calls (collectives),
  so timing uses a fixed count, not a budget.

Each variant is timed in the same process, device-synchronized on every GPU
it uses, median of many calls; ratios are computed from those numbers.

    python benchmarks/multi_gpu.py > multi_gpu.json
    python benchmarks/multi_gpu.py --only split          # one part at a time
    python benchmarks/multi_gpu.py --device cpu --smoke  # the code path on a CPU (gloo, eager): no figures
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
from xpupack import _device
from xpupack.tuned import session_of

sys.path.insert(0, str(Path(__file__).parent))
from graph_latency import make_model  # noqa: E402 (the h1024x12 model of the single-GPU benchmark)

HIDDEN, LAYERS, SEQ, BATCHES = 1024, 12, 32, (1, 8)
#: --smoke: a tiny model and few calls, to run the code path (CI, on a CPU)
SMOKE = dict(hidden=64, layers=2, warmup=1, iterations=3)
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
        self.stages = nn.ModuleList(
            nn.Sequential(*base.layers[i * per_stage : (i + 1) * per_stage]).to(device)
            for i, device in enumerate(devices)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for stage in self.stages:
            x = stage(x.to(next(stage.parameters()).device))
        return self.head(self.norm(x.to(self.embed.weight.device)))


class Sizes:
    """The model and call counts of one run (`SMOKE` shrinks them)."""

    hidden, layers, warmup, iterations = HIDDEN, LAYERS, 20, 200


def timed_us(fn, devices: list[torch.device]) -> float:
    """Median microseconds per call, waiting for every device in ``devices`` before each clock read."""
    warmup, iterations = Sizes.warmup, Sizes.iterations

    def sync():
        for device in devices:
            _device.synchronize(device)

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


def _strategy(*, inductor: bool = False) -> xpupack.Strategy:
    """Graph first, eager last (Inductor between them for tensor parallel, where the graph backend refuses
    the sharded blocks). Never timed against eager: the benchmark shows the ratio, and tensor-parallel
    ranks must choose alike."""
    middle = [xpupack.InductorBackend()] if inductor else []
    return xpupack.FirstWins([xpupack.GraphBackend(), *middle, xpupack.EagerBackend()], min_speedup=None)


def _rounded(row: dict) -> dict:
    """Times to the nanosecond, ratios to four significant digits (a tuned side slowed down by a busy machine
    gives ratios like 0.018, which three decimals would cut by 1%)."""
    return {k: round(v, 3) if k.endswith("_us") else float(f"{v:.4g}") for k, v in row.items()}


def _backends(model) -> dict:
    stats = xpupack.stats(model)
    return {
        "backends": sorted({s["backend"] for s in stats.values()}),
        "fallbacks": sum(s["fallbacks"] for s in stats.values()),
    }


def _eager_and_tuned(model, modules, devices, sample_device, strategy: xpupack.Strategy | None = None) -> dict:
    """Eager and tuned latency of ``model`` for each batch size (tuned in place, device=None)."""
    ids = {batch: _ids(batch, sample_device) for batch in BATCHES}
    progress(f"eager on {', '.join(map(str, devices))}")
    eager = {batch: timed_us(lambda b=batch: model(ids[b]), devices) for batch in BATCHES}
    with torch.inference_mode():
        expected = {batch: model(ids[batch]).float() for batch in BATCHES}
    progress("tuning")
    xpupack.tune(model, list(ids.values()), modules=modules, strategy=strategy or _strategy())
    progress("timing the tuned model")
    tuned = {batch: timed_us(lambda b=batch: model(ids[b]), devices) for batch in BATCHES}
    with torch.inference_mode():
        error = max(float((model(ids[b]).float() - expected[b]).abs().max()) for b in BATCHES)
    return {"eager_us": eager, "tuned_us": tuned, "max_abs_diff": error, **_backends(model)}


def _model(dtype: torch.dtype, device: str) -> nn.Module:
    return make_model(Sizes.hidden, Sizes.layers, dtype, device)


def bench_split(dtype: torch.dtype, device_type: str) -> dict:
    two = [f"{device_type}:0", f"{device_type}:1"] if device_type != "cpu" else ["cpu", "cpu"]
    split = _eager_and_tuned(Split(_model(dtype, "cpu"), two), ["stages.*"], [torch.device(d) for d in two], two[0])
    one = _eager_and_tuned(Split(_model(dtype, "cpu"), two[:1]), ["stages.*"], [torch.device(two[0])], two[0])
    result = {
        "backends": split["backends"],
        "fallbacks": split["fallbacks"],
        "max_abs_diff_vs_eager": split["max_abs_diff"],
    }
    for batch in BATCHES:
        row = {
            "split_eager_us": split["eager_us"][batch],
            "split_tuned_us": split["tuned_us"][batch],
            "one_gpu_eager_us": one["eager_us"][batch],
            "one_gpu_tuned_us": one["tuned_us"][batch],
        }
        row["split_tuned_speedup_vs_split_eager"] = row["split_eager_us"] / row["split_tuned_us"]
        row["split_tuned_vs_one_gpu_tuned"] = row["one_gpu_tuned_us"] / row["split_tuned_us"]
        result[f"batch{batch}"] = _rounded(row)
    return result


def tp_rank(dtype: torch.dtype, device_type: str, out: Path) -> None:
    """One rank of the tensor-parallel run (started by torchrun from `bench_tensor_parallel`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_type == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device(device_type, int(os.environ["LOCAL_RANK"]))
        getattr(torch, device_type).set_device(device)
        dist.init_process_group("nccl" if device_type == "cuda" else "xccl", device_id=device)
    mesh = init_device_mesh(device_type, (world,))
    result: dict = {}
    if rank == 0:  # one GPU, while the other ranks wait
        progress("one GPU, rank 0")
        result["one_gpu"] = _eager_and_tuned(_model(dtype, str(device)), ["layers.*"], [device], str(device))
    dist.barrier()
    progress(f"tensor parallel, rank {rank}")
    model = _model(dtype, str(device))
    for block in model.layers:
        parallelize_module(block, mesh, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    result["tensor_parallel"] = _eager_and_tuned(model, ["layers.*"], [device], str(device), _strategy(inductor=True))
    rejected = {
        path: [e.reason for e in tuned.report if e.status == "rejected"]
        for path, tuned in session_of(model).modules.items()
    }
    result["tensor_parallel"]["rejected"] = {p: r for p, r in rejected.items() if r}
    if rank == 0:
        out.write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


def bench_tensor_parallel(dtype_name: str, device_type: str, smoke: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rank0.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            "--dtype",
            dtype_name,
            "--device",
            device_type,
            "--tp-rank-out",
            str(out),
            *(["--smoke"] if smoke else []),
        ]
        subprocess.run(command, check=True, stdout=2)  # the ranks print to our stderr: stdout carries the JSON only
        raw = json.loads(out.read_text())
    tp, one = raw["tensor_parallel"], raw["one_gpu"]
    result = {
        "backends": tp["backends"],
        "fallbacks": tp["fallbacks"],
        "rejected": tp["rejected"],
        "max_abs_diff_vs_eager_tp": tp["max_abs_diff"],
    }
    for batch in BATCHES:
        key = str(batch)
        row = {
            "tp_eager_us": tp["eager_us"][key],
            "tp_tuned_us": tp["tuned_us"][key],
            "one_gpu_eager_us": one["eager_us"][key],
            "one_gpu_tuned_us": one["tuned_us"][key],
        }
        row["tp_tuned_speedup_vs_tp_eager"] = row["tp_eager_us"] / row["tp_tuned_us"]
        row["tp_tuned_speedup_vs_one_gpu_eager"] = row["one_gpu_eager_us"] / row["tp_tuned_us"]
        row["tp_tuned_speedup_vs_one_gpu_tuned"] = row["one_gpu_tuned_us"] / row["tp_tuned_us"]
        result[f"batch{batch}"] = _rounded(row)
    return result


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on a CPU")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "xpu", "cpu"],
        help="the device type; cpu runs the code path only (one device, gloo, no graphs)",
    )
    parser.add_argument("--only", choices=["split", "tensor_parallel"], default=None)
    parser.add_argument("--smoke", action="store_true", help=f"a tiny model and few calls ({SMOKE})")
    parser.add_argument("--tp-rank-out", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.dtype = options.dtype or ("float32" if options.device == "cpu" else "bfloat16")
    dtype = getattr(torch, options.dtype)
    if options.smoke:
        Sizes.hidden, Sizes.layers, Sizes.warmup, Sizes.iterations = SMOKE.values()
    if options.tp_rank_out is not None:
        tp_rank(dtype, options.device, options.tp_rank_out)
        return None
    if options.device != "cpu" and getattr(torch, options.device).device_count() < 2:
        sys.exit(f"needs two {options.device} devices (or --device cpu for the code path)")
    name = _device.device_name(torch.device(options.device, 0) if options.device != "cpu" else torch.device("cpu"))
    report = {
        "torch": torch.__version__,
        "xpupack": xpupack.__version__,
        "device": name,
        "model": f"h{Sizes.hidden}x{Sizes.layers}, seq {SEQ}",
        "dtype": options.dtype,
        "smoke": options.smoke,
    }
    if options.only in (None, "split"):
        report["split"] = bench_split(dtype, options.device)
    if options.only in (None, "tensor_parallel"):
        report["tensor_parallel"] = bench_tensor_parallel(options.dtype, options.device, options.smoke)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
