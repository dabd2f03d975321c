"""How fast int8 weight-only linears can be at decode batch sizes, beside bf16, on a CUDA GPU.

The linear layers of one decode step of a Llama-shaped model (the 886M model of ``llm_decode.py``, or
Llama-3-8B's shapes), each with weights of its own so that no weight stays in L2, recorded as one CUDA
graph and replayed. Side by side in one process:

- ``bf16_cublas``: ``F.linear`` in bf16 (cuBLAS);
- ``bf16_inductor_cd`` / ``int8_inductor_cd``: each shape compiled by Inductor with coordinate descent,
  bf16 and torchao 0.18's int8 weight-only formula (``mm(x, w.t().to(x.dtype)) * scale``): what a
  package's graph-over-Inductor decode step runs;
- ``int8_triton_cvt`` / ``int8_triton_magic`` (batch 1): hand-written Triton int8 GEMV kernels, each
  shape's launch settings picked by a sweep (the best of 62), converting the int8 weights with the
  conversion instruction or with integer operations (a float's bits ``0x4B000000 | (b + 128)`` are
  ``2**23 + b + 128``); and at batch 8 a Triton kernel that converts to bf16 and multiplies with
  ``tl.dot``. They are an experiment, not part of xpupack: they bound what a better int8 kernel in a
  package could gain;
- ``int8_eager_torchao_formula`` and ``int8_weight_int8pack_mm``: the formula uncompiled, and aten's
  ``_weight_int8pack_mm``.

Prints JSON: per variant the µs of one step's linears and the bytes of weights read per second, and each
int8 variant's speed relative to ``bf16_inductor_cd`` (``vs_bf16_inductor``, above 1 is faster).

    python benchmarks/int8_linears.py --shapes 886m --batch 1
    python benchmarks/int8_linears.py --shapes 8b --batch 1 --budget 190
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time

import torch

#: (hidden, intermediate, key-value width, vocabulary, layers)
SHAPES = {"886m": (2048, 5632, 1024, 32000, 16), "8b": (4096, 14336, 1024, 128256, 32)}


def _per_thread(config, bytes_per_element):
    block_n, block_k, warps, _ = config
    return block_n * block_k // bytes_per_element // (32 * warps)


#: each Triton kernel's launcher in ``_int8_kernels`` and the settings swept per shape: (rows per program,
#: K per step, warps, stages)
SWEEPS = {
    "int8_triton_cvt": (
        "launch_cvt",
        [
            c
            for c in itertools.product([1, 2, 4, 8, 16], [256, 512, 1024, 2048], [2, 4, 8], [1, 3])
            if 16 <= _per_thread(c, 1) <= 64
        ],
    ),
    "int8_triton_magic": (
        "launch_magic",
        [
            c
            for c in itertools.product([1, 2, 4, 8, 16], [512, 1024, 2048, 4096], [2, 4, 8], [1, 3])
            if 4 <= _per_thread(c, 4) <= 16
        ],
    ),
    "int8_triton_dot": ("launch_dot", list(itertools.product([16, 32, 64], [128, 256, 512], [4, 8], [2, 4]))),
}


def step_shapes(name):
    """(out, in) of each linear of one decode step, in order: per layer q, k, v, o, gate, up, down; the head."""
    hidden, intermediate, kv, vocabulary, layers = SHAPES[name]
    layer = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (intermediate, hidden),
        (intermediate, hidden),
        (hidden, intermediate),
    ]
    return layer * layers + [(vocabulary, hidden)]


def quantize(w):
    """Per-row symmetric int8 as torchao's ``Int8WeightOnlyConfig``: (int8 weights, scales in w's type)."""
    scale = (w.abs().amax(dim=1).float() / 127.5).clamp(min=torch.finfo(torch.float32).eps).to(w.dtype)
    return torch.round(w.float() / scale.float()[:, None]).clamp(-128, 127).to(torch.int8), scale


def int8_from_integer_ops(q):
    """int8 to float32 with integer operations, as ``_int8_word_byte``, for Inductor to compile."""
    return ((q.view(torch.uint8).to(torch.int32) ^ 0x80) | 0x4B000000).view(torch.float32) - 8388736.0


def step_us(calls, replays=20):
    """µs of one pass over ``calls`` recorded as one CUDA graph: the best of three timings of 20 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timings = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        timings.append(start.elapsed_time(end) * 1000 / replays)
    return min(timings)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="886m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=150, help="seconds; the sweeps stop at half of it")
    parser.add_argument(
        "--kernels", default=None, help="comma-separated Triton kernels to sweep (default: all for the batch size)"
    )
    args = parser.parse_args(argv)
    import _int8_kernels as kernels  # Triton: only where this runs
    import triton

    started = time.time()
    device = torch.device("cuda")
    torch.manual_seed(0)
    shapes = step_shapes(args.shapes)
    unique = sorted(set(shapes))
    weights = {
        shape: [torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(shapes.count(shape))]
        for shape in unique
    }
    quantized = {shape: [quantize(w) for w in ws] for shape, ws in weights.items()}
    inputs = {k: torch.randn(args.batch, k, device=device, dtype=torch.bfloat16) for _, k in unique}
    bf16_bytes, int8_bytes = sum(n * k * 2 for n, k in shapes), sum(n * k for n, k in shapes)
    report = {
        "shapes": args.shapes,
        "batch": args.batch,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "linears": len(shapes),
        "weight_bytes": {"bf16": bf16_bytes, "int8": int8_bytes},
        "sweeps": {},
        "max_rel_err": {},
    }
    names = (
        args.kernels.split(",")
        if args.kernels
        else ["int8_triton_cvt", "int8_triton_magic"]
        if args.batch == 1
        else ["int8_triton_dot"]
    )
    best = {}
    for name in names:
        launcher, configs = SWEEPS[name]
        launch = getattr(kernels, launcher)
        best[name], errors = {}, []
        for n, k in unique:
            q, s = quantized[(n, k)][0]
            x = inputs[k]
            timed = []
            for config in configs:
                if len(timed) >= 3 and time.time() - started > args.budget / 2:
                    break
                try:
                    launch(x, q, s, config)
                except Exception:  # noqa: BLE001 - a setting the compiler refuses is left out
                    continue
                call = functools.partial(launch, x, q, s, config)
                timed.append((triton.testing.do_bench(call, warmup=5, rep=20), config))
            timed.sort()
            expected = (x.float() @ q.float().t()) * s.float()
            errors.append(float((launch(x, q, s, timed[0][1]).float() - expected).norm() / expected.norm()))
            best[name][(n, k)] = timed[0][1]
            report["sweeps"].setdefault(name, {})[f"{n}x{k}"] = {
                "best": timed[0][1],
                "us": round(timed[0][0] * 1000, 2),
                "tried": len(timed),
                "GB_per_s": round(n * k / timed[0][0] / 1e6, 1),
            }
        report["max_rel_err"][name] = max(errors)

    def each_linear(make):
        seen = dict.fromkeys(unique, 0)
        calls = []
        for shape in shapes:
            calls.append(make(shape, seen[shape]))
            seen[shape] += 1
        return calls

    variants = {
        "bf16_cublas": each_linear(
            lambda sh, i: lambda w=weights[sh][i], x=inputs[sh[1]]: torch.nn.functional.linear(x, w)
        ),
        "int8_eager_torchao_formula": each_linear(
            lambda sh, i: lambda q=quantized[sh][i], x=inputs[sh[1]]: torch.mm(x, q[0].t().to(x.dtype)) * q[1]
        ),
    }
    if args.shapes == "886m":  # 100 ms a step at 8B
        variants["int8_weight_int8pack_mm"] = each_linear(
            lambda sh, i: lambda q=quantized[sh][i], x=inputs[sh[1]]: torch._weight_int8pack_mm(x, q[0], q[1])
        )
    for name in names:
        launch = getattr(kernels, SWEEPS[name][0])
        variants[name] = each_linear(
            lambda sh, i, name=name, f=launch: functools.partial(f, inputs[sh[1]], *quantized[sh][i], best[name][sh])
        )
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    bf16 = torch.compile(lambda x, w: torch.nn.functional.linear(x, w), dynamic=False)
    int8 = torch.compile(lambda x, q, s: torch.mm(x, q.t().to(x.dtype)) * s, dynamic=False)
    int8_integer_ops = torch.compile(
        lambda x, q, s: (torch.mm(x.float(), int8_from_integer_ops(q).t()) * s.float()).to(x.dtype), dynamic=False
    )
    variants["bf16_inductor_cd"] = each_linear(lambda sh, i: lambda w=weights[sh][i], x=inputs[sh[1]]: bf16(x, w))
    for name, function in (("int8_inductor_cd", int8), ("int8_inductor_cd_integer_ops", int8_integer_ops)):
        variants[name] = each_linear(
            lambda sh, i, f=function: lambda q=quantized[sh][i], x=inputs[sh[1]]: f(x, q[0], q[1])
        )
    results = {}
    for name, calls in variants.items():
        us = step_us(calls)
        results[name] = {
            "us": round(us, 1),
            "TB_per_s": round((bf16_bytes if name.startswith("bf16") else int8_bytes) / us / 1e6, 2),
        }
        print(name, results[name], file=sys.stderr, flush=True)
    for name, result in results.items():
        if name.startswith("int8"):
            result["vs_bf16_inductor"] = round(results["bf16_inductor_cd"]["us"] / result["us"], 3)
    report["step"] = results
    report["elapsed_s"] = round(time.time() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
