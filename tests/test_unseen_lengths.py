"""An unforeseen call never waits on a compile: a KV cache of a length no tuned call had (another
``max_new_tokens``) runs the original module while its compile runs off the caller's path, and with
Inductor one compiled step serves every cache length (docs/language-models.md, "Cache length").
"""

import json
import threading

import pytest
import torch

import xpupack
from support.backends import PreparingBackend
from support.language_models import NEW_TOKENS, generate, prompt, static_cache, tiny_llama, tune_llm, whole
from support.models import Accumulator, RunningCache
from support.strategies import GRAPH
from xpupack import _background
from xpupack.manifest import read_manifest
from xpupack.state import scratch_copy, state_type

#: lengths no tuned call had: the tuned cache holds prompt + NEW_TOKENS, these longer ones
UNSEEN, OTHER_UNSEEN = 10, 14


def runner_of(model):
    return xpupack.tuned.session_of(model).modules[""].runner


def only_prefills(fallback_calls):
    return all("prefill" in event.reason for event in fallback_calls)


def test_calls_of_a_new_cache_length_run_the_original_until_its_compile_is_done(fallback_calls):
    model, reference = tune_llm(xpupack.Only(PreparingBackend()))
    runner = runner_of(model)
    ids = prompt(seed=2)
    expected = generate(reference, ids, UNSEEN)
    runs = runner.runs
    assert torch.equal(generate(model, ids, UNSEEN), expected)
    stats = whole(model)
    assert stats["new_sizes"] == 1 and stats["compiling"] == UNSEEN - 1  # every decode step: the prefill falls back
    assert runner.runs == runs
    runner.preparations[0].set_result(None)  # the compile is done: later calls switch over
    assert torch.equal(generate(model, ids, UNSEEN), expected)
    assert runner.runs == runs + UNSEEN - 1 and whole(model)["compiling"] == UNSEEN - 1
    assert only_prefills(fallback_calls)


def test_a_failed_compile_leaves_the_new_length_on_the_original_for_good(fallback_calls):
    model, reference = tune_llm(xpupack.Only(PreparingBackend()))
    runner = runner_of(model)
    ids = prompt(seed=3)
    expected = generate(reference, ids, UNSEEN)
    generate(model, ids, UNSEEN)
    runner.preparations[0].set_exception(RuntimeError("the compiler crashed"))
    runs = runner.runs
    for _ in range(2):
        assert torch.equal(generate(model, ids, UNSEEN), expected)
    stats = whole(model)
    assert runner.runs == runs and stats["compiling"] == UNSEEN - 1
    assert "the compiler crashed" in " ".join(stats["backend_errors"].values())
    assert stats["fallback_reasons"]["backend error"] == 1


def test_a_new_cache_length_is_handed_to_the_runner_and_the_tuned_spec_stays_as_it_was(tmp_path, fallback_calls):
    """The dispatcher numbers the signatures it serves after the spec's and hands each new one to the runner;
    the spec the backend was built from never changes, and a package saved after serving lists the new length."""
    model, _ = tune_llm(xpupack.Only(PreparingBackend()))
    tuned = xpupack.tuned.session_of(model).modules[""]
    spec = tuned.spec
    tuned_signatures = spec.signatures
    generate(model, prompt(seed=2), UNSEEN)
    assert tuned.spec is spec and spec.signatures == tuned_signatures
    [(index, signature)] = tuned.runner.added
    assert index == len(spec.signatures) and tuned.signatures == [*spec.signatures, signature]
    assert signature.state_slots and whole(model)["signatures"] == len(spec.signatures) + 1
    root = xpupack.save(model, tmp_path / "pkg")
    [entry] = read_manifest(root)["modules"]
    saved = json.loads((root / entry["spec"]).read_text())
    assert len(saved["signatures"]) == len(spec.signatures) + 1 and saved["signature_calls"][-1] == 0


def test_a_graph_records_a_new_cache_length_once_its_base_is_ready(emulated_graphs, fallback_calls):
    model, reference = tune_llm(xpupack.Only(xpupack.GraphBackend(base=PreparingBackend())))
    ids = prompt(seed=4)
    expected = generate(reference, ids, UNSEEN)
    captures = emulated_graphs.captures
    assert torch.equal(generate(model, ids, UNSEEN), expected)
    assert emulated_graphs.captures == captures and whole(model)["compiling"] == UNSEEN - 1
    runner_of(model).base_runner.preparations[0].set_result(None)
    replays = emulated_graphs.replays
    assert torch.equal(generate(model, ids, UNSEEN), expected)
    # the first step at the new cache runs for real, the second is recorded, the rest replay
    assert emulated_graphs.captures == captures + 1 and emulated_graphs.replays - replays == UNSEEN - 3
    assert only_prefills(fallback_calls)


def test_no_capture_overlaps_work_off_the_callers_path(emulated_graphs, fallback_calls):
    model, reference = tune_llm(GRAPH, run=lambda m, ids: generate(m, ids, NEW_TOKENS, cache=static_cache(m, 16)))
    ids, cache = prompt(seed=5), static_cache(model, 16)
    expected = generate(reference, ids, NEW_TOKENS)
    captures = emulated_graphs.captures
    started, finish = threading.Event(), threading.Event()
    # as a compile's device work on the worker (a compile's Python would also make the caller's calls wait)
    _background.submit(lambda: (started.set(), finish.wait(timeout=60)), runs_model=False)
    started.wait(timeout=60)
    try:
        assert torch.equal(generate(model, ids, NEW_TOKENS, cache=cache), expected)
    finally:
        finish.set()
    _background.wait(timeout=60)
    assert emulated_graphs.captures == captures  # each step ran for real instead of being recorded
    cache.reset()
    assert torch.equal(generate(model, ids, NEW_TOKENS, cache=cache), expected)
    assert emulated_graphs.captures == captures + 2  # the prefill and the decode step, each run once before


def test_a_scratch_copy_has_zeroed_state_of_the_same_layout():
    model = tiny_llama()
    cache = static_cache(model, 16)
    generate(model, prompt(), 2, cache=cache)
    state = state_type(cache).state_tensors(cache)
    before = [tensor.clone() for tensor in state]
    ids = torch.ones(1, 1, dtype=torch.long)
    (copied_ids,), kwargs = scratch_copy((ids,), {"cache": cache}, state)
    scratch = state_type(kwargs["cache"]).state_tensors(kwargs["cache"])
    assert torch.equal(copied_ids, ids) and copied_ids is not ids
    for tensor, copied, old in zip(state, scratch, before):
        assert copied.data_ptr() != tensor.data_ptr() and not copied.any()
        assert (copied.shape, copied.stride(), copied.dtype) == (tensor.shape, tensor.stride(), tensor.dtype)
        assert torch.equal(tensor, old)
        # marked a static address as transformers marks the cache's own: Dynamo compiles the same graph for it
        assert getattr(copied, "_dynamo_static_input_type", None) == tensor._dynamo_static_input_type
    assert any(tensor.any() for tensor in state)  # the caller's cache holds the prompt


def test_a_step_that_takes_no_symbolic_sizes_is_compiled_per_shape(monkeypatch, tmp_path, fallback_calls):
    """Where the compile with sizes as symbols fails, Inductor compiles calls with state per shape, at
    tune time and, told by the package, at load time."""

    def fake_compile(function, *, dynamic, **settings):  # no Inductor here: the static "compile" is eager
        def symbolic(*args, **kwargs):
            raise RuntimeError("no symbolic sizes here")

        return symbolic if dynamic else function

    monkeypatch.setattr(torch, "compile", fake_compile)
    # the fake static compile counts as compiled code (Dynamo holds none for it)
    monkeypatch.setattr("xpupack._torch_compat.has_compiled_code", lambda entry: True)
    xpupack.register_state(RunningCache, lambda cache: [cache.total, cache.steps])
    model, cache = Accumulator().eval(), RunningCache()
    xpupack.tune(
        model,
        [torch.randn(1, 8) for _ in range(2)],
        run=lambda m, x: m(x, cache),
        strategy=xpupack.Only(xpupack.InductorBackend()),
    )
    root = xpupack.save(model, tmp_path / "pkg")
    [entry] = read_manifest(root)["modules"]
    assert entry["backend"]["config"]["state_sizes"] == "per shape"
    loaded = xpupack.load(Accumulator(), root, defer_compile=True)
    mine = RunningCache()
    with torch.no_grad():
        for _ in range(3):
            loaded(torch.randn(1, 8), mine)
    assert int(mine.steps) == 3 and whole(loaded)["fallbacks"] == 0 and whole(loaded)["backend"] == "inductor"


# -- Inductor: a fresh process, empty caches --------------------------------------------------------

FRESH_PROCESS = """
import json
import threading
import torch, xpupack
from torch._dynamo.callback import on_compile_start
from xpupack import _background, _device
from support.emulated_graph import EmulatedGraphs
from support.language_models import generate, prompt, tiny_llama

graphs = EmulatedGraphs()
if {graph}:
    _device.GRAPH_APIS["cpu"] = graphs
expected = torch.load({expected!r})
compiles = []
on_compile_start(lambda *args: compiles.append(threading.current_thread().name))
model = xpupack.load(tiny_llama(seed=5), {root!r}, defer_compile=True)

def check(length, seed):
    assert torch.equal(generate(model, prompt(seed=seed), length), expected[length]), length

check({unseen}, 11)
stats = xpupack.stats(model)[""]
assert stats["compiling"] >= 1 and stats["fallbacks"] == 1, stats  # the prefill falls back
assert threading.current_thread().name not in compiles, compiles
_background.wait(timeout=500)
for _ in range(5):  # a load that defers its compile switches over call by call (docs/cold-start.md)
    compiling = xpupack.stats(model)[""]["compiling"]
    check({unseen}, 11)
    _background.wait(timeout=500)
    if xpupack.stats(model)[""]["compiling"] == compiling:
        break
assert xpupack.stats(model)[""]["compiling"] == compiling, xpupack.stats(model)[""]  # switched over
assert compiles and "backend_errors" not in xpupack.stats(model)[""], (compiles, xpupack.stats(model)[""])
check({other}, 12)  # another length: the same compiled step
_background.wait(timeout=500)
compiled = len(compiles)
check({other}, 12)
stats = xpupack.stats(model)[""]
assert len(compiles) == compiled and "backend_errors" not in stats, (compiles, stats)
assert not {graph} or graphs.replays > 0, graphs.replays
assert threading.current_thread().name not in compiles, compiles
print("ok", compiles, stats)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        xpupack.Only(xpupack.InductorBackend()),
        xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend())),
    ],
    ids=["inductor", "graph+inductor"],
)
def test_a_fresh_process_serves_unseen_generate_lengths_without_compiling_on_the_callers_path(
    emulated_graphs, strategy, tmp_path, run_python, fallback_calls
):
    model, reference = tune_llm(strategy)
    root = xpupack.save(model, tmp_path / "pkg")
    expected = {
        UNSEEN: generate(reference, prompt(seed=11), UNSEEN),
        OTHER_UNSEEN: generate(reference, prompt(seed=12), OTHER_UNSEEN),
    }
    torch.save(expected, tmp_path / "expected.pt")
    result = run_python(
        FRESH_PROCESS.format(
            graph=isinstance(strategy.backends[0], xpupack.GraphBackend),
            expected=str(tmp_path / "expected.pt"),
            root=str(root),
            unseen=UNSEEN,
            other=OTHER_UNSEEN,
        ),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")},
    )
    assert "ok" in result.stdout
