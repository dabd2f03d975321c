"""A loader process for tests/test_concurrency.py.

Usage: ``python concurrent_loader.py PACKAGE [--revision REV] [--hub-cache REPO_DIR] [--emulated-graphs]
[--repeat N]``; PACKAGE is a directory or a Hub repo id (``HF_ENDPOINT``, ``HF_HOME`` from the environment).
It imports everything and builds its model, prints ``ready``, waits for a
line on stdin (so that several loaders start at the same moment), loads the
package and prints one JSON line: which model's outputs it got, the
backends, fallbacks, or the error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

import xpupack
import xpupack.loading  # noqa: F401 (patched below through sys.modules; `import xpupack` imports it lazily)
from support.models import make_stack
from xpupack.source import Source


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--revision", default=None, help="Hub revision: branch, tag or commit hash")
    parser.add_argument("--hub-cache", default=None, help="the repo folder of a Hugging Face cache")
    parser.add_argument("--emulated-graphs", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    options = parser.parse_args()
    if options.emulated_graphs:
        from support.emulated_graph import EmulatedGraphs
        from xpupack import _device

        _device.GRAPH_APIS["cpu"] = EmulatedGraphs()
    if options.hub_cache:  # what xpupack.hub resolves a pinned revision to: a snapshot linking into blobs/
        importlib.import_module("xpupack.loading").resolve_source = lambda *a, **k: Source(
            Path(options.package), trusted=True, links_within=Path(options.hub_cache), description="org/name@pinned"
        )
    references = {seed: make_stack(seed=seed) for seed in (0, 1)}
    x = torch.randn(4, 8)
    print("ready", flush=True)
    sys.stdin.readline()
    results = []
    for _ in range(options.repeat):
        try:
            model = xpupack.load(
                make_stack(seed=9), "org/name" if options.hub_cache else options.package, revision=options.revision
            )
            with torch.no_grad():
                out = model(x)
                seeds = [seed for seed, ref in references.items() if torch.allclose(out, ref(x), atol=1e-5)]
            stats = xpupack.stats(model)
            results.append(
                {
                    "seeds": seeds,
                    "backends": sorted({s["backend"] for s in stats.values()}),
                    "fallbacks": sum(s["fallbacks"] for s in stats.values()),
                }
            )
        except xpupack.XpupackError as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
