"""Threads that call, switch and load one model at once (in one process; tests/test_concurrency.py runs processes).

Each test forces the interleaving that broke (a pause inside one thread while the other acts) and
bounds every wait, so that it fails the same way on every run without the fix and passes with it.
"""

from __future__ import annotations

import copy
import importlib
import threading

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
