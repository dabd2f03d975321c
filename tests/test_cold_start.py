"""A package comes alive at once on a fresh server: a device graph over compiled code records the original
module at load and switches to the compiled code once a background thread has it (docs/cold-start.md)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import xpupack
from support.backends import GatedCompileBackend
from support.language_models import generate, prompt, tiny_llama
from support.models import make_stack, stack_samples
from xpupack import _background


@pytest.fixture
def gate():
    GatedCompileBackend.GATE, GatedCompileBackend.RESTORING = threading.Event(), threading.Event()
    GatedCompileBackend.RUNNERS = []
    yield GatedCompileBackend.GATE
    GatedCompileBackend.GATE.set()  # a restore still waiting ends now
    _background.wait(30)


def package(tmp_path, **options):
    model = xpupack.tune(
        make_stack(),
        stack_samples(),
        modules=["layers.*.mlp"],
        strategy=xpupack.Only(xpupack.GraphBackend(base=GatedCompileBackend(**options))),
    )
    return xpupack.save(model, tmp_path / "pkg")


def serve(model, batch=4):
    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        return model(x), make_stack()(x)


def llm_package(tmp_path, **options):
    """A tiny Llama's decode steps as graph over a `GatedCompileBackend`, tuned on 6 new tokens."""
    strategy = xpupack.Only(xpupack.GraphBackend(base=GatedCompileBackend(**options)))
    model = xpupack.tune(tiny_llama(), [prompt()], run=lambda m, ids: generate(m, ids, 6), strategy=strategy)
    return xpupack.save(model, tmp_path / "pkg")


def base_runs() -> int:
    return sum(runner.runs for runner in GatedCompileBackend.RUNNERS)


def test_a_graph_over_compiled_code_serves_at_once_and_switches_once_the_compile_is_done(
    emulated_graphs, gate, tmp_path
):
    root = package(tmp_path)
    model = xpupack.load(
        make_stack(), root, defer_compile=True
    )  # returns although the compiled part is not restored yet
    actual, expected = serve(model)
    assert torch.allclose(actual, expected)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["backend"] == "graph" and stats["compiling"] >= 1 and stats["compiled_serving"] is False
    assert stats["fallbacks"] == 0 and base_runs() == 0

    gate.set()
    _background.wait(30)
    actual, expected = serve(model)
    assert torch.allclose(actual, expected)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["compiled_serving"] is True and "upgrade_error" not in stats
    runs = base_runs()
    assert runs > 0  # the new recordings run the compiled code
    serve(model)
    assert base_runs() > runs  # and every replay after them


@pytest.mark.parametrize(
    "options, why",
    [
        ({"fail": True}, "restoring the compiled module failed: RuntimeError"),
        ({"offset": 1.0}, "differs from the original module"),
    ],
)
def test_compiled_code_that_fails_or_answers_wrong_is_never_switched_in(emulated_graphs, gate, tmp_path, options, why):
    root = package(tmp_path, **options)
    model = xpupack.load(make_stack(), root, defer_compile=True)
    gate.set()
    _background.wait(30)
    for batch in (4, 2):
        actual, expected = serve(model, batch)
        assert torch.allclose(actual, expected)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert why in stats["upgrade_error"] and stats["compiled_serving"] is False and stats["fallbacks"] == 0


def test_defer_compile_false_returns_with_the_compiled_code_recorded(emulated_graphs, gate, tmp_path):
    root = package(tmp_path)
    gate.set()
    model = xpupack.load(make_stack(), root, defer_compile=False)
    assert base_runs() > 0  # recorded over the compiled code before load returned
    actual, expected = serve(model)
    assert torch.allclose(actual, expected)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["compiling"] == 0 and "compiled_serving" not in stats


def test_a_language_model_decodes_through_the_original_recordings_then_the_compiled_ones(
    emulated_graphs, gate, tmp_path, fallback_calls
):
    root = llm_package(tmp_path)
    expected = generate(tiny_llama(), prompt(seed=5), 8, eager=True)
    served = xpupack.load(tiny_llama(), root, defer_compile=True)
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert base_runs() == 0 and xpupack.stats(served)[""]["compiling"] > 0
    gate.set()
    _background.wait(30)
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    stats = xpupack.stats(served)[""]
    assert stats["compiled_serving"] is True and base_runs() > 0
    runs = base_runs()
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert base_runs() > runs  # the decode steps replay recordings over the compiled code
    assert all("StaticCache not ready" in event.reason for event in fallback_calls)  # the prefills only


def test_a_language_models_first_generate_replays_recordings_of_the_original_while_its_compile_waits(
    emulated_graphs, gate, tmp_path, fallback_calls
):
    # the compile (held at the gate, as seconds of compiling on a fresh server) must not start before the
    # first decode step is recorded: while the worker compiles, a capture cannot be made
    root = llm_package(tmp_path)
    expected = generate(tiny_llama(), prompt(seed=5), 8, eager=True)
    served = xpupack.load(tiny_llama(), root, defer_compile=True)
    assert not GatedCompileBackend.RESTORING.wait(0.5)  # nothing to compile for until a decode step came
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    stats = xpupack.stats(served)[""]
    assert stats["recordings"] == 1 and stats["warm_runs"] == 1 and stats["compiled_serving"] is False
    assert GatedCompileBackend.RESTORING.wait(10)  # started by itself once the caller paused
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)  # replays beside the compile
    gate.set()
    _background.wait(30)
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert xpupack.stats(served)[""]["compiled_serving"] is True and base_runs() > 0
    assert all("StaticCache not ready" in event.reason for event in fallback_calls)  # the prefills only


def test_a_decode_length_met_while_the_compile_waits_is_handed_to_the_compiled_module_once_it_serves(
    emulated_graphs, gate, tmp_path, fallback_calls
):
    """A new cache length served while the base is restored off the caller's path reaches the base runner
    (`Runner.add_signature`) when it takes over: the spec it was restored from does not list it."""
    root = llm_package(tmp_path)  # tuned on 6 new tokens: 8 makes a longer cache
    expected = generate(tiny_llama(), prompt(seed=5), 8, eager=True)
    served = xpupack.load(tiny_llama(), root, defer_compile=True)
    tuned = xpupack.tuned.session_of(served).modules[""]
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    new = set(range(len(tuned.spec.signatures), len(tuned.signatures)))
    assert new and not GatedCompileBackend.RUNNERS
    gate.set()
    _background.wait(30)
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert new <= tuned.runner.base_runner.supported and base_runs() > 0


def test_a_decode_step_whose_original_module_a_capture_refuses_runs_unrecorded_until_the_compiled_one_records(
    emulated_graphs, gate, tmp_path, fallback_calls, caplog
):
    """Regression (H200): a TorchAO int8 package's decode step could not be recorded over the quantized
    original module at load; the signature was given up for good, so its compiled form never served it."""
    root = llm_package(tmp_path)
    expected = generate(tiny_llama(), prompt(seed=5), 8, eager=True)
    served = xpupack.load(tiny_llama(), root, defer_compile=True)
    emulated_graphs.fail_capture = lambda: not gate.is_set()  # the original module refuses to be recorded
    with caplog.at_level("WARNING", logger="xpupack"):
        assert torch.equal(generate(served, prompt(seed=5), 8), expected)
        assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert caplog.text.count("runs unrecorded until the compiled module takes it") == 1  # tried once
    assert GatedCompileBackend.RESTORING.wait(10)  # the held compile started all the same
    gate.set()
    _background.wait(30)
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    stats = xpupack.stats(served)[""]
    assert stats["compiled_serving"] is True and stats["recordings"] >= 1 and base_runs() > 0
    assert all("StaticCache not ready" in event.reason for event in fallback_calls)  # the prefills: no errors


def test_a_decode_step_the_compiled_module_cannot_take_stays_on_the_original_recordings(
    emulated_graphs, gate, tmp_path, fallback_calls, caplog
):
    root = llm_package(tmp_path, prepare_fails=True)
    expected = generate(tiny_llama(), prompt(seed=5), 8, eager=True)
    served = xpupack.load(tiny_llama(), root, defer_compile=True)
    gate.set()
    _background.wait(30)
    with caplog.at_level("WARNING", logger="xpupack"):
        for _ in range(3):
            assert torch.equal(generate(served, prompt(seed=5), 8), expected)
    assert caplog.text.count("could not take") == 1  # said once, never asked again
    assert base_runs() == 0 and xpupack.stats(served)[""]["fallbacks"] == len(fallback_calls)


def test_a_load_gives_its_deferred_work_to_the_worker_only_once_every_module_is_restored():
    ran = []
    with _background.deferring():
        assert _background.deferred()
        first = _background.later(lambda: ran.append(_background.deferred()) or "first")
        second = _background.later(lambda: "second")
        _background.wait(5)
        assert ran == [] and not first.done()  # nothing starts while the load still records
    assert first.result(5) == "first" and second.result(5) == "second"
    assert ran == [False]  # the deferred work defers nothing again
    with pytest.raises(ValueError), _background.deferring():
        cancelled = _background.later(lambda: ran.append("never"))
        raise ValueError("a module failed to restore")
    _background.wait(5)
    assert cancelled.cancelled() and "never" not in ran
    assert not _background.deferred()


def test_a_held_job_starts_only_when_its_owner_starts_it_and_its_condition_holds_or_someone_waits():
    ran, ready = [], threading.Event()
    with _background.deferring():
        held = _background.hold(lambda: ran.append("held") or "done")
        waited = _background.hold(lambda: ran.append("waited"))
    _background.submit(lambda: None).result(5)  # the worker is idle, and the held jobs did not run
    assert ran == [] and not held.future.done()
    held.start(ready=ready.is_set)
    held.start()  # a second start does nothing
    assert not _background.submit(lambda: None).done()  # queued behind the held job, which polls its condition
    ready.set()
    assert held.future.result(5) == "done" and ran == ["held"]
    _background.wait(5)  # starts what is still held
    assert ran == ["held", "waited"] and waited.future.done()
    with pytest.raises(ValueError), _background.deferring():
        never = _background.hold(lambda: ran.append("never"))
        raise ValueError("a module failed to restore")
    never.start()
    _background.wait(5)
    assert never.future.cancelled() and "never" not in ran


def test_quiet_is_true_once_the_caller_paused_or_at_the_latest_after_its_limit():
    last = [time.monotonic()]
    ready = _background.quiet(lambda: last[0], pause_s=30, at_most_s=60)
    assert not ready()
    last[0] -= 31  # the caller's latest call is older than the pause
    assert ready()
    assert _background.quiet(lambda: time.monotonic(), pause_s=60, at_most_s=0)()  # a caller that never pauses


def _random_numbers(seed: int, count: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(4) for _ in range(count)]


def test_a_background_job_that_restores_the_random_state_leaves_the_callers_random_numbers_alone():
    """Regression: a compile restores the global random state it found when it started (Dynamo does, for every
    frame it compiles). On the worker that rewound the caller's generator to where it was then: a model built
    from a seed during a load's compile took other weights (a CI run's wrong logits) and sampling repeated
    itself."""
    expected = _random_numbers(0, 2)
    torch.manual_seed(0)
    at_start = torch.random.get_rng_state()
    first = torch.randn(4)  # the caller goes on while the job runs
    _background.submit(lambda: torch.random.set_rng_state(at_start)).result(timeout=30)
    second = torch.randn(4)
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
    torch.manual_seed(3)  # the caller's own calls still set it
    assert torch.equal(torch.randn(4), _random_numbers(3, 1)[0])


def test_a_compile_on_the_worker_leaves_the_callers_random_numbers_alone():
    started, proceed = threading.Event(), threading.Event()

    def backend(graph, example_inputs):  # runs inside Dynamo's compile of the frame, on the worker
        started.set()
        proceed.wait(timeout=30)
        return graph.forward

    compiled = torch.compile(lambda x: x * 2 + 1, backend=backend)
    expected = _random_numbers(0, 2)
    torch.manual_seed(0)
    future = _background.submit(lambda: compiled(torch.ones(3)))
    started.wait(timeout=30)
    first = torch.randn(4)  # drawn while Dynamo holds the state it will restore
    proceed.set()
    torch.testing.assert_close(future.result(timeout=60), torch.full((3,), 3.0))
    assert torch.equal(first, expected[0]) and torch.equal(torch.randn(4), expected[1])


@pytest.fixture
def busy_worker():
    """Holds the background worker on a job of its own (no model's code) until the test lets go: what a load
    queues waits."""
    release, started = threading.Event(), threading.Event()
    _background.submit(lambda: (started.set(), release.wait(timeout=60)), runs_model=False)
    started.wait(timeout=60)
    yield release
    release.set()
    _background.wait(60)


@pytest.mark.slow
def test_an_inductor_package_serves_the_original_module_until_its_compile_off_the_callers_path_is_done(
    inductor_package, busy_worker
):
    _, root = inductor_package
    model = xpupack.load(make_stack(), root, defer_compile=True)
    actual, expected = serve(model)
    assert torch.allclose(actual, expected)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["backend"] == "inductor" and stats["compiling"] == 1 and stats["compiled_serving"] is False
    busy_worker.set()
    _background.wait(120)
    actual, expected = serve(model)
    assert torch.allclose(actual, expected, atol=1e-5)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["compiling"] == 1 and stats["compiled_serving"] is True and stats["fallbacks"] == 0, stats


@pytest.mark.parametrize("failure, why", [("raises", "the compile failed"), ("wrong", "differs from the original")])
def test_an_inductor_compile_off_the_callers_path_that_fails_or_answers_wrong_leaves_the_original_module_serving(
    tmp_path, monkeypatch, busy_worker, failure, why
):
    # an eager "compile": this test is about what a failure leaves, not about Inductor
    monkeypatch.setattr(torch, "compile", lambda function, **settings: function)
    monkeypatch.setattr("xpupack._torch_compat.has_compiled_code", lambda entry: True)
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.InductorBackend())
    )
    root = xpupack.save(model, tmp_path / "pkg")

    def broken(function, **settings):
        if failure == "raises":
            raise RuntimeError("the compile failed")
        return lambda *args, **kwargs: function(*args, **kwargs) + 1

    monkeypatch.setattr(torch, "compile", broken)
    model = xpupack.load(make_stack(), root, defer_compile=True)
    busy_worker.set()
    _background.wait(60)
    actual, expected = serve(model)
    assert torch.allclose(actual, expected)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert why in stats["upgrade_error"] and stats["compiled_serving"] is False
    assert stats["fallbacks"] == 0 and stats["compiling"] == 1


TUNE_LANGUAGE_MODEL = """
import xpupack
from support.emulated_graph import EmulatedGraphs
from support.language_models import generate, prompt, tiny_llama
from xpupack import _device

_device.GRAPH_APIS["cpu"] = EmulatedGraphs()
strategy = xpupack.Only({backend})
model = xpupack.tune(tiny_llama(), [prompt()], run=lambda m, ids: generate(m, ids, 6), strategy=strategy)
xpupack.save(model, {root!r})
"""

LOAD_AND_COUNT = """
import json
import threading
import time
import torch
import xpupack
from support.emulated_graph import EmulatedGraphs
from support.language_models import generate, prompt, static_cache, tiny_llama
from torch._dynamo.utils import counters
from xpupack import _background, _device
from xpupack.backends.inductor import InductorRunner

_device.GRAPH_APIS["cpu"] = EmulatedGraphs()
compiled_on, compiled_at = [], []  # the threads the decode step compiles on, and when
first_call = InductorRunner._first_call


def observed_first_call(*args):
    compiled_on.append(threading.current_thread().name)
    compiled_at.append(time.monotonic())
    return first_call(*args)


InductorRunner._first_call = observed_first_call
with {mode}:  # the mode the caller serves in: Dynamo guards on inference tensors
    model = xpupack.load(tiny_llama(), {root!r}, defer_compile=True)
    {settle}
    for number in range(3):  # the decode step compiles off the caller's path, on a scratch copy of its cache
        started = time.monotonic()
        generate(model, prompt(seed=5), 6)
        if number == 0:  # a graph backend's recordings replayed while the compile waited for the caller's pause
            first_replays = _device.GRAPH_APIS["cpu"].replays
            compiles_during_first = sum(started <= at <= time.monotonic() for at in compiled_at)
        _background.wait(300)
    for _ in range(2):  # a cache of the caller's own: its first steps run the compiled code for real, unrecorded
        generate(model, prompt(seed=6), 6, cache=static_cache(model, 14))
        _background.wait(300)
report = {{"graphs": counters["stats"]["unique_graphs"], "stats": xpupack.stats(model)[""], "on": compiled_on,
          "first_replays": first_replays, "compiles_during_first": compiles_during_first}}
print(json.dumps({{**counters["inductor"], **report}}))
"""


@pytest.fixture(scope="module")
def language_model_package(tmp_path_factory, run_python_for_module):
    """``package(backend)``: `TUNE_LANGUAGE_MODEL`'s package, tuned once per backend in a fresh process (on
    the run's shared compiler cache: tuning is not what these tests check) and loaded by each serving mode's
    test. Tests must not change the package."""
    packages = {}

    def package(backend: str) -> str:
        if backend not in packages:
            root = str(tmp_path_factory.mktemp("tuned-language-model") / "pkg")
            run_python_for_module(TUNE_LANGUAGE_MODEL.format(root=root, backend=backend))
            packages[backend] = root
        return packages[backend]

    return package


def _backend(backend: str, label: str):
    # one xdist worker tunes a backend's package for both serving modes
    return pytest.param(backend, id=label, marks=pytest.mark.xdist_group(f"cold-start-{label}"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    [
        _backend("xpupack.GraphBackend(base=xpupack.InductorBackend())", "graph+inductor"),
        _backend(
            'xpupack.GraphBackend(base=xpupack.InductorBackend(base=xpupack.TorchAOBackend("int8-weight-only", '
            "min_sqnr_db=10)))",
            "graph+inductor+torchao",
        ),
        _backend("xpupack.InductorBackend()", "inductor"),
        _backend(
            'xpupack.InductorBackend(base=xpupack.TorchAOBackend("int8-weight-only", min_sqnr_db=10))',
            "inductor+torchao",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["torch.no_grad()", "torch.inference_mode()"], ids=["no_grad", "inference_mode"])
def test_a_decode_step_compiled_at_load_hits_the_graph_the_package_carries(
    tmp_path, run_python, language_model_package, backend, mode
):
    """Regressions: Dynamo compiled the decode step again at load, missing the package's graph (on the H200:
    a second graph and 27 coordinate-descent benchmarks while serving). The compile at load runs on a scratch
    copy of the caller's cache, whose tensors transformers had not marked static addresses as it marks a
    StaticCache's own; and a call with state run for real (a new cache's first steps) handed the compiled
    code the caller's inputs, among them ``generate()``'s attention mask, a view, where tuning's recorded
    calls and the recordings give it copies of their own. Inductor without a graph compiled the decode
    step on the caller's path, on its first call after the load's compile, and so did every package over
    TorchAO (its quantized module served meanwhile now, recorded before the compile starts); and, served under
    ``torch.inference_mode``, it compiled it there once more (Dynamo guards on inference tensors, which
    the caller's are and the scratch copy compiled at load was not)."""
    root = language_model_package(backend)
    # a graph over TorchAO holds nothing back: its load's own jobs (the artifacts' install) are waited for, so
    # that the first generate() can record at once. Elsewhere the wait would start the held compile early
    graph_over_torchao = backend.startswith("xpupack.GraphBackend") and "TorchAO" in backend
    settle = "_background.wait(300)" if graph_over_torchao else "pass"
    result = run_python(
        LOAD_AND_COUNT.format(root=root, mode=mode, settle=settle),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty")},
    )
    counters = json.loads(result.stdout.strip().splitlines()[-1])
    assert counters["stats"]["fallbacks"] == counters["stats"]["fallback_reasons"].get("signature"), counters
    assert counters.get("fxgraph_cache_miss", 0) == 0 and counters.get("fxgraph_cache_hit", 0) >= 1, counters
    # one Dynamo graph per tuned step (the prefill's, the decode step's): nothing compiled again for another input form
    assert counters["graphs"] == 2, counters
    assert counters["on"] and "MainThread" not in counters["on"], counters  # never on the caller's path
    # the module itself served the decode steps meanwhile, then the compiled code (recorded, with a graph)
    assert counters["stats"].get("compiling", 0) >= 1 and counters["stats"]["compiled_serving"] is True, counters
    if graph_over_torchao:
        # the first generate() replayed the quantized module's recordings, and its decode step compiled only once
        # the caller paused: it had run every step for real while the compile held the device (29 s on the H200)
        assert counters["first_replays"] >= 1 and counters["compiles_during_first"] == 0, counters


TUNE_TWO_FORMS = """
import torch
import xpupack
from support.emulated_graph import EmulatedGraphs
from support.language_models import decode_loop, generate, prompt, static_cache, tiny_llama
from xpupack import _device

_device.GRAPH_APIS["cpu"] = EmulatedGraphs()


def run(model, sample):
    if sample == "loop":  # a hand-written loop: another form of the decode-step call than generate()'s
        return decode_loop(model, prompt(), 4, static_cache(model, 14))
    if sample == "batch2":  # generate() of two rows: its sizes are another pattern (2 also counts the KV heads)
        return generate(model, torch.cat([prompt(), prompt(seed=2)]), 6)
    return generate(model, prompt(), 6)


strategy = xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend()))
model = xpupack.tune(tiny_llama(), {samples!r}, run=run, strategy=strategy)
xpupack.save(model, {root!r})
"""

LOAD_GENERATE_AND_COUNT = """
import json
import torch
import xpupack
from support.emulated_graph import EmulatedGraphs
from support.language_models import generate, prompt, tiny_llama
from torch._dynamo.utils import counters
from xpupack import _background, _device

_device.GRAPH_APIS["cpu"] = EmulatedGraphs()
model = xpupack.load(tiny_llama(), {root!r}, defer_compile=True)
ids = torch.cat([prompt(seed=5)] * {rows})
for _ in range(2):  # its decode step is the first this process compiles
    generate(model, ids, 6)
    _background.wait(300)
print(json.dumps({{**counters["inductor"], "stats": xpupack.stats(model)[""]}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "samples, rows",
    [(["loop", "generate"], 1), (["generate", "batch2"], 2)],
    ids=["generate-after-a-loop", "batch2-after-batch1"],
)
def test_a_decode_step_hits_the_carried_graph_whatever_call_compiles_first(tmp_path, run_python, samples, rows):
    """Regression: on the H200 an int8 package's first generate() after a load compiled its decode step
    from scratch (a cache miss and 22 coordinate-descent benchmarks, 70 s). Its tune had run a decode
    loop before generate(), and batch 1 before batch 8. All its calls with state shared one compiled
    function, so each later form's graph was Dynamo's second for it, made with what the first taught it
    (which sizes change), unlike the graph a load makes when that form comes first."""
    root = str(tmp_path / "pkg")
    run_python(TUNE_TWO_FORMS.format(root=root, samples=samples))  # on the run's shared compiler cache
    result = run_python(
        LOAD_GENERATE_AND_COUNT.format(root=root, rows=rows), env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty")}
    )
    counters = json.loads(result.stdout.strip().splitlines()[-1])
    assert counters["stats"]["compiled_serving"] is True, counters
    assert counters.get("fxgraph_cache_miss", 0) == 0 and counters.get("fxgraph_cache_hit", 0) >= 1, counters
