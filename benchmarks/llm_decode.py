"""LLM decode on a GPU: xpupack packages against transformers and a hand-captured graph, side by side.

The model is Llama-shaped (hidden 2048, 16 layers, 16 heads, 8 KV heads,
intermediate 5632, vocab 32000: 886M parameters, random weights), bf16, batch
1, a 32-token prompt, 128 new tokens. Every variant runs in a fresh process
and is timed the same way: tokens per second of the decode loop (one model
call per token on a caller-held static cache, greedy, device-synchronized at
the end) and of ``generate(cache_implementation="static")``; xpupack variants
also report package -> first token (load, prefill, first greedy token; the
model itself built before the clock starts).

    python benchmarks/llm_decode.py --device cuda > llm_decode.json
    python benchmarks/llm_decode.py --variants xpupack_bf16,hand_graph_inductor
    python benchmarks/llm_decode.py --variants xpupack_int8 --compile-options '{"coordinate_descent_tuning": true}'

Variants: hf_dynamic, hf_static (transformers' auto-compiled static cache),
hf_static_after_import (the same after ``import xpupack``), hand_graph_eager,
hand_graph_inductor (a CUDA graph captured by hand around the eager or
Inductor-compiled decode step), xpupack_bf16 (default strategy),
xpupack_int8 (graph over Inductor over TorchAO int8-weight-only).
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
sys.path.insert(0, str(HERE.parent / "tests"))  # support.language_models: the decode loop the tests use too

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
PROMPT, NEW_TOKENS, HBM_BYTES_PER_S = 32, 128, 4.8e12
ALL = ["hf_dynamic", "hf_static", "hf_static_after_import", "hand_graph_eager", "hand_graph_inductor",
       "xpupack_bf16", "xpupack_int8"]


def build(device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).eval()
    return model


def ids_on(device: str):
    import torch

    return torch.randint(3, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)


def synced(device: str, fn):
    import torch

    getattr(torch, device.split(":")[0]).synchronize()
    start = time.perf_counter()
    result = fn()
    getattr(torch, device.split(":")[0]).synchronize()
    return result, time.perf_counter() - start


def loop_tokens_per_s(model, device: str, step=None) -> tuple[float, list]:
    """The decode loop on one caller-held cache, twice (the first warms up); tokens/s of the second."""
    from support.language_models import decode_loop, static_cache

    cache = static_cache(model, PROMPT + NEW_TOKENS + 8)
    decode_loop(model, ids_on(device), NEW_TOKENS, cache) if step is None else step(cache)
    cache.reset()
    tokens, seconds = synced(device, lambda: decode_loop(model, ids_on(device), NEW_TOKENS, cache)
                             if step is None else step(cache))
    return NEW_TOKENS / seconds, tokens[0, :16].tolist()


def generate_tokens_per_s(model, device: str) -> tuple[float, float]:
    """``generate(cache_implementation="static")`` twice: seconds of the first, tokens/s of the second."""
    import torch

    def run():
        with torch.no_grad():
            return model.generate(ids_on(device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, cache_implementation="static")

    _, first = synced(device, run)
    _, second = synced(device, run)
    return first, NEW_TOKENS / second


def hand_graph(model, device: str, compiled: bool):
    """A CUDA graph captured by hand around one decode step (Inductor-compiled or eager) on a fixed cache."""
    import torch

    from support.language_models import cache_argument

    api = getattr(torch, device.split(":")[0])
    name = cache_argument(model)
    positions_too = "cache_position" in __import__("inspect").signature(type(model).forward).parameters
    forward = torch.compile(model.forward, dynamic=False) if compiled else model.forward
    graphs = {}
    # the graph reads these very tensors on every replay: they live as long as the step function
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    position = torch.zeros(1, 1, dtype=torch.long, device=device)

    def step(cache):
        def decode():
            extra = {"cache_position": position[0]} if positions_too else {}
            return forward(input_ids=token, **{name: cache}, use_cache=True, position_ids=position, **extra).logits

        tokens = []
        with torch.no_grad():
            ids = ids_on(device)
            extra = {"cache_position": torch.arange(PROMPT, device=device)} if positions_too else {}
            logits = model(input_ids=ids, **{name: cache}, use_cache=True,
                           position_ids=torch.arange(PROMPT, device=device)[None], **extra).logits
            for number in range(NEW_TOKENS):
                token.copy_(logits[:, -1:].argmax(-1))
                tokens.append(token.clone())
                position.fill_(PROMPT + number)
                key = id(cache)
                if key not in graphs:  # first step runs for real (warm-up, compile), then capture
                    logits = decode()
                    graph = api.CUDAGraph() if hasattr(api, "CUDAGraph") else api.XPUGraph()
                    with api.graph(graph):
                        static_logits = decode()
                    graphs[key] = (graph, static_logits)
                    continue
                graph, static_logits = graphs[key]
                graph.replay()
                logits = static_logits
        return torch.cat(tokens, dim=1)

    return step


def run_variant(name: str, device: str, workdir: Path) -> dict:
    started = time.perf_counter()
    if name == "hf_static_after_import":
        import xpupack  # noqa: F401  (the point: importing it must not slow transformers down)
    import torch

    result: dict = {"variant": name}
    if name.startswith("xpupack"):
        return {**result, **serve_package(name, device, workdir)}
    model = build(device)
    if name == "hf_dynamic":
        with torch.no_grad():
            model.generate(ids_on(device), max_new_tokens=8, do_sample=False)
            _, seconds = synced(device, lambda: model.generate(ids_on(device), max_new_tokens=NEW_TOKENS,
                                                               min_new_tokens=NEW_TOKENS, do_sample=False))
        result["generate_tokens_per_s"] = NEW_TOKENS / seconds
    elif name in ("hf_static", "hf_static_after_import"):
        result["first_generate_s"], result["generate_tokens_per_s"] = generate_tokens_per_s(model, device)
    elif name.startswith("hand_graph"):
        compiled = name.endswith("inductor")
        step = hand_graph(model, device, compiled)
        result["loop_tokens_per_s"], result["tokens"] = loop_tokens_per_s(model, device, step)
        with torch.no_grad():
            eager_cache_tokens = loop_tokens_per_s(model, device)[1]
        result["tokens_equal_eager"] = result["tokens"] == eager_cache_tokens
    result["process_s"] = time.perf_counter() - started
    return result


def strategy_for(name: str, compile_options: dict | None = None):
    import xpupack

    if name == "xpupack_int8":
        # random weights quantize worse than trained ones: int8's default 30 dB floor is lowered here
        return xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend(
            base=xpupack.TorchAOBackend("int8-weight-only", min_sqnr_db=20), compile_options=compile_options)))
    if compile_options:
        return xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend(compile_options=compile_options)))
    return None  # the default: graph over Inductor first on a GPU


def build_package(name: str, device: str, workdir: Path, compile_options: dict | None = None) -> dict:
    """Tunes on the decode loop and on generate(), saves without weights (the loader builds the same model)."""
    import torch

    import xpupack
    from support.language_models import decode_loop, static_cache

    model = build(device)

    def run(m, kind):
        if kind == "loop":
            return decode_loop(m, ids_on(device), 8, static_cache(m, PROMPT + NEW_TOKENS + 8))
        with torch.no_grad():  # the cache generate() makes is as long as when serving: one compile, one size
            return m.generate(ids_on(device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, cache_implementation="static")

    started = time.perf_counter()
    xpupack.tune(model, ["loop", "generate"], run=run, device=device,
                 strategy=strategy_for(name, compile_options))
    tuned_s = time.perf_counter() - started
    xpupack.save(model, workdir / name, weights=False)
    return {"tune_s": tuned_s, "report": xpupack.tuned.session_of(model).modules[""].report}


def serve_package(name: str, device: str, workdir: Path) -> dict:
    import torch

    import xpupack

    model = build(device)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    started = time.perf_counter()
    # steady state: the decode loop is timed on the compiled code (a load that defers it would time the
    # original module's recordings first; benchmarks/cold_start.py measures that start instead)
    xpupack.load(model, workdir / name, device=device, defer_compile=False)
    with torch.no_grad():
        logits = model(input_ids=ids_on(device)).logits
        first = int(logits[0, -1].argmax())
    first_token_s = time.perf_counter() - started
    loop, tokens = loop_tokens_per_s(model, device)
    first_generate_s, generate = generate_tokens_per_s(model, device)
    stats = xpupack.stats(model)[""]
    from torch._dynamo.utils import counters  # where the serving process's compile time went

    return {"package_to_first_token_s": first_token_s, "first_token": first, "loop_tokens_per_s": loop,
            "tokens": tokens, "first_generate_s": first_generate_s, "generate_tokens_per_s": generate,
            "recording_memory_bytes": stats["memory_bytes"], "stats": stats,
            "inductor_counters": dict(counters["inductor"])}


def fresh(arguments: list[str]) -> dict:
    """Runs this script in a fresh process; returns the JSON it prints last."""
    result = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        return {"error": result.stderr[-2000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default=",".join(ALL))
    parser.add_argument("--workdir", default=None, help="where packages go (default: a temporary directory)")
    parser.add_argument("--compile-options", type=json.loads, default=None, metavar="JSON",
                        help='Inductor settings for the xpupack variants, e.g. \'{"coordinate_descent_tuning": true}\'')
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one or args.build:
        workdir = Path(args.workdir)
        print(json.dumps(build_package(args.build, args.device, workdir, args.compile_options) if args.build
                         else run_variant(args.one, args.device, workdir), default=str))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="llm-decode-"))
    results = {}
    for name in args.variants.split(","):
        common = ["--device", args.device, "--workdir", str(workdir)]
        if name.startswith("xpupack"):
            options = ["--compile-options", json.dumps(args.compile_options)] if args.compile_options else []
            results[f"{name}_build"] = fresh([*common, *options, "--build", name])
        results[name] = fresh([*common, "--one", name])
        print(f"{name}: {json.dumps(results[name], default=str)[:400]}", file=sys.stderr, flush=True)
    parameters = sum(v for k, v in _parameter_count().items())
    summary = {"hbm_limit_tokens_per_s": HBM_BYTES_PER_S / (2 * parameters), "parameters": parameters}
    hand = results.get("hand_graph_inductor", {}).get("loop_tokens_per_s")
    hf = results.get("hf_static", {}).get("generate_tokens_per_s")
    for name in ("xpupack_bf16", "xpupack_int8"):
        mine = results.get(name, {})
        if hand and mine.get("loop_tokens_per_s"):
            summary[f"{name}_loop_vs_hand_graph_inductor"] = mine["loop_tokens_per_s"] / hand
        if hf and mine.get("generate_tokens_per_s"):
            summary[f"{name}_generate_vs_hf_static"] = mine["generate_tokens_per_s"] / hf
    print(json.dumps({"config": CONFIG, "prompt": PROMPT, "new_tokens": NEW_TOKENS,
                      "compile_options": args.compile_options, "summary": summary,
                      "results": results}, indent=2, default=str))


def _parameter_count() -> dict:
    hidden, inter, layers, vocab = (CONFIG["hidden_size"], CONFIG["intermediate_size"],
                                    CONFIG["num_hidden_layers"], CONFIG["vocab_size"])
    kv = hidden * CONFIG["num_key_value_heads"] // CONFIG["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    return {"layers": layers * per_layer, "embeddings": 2 * vocab * hidden, "norm": hidden}


if __name__ == "__main__":
    main()
