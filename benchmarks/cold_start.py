"""Cold start of an Inductor package on CPU: build vs. fresh-process load to first output.

Each step runs in a fresh Python process with a fresh, empty Inductor cache,
as on a new server; times are measured from after ``import torch`` to the
first output (or to the package on disk, for the build):

- ``compile_from_scratch_s``: ``torch.compile`` of the same modules, the
  same way the Inductor backend compiles them, then the first output;
- ``build_s``: ``xpupack.tune`` + ``xpupack.save`` (recording, compiling,
  checking against eager, writing);
- ``load_s``: ``xpupack.load`` of that package + the first output;
- ``load_warm_s``: the same again with the cache the previous load filled.

    python benchmarks/cold_start.py [--modules 'layers.*.mlp']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

PRELUDE = """
import json, time, torch
start = time.perf_counter()
import xpupack
from xpupack.examples import tiny_transformer, tiny_transformer_samples
"""

SCRATCH = PRELUDE + """
model = tiny_transformer()
for name, module in model.named_modules():
    if xpupack.recorder.select_modules(model, MODULES).get(name) is module:
        module.forward = torch.compile(module.forward, dynamic=False)
with torch.no_grad():
    for ids in tiny_transformer_samples():
        model(ids)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

BUILD = PRELUDE + """
model = xpupack.tune(tiny_transformer(), tiny_transformer_samples(), modules=MODULES,
                     strategy=xpupack.Only(xpupack.InductorBackend()))
xpupack.save(model, PACKAGE)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

LOAD = PRELUDE + """
from torch._dynamo.utils import counters
model = xpupack.load(tiny_transformer(seed=1), PACKAGE)
with torch.no_grad():
    model(tiny_transformer_samples()[0])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "fallbacks": sum(s["fallbacks"] for s in xpupack.stats(model).values()),
                  "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run(code: str, cache: Path, **constants) -> dict:
    header = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    result = subprocess.run([sys.executable, "-c", header + textwrap.dedent(code)], capture_output=True,
                            text=True, env=env, timeout=1200)
    if result.returncode:
        raise SystemExit(f"step failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", default="layers.*.mlp")
    args = parser.parse_args()
    modules = [args.modules]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        package = str(tmp / "pkg")
        scratch = run(SCRATCH, tmp / "cache-scratch", MODULES=modules)
        build = run(BUILD, tmp / "cache-build", MODULES=modules, PACKAGE=package)
        load = run(LOAD, tmp / "cache-load", PACKAGE=package)
        warm = run(LOAD, tmp / "cache-load", PACKAGE=package)
        size = sum(p.stat().st_size for p in Path(package).rglob("*") if p.is_file())
    report = {
        "model": "xpupack.examples:tiny_transformer", "modules": modules, "device": "cpu",
        "cpus": os.cpu_count(),
        "compile_from_scratch_s": round(scratch["seconds"], 2),
        "build_s": round(build["seconds"], 2),
        "load_s": round(load["seconds"], 2),
        "load_warm_s": round(warm["seconds"], 2),
        "load_fxgraph_cache": {"hit": load["fxgraph_cache_hit"], "miss": load["fxgraph_cache_miss"]},
        "load_fallbacks": load["fallbacks"],
        "package_bytes": size,
        "load_vs_compile_from_scratch": round(load["seconds"] / scratch["seconds"], 3),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
