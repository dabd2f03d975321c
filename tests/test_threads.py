"""Threads that call, switch and load one model at once (in one process; tests/test_concurrency.py runs processes).

Each test forces the interleaving that broke (a pause inside one thread while the other acts) and
bounds every wait, so that it fails the same way on every run without the fix and passes with it.
"""

from __future__ import annotations

import copy
import importlib
import threading
import time

import pytest
import torch

import xpupack
from support.models import make_stack, stack_samples
from support.strategies import GRAPH

#: how long a paused thread waits for the other one before it goes on (the fix makes the other one wait)
PAUSE_S = 1.0


def _run(*targets):
    threads = [threading.Thread(target=target, name=f"worker-{n}") for n, target in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)


def _tuned():
    model = make_stack()
    reference = copy.deepcopy(model)
    return xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"], strategy=GRAPH), reference


def _errors_of(model):
    return {
        path: entry.get("backend_errors") for path, entry in xpupack.stats(model).items() if entry.get("backend_errors")
    }


def test_deactivating_while_a_call_replays_never_moves_its_signature_to_eager(emulated_graphs):
    """Regression: `release` dropped the recordings while a call was between its storage check and its replay;
    the call failed with "signature not recorded", and that signature ran the original module for good."""
    model, reference = _tuned()
    runner = xpupack.tuned.session_of(model).modules["layers.0.mlp"].runner
    watch, inside, released = runner._watch, threading.Event(), threading.Event()

    class PausingWatch:
        def changed(self):  # the call is past the lock: let the other thread act now
            inside.set()
            released.wait(PAUSE_S)
            return watch.changed()

    runner._watch = PausingWatch()
    x = torch.randn(2, 8)
    outputs = []

    def call():
        with torch.no_grad():
            outputs.append(model(x))

    def deactivate():
        inside.wait(PAUSE_S * 5)
        xpupack.deactivate(model)
        released.set()

    _run(call, deactivate)
    xpupack.activate(model)
    with torch.no_grad():
        outputs.append(model(x))
        expected = reference(x)
    assert _errors_of(model) == {}
    assert all(torch.allclose(output, expected, atol=1e-6) for output in outputs)
    assert xpupack.stats(model)["layers.0.mlp"]["active_signatures"] == 2


def test_switching_on_and_off_while_calls_run_keeps_every_recording(emulated_graphs):
    model, reference = _tuned()
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = reference(x)
    wrong = []

    def call():
        with torch.no_grad():
            for _ in range(100):
                if not torch.allclose(model(x), expected, atol=1e-6):
                    wrong.append(1)

    def switch():
        for _ in range(20):
            xpupack.deactivate(model)
            xpupack.activate(model)

    _run(call, switch)
    assert wrong == [] and _errors_of(model) == {}
    assert all(entry["active_signatures"] == entry["signatures"] for entry in xpupack.stats(model).values())


def test_two_threads_loading_into_one_model_leave_it_running_the_load_that_came_last(tmp_path, monkeypatch):
    """Regression: a load that replaced another load's session while that one was between attaching and
    activating left the model's modules running the replaced session's forwards: `stats` missed their
    calls and `deactivate` could not take them off. Loads into one model now run one after the other."""
    eager = xpupack.FirstWins([xpupack.EagerBackend()])
    roots = [
        xpupack.save(
            xpupack.tune(make_stack(seed=seed), stack_samples(), modules=["layers.*.mlp"], strategy=eager),
            tmp_path / f"pkg{seed}",
        )
        for seed in (0, 1)
    ]
    model = make_stack(seed=5)
    load_module = importlib.import_module("xpupack.loading")
    attach, attached, second_done = load_module.attach, threading.Event(), threading.Event()

    def pausing_attach(model_, session):
        attach(model_, session)
        if threading.current_thread().name == "worker-0":
            attached.set()
            second_done.wait(PAUSE_S)

    monkeypatch.setattr(load_module, "attach", pausing_attach)

    def first():
        xpupack.load(model, roots[0])

    def second():
        attached.wait(PAUSE_S * 5)
        xpupack.load(model, roots[1])
        second_done.set()

    _run(first, second)
    session = xpupack.tuned.session_of(model)
    for path, tuned in session.modules.items():
        assert model.get_submodule(path).__dict__.get("forward") is tuned, path
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert [entry["calls"] for entry in xpupack.stats(model).values()] == [1, 1]
    xpupack.deactivate(model)
    assert not any("forward" in model.get_submodule(path).__dict__ for path in session.modules)


def test_a_graph_load_and_its_calls_never_wait_for_another_models_compile(emulated_graphs, tmp_path):
    """Regression (reliability round 4, item 4): a graph package's load waited for the device lock that another
    model's compile on the background worker held (46.5 s instead of 0.02 s on the H200), and so would its calls.
    Now the load records nothing while the lock is taken elsewhere: calls run unrecorded meanwhile, and the
    first call after the compile records and replays."""
    from xpupack import _background

    model, reference = _tuned()
    root = xpupack.save(model, tmp_path / "pkg")
    compiling, done = threading.Event(), threading.Event()

    def another_models_compile():  # holds the device lock as the worker does while it compiles
        with _background.device_work:
            compiling.set()
            done.wait(60)

    tuning_captures = emulated_graphs.captures
    holder = threading.Thread(target=another_models_compile)
    holder.start()
    compiling.wait(10)
    loaded, outputs, x = [], [], torch.randn(2, 8)

    def load_and_call():
        loaded.append(xpupack.load(make_stack(), root))
        with torch.no_grad():
            outputs.append(loaded[0](x))

    try:
        _run(load_and_call)  # fails if the load or the call waits for the compile (30 s, then the assertion)
        captures_meanwhile = emulated_graphs.captures - tuning_captures
    finally:
        done.set()
        holder.join(30)
    with torch.no_grad():
        outputs.append(loaded[0](x))  # the compile is done: recorded and replayed
        expected = reference(x)
    assert captures_meanwhile == 0 and emulated_graphs.captures > tuning_captures and emulated_graphs.replays >= 1
    assert all(torch.allclose(output, expected, atol=1e-6) for output in outputs)
    stats = xpupack.stats(loaded[0])["layers.0.mlp"]
    assert stats["fallbacks"] == 0 and stats["recordings"] == 2, stats


def _job_on_the_worker(seconds):
    """Submits a job that holds xpupack's worker for ``seconds``; returns ``(started, running)`` events."""
    from xpupack import _background

    started, running = threading.Event(), threading.Event()

    def job():
        running.set()
        started.set()
        time.sleep(seconds)
        running.clear()

    _background.submit(job)
    assert started.wait(30)
    return running


@pytest.mark.xpupack_allow_fallbacks
def test_a_call_that_runs_the_models_python_waits_for_a_job_on_the_worker_and_a_replay_does_not(emulated_graphs):
    """Regression: a ``defer_compile=True`` load's compile on the worker traced a tiny Llama while the caller's
    ``generate()`` ran the same model's Python (its decode steps, before the compiled code served):
    transformers' output capture keeps a process-wide variable while compiled code runs, which the caller's
    forward changed under the trace, and Dynamo failed to build its guards ("Expected dict, got NoneType", 3 of
    4 loads). Now a call that runs the model's Python (a fallback here) waits for the job; a replay does not."""
    model, reference = _tuned()
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)  # recorded at tune time; a replay from here on
    inside_job = []
    model.layers[0]["mlp"].up.register_forward_pre_hook(lambda *_: inside_job.append(running.is_set()))

    running = _job_on_the_worker(PAUSE_S)
    with torch.no_grad():
        replayed = model(x)  # replays both MLPs: no Python of theirs runs
    replayed_during_job = running.is_set()
    inside_job.clear()  # the emulated replays ran the Python again (a device's replay runs none)
    running = _job_on_the_worker(PAUSE_S)
    with torch.no_grad():
        fell_back = model(x, scale=2.0)  # a constant no signature has: the original module runs
    assert replayed_during_job and inside_job == [False], (replayed_during_job, inside_job)
    assert xpupack.stats(model)["layers.0.mlp"]["fallback_reasons"] == {"signature": 1}
    with torch.no_grad():
        assert torch.allclose(replayed, reference(x), atol=1e-6)
        assert torch.allclose(fell_back, reference(x, scale=2.0), atol=1e-6)


@pytest.mark.xpupack_allow_fallbacks
def test_a_job_on_the_worker_waits_for_a_call_that_runs_the_models_python(emulated_graphs):
    """The other side of the exclusion: a job given while a call runs the model's Python starts after it."""
    from xpupack import _background

    model, _ = _tuned()
    in_forward, order = threading.Event(), []

    def slow_up(*_):
        in_forward.set()
        time.sleep(PAUSE_S)
        order.append("call")

    model.layers[0]["mlp"].up.register_forward_pre_hook(slow_up)

    def call():
        with torch.no_grad():
            model(torch.randn(2, 8), scale=2.0)  # falls back: the original module runs

    def give_job():
        assert in_forward.wait(30)
        _background.submit(lambda: order.append("job")).result(30)

    _background.submit(lambda: None).result(30)  # the worker exists, as after any deferred load
    _run(call, give_job)
    assert order == ["call", "job"], order
