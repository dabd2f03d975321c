"""Shared fixtures: isolated caches, the emulated graph device, hardware markers, a Hub on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import xpupack
from support.emulated_graph import EmulatedGraphs
from support.hub_server import OlahHub
from support.models import make_stack, stack_samples
from xpupack import _device
from xpupack.examples import tiny_transformer, tiny_transformer_samples


def _graph_device() -> str | None:
    for device_type in ("xpu", "cuda"):
        module = getattr(torch, device_type, None)
        if module is not None and module.is_available():
            return device_type
    return None


GRAPH_DEVICE = _graph_device()


#: a test that uses one of these is `slow` (the quick loop, ``-m "not slow"``, leaves it out; CI runs it):
#: the session's compiled packages cost an Inductor compile in each xdist worker, run_python a fresh process
SLOW_FIXTURES = frozenset({"inductor_package", "graph_inductor_package", "run_python"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Applies the hardware markers from one capability probe, and `slow` to the users of `SLOW_FIXTURES`."""
    have = {
        "requires_graph_device": GRAPH_DEVICE is not None,
        "requires_cuda": torch.cuda.is_available(),
        "requires_xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        for marker, available in have.items():
            if marker in item.keywords and not available:
                item.add_marker(pytest.mark.skip(reason=f"{marker}: no such device here"))


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache() -> Path:
    """The run's one Inductor cache (the root conftest's `pytest_configure` sets it, for every xdist worker
    and every fresh process a test starts): a module compiles once per run, never from the user's cache.
    A test that looks at what a cache holds uses a cache of its own: the other workers write to this one."""
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


@pytest.fixture(scope="session")
def inductor_package(tmp_path_factory, _inductor_cache):
    """``(tuned model, package)``: the stack's MLPs compiled by Inductor, once per run (compiling is slow).

    Tests must not change the package; copy it first.
    """
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.InductorBackend())
    )
    root = xpupack.save(model, tmp_path_factory.mktemp("inductor") / "pkg")
    return model, root


@pytest.fixture(scope="session")
def eager_package(tmp_path_factory) -> Path:
    """The package of the stack's MLPs tuned with eager (`inductor_package`'s modules, without compiled code).

    Tests must not change the package; copy it first.
    """
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.EagerBackend())
    )
    return xpupack.save(model, tmp_path_factory.mktemp("eager") / "pkg")


@pytest.fixture(scope="session")
def demo_eager_package(tmp_path_factory) -> Path:
    """The package of the demo transformer (`xpupack.examples`, seed 0) with its MLPs tuned with eager, as a
    user's first package is: it builds in a second. Tests must not change the package; copy it first."""
    model = xpupack.tune(
        tiny_transformer(),
        tiny_transformer_samples(),
        modules=["layers.*.mlp"],
        device="cpu",
        strategy=xpupack.FirstWins([xpupack.EagerBackend()]),
    )
    return xpupack.save(model, tmp_path_factory.mktemp("demo-eager") / "pkg")


@pytest.fixture(scope="session")
def graph_inductor_package(tmp_path_factory, _inductor_cache):
    """``(tuned model, package)``: the stack's MLPs as ``graph+inductor``, once per run.

    Built through the emulated device graphs (a CPU has none), so that loading it
    here without them falls back from graph to the Inductor base: compiled
    artifacts behind a fallback. Tests must not change the package; copy it first.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_device.GRAPH_APIS, "cpu", EmulatedGraphs())
        model = xpupack.tune(
            make_stack(),
            stack_samples(),
            modules=["layers.*.mlp"],
            strategy=xpupack.Only(xpupack.GraphBackend(base=xpupack.InductorBackend())),
        )
        root = xpupack.save(model, tmp_path_factory.mktemp("graph-inductor") / "pkg")
    return model, root


@pytest.fixture(autouse=True)
def _background_work_ends_with_its_test():
    """A load hands compiles to xpupack's background worker (``defer_compile``): what a test started
    finishes before the next test runs, which may spy on torch.compile or change its caches."""
    yield
    from xpupack import _background

    if _background._worker is not None:
        _background.wait(600)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("XPUPACK_CACHE", str(tmp_path / "xpupack-cache"))


@pytest.fixture
def emulated_graphs(monkeypatch):
    """Device graphs on CPU through `EmulatedGraphs` (for the graph backend's logic)."""
    api = EmulatedGraphs()
    monkeypatch.setitem(_device.GRAPH_APIS, "cpu", api)
    return api


def fresh_python(code: str, folder: Path, *, env: dict | None = None, check: bool = True):
    """Runs a Python snippet in a fresh process (its script written into ``folder``); fails the test on a
    non-zero exit unless ``check`` is false. ``tests/`` is on its path, for ``support``."""
    script = folder / "snippet.py"
    script.write_text(textwrap.dedent(code))
    tests_dir = os.path.dirname(__file__)
    full_env = {
        **os.environ,
        "PYTHONPATH": tests_dir + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **(env or {}),
    }
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full_env, timeout=600)
    if check and result.returncode != 0:
        pytest.fail(f"fresh process failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture
def run_python(tmp_path):
    """Runs a Python snippet in a fresh process; returns its stdout (fails the test on a non-zero exit)."""

    def run(code: str, *, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return fresh_python(code, tmp_path, env=env, check=check)

    return run


@pytest.fixture(scope="module")
def run_python_for_module(tmp_path_factory):
    """`run_python` for a module-scoped fixture (a package several tests load, built in a fresh process)."""
    folder = tmp_path_factory.mktemp("fresh-process")

    def run(code: str, *, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return fresh_python(code, folder, env=env, check=check)

    return run


@pytest.fixture(scope="session")
def olah_server(tmp_path_factory):
    """olah on 127.0.0.1, offline, serving git repos: a real Hub-compatible HTTP server for the session.

    Skipped only when olah cannot start here; in CI (``CI`` set) that fails instead.
    """
    server = OlahHub(tmp_path_factory.mktemp("olah"))
    problem = server.start()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the Hub tests need olah in CI: {problem}")
        pytest.skip(f"cannot start olah: {problem}")
    yield server
    server.stop()


@pytest.fixture
def hub(olah_server, monkeypatch):
    """The olah server as this test's Hub (``HF_ENDPOINT``), online."""
    monkeypatch.setenv("HF_ENDPOINT", olah_server.endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return olah_server
