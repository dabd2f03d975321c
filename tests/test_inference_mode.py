"""Tuning, saving, loading and serving under `torch.inference_mode()`, `torch.no_grad()` or neither.

Tensors made under inference mode cannot be written in place outside it, and
most code that runs a model (transformers' ``generate()`` included) runs it
under inference mode: xpupack must work whichever mode the caller's code uses,
at every step, and in any mix of them (tuned in one, served in another).

CPU: the graph backend's logic through the emulated graph.
"""

import contextlib
import copy

import pytest
import torch

import xpupack
from support.language_models import prompt, tiny_llama
from support.models import Accumulator, RunningCache, make_stack, stack_samples
from support.strategies import GRAPH

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "neither": contextlib.nullcontext}
TOKENS = 5

xpupack.register_state(RunningCache, lambda cache: [cache.total, cache.steps])


def generate(model, ids, mode: str):
    with MODES[mode]():  # disable_compile: the untuned reference must not compile itself (it would on a GPU)
        return model.generate(
            ids,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,
        )


@pytest.mark.parametrize("tune_mode", MODES)
def test_a_language_model_tunes_saves_loads_and_serves_in_every_mode(
    emulated_graphs, tmp_path, tune_mode, fallback_calls
):
    """The samples' run uses the mode (as a user's generate loop does), `tune` itself is called outside it."""
    model, reference = tiny_llama(), tiny_llama()
    xpupack.tune(model, [prompt()], run=lambda m, ids: generate(m, ids, tune_mode), strategy=GRAPH)
    assert xpupack.stats(model)[""]["backend"] == "graph"
    with MODES[tune_mode]():
        root = xpupack.save(model, tmp_path / "pkg")
    for serve_mode in MODES:
        fresh = tiny_llama()
        with MODES[serve_mode]():
            loaded = xpupack.load(fresh, root)
        replays = emulated_graphs.replays
        ids = prompt(seed=7)
        assert torch.equal(generate(loaded, ids, serve_mode), generate(reference, ids, serve_mode)), serve_mode
        stats = xpupack.stats(loaded)[""]
        assert stats["fallbacks"] == 0, (serve_mode, stats)  # the prefill too: its cache is allocated ahead
        assert emulated_graphs.replays - replays == TOKENS - 3, serve_mode  # a run, a recording, then replays
    assert fallback_calls == []


def plain_model():
    """The stack, deployed as such models are: parameters that need no grad (else a call under
    neither mode needs autograd, which a recording cannot give: it runs the original module)."""
    return make_stack().requires_grad_(False)


def samples_in(mode: str) -> list:
    with MODES[mode]():
        return [sample.clone() for sample in stack_samples()]


@pytest.mark.parametrize("tune_mode", MODES)
def test_a_plain_model_tunes_saves_loads_and_serves_in_every_mode(emulated_graphs, tmp_path, tune_mode):
    model, reference = plain_model(), plain_model()
    with MODES[tune_mode]():
        xpupack.tune(model, samples_in(tune_mode), modules=["layers.*.mlp"], strategy=GRAPH)
        root = xpupack.save(model, tmp_path / "pkg")
    for serve_mode in MODES:
        fresh = plain_model()
        with MODES[serve_mode]():
            loaded = xpupack.load(fresh, root)
        for tuned in (model, loaded):
            for sample in (*samples_in(serve_mode), samples_in(serve_mode)[1][:3]):  # [:3]: padded up to 4
                with MODES[serve_mode]():
                    assert torch.allclose(tuned(sample), reference(sample), atol=1e-6), serve_mode
            stats = xpupack.stats(tuned)
            assert all(s["backend"] == "graph" and s["fallbacks"] == 0 and s["padded"] >= 1 for s in stats.values()), (
                serve_mode,
                stats,
            )
    assert all(not p.is_inference() for p in loaded.parameters())


def test_a_model_built_under_inference_mode_tunes_loads_and_serves_there(emulated_graphs, tmp_path):
    """Its weights are inference tensors, usable only under inference mode: xpupack stays in it."""
    with torch.inference_mode():
        model, reference, fresh = plain_model(), plain_model(), plain_model()
        samples = samples_in("inference_mode")
        xpupack.tune(model, samples, modules=["layers.*.mlp"], strategy=GRAPH)
        root = xpupack.save(model, tmp_path / "pkg")
        loaded = xpupack.load(fresh, root)
        for tuned in (model, loaded):
            assert torch.allclose(tuned(samples[1][:3]), reference(samples[1][:3]), atol=1e-6)
            assert all(s["backend"] == "graph" and s["padded"] == 1 for s in xpupack.stats(tuned).values())


@pytest.mark.parametrize("tune_mode", ["inference_mode", "no_grad"])
def test_a_state_made_under_inference_mode_is_put_back_as_the_samples_left_it(emulated_graphs, tune_mode):
    model = Accumulator().eval()
    with MODES[tune_mode]():
        cache = RunningCache()
        inputs = [torch.randn(1, 8) for _ in range(3)]
    expected = copy.deepcopy(model)
    theirs = RunningCache()
    with torch.no_grad():
        for x in inputs:
            expected(x, theirs)

    def run(m, x):
        with MODES[tune_mode]():
            return m(x, cache)

    xpupack.tune(model, inputs, run=run, strategy=GRAPH)
    assert xpupack.stats(model)[""]["backend"] == "graph"
    assert int(cache.steps) == 3 and torch.allclose(cache.total, theirs.total)
    with MODES[tune_mode]():
        x = torch.randn(1, 8)
        for _ in range(4):
            assert torch.allclose(model(x, cache), expected(x, theirs), atol=1e-6)
    assert xpupack.stats(model)[""]["fallbacks"] == 0


def test_a_failed_cleanup_never_hides_the_error_that_stopped_tuning(monkeypatch):
    class Broken(xpupack.FirstWins):
        def choose(self, target, spec, references, device):
            raise RuntimeError("the strategy broke")

    def failing_cleanup(samples):
        raise RuntimeError("the cleanup broke too")

    monkeypatch.setattr(xpupack.module_spec.Samples, "drop", failing_cleanup)
    with pytest.raises(RuntimeError, match="the strategy broke"):
        xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=Broken([xpupack.EagerBackend()]))


@pytest.mark.requires_graph_device
def test_real_graphs_of_a_language_model_tuned_under_inference_mode_replay_in_every_mode(tmp_path, fallback_calls):
    from conftest import GRAPH_DEVICE

    model, reference = tiny_llama().to(GRAPH_DEVICE), tiny_llama().to(GRAPH_DEVICE)
    strategy = xpupack.Only(xpupack.GraphBackend())
    xpupack.tune(
        model, [prompt(device=GRAPH_DEVICE)], run=lambda m, ids: generate(m, ids, "inference_mode"), strategy=strategy
    )
    root = xpupack.save(model, tmp_path / "pkg")
    for serve_mode in MODES:
        loaded = xpupack.load(tiny_llama().to(GRAPH_DEVICE), root)
        ids = prompt(seed=7, device=GRAPH_DEVICE)
        for _ in range(2):  # the second generate() replays the recording the first one made
            assert torch.equal(generate(loaded, ids, serve_mode), generate(reference, ids, serve_mode)), serve_mode
        stats = xpupack.stats(loaded)[""]
        assert stats["fallbacks"] == 0 and stats["recordings"] >= 1, (serve_mode, stats)  # prefills included
    assert fallback_calls == []


def _compiles() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("tensors_made_in", ["inference_mode", "no_grad"])
def test_inductor_code_serves_calls_under_inference_mode_without_compiling_again(tensors_made_in, fallback_calls):
    """Tuning compiles outside inference mode; a call under it (its tensors made there or outside) runs
    that code, not a new compile on the caller's path, and answers as eager does."""
    model, reference = make_stack(), make_stack()
    with torch.inference_mode():
        xpupack.tune(model, stack_samples(), strategy=xpupack.Only(xpupack.InductorBackend()))
    before = _compiles()
    with MODES[tensors_made_in]():
        x = torch.randn(4, 8)
    with torch.inference_mode():
        out = model(x)
    assert _compiles() == before and fallback_calls == []
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x.clone()))
    assert not out.is_inference()  # a normal tensor, which inference mode takes
