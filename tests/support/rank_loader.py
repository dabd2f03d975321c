"""One rank of a fleet loading one package, for tests/test_ranks.py and tests/test_multi_gpu.py.

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node N rank_loader.py PACKAGE OUT_DIR
[--revision REV] [--device cpu|cuda] [--emulated-graphs]``. PACKAGE is a directory or a Hub repo id
(``HF_ENDPOINT``, ``HF_HOME`` from the environment). Every rank builds its model, waits for the others
(a barrier, so that all load at the same moment), loads the package onto ``cpu`` or ``cuda:LOCAL_RANK``
and writes ``OUT_DIR/rank<RANK>.json``: whose weights its outputs match, the backends, the fallbacks, the
device its modules run on, or the error.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import xpupack
from support.models import make_stack
from xpupack.tuned import session_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("out", type=Path)
    parser.add_argument("--revision", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--emulated-graphs", action="store_true")
    options = parser.parse_args()
    if options.emulated_graphs:
        from support.emulated_graph import EmulatedGraphs
        from xpupack import _device

        _device.GRAPH_APIS["cpu"] = EmulatedGraphs()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if options.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
    )
    references = {seed: make_stack(seed=seed).to(device) for seed in (0, 1)}
    model = make_stack(seed=9)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(device)
    dist.barrier()  # every rank loads at the same moment
    try:
        model = xpupack.load(model, options.package, revision=options.revision, device=device)
        with torch.no_grad():
            out = model(x)
            seeds = [seed for seed, ref in references.items() if torch.allclose(out, ref(x), atol=1e-5)]
        stats = xpupack.stats(model)
        result = {
            "seeds": seeds,
            "backends": sorted({s["backend"] for s in stats.values()}),
            "fallbacks": sum(s["fallbacks"] for s in stats.values()),
            "devices": sorted({str(d) for d in session_of(model).devices.values()}),
        }
    except xpupack.XpupackError as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    (options.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
