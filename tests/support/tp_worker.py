"""One rank of a tensor-parallel run, for tests/test_tensor_parallel.py and tests/test_multi_gpu.py.

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node 2 tp_worker.py PACKAGE OUT_DIR
MODE --backend eager|inductor|graph [--device cpu|cuda] [--emulated-graphs]``.

The model: MLP blocks whose ``up`` is column-parallel and ``down`` row-parallel
(``parallelize_module``: one all-reduce per block). MODE ``tune`` tunes the
blocks on every rank with the backend and saves PACKAGE (every rank calls
`xpupack.save`), eager wherever the backend is rejected; MODE ``load`` loads PACKAGE into a freshly built sharded model
of other weights. Each rank writes ``OUT_DIR/rank<RANK>.json``: whether the
outputs match the unsharded model's (and eager TP's), the backends, fallbacks,
and for ``tune`` what a speed-gated strategy said.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import xpupack
from support.split_models import Block
from xpupack.tuned import session_of


class Blocks(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def make_blocks(seed: int, width: int = 8, depth: int = 2, dtype: torch.dtype = torch.float32) -> Blocks:
    torch.manual_seed(seed)
    return Blocks(width, depth).to(dtype).eval()


def shard(model: Blocks, mesh) -> Blocks:
    for layer in model.layers:
        parallelize_module(layer, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def strategy(name: str) -> xpupack.Strategy:
    """``name``'s backend, and eager where it cannot take a module (why is kept in the report): never timed,
    since every rank must make the same calls."""
    backend = {"eager": xpupack.EagerBackend, "inductor": xpupack.InductorBackend, "graph": xpupack.GraphBackend}[name]
    return xpupack.FirstWins([backend(), xpupack.EagerBackend()], min_speedup=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=["tune", "load"])
    parser.add_argument("--backend", choices=["eager", "inductor", "graph"], default="eager")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--emulated-graphs", action="store_true")
    options = parser.parse_args()
    if options.emulated_graphs:
        from support.emulated_graph import EmulatedGraphs
        from xpupack import _device

        _device.GRAPH_APIS["cpu"] = EmulatedGraphs()
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if options.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (world,))
    reference = make_blocks(seed=0).to(device)
    eager_tp = shard(make_blocks(seed=0).to(device), mesh)
    samples = [torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(device)]
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2)).to(device)
    result: dict = {}
    if options.mode == "tune":
        try:
            xpupack.tune(shard(make_blocks(seed=0).to(device), mesh), samples, modules=["layers.*"])
        except xpupack.TuningError as exc:
            result["speed_gated"] = str(exc)
        model = xpupack.tune(
            shard(make_blocks(seed=0).to(device), mesh),
            samples,
            modules=["layers.*"],
            strategy=strategy(options.backend),
        )
        xpupack.save(model, options.package)
    else:
        model = xpupack.load(shard(make_blocks(seed=9).to(device), mesh), options.package)
    with torch.no_grad():
        out = torch.as_tensor(model(x))
        result["matches_unsharded"] = torch.allclose(out, reference(x), atol=1e-4, rtol=1e-4)
        result["matches_eager_tp"] = torch.allclose(out, torch.as_tensor(eager_tp(x)), atol=1e-4, rtol=1e-4)
    stats = xpupack.stats(model)
    result.update(
        backends=sorted({s["backend"] for s in stats.values()}),
        fallbacks=sum(s["fallbacks"] for s in stats.values()),
        calls=sum(s["calls"] for s in stats.values()),
    )
    rejected = [
        f"{path}: {entry.backend}: {entry.reason}"
        for path, tuned in session_of(model).modules.items()
        for entry in tuned.report
        if entry.status == "rejected"
    ]
    if rejected:  # why a backend did not take a module (e.g. a device graph that cannot record a collective)
        result["rejected"] = rejected
    (options.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
