"""A real-size language model through xpupack: tune, save, then load on a fresh server and serve.

The model is Llama-shaped with random weights, by default Llama-3-8B's shapes (hidden 4096,
intermediate 14336, 32 layers, 32 heads, 8 KV heads, vocabulary 128256; LlamaConfig's other defaults),
bf16, batch 1, a 32-token prompt, 128 new tokens. ``--layers``, ``--hidden``, ``--intermediate``,
``--vocab``, ``--heads`` and ``--kv-heads`` scale it down (a CPU runs it small).

Two fresh processes, each with empty Inductor and Triton caches (``_caches.py``; what a new server meets):

- **build**: ``xpupack.tune`` with the default strategy (with ``--backends LIST``: those candidates, first
  that passes wins; with ``--quantize CONFIG``: the one quantized
  chain, ``graph+inductor+torchao:CONFIG``, ``inductor+torchao:CONFIG`` on a CPU, over random weights first
  rounded to CONFIG's grid: ``round_to_grid`` says why), under
  ``torch.inference_mode()``, on a greedy ``generate(..., cache_implementation="static")`` and a
  hand-written decode loop on a caller-held
  ``StaticCache`` (``llm_decode.py``'s samples), then ``xpupack.save`` (weights included);
- **serve**: the model built (with ``--empty-model`` empty: its parameters on the meta device) and the
  package's files read once (page cache warm) before the clock; then
  ``xpupack.load`` (with ``warmup="auto"`` unless ``--warmup none``: the prefill and decode steps compiled
  inside it) and back-to-back ``generate()`` calls until ``--seconds`` after the load started; then
  the decode loop and the prefill through the package, and the same through hand-compiled code of the same
  model in the same process (after ``xpupack.deactivate``).

It prints one JSON object (sizes in GB of 10^9 bytes, times in seconds, rates per second):

- ``tune_s``, ``save_s``, ``package_gb``, ``save_gb_s`` (package bytes ÷ save seconds); with ``--quantize``,
  ``weights_rounded_to_grid`` (how many linear layers' weights were);
- ``load_s``, ``load_gb_s`` (package bytes ÷ load seconds), ``load_phases`` (where the load's time went:
  verify, weights, modules, warmup, ... as ``xpupack.stats(totals=True)`` has them),
  ``extra_device_memory_gb`` (the load's peak above what was allocated before it: CUDA's
  ``max_memory_allocated``; on a CPU the growth of the peak resident set, ``resource.getrusage``),
  ``threads_alive_after_load`` (threads other than the main one right after ``load()`` returns; the aim is
  none), ``load_compile_s`` (where the compile stack's time inside the load went, by its own timers:
  ``bytecode_tracing`` is Dynamo's, ``OutputGraph.call_user_compiler`` the backend's, cache loads included),
  ``load_compiler_counters`` (graphs traced, Inductor cache hits and misses, autotuning),
  ``load_to_first_token_s`` (from the start of ``load()`` to the first token of the first ``generate()``);
- ``time_series``: ``[seconds since load() started, tokens/s]`` at the end of each ``generate()``;
  ``slowest_generate_tokens_s``, ``steady_tokens_s`` (median of the last third),
  ``time_to_full_speed_s`` (from the start of ``load()`` to the start of the first ``generate()`` after
  which every one ran at ≥ 0.9× steady; None if the last did not);
- ``stats``: ``xpupack.stats`` summed after the time series (calls, fallbacks, calls served while a compile
  was pending, fallback reasons, backend per module); ``prefill_fallbacks``: calls of more than one token
  that fell back in it;
- ``decode_tokens_s``: the decode loop through the package (one ``model(...)`` per token on a caller-held
  ``StaticCache``, once nothing waits for a compile); ``hand_decode_tokens_s``: a CUDA graph captured by
  hand around the ``torch.compile``d decode step (on a CPU: the compiled step, no graph; ``hand`` says
  which); ``decode_vs_hand`` (above 1: the package is faster);
- ``ttft_s``, ``hand_ttft_s``: a prefill of the prompt to its first token (median of 3 after a warm-up)
  through the package and through ``torch.compile`` of the forward; ``ttft_vs_hand`` (above 1: the
  package is slower);
- ``tokens_equal``, ``first_differing_position``: the package's greedy tokens (the series' last ``generate()``)
  against eager's of the model as it was tuned, in the build process (``reference_tokens.json``: with
  ``--quantize``, its bf16 weights rounded to the grid); bf16 may differ where two logits are within rounding;
- with ``--quantize``, the hand-compiled step is the quantized model's (a loaded quantized package keeps no
  bf16 weights: a call that falls back, and the model after ``deactivate``, run the quantized module),
  compiled with the candidate's Inductor settings; the bf16 package's speed comes from a run without
  ``--quantize`` on the same machine;
- with ``--quantize`` and ``--baseline``, the unquantized package of the same model is built and served in
  the same run, on the same machine (first, its processes as above, in ``WORKDIR/baseline``; the quantized
  one's in ``WORKDIR/quantized``): ``baseline`` holds its figures, ``vs_baseline`` the quantized package's
  over them (``decode_tokens_s``: above 1 the quantized one decodes faster; ``package_gb``, ``load_s``,
  ``time_to_full_speed_s``, ``extra_device_memory_gb``, ``ttft_s``);
- ``device``, ``device_name``, ``torch``, ``transformers``, the settings, ``tuned_backends`` (what tuning
  chose) and ``tuned_candidates`` (each candidate's verdict, as ``xpupack inspect`` shows it);
  ``phases`` (each phase: ``ok``, ``error`` or ``skipped``), ``errors`` (phase -> error) and ``skipped``
  (phase -> why). A failed phase records its error and the others still run. In the last tenth
  of ``--budget`` (30 s at most) no phase starts; a process still running at the budget is stopped, its
  running phase recorded as an error. The JSON is printed in every case.

    python benchmarks/big_model.py --out big_model.json                   # Llama-3-8B shapes on a GPU
    python benchmarks/big_model.py --layers 8 --budget 540                 # a quarter of the layers
    python benchmarks/big_model.py --quantize int8-weight-only            # a quantized package
    python benchmarks/big_model.py --quantize int4-weight-only --baseline graph+inductor --empty-model
                                                                          # ... and bf16's, side by side
    python benchmarks/big_model.py --device cpu --layers 2 --hidden 64 --intermediate 128 --vocab 256 \\
        --heads 4 --kv-heads 2 --new-tokens 8 --prompt 8 --seconds 3      # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # support.language_models: the decode loop the tests use too

from _caches import compile_seconds, compile_seconds_since, compiler_counters, empty_compiler_caches  # noqa: E402  (found through the path set above)
from llm_decode import MARK, emit, merge, sync, synced  # noqa: E402

GB = 1e9
#: Llama-3-8B's shapes: the default model
LLAMA3_8B = {"layers": 32, "hidden": 4096, "intermediate": 14336, "vocab": 128256, "heads": 32, "kv_heads": 8}
#: every field of the report, None until a phase fills it (a failed or skipped phase leaves it so)
FIELDS = [
    "tune_s",
    "save_s",
    "save_gb_s",
    "package_gb",
    "load_s",
    "load_gb_s",
    "load_phases",
    "extra_device_memory_gb",
    "threads_alive_after_load",
    "load_compile_s",
    "load_compiler_counters",
    "load_to_first_token_s",
    "time_series",
    "slowest_generate_tokens_s",
    "steady_tokens_s",
    "time_to_full_speed_s",
    "stats",
    "prefill_fallbacks",
    "decode_tokens_s",
    "hand_decode_tokens_s",
    "hand",
    "decode_vs_hand",
    "ttft_s",
    "hand_ttft_s",
    "ttft_vs_hand",
    "tokens_equal",
    "first_differing_position",
]
FULL_SPEED = 0.9


# --- the model and its inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The model and the calls of a run; what ``llm_decode.py``'s helpers read from their settings."""

    device: str
    dtype: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    prompt: int
    new_tokens: int
    batch: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Shape:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    def config(self) -> dict:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": max(8192, self.cache_length),
        }

    @property
    def cache_length(self) -> int:
        return self.prompt + self.new_tokens + 8

    def ids(self, batch: int):
        """``batch`` rows of ``prompt`` random tokens (seeded: the same in every process)."""
        import torch

        generator = torch.Generator().manual_seed(1)
        return torch.randint(3, self.vocab, (batch, self.prompt), generator=generator).to(self.device)

    def cache(self, model):
        from support.language_models import static_cache

        return static_cache(model, self.cache_length)


def build(shape: Shape, seed: int, empty: bool = False):
    """The Llama with random weights, made in ``shape.dtype`` on ``shape.device`` (never a float32 copy first);
    ``empty``: its parameters on the meta device (accelerate's ``init_empty_weights``; buffers real), for a
    load that fills them all."""
    import contextlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape.dtype))
    if empty:
        from accelerate import init_empty_weights
    try:
        with torch.device(shape.device), init_empty_weights() if empty else contextlib.nullcontext():
            model = LlamaForCausalLM(LlamaConfig(**shape.config()))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def read_through(folder: Path) -> None:
    """Reads every file once, so that the load that follows reads from the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


# --- phases: each records its figures, its error, or why it did not run ------------------------------


#: each process's phases, in order (the parent names those a stopped process never reached)
PHASES = {
    "build": ["tune", "save"],
    "serve": ["prepare", "load", "series", "decode", "ttft", "deactivate", "tokens", "hand_decode", "hand_ttft"],
}


class Phases:
    """Runs a process's phases in order. A phase returns its figures (a dict, emitted for the parent); one
    that raises records its error; one whose prerequisite failed, or that would start after the
    deadline, records why it was skipped. Either way the next phase runs, and each phase's outcome
    (``ok``, ``error``, ``skipped``) goes to the parent under ``phases``."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline
        self.missing: set[str] = set()

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()

    def run(self, name: str, function, *, needs: tuple[str, ...] = ()) -> dict | None:
        why = next((f"{need} did not run" for need in needs if need in self.missing), None)
        if why is None and (self.left() or 1) <= 0:
            why = "the --budget ran out"
        if why:
            self.missing.add(name)
            emit(skipped={name: why}, phases={name: "skipped"})
            return None
        try:
            figures = function()
        except Exception as error:  # noqa: BLE001  (recorded in the report; the next phase still runs)
            self.missing.add(name)
            traceback.print_exc()
            emit(errors={name: f"{type(error).__name__}: {error}"[:2000]}, phases={name: "error"})
            return None
        emit(**figures, phases={name: "ok"})
        return figures


# --- the build process: tune and save ----------------------------------------------------------------


def step_build(
    shape: Shape,
    package: Path,
    phases: Phases,
    quantize: str | None = None,
    floor: float | None = None,
    backend_list: str | None = None,
) -> None:
    # tuning's progress (each candidate built, checked, timed) goes to the build process's log
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("xpupack").addHandler(handler)
    logging.getLogger("xpupack").setLevel(logging.INFO)
    emit_device_name(shape)
    built: dict = {}
    phases.run("tune", lambda: tune(shape, built, package, quantize, floor, backend_list))
    phases.run("save", lambda: save(built["model"], package), needs=("tune",))


def emit_device_name(shape: Shape) -> None:
    import torch

    emit(device_name=torch.cuda.get_device_name() if shape.device.startswith("cuda") else shape.device)


def quantized_chain(device: str, config: str, floor: float | None = None):
    """The one quantized candidate of ``--quantize``, as the thorough search builds it
    (`xpupack.searches.quantized_candidates`: TorchAO's ``config`` under Inductor with coordinate descent, in a
    device graph where the device has them); the accuracy floor is ``--min-sqnr-db`` where given, else
    ``llm_decode.py``'s (20 dB for weight-only int8: a random 8B model's logits are close, so its tokens drift
    sooner than a trained model's), else the config's own."""
    import torch

    import xpupack
    from llm_decode import QUANTIZED
    from xpupack.searches import quantized_candidates

    floor = dict(QUANTIZED.values()).get(config) if floor is None else floor
    torchao = xpupack.TorchAOBackend(config, **({} if floor is None else {"min_sqnr_db": floor}))
    return quantized_candidates(torch.device(device), [torchao])[0]


def hand_compile_settings(device: str, config: str | None) -> dict:
    """``torch.compile``'s settings for the hand-compiled step: the defaults for bf16 (the default strategy's),
    the quantized candidate's with ``--quantize`` (coordinate descent, and TorchAO's own)."""
    import torch

    if config is None:
        return {}
    chain = quantized_chain(device, config)
    inductor = chain if chain.name == "inductor" else chain.base
    return inductor.compile_settings(torch.device(device))


def round_to_grid(model, config: str) -> int:
    """Rounds every linear layer's weight to what TorchAO's ``config`` stores (quantized, then dequantized in
    place); returns how many. Random weights at full precision are no model to quantize: through 32 layers an
    8B one's logits lost 15.5 dB to int8 weight-only and all their signal to int4 (-0.4 dB SQNR, H100), and the
    accuracy check rightly refused both. Weights already on the grid stand for a trained model's, whose
    quantization costs little. bf16 cannot hold every grid point times its scale, so the rounding removes a
    part of the loss, not all (int8 on the tiny CPU model: 43-44 dB per layer before, 48 after); where the
    check still refuses, ``--min-sqnr-db`` sets the floor and the JSON's settings say so."""
    import torch
    from torchao.quantization import quantize_

    import xpupack

    settings = xpupack.TorchAOBackend(config).config
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    with torch.no_grad():
        for module in linears:  # one layer's copy at a time: an 8B model has no room for two
            probe = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            probe.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            quantize_(probe, settings)
            module.weight.copy_(stored_weight(probe, module.weight.dtype))
    return len(linears)


def stored_weight(layer, dtype):
    """The weight a quantized linear layer computes with, in ``dtype``: ``dequantize()``, or where its tensor type
    has none (int4's tile-packed layout for torchao's tinygemm kernel) the layer's own product with the
    identity, ``linear(I, W) = W^T``, 1024 rows of it at a time."""
    import torch

    try:
        return layer.weight.dequantize().to(dtype)
    except NotImplementedError:
        blocks = []
        for start in range(0, layer.in_features, 1024):
            rows = min(1024, layer.in_features - start)
            block = torch.zeros(rows, layer.in_features, dtype=dtype, device=layer.weight.device)
            block[:, start : start + rows].fill_diagonal_(1)
            blocks.append(layer(block))
        return torch.cat(blocks).t()


def tune(
    shape: Shape,
    built: dict,
    package: Path,
    quantize: str | None = None,
    floor: float | None = None,
    backend_list: str | None = None,
) -> dict:
    import torch

    import xpupack
    from llm_decode import greedy_generate
    from support.language_models import decode_loop

    model = built["model"] = build(shape, seed=0)
    rounded = {} if quantize is None else {"weights_rounded_to_grid": round_to_grid(model, quantize)}
    with torch.inference_mode():  # the serve's reference: a quantized package has no bf16 weights to rerun
        eager = greedy_generate(model, shape, shape.batch, disable_compile=True)
    reference_tokens(package).write_text(json.dumps(eager[:, shape.prompt :].tolist()))

    def run(m, kind: str):
        if kind == "loop":
            return decode_loop(m, shape.ids(shape.batch), min(8, shape.new_tokens), shape.cache(m))
        return greedy_generate(m, shape, shape.batch)

    strategy = None if quantize is None else xpupack.Only(quantized_chain(shape.device, quantize, floor))
    if backend_list is not None:  # the candidates named, in order, as `xpupack build --backends` takes them
        from xpupack.cli.build import parse_backends

        strategy = xpupack.FirstWins(parse_backends(backend_list))
    started = time.perf_counter()
    with torch.inference_mode():
        xpupack.tune(model, ["loop", "generate"], run=run, device=shape.device, strategy=strategy)
    return {
        **rounded,
        "tune_s": round(time.perf_counter() - started, 2),
        "tuned_backends": backends(model),
        "tuned_candidates": candidates(model),
    }


def reference_tokens(package: Path) -> Path:
    """Where the build leaves eager's greedy tokens (a JSON list per row) for the serve to compare with."""
    return package.parent / "reference_tokens.json"


def save(model, package: Path) -> dict:
    import xpupack

    started = time.perf_counter()
    xpupack.save(model, package)
    seconds = time.perf_counter() - started
    size = folder_bytes(package)
    return {
        "save_s": round(seconds, 2),
        "package_gb": round(size / GB, 6),
        "save_gb_s": significant(size / GB / seconds),
    }


def significant(value: float) -> float:
    """``value`` to 4 significant digits (a tiny package's GB/s stays above 0)."""
    return float(f"{value:.4g}")


def backends(model) -> dict:
    """Each tuned module's backend in full (``graph+inductor``; `xpupack.stats` names only the outer one)."""
    import xpupack

    session = xpupack.tuned.session_of(model)
    return {path or "<model>": module.backend.label for path, module in session.modules.items()}


def candidates(model) -> dict:
    """Each tuned module's candidates, one `xpupack.candidate.Candidate.summary` line each (why one was
    chosen, refused or slower), as `xpupack inspect` shows them."""
    import xpupack

    session = xpupack.tuned.session_of(model)
    return {path or "<model>": [c.summary() for c in module.report] for path, module in session.modules.items()}


# --- the serve process: load on empty caches, serve, compare with hand-compiled code -------------------


class Server:
    """A fresh server's view of the package: each method is one phase of `step_serve`."""

    def __init__(
        self, shape: Shape, package: Path, warmup: str | None, quantize: str | None = None, empty: bool = False
    ):
        self.shape, self.package, self.warmup, self.quantize, self.empty = shape, package, warmup, quantize, empty
        self.model = None
        self.started = 0.0  # perf_counter when load() started
        self.prefill_fallbacks = 0
        self.last_tokens = None

    def prepare(self) -> dict:
        """What a server does before the clock: device context, the model, the package in the page cache."""
        import torch

        torch.zeros(1, device=self.shape.device)
        # other weights than the package's (the load replaces them), or none at all with --empty-model
        self.model = build(self.shape, seed=1, empty=self.empty)
        read_through(self.package)
        sync(self.shape.device)
        return {}

    def load(self) -> dict:
        device, before = self.shape.device, device_memory_before(self.shape.device)
        compiled_before = compile_seconds()
        self.started = time.perf_counter()
        import xpupack  # inside the clock: a server pays for it

        xpupack.load(self.model, self.package, device=device, warmup=self.warmup)
        seconds = time.perf_counter() - self.started
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        self.count_prefill_fallbacks()
        phases = xpupack.stats(self.model, totals=True)["totals"]["load_seconds"]
        return {
            "load_s": round(seconds, 3),
            "load_gb_s": significant(folder_bytes(self.package) / GB / seconds),
            "load_phases": {phase: round(phase_s, 3) for phase, phase_s in phases.items()},
            "extra_device_memory_gb": round(device_memory_growth(device, before) / GB, 3),
            "threads_alive_after_load": threads,
            "load_compile_s": compile_seconds_since(compiled_before),
            "load_compiler_counters": compiler_counters(),
        }

    def count_prefill_fallbacks(self) -> None:
        """From now on, counts in ``prefill_fallbacks`` every fallback of a call of more than one token."""
        from xpupack._listeners import add_fallback_listener

        tokens = [0]  # of the model call under way

        def note(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            tokens[0] = ids.shape[-1] if ids is not None else 0

        def count(event) -> None:
            if tokens[0] > 1:
                self.prefill_fallbacks += 1

        self.model.register_forward_pre_hook(note, with_kwargs=True)
        add_fallback_listener(count)

    def series(self, seconds: float, left) -> dict:
        """Back-to-back ``generate()`` calls until ``seconds`` after load() started (or the budget ends)."""
        first_token = FirstToken(self.shape.device)
        points, starts = [], []
        while not points or time.perf_counter() - self.started < seconds:
            if points and (left() or 1) <= 0:
                emit(skipped={"series_rest": f"the --budget ran out {points[-1][0]} s after load() started"})
                break
            starts.append(time.perf_counter() - self.started)
            tokens_s = self.generate_tokens_s(first_token if not points else None)
            points.append([round(time.perf_counter() - self.started, 3), round(tokens_s, 2)])
        rates = [rate for _, rate in points]
        steady = statistics.median(rates[-max(1, len(rates) // 3) :])
        return {
            "load_to_first_token_s": round(first_token.at - self.started, 3),
            "time_series": points,
            "slowest_generate_tokens_s": min(rates),
            "steady_tokens_s": steady,
            "time_to_full_speed_s": full_speed_at(starts, rates, steady),
            "stats": stats_summary(self.model),
            "prefill_fallbacks": self.prefill_fallbacks,
        }

    def generate_tokens_s(self, first_token=None) -> float:
        import torch
        from transformers import StoppingCriteriaList

        from llm_decode import greedy_generate

        options = {"stopping_criteria": StoppingCriteriaList([first_token])} if first_token else {}
        with torch.inference_mode():
            out, seconds = synced(
                self.shape.device, lambda: greedy_generate(self.model, self.shape, self.shape.batch, **options)
            )
        self.last_tokens = out[:, self.shape.prompt :].cpu()
        return self.shape.batch * self.shape.new_tokens / seconds

    def decode(self) -> dict:
        import torch

        from llm_decode import loop_tokens_per_s

        with torch.inference_mode():
            tokens_s, _, _ = loop_tokens_per_s(self.model, self.shape, self.shape.batch)
        return {"decode_tokens_s": round(tokens_s, 2)}

    def ttft(self) -> dict:
        return {"ttft_s": round(prefill_seconds(self.model, self.model, self.shape), 4)}

    def deactivate(self) -> dict:
        """From here on the model is eager, with the package's weights: the reference for the phases after."""
        import xpupack
        from xpupack import _background

        _background.wait(600)
        xpupack.deactivate(self.model)
        return {}

    def tokens(self) -> dict:
        """The package's tokens (the last ``generate()`` of the series) against the build's eager tokens."""
        import torch

        eager = torch.tensor(json.loads(reference_tokens(self.package).read_text()))
        differ = (eager != self.last_tokens).any(0).nonzero()
        return {"tokens_equal": not len(differ), "first_differing_position": int(differ[0]) if len(differ) else None}

    def hand_decode(self) -> dict:
        import torch

        from llm_decode import hand_graph, loop_tokens_per_s

        capture = self.shape.device != "cpu"
        settings = hand_compile_settings(self.shape.device, self.quantize)
        step = hand_graph(self.model, self.shape, compiled=True, capture=capture, compile_settings=settings)
        with torch.inference_mode():
            tokens_s, _, _ = loop_tokens_per_s(self.model, self.shape, self.shape.batch, step)
        how = (
            "a device graph of the torch.compile'd step" if capture else "the torch.compile'd step (no graphs on a CPU)"
        )
        return {"hand_decode_tokens_s": round(tokens_s, 2), "hand": how}

    def hand_ttft(self) -> dict:
        import torch

        compiled = torch.compile(self.model.forward, dynamic=False)
        return {"hand_ttft_s": round(prefill_seconds(compiled, self.model, self.shape), 4)}


class FirstToken:
    """A stopping criterion that never stops: it notes when ``generate()`` has its first token."""

    def __init__(self, device: str):
        self.device, self.at = device, None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.at is None:
            sync(self.device)
            self.at = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def full_speed_at(starts: list[float], rates: list[float], steady: float) -> float | None:
    """When the last run of ``generate()`` calls at ≥ `FULL_SPEED` × steady began (None: the last was slower)."""
    slow = [i for i, rate in enumerate(rates) if rate / steady < FULL_SPEED]
    if not slow:
        return round(starts[0], 3)
    last = slow[-1]
    return round(starts[last + 1], 3) if last + 1 < len(starts) else None


def prefill_seconds(forward, model, shape: Shape, repeats: int = 3) -> float:
    """Median seconds of ``forward`` prefilling the prompt into a reset cache, to the first token (argmax),
    after one untimed call (a compile's, or a package's first)."""
    import inspect

    import torch

    from support.language_models import cache_argument

    cache, ids = shape.cache(model), shape.ids(shape.batch)
    at = torch.arange(ids.shape[1], device=ids.device)
    inputs = {"input_ids": ids, cache_argument(model): cache, "use_cache": True, "position_ids": at[None]}
    if "cache_position" in inspect.signature(type(model).forward).parameters:  # transformers before 5.20
        inputs["cache_position"] = at

    def first_token():
        return forward(**inputs).logits[:, -1].argmax(-1)

    def once() -> float:
        with torch.inference_mode():  # the cache's tensors are made, and reset, in inference mode
            cache.reset()
            return synced(shape.device, first_token)[1]

    once()
    return statistics.median(once() for _ in range(repeats))


def stats_summary(model) -> dict:
    import xpupack

    stats = xpupack.stats(model, totals=True)
    modules = stats["modules"].items()
    reasons: dict[str, int] = {}
    for _, entry in modules:
        for reason, count in entry.get("fallback_reasons", {}).items():
            reasons[reason] = reasons.get(reason, 0) + count
    return {
        "calls": stats["totals"]["calls"],
        "fallbacks": stats["totals"]["fallbacks"],
        "compiling": sum(entry.get("compiling", 0) for _, entry in modules),
        "fallback_reasons": reasons,
        "backends": backends(model),
    }


def device_memory_before(device: str) -> int:
    """What `device_memory_growth` measures from: bytes allocated on the GPU, or the CPU's resident peak."""
    import resource

    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_memory_growth(device: str, before: int) -> int:
    import resource

    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() - before
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def step_serve(
    shape: Shape,
    package: Path,
    seconds: float,
    warmup: str,
    phases: Phases,
    quantize: str | None = None,
    empty: bool = False,
) -> None:
    emit_device_name(shape)  # also where the build ran in another call (--only serve)
    server = Server(shape, package, warmup=None if warmup == "none" else warmup, quantize=quantize, empty=empty)
    phases.run("prepare", server.prepare)
    phases.run("load", server.load, needs=("prepare",))
    phases.run("series", lambda: server.series(seconds, phases.left), needs=("load",))
    decode = phases.run("decode", server.decode, needs=("load",))
    ttft = phases.run("ttft", server.ttft, needs=("load",))
    phases.run("deactivate", server.deactivate, needs=("load",))
    phases.run("tokens", server.tokens, needs=("series",))
    hand = phases.run("hand_decode", server.hand_decode, needs=("deactivate",))
    if decode and hand:
        emit(decode_vs_hand=round(decode["decode_tokens_s"] / hand["hand_decode_tokens_s"], 3))
    hand = phases.run("hand_ttft", server.hand_ttft, needs=("deactivate",))
    if ttft and hand:
        emit(ttft_vs_hand=round(ttft["ttft_s"] / hand["hand_ttft_s"], 3))


# --- the parent: two fresh processes, the budget, the report ------------------------------------------


def run_steps(args: argparse.Namespace, workdir: Path, deadline: float | None) -> dict:
    """The build and serve processes (or the one ``--only`` names) of one package in ``workdir``; their figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    found: dict = {}
    for step in (args.only,) if args.only else ("build", "serve"):
        if step == "serve" and found.get("package_gb") is None and not args.only:
            merge(found, {"skipped": {"serve": "no package: the build did not finish"}})
        elif deadline is not None and deadline <= time.time():
            merge(found, {"skipped": {step: "the --budget ran out"}})
        else:
            merge(found, run_step(step, args, workdir, deadline))
    return found


#: the figures `over_baseline` compares: a quantized package's over the unquantized one's
COMPARED = ["decode_tokens_s", "package_gb", "load_s", "time_to_full_speed_s", "extra_device_memory_gb", "ttft_s"]


def over_baseline(quantized: dict, baseline: dict) -> dict:
    """Each of `COMPARED` of ``quantized`` over ``baseline``'s, to 3 decimals; None where either is missing or the
    baseline's is 0."""
    ratios: dict = {}
    for name in COMPARED:
        mine, theirs = quantized.get(name), baseline.get(name)
        ratios[name] = round(mine / theirs, 3) if mine is not None and theirs else None
    return ratios


def run_step(step: str, args: argparse.Namespace, workdir: Path, deadline: float | None) -> dict:
    """Runs ``step`` in a fresh process on empty compiler caches, stopped at ``deadline`` (its phases stop
    starting a margin before it); returns its figures, and what happened to the phases it never finished."""
    command = [sys.executable, __file__, *child_arguments(args), "--step", step, "--workdir", str(workdir)]
    if deadline is not None:
        command += ["--deadline", str(deadline - min(30, args.budget / 10))]
    log = workdir / f"{step}.log"
    with open(log, "w") as errors:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**empty_compiler_caches(workdir / f"caches-{step}"), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # its compile workers go with it when it is stopped
        )
        try:
            out, _ = process.communicate(timeout=None if deadline is None else max(1, deadline - time.time()))
            stopped = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            stopped = True
    found: dict = {}
    for line in out.splitlines():
        if line.startswith(MARK):
            merge(found, json.loads(line[len(MARK) :]))
    if stopped:
        unfinished(found, step, "stopped by the --budget while it ran")
    elif process.returncode:
        unfinished(
            found, step, f"the process exited with {process.returncode}: " + log.read_text(errors="replace")[-1500:]
        )
    return found


def unfinished(found: dict, step: str, why: str) -> None:
    """The phases of ``step`` that a stopped or crashed process left without an outcome: the one that was
    running gets ``why`` as its error, the ones after it are skipped."""
    outcomes = found.setdefault("phases", {})
    never = [name for name in PHASES[step] if name not in outcomes]
    if not never:  # it failed after its last phase
        merge(found, {"errors": {step: why}})
        return
    merge(found, {"errors": {never[0]: why}, "phases": {never[0]: "error"}})
    for name in never[1:]:
        merge(found, {"skipped": {name: f"{never[0]} did not finish"}, "phases": {name: "skipped"}})


def child_arguments(args: argparse.Namespace) -> list[str]:
    names = ["device", "dtype", *LLAMA3_8B, "prompt", "new_tokens", "batch", "seconds", "warmup"]
    parts = [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    quantize = ["--quantize", args.quantize] if args.quantize else []
    backends = ["--backends", args.backends] if args.backends else []
    floor = ["--min-sqnr-db", str(args.min_sqnr_db)] if args.min_sqnr_db is not None else []
    return parts + quantize + backends + floor + (["--empty-model"] if args.empty_model else [])


def report_head(args: argparse.Namespace) -> dict:
    from importlib.metadata import version

    import torch

    return {
        "benchmark": "big_model",
        "device": args.device,
        "device_name": None,
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "settings": {name: getattr(args, name) for name in Shape.__dataclass_fields__}
        | {
            "seconds": args.seconds,
            "warmup": args.warmup,
            "quantize": args.quantize,
            "min_sqnr_db": args.min_sqnr_db,
            "backends": args.backends,
            "empty_model": args.empty_model,
            "baseline": args.baseline,
        },
        **dict.fromkeys(FIELDS),
        "tuned_backends": None,
        "tuned_candidates": None,
        "phases": {},
        "errors": {},
        "skipped": {},
    }


def parser() -> argparse.ArgumentParser:
    import torch

    from xpupack.searches import QUANTIZE_CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    for name, default in LLAMA3_8B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"default {default}")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per generate() (default 128)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=60, help="the time series' window after load() starts")
    parser.add_argument(
        "--warmup",
        choices=["auto", "none"],
        default="auto",
        help="xpupack.load's warmup: 'auto' compiles the prefill and decode steps inside load() (default)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_CONFIGS,
        default=None,
        metavar="CONFIG",
        help=f"tune one quantized candidate (graph+inductor+torchao:CONFIG) instead of the default strategy; "
        f"one of {', '.join(QUANTIZE_CONFIGS)}",
    )
    parser.add_argument(
        "--min-sqnr-db",
        type=float,
        default=None,
        metavar="DB",
        help="--quantize's accuracy floor (default: llm_decode.py's, else the config's); the JSON's settings say it",
    )
    parser.add_argument(
        "--backends",
        default=None,
        metavar="LIST",
        help="tune these candidates in order instead of the default strategy, as `xpupack build --backends` "
        "takes them (graph+aoti,graph+inductor); not with --quantize",
    )
    parser.add_argument(
        "--empty-model",
        action="store_true",
        help="the server builds the model empty (accelerate's init_empty_weights) and the load fills it: how a "
        "quantized package keeps only the quantized weights in memory (docs/packages.md)",
    )
    parser.add_argument(
        "--baseline",
        nargs="?",
        const="default",
        default=None,
        metavar="LIST",
        help="with --quantize: also build and serve the unquantized package in this run, first (with the default "
        "strategy, or the candidates LIST names as --backends takes them), and report the quantized one's figures "
        "over its (vs_baseline); --empty-model applies to the quantized one only",
    )
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="phases after it are skipped")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--workdir", default=None, help="package, caches and logs (default: a temporary folder)")
    parser.add_argument(
        "--only",
        choices=["build", "serve"],
        default=None,
        help="run one of the two processes: 'serve' loads the package an earlier 'build' left in --workdir",
    )
    parser.add_argument("--step", choices=["build", "serve"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser_ = parser()
    args = parser_.parse_args(argv)
    if args.quantize and args.backends:
        parser_.error("--quantize tunes its own candidate: give --quantize or --backends, not both")
    if args.baseline and not args.quantize:
        parser_.error("--baseline is the unquantized package a --quantize run is measured against: give --quantize")
    shape = Shape.of(args)
    if args.step:
        package, phases = Path(args.workdir) / "pkg", Phases(args.deadline)
        if args.step == "build":
            step_build(shape, package, phases, args.quantize, args.min_sqnr_db, args.backends)
        else:
            step_serve(shape, package, args.seconds, args.warmup, phases, args.quantize, args.empty_model)
        return {}
    started = time.perf_counter()
    deadline = time.time() + args.budget if args.budget else None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="big-model-"))
    report = report_head(args)
    if args.baseline:
        baseline = argparse.Namespace(
            **{**vars(args), "quantize": None, "min_sqnr_db": None, "empty_model": False, "baseline": None}
        )
        baseline.backends = None if args.baseline == "default" else args.baseline
        packages = [(baseline, workdir / "baseline"), (args, workdir / "quantized")]
    else:
        packages = [(args, workdir)]
    for _, folder in packages:  # before anything runs: a serve must not spend the budget on the first alone
        if args.only == "serve" and not (folder / "pkg").is_dir():
            raise SystemExit(f"--only serve: no package in {folder} (run --only build with this --workdir first)")
    found = [run_steps(package_args, folder, deadline) for package_args, folder in packages]
    merge(report, found[-1])
    if args.baseline:
        report["baseline"] = found[0]
        report["vs_baseline"] = over_baseline(report, found[0])
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return json.loads(text)


if __name__ == "__main__":
    main()
