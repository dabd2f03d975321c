"""Language-model decoding: calls that carry a KV cache are recorded, replayed and shipped.

CPU: the graph backend's logic through the emulated graph, and Inductor. Real
device graphs: tests/test_graph_device.py.
"""

import copy
import json
import threading

import pytest
import torch

import xpupack
from support.emulated_graph import TracedGraphs
from support.language_models import (
    NEW_TOKENS,
    cache_argument,
    decode_loop,
    generate,
    prompt,
    static_cache,
    tiny_gemma2,
    tiny_gemma3,
    tiny_gpt2,
    tiny_llama,
    tiny_mistral,
    tune_llm,
    whole,
)
from support.models import Accumulator, RunningCache, make_stack
from support.strategies import GRAPH
from xpupack import _device
from xpupack.manifest import read_manifest
from xpupack.signature import Signature, StateLeaf, Unsynthesizable

#: the emulated graph (CPU) re-runs the module on every replay, slower than eager by construction: these
#: tests are about the graph's logic, not its speed, so the speed gate is off

xpupack.register_state(RunningCache, lambda cache: [cache.total, cache.steps])


@pytest.fixture(autouse=True)
def only_prefills_fall_back(request, fallback_calls):
    """Decode steps never fall back; a prefill (its cache is allocated by that call) may."""
    yield
    if "expects_fallbacks" not in request.keywords:
        assert all("prefill" in event.reason for event in fallback_calls), fallback_calls


# -- importing and tuning leave other people's torch.compile alone -------------------------------

COMPILE_A_MODULELIST_SLICE = """
import torch
from torch import nn
torch._dynamo.config.error_on_recompile = True

class Sliced(nn.Module):  # as transformers' LlamaModel.forward slices self.layers[:n]
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x

model = Sliced().eval()
compiled = torch.compile(model, backend="eager")
with torch.no_grad():
    for _ in range(5):
        compiled(torch.randn(2, 4))
hooks = nn.modules.module
assert not (hooks._global_parameter_registration_hooks or hooks._global_buffer_registration_hooks
            or hooks._global_module_registration_hooks), "process-wide registration hooks are installed"
print("no recompiles")
"""


def test_importing_xpupack_leaves_torch_compile_alone(run_python):
    result = run_python("import xpupack\n" + COMPILE_A_MODULELIST_SLICE)
    assert "no recompiles" in result.stdout


def test_tuning_and_loading_another_model_leave_torch_compile_alone(run_python, tmp_path):
    result = run_python(
        f"""
import torch, xpupack
from xpupack import _device
from support.emulated_graph import EmulatedGraphs
from support.models import make_stack, stack_samples
_device.GRAPH_APIS["cpu"] = EmulatedGraphs()
graph = xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], min_speedup=None)
model = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=graph)
xpupack.save(model, {str(tmp_path / "pkg")!r})
loaded = xpupack.load(make_stack(seed=1), {str(tmp_path / "pkg")!r})
assert {{s["backend"] for s in xpupack.stats(loaded).values()}} == {{"graph"}}
"""
        + COMPILE_A_MODULELIST_SLICE
    )
    assert "no recompiles" in result.stdout


# -- decode steps through generate() ----------------------------------------------------------------


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_decode_steps_replay_and_tokens_equal_eager(emulated_graphs, make):
    model, reference = tune_llm(make=make)
    assert whole(model)["backend"] == "graph"
    ids = prompt(seed=7)
    calls_before, fallbacks_before = whole(model)["calls"], whole(model)["fallbacks"]
    replays = emulated_graphs.replays
    assert torch.equal(generate(model, ids, NEW_TOKENS), generate(reference, ids, NEW_TOKENS))
    stats = whole(model)
    assert stats["calls"] - calls_before == NEW_TOKENS  # the prefill, then one call per decode step
    assert stats["fallbacks"] - fallbacks_before == 0  # the prefill too: its new cache is allocated ahead
    # a new cache: its first decode step runs for real, the second is recorded, the rest replay
    assert emulated_graphs.replays - replays == NEW_TOKENS - 3


def test_gpt2_mlps_tuned_through_generate_on_a_batch_of_prompts_pad_prompt_lengths(emulated_graphs):
    """Prefill and decode calls differ in the sequence axis, so the padding check cuts a two-prompt call
    along it; GPT-2's ``Conv1D`` views its input, and a strided cut made it raise and the tune crash
    (issue 31). The check's cut call is a call of its own, as a caller's shorter prompt would be."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    ids = torch.cat([prompt(seed=1), prompt(seed=2)])
    xpupack.tune(
        model, [ids], modules=["transformer.h.*.mlp"], run=lambda m, x: generate(m, x, NEW_TOKENS), strategy=GRAPH
    )
    spec = xpupack.tuned.session_of(model).modules["transformer.h.0.mlp"].spec
    assert spec.padding_refused is None and {axes.inputs for axes in spec.batch_axes.values()} == {(1,)}
    shorter = torch.cat([prompt(5, seed=3), prompt(5, seed=4)])
    assert torch.equal(generate(model, shorter, NEW_TOKENS), generate(reference, shorter, NEW_TOKENS))
    stats = xpupack.stats(model)["transformer.h.0.mlp"]
    assert stats["backend"] == "graph" and stats["padded"] == 1 and stats["fallbacks"] == 0


def test_a_longer_generate_takes_its_new_cache_size(emulated_graphs):
    """Tuned with 6 new tokens, served with 10: the cache is longer, the decode steps still replay."""
    model, reference = tune_llm()
    ids = prompt(seed=2)
    replays = emulated_graphs.replays
    assert torch.equal(generate(model, ids, 10), generate(reference, ids, 10))
    stats = whole(model)
    assert stats["fallbacks"] == 1 and stats["new_sizes"] == 1
    assert emulated_graphs.replays - replays == 10 - 3


@pytest.mark.expects_fallbacks
def test_calls_of_another_structure_are_not_taken_as_new_sizes(emulated_graphs, fallback_calls):
    model, _ = tune_llm()
    with torch.no_grad():
        model(input_ids=prompt(), use_cache=False)  # no cache at all: another family
    assert whole(model)["new_sizes"] == 0 and whole(model)["fallbacks"] == 1


def test_each_decode_step_runs_once(emulated_graphs):
    """The warm-up of a call with state is the call itself: no step updates the cache twice."""
    model, reference = tune_llm(run=lambda m, ids: decode_loop(m, ids, 4, static_cache(m, 32)))
    ids = prompt(seed=3)
    cache, reference_cache = static_cache(model, 32), static_cache(reference, 32)
    assert torch.equal(decode_loop(model, ids, 12, cache), decode_loop(reference, ids, 12, reference_cache))
    for layer, reference_layer in zip(cache.layers, reference_cache.layers):
        assert torch.equal(layer.keys, reference_layer.keys)
        assert torch.equal(layer.values, reference_layer.values)


def test_a_user_state_type_updates_exactly_once_per_call(emulated_graphs):
    model = Accumulator().eval()
    reference = copy.deepcopy(model)
    cache = RunningCache()
    xpupack.tune(model, [torch.randn(1, 8) for _ in range(3)], run=lambda m, x: m(x, cache), strategy=GRAPH)
    assert xpupack.stats(model)[""]["backend"] == "graph"
    assert int(cache.steps) == 3  # tuning put the cache back as the samples left it
    mine, theirs = RunningCache(), RunningCache()
    with torch.no_grad():
        for step in range(1, 8):
            x = torch.randn(1, 8)
            assert torch.allclose(model(x, mine), reference(x, theirs), atol=1e-6)
            assert int(mine.steps) == step
    stats = xpupack.stats(model)[""]
    assert stats["fallbacks"] == 0 and stats["warm_runs"] >= 1 and emulated_graphs.replays >= 5


def with_own_cache(length=16):
    return lambda m, ids: generate(m, ids, NEW_TOKENS, cache=static_cache(m, length))


def test_a_caller_held_cache_is_recorded_once(emulated_graphs, fallback_calls):
    model, reference = tune_llm(run=with_own_cache())
    ids = prompt(seed=5)
    cache = static_cache(model, 16)
    first = generate(model, ids, NEW_TOKENS, cache=cache)
    captures, warm = emulated_graphs.captures, whole(model)["warm_runs"]
    cache.reset()
    assert torch.equal(generate(model, ids, NEW_TOKENS, cache=cache), first)
    # the prefill, which ran for real into the new cache, is recorded at its second call there; every
    # decode step replayed
    assert emulated_graphs.captures == captures + 1 and whole(model)["warm_runs"] == warm
    assert whole(model)["fallbacks"] == 0 and fallback_calls == []
    assert torch.equal(first, generate(reference, ids, NEW_TOKENS))


def test_new_caches_record_again_up_to_the_cap(emulated_graphs):
    model, reference = tune_llm(strategy=xpupack.Only(xpupack.GraphBackend(max_recordings=2)), run=with_own_cache())
    caches = [static_cache(model, 16) for _ in range(4)]  # kept alive: four sets of addresses
    for cache in caches:
        ids = prompt(seed=9)
        assert torch.equal(generate(model, ids, NEW_TOKENS, cache=cache), generate(reference, ids, NEW_TOKENS))
        assert whole(model)["recordings"] <= 2
    assert whole(model)["fallbacks"] == 0  # the prefills too: each new cache is allocated ahead
    assert whole(model)["warm_runs"] >= len(caches)  # each new cache ran once for real, then recorded


def test_prefill_and_decode_are_separate_signatures(emulated_graphs):
    model, _ = tune_llm()
    spec = xpupack.tuned.session_of(model).modules[""].spec
    prefill, decode = spec.signatures
    assert prefill.state_slots and decode.state_slots and not spec.unrecordable
    assert prefill.state_layout == decode.state_layout  # the prefill's state: the cache it allocates
    assert spec.signature_calls == (1, NEW_TOKENS - 1)


# -- the prefill: a new StaticCache allocated ahead of its first call -------------------------------


@pytest.fixture
def allocations(monkeypatch):
    """The token count of the keys each StaticCache layer's allocation is handed: 0 where xpupack allocates
    the cache ahead of the prefill (as transformers' own early_initialization does), the prompt's length
    where the call allocates it itself."""
    from transformers.cache_utils import StaticLayer

    seen: list[int] = []
    allocate = StaticLayer.lazy_initialization

    def spy(layer, keys, values):
        seen.append(keys.shape[-2])
        return allocate(layer, keys, values)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", spy)
    return seen


def test_allocating_ahead_is_transformers_own_allocation_and_undoes_exactly():
    from xpupack.state import allocate_ahead, unallocated

    model = tiny_llama()
    ahead, own = static_cache(model, 16), static_cache(model, 16)
    with torch.no_grad():
        model(input_ids=prompt(), **{cache_argument(model): own}, use_cache=True)  # transformers allocates
    layouts = Signature.of_call((own,), {}).leaves[0].tensors
    assert unallocated(ahead) and not unallocated(own)
    assert allocate_ahead(static_cache(model, 24), layouts) is None  # another cache length: nothing done
    before = [dict(vars(layer)) for layer in ahead.layers]
    undo = allocate_ahead(ahead, layouts)
    assert undo is not None and Signature.of_call((ahead,), {}).leaves[0].tensors == layouts
    for mine, theirs in zip(ahead.layers, own.layers, strict=True):
        assert mine.is_initialized and vars(mine).keys() == vars(theirs).keys()
        for name, value in vars(theirs).items():
            if isinstance(value, torch.Tensor):  # zeros, static addresses as transformers marks them
                assert not getattr(mine, name).any()
                assert vars(getattr(mine, name)) == vars(value), name
            else:
                assert getattr(mine, name) == value, name
    undo()
    for layer, attributes in zip(ahead.layers, before, strict=True):
        assert vars(layer).keys() == attributes.keys()
        assert all(vars(layer)[name] is value for name, value in attributes.items())
        assert not layer.is_initialized and vars(layer.cumulative_length) == {}
    assert unallocated(ahead)


def test_a_prefill_is_served_into_a_cache_allocated_ahead_also_after_load(
    emulated_graphs, allocations, fallback_calls, tmp_path
):
    model, reference = tune_llm()
    ids = prompt(seed=7)
    expected = generate(reference, ids, NEW_TOKENS)
    for served in (model, xpupack.load(tiny_llama(seed=3), xpupack.save(model, tmp_path / "pkg"))):
        allocations.clear()
        assert torch.equal(generate(served, ids, NEW_TOKENS), expected)
        assert allocations == [0, 0]  # both layers allocated ahead by xpupack, none by the prefill itself
        stats = whole(served)
        assert stats["fallbacks"] == 0 and stats["calls"] == NEW_TOKENS and fallback_calls == []


@pytest.mark.slow
def test_compiled_prefills_serve_generate_and_a_reused_cache_also_after_load(fallback_calls, tmp_path):
    def both(model, ids):  # generate()'s own cache, and one the caller holds
        generate(model, ids, NEW_TOKENS)
        with_own_cache(16)(model, ids)

    model, reference = tune_llm(xpupack.Only(xpupack.InductorBackend()), run=both)
    ids = prompt(seed=7)
    expected = generate(reference, ids, NEW_TOKENS)
    root = xpupack.save(model, tmp_path / "pkg")
    for served in (model, xpupack.load(tiny_llama(seed=3), root, defer_compile=False)):
        assert torch.equal(generate(served, ids, NEW_TOKENS), expected)
        cache = static_cache(served, 16)
        for _ in range(2):  # the second prefill into the cache the first generate() allocated
            cache.reset()
            assert torch.equal(generate(served, ids, NEW_TOKENS, cache=cache), expected)
        stats = whole(served)
        assert stats["calls"] == 3 * NEW_TOKENS and stats["fallbacks"] == stats["compiling"] == 0, stats
    assert fallback_calls == []


@pytest.mark.expects_fallbacks
def test_a_prefill_of_another_batch_leaves_the_cache_to_transformers(emulated_graphs, allocations, fallback_calls):
    model, reference = tune_llm()
    ids = torch.cat([prompt(seed=3), prompt(seed=4)])  # batch 2: tuned with batch 1
    allocations.clear()
    assert torch.equal(generate(model, ids, NEW_TOKENS), generate(reference, ids, NEW_TOKENS))
    assert allocations == [8, 8, 8, 8]  # the prefill allocated its own cache, as the reference's did
    prefills = [event.reason for event in fallback_calls if "StaticCache not ready" in event.reason]
    assert len(prefills) == 1 and "int64[2, 8]" in prefills[0]


@pytest.mark.expects_fallbacks
def test_a_prefill_the_backend_fails_gets_its_cache_back_unallocated(emulated_graphs, allocations, fallback_calls):
    model, reference = tune_llm()
    tuned = xpupack.tuned.session_of(model).modules[""]
    run = tuned.runner.run

    def broken_prefill(index, args, kwargs, leaves):
        if (1, 8) in [leaf.shape for leaf in tuned.signatures[index].tensor_leaves]:  # the prompt: a prefill
            raise RuntimeError("broken prefill")
        return run(index, args, kwargs, leaves)

    tuned.runner.run = broken_prefill
    ids = prompt(seed=8)
    allocations.clear()
    assert torch.equal(generate(model, ids, NEW_TOKENS), generate(reference, ids, NEW_TOKENS))
    # allocated ahead, put back when the backend failed, allocated by the original module's prefill
    assert allocations == [0, 0, 8, 8, 8, 8]
    assert [event.reason for event in fallback_calls] == ["backend error"]
    assert whole(model)["fallback_reasons"] == {"backend error": 1}


@pytest.mark.slow
def test_an_aoti_package_serves_every_call_of_a_generate_also_after_load(fallback_calls, tmp_path):
    model, reference = tune_llm(xpupack.Only(xpupack.AOTIBackend()))
    ids = prompt(seed=9)
    expected = generate(reference, ids, NEW_TOKENS)
    for served in (model, xpupack.load(tiny_llama(seed=3), xpupack.save(model, tmp_path / "pkg"))):
        assert torch.equal(generate(served, ids, NEW_TOKENS), expected)
        stats = whole(served)
        assert stats["backend"] == "aoti" and stats["programs"] == 2  # the prefill's and the decode step's
        assert stats["fallbacks"] == stats["compiling"] == 0 and fallback_calls == []


def test_a_dynamic_cache_stays_eager_and_says_how_to_tune_it(emulated_graphs, fallback_calls):
    model = tiny_llama()
    with torch.no_grad():
        xpupack.tune(
            model, [prompt()], run=lambda m, ids: m.generate(ids, max_new_tokens=3, do_sample=False), strategy=GRAPH
        )
    stats = whole(model)
    assert stats["backend"] == "eager"
    report = xpupack.tuned.session_of(model).modules[""].report[0].reason
    assert "DynamicCache" in report and 'cache_implementation="static"' in report
    with torch.no_grad():
        model.generate(prompt(), max_new_tokens=2, do_sample=False)
    assert fallback_calls == [] and whole(model)["fallbacks"] == 0  # eager runs it as it would untuned


@pytest.mark.expects_fallbacks
def test_serving_with_a_dynamic_cache_warns_once_per_model(emulated_graphs, fallback_calls, caplog):
    """A model tuned with a static cache, served by a plain ``generate()``: each call falls back."""
    hint = 'cache_implementation="static"'
    for _ in range(2):  # two models, each warned once
        model, _ = tune_llm()
        caplog.clear()
        for _ in range(2):
            with torch.no_grad():
                model.generate(prompt(), max_new_tokens=3, do_sample=False)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and hint in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "DynamicCache" in warnings[0] and "every call" in warnings[0]
        assert whole(model)["fallbacks"] == 6 and all(hint in event.reason for event in fallback_calls)
        fallback_calls.clear()


def test_bench_leaves_out_calls_with_a_cache(emulated_graphs, caplog):
    from xpupack.bench import benchmark

    model, _ = tune_llm()
    assert benchmark(model, iterations=3, warmup=1) == []  # the decode step is its only signature
    assert "with a KV cache are not timed" in caplog.text


def test_generate_does_not_compile_a_tuned_model(emulated_graphs):
    model, _ = tune_llm()
    assert model.generation_config.disable_compile is True
    xpupack.deactivate(model)
    assert model.generation_config.disable_compile is False
    xpupack.activate(model)
    assert model.generation_config.disable_compile is True


# -- sliding-window caches (Mistral, Gemma 2, Gemma 3) ------------------------------------------------


@pytest.fixture
def traced_graphs(monkeypatch):
    """Device graphs on CPU that run a call's Python once, as real ones do (`TracedGraphs`): a Python value
    the call read is baked into its recording, so a replay at another position would show it."""
    api = TracedGraphs()
    monkeypatch.setitem(_device.GRAPH_APIS, "cpu", api)
    return api


#: a window of 10 with an 8-token prompt: the first decode steps fill the window, the later ones slide it
SLIDING = {
    "mistral-default-window": tiny_mistral,  # 4096: every step fills
    "mistral": lambda seed=0: tiny_mistral(seed, sliding_window=10),
    "gemma2": lambda seed=0: tiny_gemma2(seed, sliding_window=10),
    "gemma3": lambda seed=0: tiny_gemma3(seed, sliding_window=10),
}


def bare_decode(model, ids, new_tokens, logits):
    """Tokens and caches only: the model derives positions and masks from the cache's counts."""
    return decode_loop(model, ids, new_tokens, static_cache(model, 32), positions=False, step_logits=logits)


@pytest.mark.parametrize("make", SLIDING.values(), ids=SLIDING.keys())
def test_sliding_window_decode_steps_replay_with_eager_logits_also_after_load(traced_graphs, make, tmp_path):
    model = make()
    xpupack.tune(model, [prompt()], run=lambda m, ids: bare_decode(m, ids, 4, []), strategy=GRAPH)
    assert whole(model)["backend"] == "graph"
    ids = prompt(seed=3)
    for served in (model, xpupack.load(make(seed=1), xpupack.save(model, tmp_path / "pkg"))):
        xpupack.deactivate(served)
        expected_logits = []
        expected = bare_decode(served, ids, 10, expected_logits)
        xpupack.activate(served)
        replays, logits = traced_graphs.replays, []
        assert torch.equal(bare_decode(served, ids, 10, logits), expected)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(logits, expected_logits, strict=True))
        stats = whole(served)
        assert stats["backend"] == "graph" and stats["fallbacks"] <= 2  # the prefills
        assert traced_graphs.replays - replays >= 10 - 6  # a path's first step runs, its second records


def test_generate_with_the_default_mistral_window_replays_decode_steps(traced_graphs):
    """The default config's window (4096) is a sliding-window cache even for a short generate()."""
    model, reference = tune_llm(make=tiny_mistral)
    stats = whole(model)
    assert stats["backend"] == "graph"
    ids = prompt(seed=7)
    calls, fallbacks, replays = stats["calls"], stats["fallbacks"], traced_graphs.replays
    assert torch.equal(generate(model, ids, NEW_TOKENS), generate(reference, ids, NEW_TOKENS))
    assert whole(model)["calls"] - calls == NEW_TOKENS and whole(model)["fallbacks"] - fallbacks == 0
    assert traced_graphs.replays - replays == NEW_TOKENS - 3


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


INDUCTOR_SLIDING = {name: make for name, make in SLIDING.items() if name != "mistral-default-window"}


@pytest.mark.slow
@pytest.mark.parametrize("make", INDUCTOR_SLIDING.values(), ids=INDUCTOR_SLIDING.keys())
def test_inductor_serves_sliding_window_decode_steps_with_one_compile_per_path_also_after_load(
    make, tmp_path, fallback_calls
):
    """The window's Python count is a symbol in the compiled step: one graph while it fills, one once it is
    full (both compiled while tuning), none for further positions; the compiled step advances the count."""
    model, reference = make(), make()

    def run(model, ids):  # generate()'s own cache and one the caller holds; the window of 10 slides in both
        generate(model, ids, 24)
        generate(model, ids, 24, static_cache(model, 32))

    xpupack.tune(model, [prompt()], run=run, strategy=xpupack.Only(xpupack.InductorBackend()))
    ids = prompt(seed=7)
    root = xpupack.save(model, tmp_path / "pkg")
    graphs = dynamo_graphs()
    loaded = xpupack.load(make(seed=3), root, defer_compile=False)
    assert dynamo_graphs() - graphs == 3  # its warm-up compiles the prefill and both paths, from the package
    for served in (model, loaded):  # neither compiles again, whatever the cache or the position
        graphs = dynamo_graphs()
        for new_tokens in (12, 24):  # 24: twice the positions, no more compiles
            mine, theirs = static_cache(served, 32), static_cache(reference, 32)
            assert torch.equal(generate(served, ids, new_tokens, mine), generate(reference, ids, new_tokens, theirs))
            assert xpupack.state.SlidingWindowCounters().read(mine) == xpupack.state.SlidingWindowCounters().read(
                theirs
            )
            assert dynamo_graphs() - graphs == 0
        assert torch.equal(generate(served, ids, 24), generate(reference, ids, 24))
        stats = whole(served)
        assert stats["backend"] == "inductor" and stats["fallbacks"] == stats["compiling"] == 0, stats
    assert fallback_calls == []


@pytest.mark.slow
def test_a_sliding_window_inductor_package_serves_a_fresh_process(tmp_path, run_python):
    model, reference = tiny_mistral(sliding_window=10), tiny_mistral(sliding_window=10)
    xpupack.tune(
        model, [prompt()], run=lambda m, ids: generate(m, ids, 12), strategy=xpupack.Only(xpupack.InductorBackend())
    )
    root = xpupack.save(model, tmp_path / "pkg")
    torch.save(generate(reference, prompt(seed=11), 24), tmp_path / "expected.pt")
    result = run_python(f"""
import torch, xpupack
from torch._dynamo.utils import counters
from support.language_models import generate, prompt, tiny_mistral
model = xpupack.load(tiny_mistral(seed=5, sliding_window=10), {str(root)!r}, defer_compile=False)
expected = torch.load({str(tmp_path / "expected.pt")!r})
for new_tokens in (12, 24):
    assert torch.equal(generate(model, prompt(seed=11), new_tokens), expected[:, : 8 + new_tokens])
    assert counters["stats"]["unique_graphs"] == 3, counters["stats"]  # the prefill, a filling and a full window
stats = xpupack.stats(model)[""]
assert stats["backend"] == "inductor" and stats["fallbacks"] == stats["compiling"] == 0, stats
print("ok")
""")
    assert "ok" in result.stdout


def test_aoti_refuses_sliding_window_caches_and_says_why():
    from xpupack.errors import NoCandidateError

    with pytest.raises(NoCandidateError, match="sliding-window layers keep a Python-side count"):
        tune_llm(xpupack.Only(xpupack.AOTIBackend()), make=lambda: tiny_mistral(sliding_window=10))


def test_a_call_whose_tokens_fill_the_window_is_never_replayed():
    from transformers.cache_utils import StaticSlidingWindowLayer

    from xpupack.state import FILLING, FULL, SlidingWindowCounters

    cache = type("Cache", (), {})()
    cache.layers = [StaticSlidingWindowLayer(max_cache_len=32, sliding_window=4)]
    counters = SlidingWindowCounters()
    assert counters.path(cache, (2,), (1,)) == counters.path(cache, (0,), (4,)) == (FILLING,)
    assert counters.path(cache, (4,), (1,)) == counters.path(cache, (90,), (1,)) == (FULL,)
    assert counters.path(cache, (3,), (2,)) is None  # the window becomes full inside the call
    assert counters.path(cache, (4,), (3,)) is None  # several tokens into a full window
    # what a compile runs ahead for the other path of a decode step, on a scratch copy
    assert counters.other_paths(cache, (2,), (1,)) == [(4,)]
    assert counters.other_paths(cache, (90,), (1,)) == [(3,)]
    assert counters.other_paths(cache, (0,), (8,)) == []  # a prefill


# -- the package ---------------------------------------------------------------------------------


def test_state_signature_round_trips_through_the_spec(emulated_graphs, tmp_path):
    model, _ = tune_llm()
    root = xpupack.save(model, tmp_path / "pkg")
    entry = read_manifest(root)["modules"][0]
    data = json.loads((root / entry["spec"]).read_text())
    state = [leaf for leaf in data["signatures"][0]["leaves"] if leaf["kind"] == "state"]
    assert state[0]["type"] == "transformers.cache_utils.StaticCache"
    assert all(set(t) == {"shape", "stride", "dtype", "device"} for t in state[0]["tensors"])
    signature = Signature.from_json(data["signatures"][0])
    assert signature == xpupack.tuned.session_of(model).modules[""].spec.signatures[0]
    with pytest.raises(Unsynthesizable):
        signature.synthesize()


def test_inspect_describes_a_language_model_package_in_text_and_json(emulated_graphs, tmp_path):
    from click.testing import CliRunner

    from xpupack.cli import main

    model, _ = tune_llm()
    root = xpupack.save(model, tmp_path / "pkg")
    described = [s.describe() for s in xpupack.tuned.session_of(model).modules[""].spec.signatures]
    assert all("StaticCache[" in text for text in described)  # the KV cache: its type and how many state tensors
    result = CliRunner().invoke(main, ["inspect", str(root), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["modules"][0]["signatures"] == described
    result = CliRunner().invoke(main, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    assert all(word in result.output for text in described for word in text.split())  # wrapped at spaces
    from xpupack.card import package_card  # the Hub's model card lists the signatures too

    assert all(text in package_card(root, read_manifest(root)) for text in described)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "state", "type": "x.Cache", "tensors": []},
        {"kind": "state", "type": 3, "tensors": [{"shape": [1], "stride": [1], "dtype": "float32", "device": "cpu"}]},
        {
            "kind": "state",
            "type": "x.Cache",
            "tensors": [{"shape": [1, 2], "stride": [1], "dtype": "float32", "device": "cpu"}],
        },
        {
            "kind": "state",
            "type": "x.Cache",
            "tensors": [{"shape": [1], "stride": [1], "dtype": "nope", "device": "cpu"}],
        },
    ],
)
def test_malformed_state_leaves_are_refused(bad):
    from xpupack.signature import _leaf_from_json

    with pytest.raises(ValueError):
        _leaf_from_json(bad)


def test_state_leaf_keys_match_live_calls():
    cache = RunningCache()
    leaf = Signature.of_call((torch.randn(1, 8), cache), {}).leaves[1]
    assert isinstance(leaf, StateLeaf) and leaf.type_name.endswith("RunningCache")
    key, _ = xpupack.signature.fit_key((torch.randn(1, 8), cache), {})
    assert Signature.of_call((torch.randn(1, 8), cache), {}).key == key


@pytest.mark.slow
def test_fresh_process_load_replays_decode_steps(emulated_graphs, tmp_path, run_python):
    model, reference = tune_llm()
    root = xpupack.save(model, tmp_path / "pkg")
    ids = prompt(seed=11)
    expected = generate(reference, ids, 12)
    torch.save(expected, tmp_path / "expected.pt")
    result = run_python(f"""
import torch, xpupack
from xpupack import _device
from support.emulated_graph import EmulatedGraphs
from support.language_models import generate, prompt, tiny_llama
api = EmulatedGraphs()
_device.GRAPH_APIS["cpu"] = api
model = xpupack.load(tiny_llama(seed=5), {str(root)!r})
assert api.captures > 0  # the load's warm-up generate() recorded the tuned decode step
replays = api.replays
tokens = generate(model, prompt(seed=11), 12)
assert torch.equal(tokens, torch.load({str(tmp_path / "expected.pt")!r}))
stats = xpupack.stats(model)[""]
assert stats["backend"] == "graph" and stats["fallbacks"] == 1 and stats["new_sizes"] == 1, stats
assert api.replays - replays == 12 - 3, api.replays - replays
print("ok")
""")
    assert "ok" in result.stdout


# -- Inductor, and the graph over it ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        xpupack.Only(xpupack.InductorBackend()),
        xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend())),
    ],
    ids=["inductor", "graph+inductor"],
)
def test_compiled_decode_steps_give_eager_tokens(emulated_graphs, strategy, tmp_path):
    model, reference = tune_llm(strategy=strategy)
    ids = prompt(seed=13)
    expected = generate(reference, ids, NEW_TOKENS)
    assert torch.equal(generate(model, ids, NEW_TOKENS), expected)
    assert whole(model)["fallbacks"] == 0  # the prefill included
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(tiny_llama(seed=3), root)
    assert torch.equal(generate(loaded, ids, NEW_TOKENS), expected)
    assert whole(loaded)["fallbacks"] == 0


# -- one tuned module, many threads -------------------------------------------------------------


def wrong_results_under_threads(device: str = "cpu", threads: int = 4, rounds: int = 20) -> list[int]:
    """Tunes the stack's MLPs as device graphs, then calls one MLP from several threads at once and
    returns the indices of the inputs whose result was not eager's."""
    model = make_stack().to(device)
    reference = copy.deepcopy(model)
    xpupack.tune(model, [torch.randn(2, 8, device=device)], modules=["layers.*.mlp"], strategy=GRAPH)
    mlp, expected_mlp = model.layers[0]["mlp"], reference.layers[0]["mlp"]
    inputs = [torch.randn(2, 8, device=device) for _ in range(32)]
    with torch.no_grad():
        expected = [expected_mlp(x, scale=1.0) for x in inputs]
    wrong = []

    def hammer(offset):
        with torch.no_grad():
            for _ in range(rounds):
                for i in range(offset, len(inputs), 2):
                    if not torch.allclose(mlp(inputs[i], scale=1.0), expected[i], atol=1e-5):
                        wrong.append(i)

    workers = [threading.Thread(target=hammer, args=(n % 2,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert xpupack.stats(model)["layers.0.mlp"]["fallbacks"] == 0
    return wrong


def test_concurrent_calls_never_return_another_threads_result(emulated_graphs):
    assert wrong_results_under_threads() == []


# -- real device graphs (the GPU machine) -------------------------------------------------------


@pytest.mark.requires_graph_device
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_real_graphs_replay_decode_steps_with_eager_tokens(make):
    from conftest import GRAPH_DEVICE

    model, reference = make().to(GRAPH_DEVICE), None
    reference = copy.deepcopy(model)
    xpupack.tune(model, [prompt(device=GRAPH_DEVICE)], run=lambda m, ids: generate(m, ids, NEW_TOKENS), strategy=GRAPH)
    assert whole(model)["backend"] == "graph"
    for seed, new_tokens in ((21, NEW_TOKENS), (22, 24)):  # the second: a longer cache, a new size
        ids = prompt(seed=seed, device=GRAPH_DEVICE)
        assert torch.equal(generate(model, ids, new_tokens), generate(reference, ids, new_tokens, eager=True))
    assert whole(model)["recordings"] >= 1 and whole(model)["memory_bytes"] > 0


@pytest.mark.expects_fallbacks  # each prefill into the reused cache: a plain fallback
@pytest.mark.requires_graph_device
def test_real_graphs_in_a_decode_loop_with_one_cache(fallback_calls):
    from conftest import GRAPH_DEVICE

    model = tiny_llama().to(GRAPH_DEVICE)
    reference = copy.deepcopy(model)
    cache = static_cache(model, 40)
    xpupack.tune(model, [prompt(device=GRAPH_DEVICE)], run=lambda m, ids: decode_loop(m, ids, 4, cache), strategy=GRAPH)
    for seed in (24, 25):
        cache.reset()
        ids = prompt(seed=seed, device=GRAPH_DEVICE)
        assert torch.equal(
            decode_loop(model, ids, 24, cache), decode_loop(reference, ids, 24, static_cache(reference, 40))
        )
    assert whole(model)["recordings"] >= 1
    assert [event.reason for event in fallback_calls if "[1, 8]" not in event.reason] == []  # only prefills


@pytest.mark.requires_graph_device
def test_real_graphs_of_a_user_state_type():
    from conftest import GRAPH_DEVICE

    model = Accumulator().to(GRAPH_DEVICE).eval()
    reference = copy.deepcopy(model)

    def cache():
        made = RunningCache()
        made.total, made.steps = made.total.to(GRAPH_DEVICE), made.steps.to(GRAPH_DEVICE)
        return made

    tuning = cache()
    xpupack.tune(
        model, [torch.randn(1, 8, device=GRAPH_DEVICE) for _ in range(3)], run=lambda m, x: m(x, tuning), strategy=GRAPH
    )
    mine, theirs = cache(), cache()
    with torch.no_grad():
        for step in range(1, 10):
            x = torch.randn(1, 8, device=GRAPH_DEVICE)
            assert torch.allclose(model(x, mine), reference(x, theirs), atol=1e-5)
            assert int(mine.steps) == step
    assert xpupack.stats(model)[""]["fallbacks"] == 0


@pytest.mark.slow
@pytest.mark.requires_graph_device
def test_real_graph_over_inductor_in_a_fresh_process(tmp_path, run_python):
    from conftest import GRAPH_DEVICE

    model = tiny_llama().to(GRAPH_DEVICE)
    reference = copy.deepcopy(model)
    xpupack.tune(
        model,
        [prompt(device=GRAPH_DEVICE)],
        run=lambda m, ids: generate(m, ids, NEW_TOKENS),
        strategy=xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend())),
    )
    root = xpupack.save(model, tmp_path / "pkg")
    expected = generate(reference, prompt(seed=31, device=GRAPH_DEVICE), 12, eager=True).cpu()
    torch.save(expected, tmp_path / "expected.pt")
    result = run_python(f"""
import torch, xpupack
from support.language_models import generate, prompt, tiny_llama
model = xpupack.load(tiny_llama(seed=4).to({GRAPH_DEVICE!r}), {str(root)!r})
tokens = generate(model, prompt(seed=31, device={GRAPH_DEVICE!r}), 12).cpu()
assert torch.equal(tokens, torch.load({str(tmp_path / "expected.pt")!r}))
stats = xpupack.stats(model)[""]
assert stats["backend"] == "graph" and stats["fallbacks"] == 1 and stats["recordings"] == 1, stats
print("ok")
""")
    assert "ok" in result.stdout


@pytest.mark.requires_graph_device
def test_real_graphs_under_concurrent_calls():
    from conftest import GRAPH_DEVICE

    assert wrong_results_under_threads(GRAPH_DEVICE, rounds=50) == []


def test_a_second_load_keeps_generate_compile_off_until_deactivated(emulated_graphs, tmp_path):
    model, _ = tune_llm()
    root = xpupack.save(model, tmp_path / "pkg")
    served = tiny_llama(seed=2)
    xpupack.load(served, root)
    xpupack.load(served, root)  # replaces the first session, which is deactivated after
    assert served.generation_config.disable_compile is True
    xpupack.deactivate(served)
    assert served.generation_config.disable_compile is False
