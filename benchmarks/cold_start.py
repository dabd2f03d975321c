"""Cold start: what a new server meets when it loads a package (empty Inductor and Triton caches).

Every step runs in a fresh Python process with its own empty
``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (a warm local cache hides
what a new server pays). The clock starts after ``import torch``, device
initialisation and building the model (a server does those anyway), and the
load's own phases come from ``xpupack.stats(model, totals=True)``. The same
load run again on the cache the first one filled is reported beside it as
``warm_local_cache``.

Models (``--model``):

- ``stack``: the transformer stack of ``graph_latency.py`` (h512×6, batch 1,
  sequence 16; fp16 on a GPU), built three ways: the default strategy, the plain
  graph, graph over Inductor. Reports package -> first output.
- ``llm``: the 886M Llama of ``llm_decode.py`` (bf16, GPU): package -> first
  ``generate(128)``, the next ``generate(128)``, then ``generate(200)``, a cache
  length the package never saw, and how many autotuning or coordinate-descent
  benchmarks and Dynamo compiles the serving process ran.
- ``tiny`` (CPU): ``xpupack.examples:tiny_transformer`` with Inductor on its MLPs,
  against ``torch.compile`` of the same modules from scratch.

    python benchmarks/cold_start.py --device cuda --model stack
    python benchmarks/cold_start.py --device cuda --model llm [--compile-options '{"coordinate_descent_tuning": true}']
    python benchmarks/cold_start.py --device cpu --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # graph_latency / llm_decode: the models those benchmarks time
sys.path.insert(0, str(HERE.parent / "tests"))  # support.language_models: the decode loop the tests use

from _caches import compiler_counters, empty_compiler_caches  # noqa: E402

STACK = {"hidden": 512, "layers": 6, "batch": 1, "seq": 16}
TINY_MODULES = ["layers.*.mlp"]
LLM_TOKENS, LLM_UNSEEN_TOKENS = 128, 200


def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        getattr(torch, device.split(":")[0]).synchronize()


def _model(name: str, device: str, seed: int = 0):
    import torch

    if name == "stack":
        from graph_latency import make_model

        dtype = torch.float16 if device != "cpu" else torch.float32
        with torch.device(device):
            return make_model(STACK["hidden"], STACK["layers"], dtype, device, seed=seed)
    if name == "llm":
        from llm_decode import build

        return build(device)
    from xpupack.examples import tiny_transformer

    return tiny_transformer(seed)


def _stack_input(device: str):
    import torch

    return torch.zeros(STACK["batch"], STACK["seq"], dtype=torch.long, device=device)


def _strategy(variant: str, compile_options: dict | None):
    import xpupack

    inductor = xpupack.InductorBackend(compile_options=compile_options)
    return {
        "default": None,
        "graph": xpupack.Only(xpupack.GraphBackend()),
        "graph_inductor": xpupack.Only(xpupack.GraphBackend(base=inductor)),
        "inductor": xpupack.Only(inductor),
    }[variant]


def step_build(model_name: str, variant: str, device: str, package: str, compile_options: dict | None) -> dict:
    import torch

    import xpupack

    model = _model(model_name, device)
    started = time.perf_counter()
    if model_name == "stack":
        xpupack.tune(model, [_stack_input(device)], device=device, strategy=_strategy(variant, compile_options))
    elif model_name == "llm":
        from llm_decode import NEW_TOKENS, ids_on

        def run(m, _):
            with torch.no_grad():
                return m.generate(
                    ids_on(device),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    cache_implementation="static",
                )

        xpupack.tune(model, ["generate"], run=run, device=device, strategy=_strategy(variant, compile_options))
    else:
        from xpupack.examples import tiny_transformer_samples

        xpupack.tune(
            model, tiny_transformer_samples(), modules=TINY_MODULES, strategy=_strategy("inductor", compile_options)
        )
    tune_s = time.perf_counter() - started
    xpupack.save(model, package, weights=model_name != "llm")
    session = xpupack.tuned.session_of(model)
    return {
        "tune_s": round(tune_s, 2),
        "backends": {path or "<model>": tuned.backend.label for path, tuned in session.modules.items()},
        "candidates": {
            path or "<model>": [entry.to_json() for entry in tuned.report] for path, tuned in session.modules.items()
        },
    }


def step_load(model_name: str, device: str, package: str) -> dict:
    import torch

    torch.zeros(1, device=device)  # device context creation, which any program on that device pays
    model = _model(model_name, device, seed=1 if model_name != "llm" else 0)
    _sync(device)
    modules_before = set(sys.modules)
    warnings = _xpupack_warnings()
    started = time.perf_counter()
    import xpupack

    xpupack.load(model, package, device=device)
    loaded = time.perf_counter()
    report: dict = {"xpupack_load_s": round(loaded - started, 3)}
    if model_name == "llm":
        report.update(_serve_llm(model, device, started))
    else:

        def call() -> None:
            with torch.no_grad():
                if model_name == "stack":
                    model(_stack_input(device))
                else:
                    from xpupack.examples import tiny_transformer_samples

                    model(tiny_transformer_samples()[0])
            _sync(device)

        call()
        report["package_to_first_output_s"] = round(time.perf_counter() - started, 3)
        report.update(_until_compiled(model, call, started))
    totals = xpupack.stats(model, totals=True)
    report["load_phases_s"] = totals["totals"].get("load_seconds", {})
    report["module_load_s"] = {path or "<model>": entry.get("load_s") for path, entry in totals["modules"].items()}
    report["fallbacks"] = totals["totals"]["fallbacks"]
    report["fallback_reasons"] = {
        path or "<model>": entry.get("fallback_reasons", {}) for path, entry in totals["modules"].items()
    }
    report["backend_errors"] = {
        path or "<model>": entry["backend_errors"]
        for path, entry in totals["modules"].items()
        if entry.get("backend_errors")
    }
    report["warnings"] = warnings[:20]  # what xpupack logged at WARNING while serving (first 20)
    report["compile_stack_imported"] = "torch._inductor.compile_fx" in set(sys.modules) - modules_before
    report.update(compiler_counters())
    return report


def _xpupack_warnings() -> list[str]:
    """A list that collects what xpupack logs at WARNING from now on (a fallback's cause, a failed switch)."""
    import logging

    collected: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: collected.append(record.getMessage()[:500])
    logging.getLogger("xpupack").addHandler(handler)
    return collected


def _until_compiled(model, call, started: float) -> dict:
    """Waits for compiled code restored off the caller's path (``load(defer_compile=True)``), then calls
    once more (the call that switches to it): when the package serves at full speed."""
    import xpupack
    from xpupack import _background

    _background.wait(900)
    call()
    stats = xpupack.stats(model)
    return {
        "package_to_compiled_s": round(time.perf_counter() - started, 3),
        "compiled_serving": {path or "<model>": entry.get("compiled_serving") for path, entry in stats.items()},
        "served_while_compiling": sum(entry.get("compiling", 0) for entry in stats.values()),
    }


def _serve_llm(model, device: str, started: float) -> dict:
    import torch

    from llm_decode import ids_on

    def generate(tokens: int) -> float:
        _sync(device)
        begun = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids_on(device),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                cache_implementation="static",
            )
        _sync(device)
        return time.perf_counter() - begun

    first = generate(LLM_TOKENS)
    report = {
        "package_to_first_generate_s": round(time.perf_counter() - started, 3),
        "first_generate_s": round(first, 3),
        "second_generate_s": round(generate(LLM_TOKENS), 3),
    }
    # the compiled code takes over the decode steps off the caller's path: generate() until none of its
    # calls was served by the original module's recordings any more
    for _ in range(40):
        served_before = report.get("served_while_compiling", -1)
        report.update(_until_compiled(model, lambda: generate(LLM_TOKENS), started))
        if all(report["compiled_serving"].values()) and report["served_while_compiling"] == served_before:
            break
    report["generate_after_compiled_s"] = round(generate(LLM_TOKENS), 3)
    before = compiler_counters()
    report["unseen_length_first_generate_s"] = round(generate(LLM_UNSEEN_TOKENS), 3)
    report["unseen_length_second_generate_s"] = round(generate(LLM_UNSEEN_TOKENS), 3)
    after = compiler_counters()
    report["unseen_length_compiles"] = after["dynamo_unique_graphs"] - before["dynamo_unique_graphs"]
    return report


def step_scratch(device: str) -> dict:
    """``torch.compile`` of the tiny model's MLPs as the Inductor backend compiles them, to first output."""
    import torch

    from xpupack.examples import tiny_transformer_samples
    from xpupack.recorder import select_modules

    model = _model("tiny", device)
    started = time.perf_counter()
    for module in select_modules(model, TINY_MODULES).values():
        module.forward = torch.compile(module.forward, dynamic=False)
    with torch.no_grad():
        for ids in tiny_transformer_samples():
            model(ids)
    return {"package_to_first_output_s": round(time.perf_counter() - started, 3)}


def fresh(arguments: list[str], caches: Path) -> dict:
    """Runs one step of this script in a fresh process on the caches in ``caches``; returns its JSON."""
    env = {**empty_compiler_caches(caches), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, __file__, *arguments], capture_output=True, text=True, env=env, timeout=1500
    )
    if result.returncode:
        return {"error": result.stderr[-3000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=["stack", "llm", "tiny"], default="stack")
    parser.add_argument(
        "--variants",
        default=None,
        help="stack/llm: strategies to build, comma-separated (default, graph, graph_inductor)",
    )
    parser.add_argument("--compile-options", type=json.loads, default=None, metavar="JSON")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--package", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        result = {
            "build": lambda: step_build(args.model, args.variant, args.device, args.package, args.compile_options),
            "load": lambda: step_load(args.model, args.device, args.package),
            "scratch": lambda: step_scratch(args.device),
        }[args.step]()
        print(json.dumps(result, default=str))
        return

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cold-start-"))
    common = ["--device", args.device, "--model", args.model]
    options = ["--compile-options", json.dumps(args.compile_options)] if args.compile_options else []
    default_variants = {"stack": "default,graph,graph_inductor", "llm": "default", "tiny": "inductor"}
    results: dict = {}
    if args.model == "tiny":
        results["compile_from_scratch"] = fresh([*common, "--step", "scratch"], workdir / "caches-scratch")
    for variant in (args.variants or default_variants[args.model]).split(","):
        package = str(workdir / f"pkg-{variant}")
        caches = workdir / f"caches-load-{variant}"
        entry = {
            "build": fresh(
                [*common, *options, "--step", "build", "--variant", variant, "--package", package],
                workdir / f"caches-build-{variant}",
            ),
            "load_empty_caches": fresh([*common, "--step", "load", "--package", package], caches),
        }
        entry["warm_local_cache"] = fresh([*common, "--step", "load", "--package", package], caches)
        results[variant] = entry
        print(f"{variant}: {json.dumps(entry['load_empty_caches'], default=str)[:300]}", file=sys.stderr, flush=True)
    summary = {}
    if args.model == "tiny":
        scratch = results["compile_from_scratch"].get("package_to_first_output_s")
        loaded = results["inductor"]["load_empty_caches"].get("package_to_first_output_s")
        if scratch and loaded:
            summary["load_vs_compile_from_scratch"] = round(loaded / scratch, 3)
    print(
        json.dumps(
            {
                "model": args.model,
                "device": args.device,
                "cpus": os.cpu_count(),
                "compile_options": args.compile_options,
                "summary": summary,
                "results": results,
            },
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
