"""TorchAO packages: size, load time and latency, measured side by side in one run; prints JSON.

For each quantization config this tunes the transformer blocks of
``xpupack.examples.TinyTransformer`` (every Linear of every block quantized),
saves a package, and measures:

- ``size``: the package's safetensors bytes against the model's weights in fp32
  (and in the model's own dtype);
- ``load``: a fresh process going from package on disk to the first output with
  ``xpupack.load`` (no ``quantize_``), against the prior tools' way: read the
  fp32 weights from safetensors, ``quantize_`` them, first output. Imports
  (torchao's alone takes seconds, as it imports ``torch._dynamo``; reported as
  ``import_torchao_s``) and building the empty model are outside both clocks;
- ``latency``: the whole model's forward, tuned against eager, device-synchronized:
  median of ``--iterations`` calls, best of ``--rounds`` alternating rounds.

Usage:
    python benchmarks/torchao_bench.py --device cpu
    python benchmarks/torchao_bench.py --device cuda            # adds int4 and graph+torchao
    python benchmarks/torchao_bench.py --device cuda --compile  # adds inductor+torchao (slow)
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing xpupack
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _caches import empty_compiler_caches  # noqa: E402

CPU_CONFIGS = ["int8-weight-only", "int8-dynamic", "float8-weight-only"]
CUDA_CONFIGS = CPU_CONFIGS + ["int4-weight-only"]


def make_model(args) -> nn.Module:
    from xpupack.examples import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 64))
    return model.to(args.device, getattr(torch, args.dtype)).eval()


def block_paths(args) -> list[str]:
    return [f"layers.{i}" for i in range(args.layers)]


def make_inputs(args) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (batch, args.seq), generator=generator).to(args.device) for batch in (1, 2)]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- fresh-process children ---------------------------------------------------------


def import_torchao() -> float:
    """Imports what both ways of loading need (torchao pulls in torch._dynamo); returns the seconds."""
    start = time.perf_counter()
    import safetensors.torch  # noqa: F401
    import torchao.prototype.safetensors.safetensors_support  # noqa: F401
    import torchao.quantization  # noqa: F401

    return time.perf_counter() - start


def child_load(args) -> dict:
    imports = import_torchao()
    import xpupack

    model = make_model(args)
    x = make_inputs(args)[0]
    synchronize(args.device)
    start = time.perf_counter()
    xpupack.load(model, args.package, device=args.device)
    ready = time.perf_counter()
    with torch.inference_mode():
        model(x)
    synchronize(args.device)
    return {"ready_s": ready - start, "first_output_s": time.perf_counter() - start, "import_torchao_s": imports}


def child_requantize(args) -> dict:
    imports = import_torchao()
    from safetensors.torch import load_file
    from torchao.quantization import quantize_

    from xpupack.backends.torchao_configs import NAMED_CONFIGS

    model = make_model(args)
    x = make_inputs(args)[0]
    prefixes = tuple(path + "." for path in block_paths(args))
    synchronize(args.device)
    start = time.perf_counter()
    model.load_state_dict(load_file(args.package, device=args.device), strict=False)  # head is tied to embed
    quantize_(
        model,
        NAMED_CONFIGS[args.config].make(),
        filter_fn=lambda module, fqn: isinstance(module, nn.Linear) and fqn.startswith(prefixes),
    )
    ready = time.perf_counter()
    with torch.inference_mode():
        model(x)
    synchronize(args.device)
    return {"ready_s": ready - start, "first_output_s": time.perf_counter() - start, "import_torchao_s": imports}


def run_child(args, mode: str, package: Path, config: str | None = None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--package",
        str(package),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--seq",
        str(args.seq),
    ] + (["--config", config] if config else [])
    runs = []
    for _ in range(args.repeat):
        # each run a new server: its own empty compiler caches
        env = {**empty_compiler_caches(), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
        if result.returncode != 0:
            return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return {key: round(statistics.median(run[key] for run in runs), 4) for key in runs[0]}


# -- the parent ---------------------------------------------------------------------


def latency_us(model: nn.Module, x: torch.Tensor, args) -> float:
    from xpupack import _timing

    with torch.inference_mode():
        return round(
            _timing.measure(
                lambda: model(x), torch.device(args.device), iterations=args.iterations, budget_s=30.0
            ).median_us,
            1,
        )


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes in fp32, bytes in the model's dtype) of the model's state dict."""
    tensors = model.state_dict().values()
    return sum(t.numel() * 4 for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def candidates(args):
    import xpupack
    from xpupack import _device

    graphs = _device.graphs_for(torch.device(args.device)) is not None
    for config in args.configs:
        yield config, "torchao", xpupack.TorchAOBackend(config)
        if graphs:
            yield config, "graph+torchao", xpupack.GraphBackend(base=xpupack.TorchAOBackend(config))
        if args.compile:
            yield config, "inductor+torchao", xpupack.InductorBackend(base=xpupack.TorchAOBackend(config))


def bench_one(args, work: Path, config: str, label: str, backend, fp32_file: Path, eager: nn.Module) -> dict:
    import xpupack

    entry: dict = {"config": config, "backend": label}
    available = backend.available(torch.device(args.device))
    if not available:
        return {**entry, "skipped": backend.why_unavailable(torch.device(args.device))}
    model = make_model(args)
    fp32_bytes, dtype_bytes = weight_bytes(model)
    inputs = make_inputs(args)
    try:
        started = time.perf_counter()
        xpupack.tune(model, inputs, modules=block_paths(args), device=args.device, strategy=xpupack.Only(backend))
        entry["tune_s"] = round(time.perf_counter() - started, 2)
    except xpupack.XpupackError as exc:
        return {**entry, "rejected": str(exc)}
    package = xpupack.save(model, work / f"{config}-{label}")
    package_bytes = sum(p.stat().st_size for p in package.rglob("*.safetensors"))
    entry["size"] = {
        "package_weight_bytes": package_bytes,
        "fp32_weight_bytes": fp32_bytes,
        "ratio_vs_fp32": round(package_bytes / fp32_bytes, 4),
        "ratio_vs_model_dtype": round(package_bytes / dtype_bytes, 4),
    }
    # alternate eager and tuned rounds, best median of each: other load on the machine hits both alike
    eager_us = tuned_us = float("inf")
    for _ in range(args.rounds):
        eager_us = min(eager_us, latency_us(eager, inputs[0], args))
        tuned_us = min(tuned_us, latency_us(model, inputs[0], args))
    entry["latency_us"] = {"tuned": tuned_us, "eager": eager_us, "speedup_vs_eager": round(eager_us / tuned_us, 3)}
    loaded = run_child(args, "load", package)
    entry["load"] = {"xpupack_load": loaded}
    if label == "torchao":  # the prior tools' way: fp32 weights + quantize_ on every load
        requantized = run_child(args, "requantize", fp32_file, config)
        entry["load"]["fp32_plus_quantize"] = requantized
        if "first_output_s" in loaded and "first_output_s" in requantized:
            entry["load"]["speedup_first_output"] = round(requantized["first_output_s"] / loaded["first_output_s"], 2)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="model dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--configs", default=None, help="comma-separated names (default: those for the device)")
    parser.add_argument("--compile", action="store_true", help="also inductor+torchao (slow on CPU)")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="alternating eager/tuned latency rounds (best median)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per load measurement (median)")
    parser.add_argument("--child", choices=["load", "requantize"], help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    if args.child:
        result = (child_load if args.child == "load" else child_requantize)(args)
        print(json.dumps(result))
        return

    import torchao
    from safetensors.torch import save_file

    import xpupack

    args.configs = (
        args.configs.split(",") if args.configs else (CUDA_CONFIGS if args.device.startswith("cuda") else CPU_CONFIGS)
    )
    with tempfile.TemporaryDirectory(prefix="torchao-bench-") as folder:
        work = Path(folder)
        eager = make_model(args)
        fp32_file = work / "weights.safetensors"
        save_file(
            {k: v.contiguous() for k, v in eager.state_dict().items() if k != "head.weight"}, str(fp32_file)
        )  # head.weight is tied to embed.weight
        results = [
            bench_one(args, work, config, label, backend, fp32_file, eager)
            for config, label, backend in candidates(args)
        ]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        json.dumps(
            {
                "benchmark": "torchao packages",
                "device": args.device,
                "device_name": device_name,
                "torch": torch.__version__,
                "torchao": torchao.__version__,
                "xpupack": xpupack.__version__,
                "threads": torch.get_num_threads(),
                "model": {
                    "class": "xpupack.examples.TinyTransformer",
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "dtype": args.dtype,
                    "input": [1, args.seq],
                    "quantized": "every Linear of every block",
                },
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
