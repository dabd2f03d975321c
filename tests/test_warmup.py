"""``xpupack.load(..., warmup=...)``: what only a real call can compile (a language model's calls with a KV
cache) is compiled inside the load, so the first ``generate()`` after it compiles nothing (issue 35)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging

import pytest
import torch
from click.testing import CliRunner

import xpupack
from support.language_models import (
    NEW_TOKENS,
    decode_loop,
    generate,
    prompt,
    static_cache,
    tiny_llama,
    tiny_mistral,
    tune_llm,
    whole,
)
from support.models import make_stack, stack_samples
from support.strategies import GRAPH
from xpupack import warmup
from xpupack.cli import main


def compiles() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def only(model) -> dict:
    """The `xpupack.stats` entry of the one tuned module."""
    (entry,) = xpupack.stats(model).values()
    return entry


@pytest.fixture
def stack_package(emulated_graphs, tmp_path):
    model = make_stack()
    xpupack.tune(model, stack_samples(), strategy=GRAPH)
    return xpupack.save(model, tmp_path / "pkg")


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", [xpupack.InductorBackend(), xpupack.GraphBackend(base=xpupack.InductorBackend())], ids=str
)
def test_auto_warmup_compiles_a_language_models_prefill_and_decode_inside_load(
    emulated_graphs, tmp_path, fallback_calls, backend
):
    model, reference = tune_llm(xpupack.Only(backend))
    root = xpupack.save(model, tmp_path / "pkg")
    before = compiles()
    loaded = xpupack.load(tiny_llama(), root, warmup="auto")
    assert compiles() > before  # the prefill and the decode step, compiled in load()
    assert whole(loaded)["calls"] == 0  # the warm-up's calls are not the caller's
    before = compiles()
    tokens = generate(loaded, prompt(seed=3), NEW_TOKENS)
    assert compiles() == before  # nothing compiles on the caller's path
    assert torch.equal(tokens, generate(reference, prompt(seed=3), NEW_TOKENS, eager=True))
    assert whole(loaded)["fallbacks"] == 0 and fallback_calls == []


@pytest.mark.parametrize("options", [{}, {"warmup": "auto"}], ids=["by-default", "auto"])
def test_the_auto_warmup_generates_each_tuned_prompt_and_cache_length(emulated_graphs, tmp_path, monkeypatch, options):
    model, _ = tune_llm(GRAPH)
    root = xpupack.save(model, tmp_path / "pkg")
    made = []
    monkeypatch.setattr(warmup, "_greedy_generate", lambda *shape: made.append(shape) or (lambda m: None))
    loaded = xpupack.load(tiny_llama(), root, **options)
    # batch 1, the 8-token prompt, a static cache of 8 + NEW_TOKENS - 1 positions (what generate() sizes)
    assert made == [(1, 8, 8 + NEW_TOKENS - 1, False)]
    assert "warmup" in xpupack.stats(loaded, totals=True)["totals"]["load_seconds"]


@pytest.mark.parametrize("with_mask", [True, False], ids=["with-a-mask", "without"])
def test_the_auto_warmup_gives_generate_an_attention_mask_where_the_tuned_one_had_one(
    emulated_graphs, tmp_path, fallback_calls, with_mask
):
    """transformers builds the 4-d mask of a sliding window's forward from the mask given to ``generate()``,
    so a prefill with a mask and one without are two signatures: a warm-up with another than the tuned
    call's would leave the tuned prefill uncompiled, and its own prefill would fall back."""
    mask = (lambda ids: {"attention_mask": torch.ones_like(ids)}) if with_mask else (lambda ids: {})

    def run(model, ids):
        return model.generate(ids, **mask(ids), max_new_tokens=NEW_TOKENS, cache_implementation="static")

    model, _ = tune_llm(GRAPH, make=lambda: tiny_mistral(sliding_window=10), run=run)
    (shape,) = filter(None, map(warmup._prefill_shape, xpupack.tuned.session_of(model).modules[""].spec.signatures))
    # either way the forward got a mask: both are tried; every layer slides, so the cache is the window long
    assert shape == (1, 8, 10, (True, False))
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(tiny_mistral(sliding_window=10, seed=3), root)
    assert fallback_calls == []  # a warm-up's own fallback (the other mask) is not the caller's
    run(loaded, prompt(seed=4))
    assert whole(loaded)["fallbacks"] == 0 and whole(loaded)["new_sizes"] == 0  # what the warm-up made fits


def test_no_warmup_with_none_or_with_defer_compile(emulated_graphs, tmp_path, monkeypatch):
    model, _ = tune_llm(GRAPH)
    root = xpupack.save(model, tmp_path / "pkg")
    made = []
    monkeypatch.setattr(warmup, "_greedy_generate", lambda *shape: made.append(shape) or (lambda m: None))
    loaded = xpupack.load(tiny_llama(), root, warmup=None)
    assert "warmup" not in xpupack.stats(loaded, totals=True)["totals"]["load_seconds"]
    xpupack.load(tiny_llama(), root, defer_compile=True)  # returns at once: its compiles run while calls serve
    assert made == []


def test_the_auto_warmup_leaves_out_the_prefill_of_a_hand_written_loop(emulated_graphs, tmp_path, monkeypatch):
    """Regression: a package tuned on a decode loop (a cache of 24) and on generate() (15) warmed up with a
    generate() of each; transformers kept the larger cache on the model and reused it for the caller's
    generate(), whose prefill then fell back and whose decode step compiled again at load's end."""

    def run(model, ids):
        decode_loop(model, ids, 4, static_cache(model, 24))
        return generate(model, ids, NEW_TOKENS)

    model, _ = tune_llm(GRAPH, run=run)
    root = xpupack.save(model, tmp_path / "pkg")
    made = []
    monkeypatch.setattr(warmup, "_greedy_generate", lambda *shape: made.append(shape) or (lambda m: None))
    xpupack.load(tiny_llama(), root, warmup="auto")
    assert made == [(1, 8, 8 + NEW_TOKENS - 1, False)]


def test_a_warmup_function_runs_once_inside_load_and_its_calls_are_not_counted(stack_package):
    seen = []

    def warm(model):
        seen.append((torch.is_grad_enabled(), only(model)["calls"]))
        model(stack_samples()[0])

    loaded = xpupack.load(make_stack(), stack_package, warmup=warm)
    assert seen == [(False, 0)]  # under no_grad, the package already active
    assert only(loaded)["calls"] == 0


def warmup_modes(package, *load_modes) -> list[bool]:
    """Whether the warm-up ran under inference mode, for a load of ``package`` in each of ``load_modes``."""
    seen: list[bool] = []
    for mode in load_modes:
        with mode():
            xpupack.load(make_stack(), package, warmup=lambda m: seen.append(torch.is_inference_mode_enabled()))
    return seen


def test_a_load_under_inference_mode_or_no_grad_warms_up_there(stack_package):
    """Compiled code guards on the mode of a call with state: a server that loads in a mode serves there, so
    its warm-up runs there too."""
    assert json.loads((stack_package / "xpupack.json").read_text())["samples_mode"] == "no_grad"
    assert warmup_modes(stack_package, torch.inference_mode, torch.no_grad, contextlib.nullcontext) == [
        True,
        False,
        False,
    ]


def test_a_load_in_neither_mode_warms_up_in_the_mode_the_package_was_tuned_in(emulated_graphs, tmp_path):
    """Regression (H100, Llama-3-8B's shapes): a package tuned under inference_mode, loaded outside any mode
    and served under inference_mode, warmed up under no_grad: its compile missed the package's artifacts
    (load 136 s) and the first generate() compiled once more for inference mode (70 s)."""
    model = make_stack()
    with torch.inference_mode():
        xpupack.tune(model, stack_samples(), strategy=GRAPH)
    package = xpupack.save(model, tmp_path / "pkg")
    assert json.loads((package / "xpupack.json").read_text())["samples_mode"] == "inference_mode"
    inspected = CliRunner().invoke(main, ["inspect", "--json", str(package)])
    assert json.loads(inspected.output)["samples_mode"] == "inference_mode", inspected.output
    assert warmup_modes(package, contextlib.nullcontext, torch.no_grad) == [True, False]
    manifest = json.loads((package / "xpupack.json").read_text())
    del manifest["samples_mode"]  # a package that does not say (built before it was recorded)
    (package / "xpupack.json").write_text(json.dumps(manifest))
    assert warmup_modes(package, contextlib.nullcontext) == [False]


def test_a_failing_warmup_is_a_warning_and_the_load_stands(stack_package, caplog):
    def broken(model):
        raise RuntimeError("no tokenizer here")

    with caplog.at_level(logging.WARNING, logger="xpupack"):
        loaded = xpupack.load(make_stack(), stack_package, warmup=broken)
    assert "the warm-up failed (RuntimeError: no tokenizer here)" in caplog.text
    reference = make_stack()
    x = stack_samples()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), reference(x))
    assert only(loaded)["fallbacks"] == 0


def test_auto_warms_nothing_for_a_package_without_a_tuned_prefill(stack_package):
    loaded = xpupack.load(make_stack(), stack_package, warmup="auto")
    assert warmup.generate_calls(loaded, xpupack.tuned.session_of(loaded)) == []


@pytest.mark.parametrize("value", ["always", 1, True])
def test_warmup_is_none_auto_or_a_function(stack_package, value):
    model = make_stack()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="give None, 'auto'"):
        xpupack.load(model, stack_package, warmup=value)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
