"""pytest plugin for deploy-after-load tests (registered through the ``pytest11`` entry point).

A fallback's output equals eager's, so comparing outputs cannot show that a
tuned module silently stopped running its backend. This plugin can:

- the ``fallback_calls`` fixture records every fallback (`FallbackEvent`:
  module path and reason) during the test, for the test to assert on;
- every test that does *not* take ``fallback_calls`` fails when any tuned
  module falls back during it;
- the ``backend_downgrades`` fixture records each loaded module called during
  the test that runs another backend than its package's (`DowngradeEvent`:
  path, the package's backend, the one that runs, why): a graph package on a
  machine without device graphs, a backend whose restore failed at load. Its
  calls are no fallbacks (the module runs what the load chose for it), so
  this is the only place they show;
- every test that does *not* take ``backend_downgrades`` fails when it calls
  such a module, wherever the model was loaded (a session fixture too).

Switch the failures off for a whole project with the ini options
``xpupack_fail_on_fallback = false`` and ``xpupack_fail_on_downgrade = false``
(``[tool.pytest.ini_options]`` or ``pytest.ini``), or for one test with
``@pytest.mark.xpupack_allow_fallbacks`` and ``@pytest.mark.xpupack_allow_downgrades``.

pytest loads this plugin into every run of every environment where xpupack
is installed, so it imports nothing heavy (no torch): it only listens, through
`xpupack._listeners`, for fallbacks that tuned modules report.

Example:
    def test_deploy(fallback_calls):
        model = xpupack.load(make_model(), "pkg/")
        model(torch.randn(8, 16, 64))          # batch 8 was never recorded
        assert [e.path for e in fallback_calls] == ["layers.0.mlp", "layers.1.mlp"]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ._listeners import add_downgrade_listener, add_fallback_listener

if TYPE_CHECKING:
    from .tuned import DowngradeEvent, FallbackEvent

__all__ = ["DowngradeEvent", "FallbackEvent", "backend_downgrades", "fallback_calls"]

#: the ini option that switches failing on unexpected fallbacks off for a project
INI_OPTION = "xpupack_fail_on_fallback"
#: the marker that switches it off for one test
MARKER = "xpupack_allow_fallbacks"
#: the ini option and the marker for modules that run another backend than their package's
DOWNGRADE_INI_OPTION = "xpupack_fail_on_downgrade"
DOWNGRADE_MARKER = "xpupack_allow_downgrades"


def __getattr__(name: str) -> Any:
    """``FallbackEvent`` and ``DowngradeEvent``, imported (with torch) on first use."""
    if name in ("FallbackEvent", "DowngradeEvent"):  # defined with the tuned modules, which import torch
        from . import tuned

        return getattr(tuned, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pytest_addoption(parser: pytest.Parser) -> None:
    """pytest hook: declares the ini options ``xpupack_fail_on_fallback`` and ``xpupack_fail_on_downgrade``.

    Both default to true; set one to false to stop failing tests on that event project-wide.

    Args:
        parser: pytest's option parser.

    Example:
        ```toml
        [tool.pytest.ini_options]
        xpupack_fail_on_fallback = false
        ```
    """
    parser.addini(
        INI_OPTION,
        type="bool",
        default=True,
        help="xpupack: fail a test that does not take the fallback_calls fixture when a tuned "
        "module falls back during it (default: true)",
    )
    parser.addini(
        DOWNGRADE_INI_OPTION,
        type="bool",
        default=True,
        help="xpupack: fail a test that does not take the backend_downgrades fixture when it calls a "
        "loaded module that runs another backend than its package's (default: true)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """pytest hook: declares the markers ``xpupack_allow_fallbacks`` and ``xpupack_allow_downgrades``.

    Declared, they work under ``--strict-markers``.

    Args:
        config: pytest's configuration.

    Example:
        ```python
        @pytest.mark.xpupack_allow_fallbacks
        def test_unseen_batch_sizes_still_answer(model):
            model(torch.randn(7, 16, 64))
        ```
    """
    config.addinivalue_line(
        "markers", f"{MARKER}: xpupack: let tuned modules fall back during this test without failing it"
    )
    config.addinivalue_line(
        "markers",
        f"{DOWNGRADE_MARKER}: xpupack: let loaded modules run another backend "
        "than their package's during this test without failing it",
    )


@pytest.fixture
def fallback_calls() -> Any:
    """The list of `FallbackEvent` recorded while the test runs (pytest fixture).

    Each event has the tuned module's ``path`` and the ``reason`` its call ran the original module
    (no recording fits, a backend error...). A test that takes this fixture is not failed for fallbacks:
    it asserts on them itself.

    Example:
        ```python
        def test_batch_8_falls_back_and_batch_1_does_not(fallback_calls):
            model = xpupack.load(make_model(), "./pkg")
            model(torch.zeros(1, 16, dtype=torch.long))
            assert fallback_calls == []
            model(torch.zeros(8, 16, dtype=torch.long))   # batch 8 was never recorded
            assert [event.reason for event in fallback_calls]
        ```
    """
    events: list[FallbackEvent] = []
    remove = add_fallback_listener(events.append)
    yield events
    remove()


@pytest.fixture
def backend_downgrades() -> Any:
    """The `DowngradeEvent` of each loaded module called during the test that runs another backend than its
    package's: one per module, in the order they were first called (pytest fixture).

    Each event has the module's ``path``, the backend its package ``promised``, the one ``running``, and
    the ``reason`` (no device graphs here, a restore that failed). A test that takes this fixture is
    not failed for downgrades: it asserts on them itself.

    Example:
        ```python
        def test_the_graph_package_runs_eager_on_a_cpu(backend_downgrades):
            model = xpupack.load(make_model(), "./graph-pkg", device="cpu")
            model(torch.zeros(1, 16, dtype=torch.long))
            assert {event.running for event in backend_downgrades} == {"eager"}
        ```
    """
    events: list[DowngradeEvent] = []
    remove = add_downgrade_listener(_once_each(events))
    yield events
    remove()


def _once_each(events: list) -> Any:
    """A listener that appends each event object once (a module reports the same one on every call)."""
    seen: set[int] = set()

    def listen(event: Any) -> None:
        if id(event) not in seen:  # ``events`` holds each one, so no id is reused meanwhile
            seen.add(id(event))
            events.append(event)

    return listen


class _Watch:
    """What one of the plugin's autouse fixtures heard during a test, and how much of it was reported."""

    def __init__(self, message: Any):
        self.events: list = []
        self.reported = 0
        self.message = message  # events -> the failure's text

    def unreported(self) -> str | None:
        """The failure's text for the events not reported yet (marking them reported), or None."""
        events, self.reported = self.events[self.reported :], len(self.events)
        return self.message(events) if events else None


_WATCHES = pytest.StashKey[list]()


def _watch(request: pytest.FixtureRequest, message: Any) -> _Watch:
    watch = _Watch(message)
    request.node.stash.setdefault(_WATCHES, []).append(watch)
    return watch


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """pytest hook: fails the test itself (not its teardown) for the fallbacks and downgrades its call
    heard; a test that failed on its own keeps its failure, the events shown in an ``xpupack`` section.

    Args:
        item: the test.
    """
    try:
        result = yield
    except BaseException:
        for problem in _unreported(item):
            item.add_report_section("call", "xpupack", problem)
        raise
    problems = _unreported(item)
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)
    return result


def _unreported(item: pytest.Item) -> list[str]:
    return [problem for watch in item.stash.get(_WATCHES, []) if (problem := watch.unreported())]


def _downgrade_message(events: list) -> str:
    listed = "\n".join(
        f"  {e.path or '<model>'}: package {e.promised}, runs {e.running} ({e.reason})" for e in events[:10]
    )
    more = f"\n  ... and {len(events) - 10} more" if len(events) > 10 else ""
    return (
        f"{len(events)} tuned module(s) ran another backend than their package's:\n{listed}{more}\n"
        "xpupack's pytest plugin fails a test that calls such a module. If the test expects it, take "
        "the `backend_downgrades` fixture (and assert on it), mark it "
        f"@pytest.mark.{DOWNGRADE_MARKER}, or set `{DOWNGRADE_INI_OPTION} = false` in the project's "
        "pytest configuration"
    )


def _fallback_message(events: list) -> str:
    listed = "\n".join(f"  {e.path or '<model>'}: {e.reason}" for e in events[:10])
    more = f"\n  ... and {len(events) - 10} more" if len(events) > 10 else ""
    return (
        f"{len(events)} call(s) of tuned modules ran the original module (fallback):\n{listed}{more}\n"
        "xpupack's pytest plugin fails a test when that happens. If the test expects fallbacks, "
        "take the `fallback_calls` fixture (and assert on it), mark it "
        f"@pytest.mark.{MARKER}, or set `{INI_OPTION} = false` in the project's pytest "
        "configuration"
    )


@pytest.fixture(autouse=True)
def _xpupack_fail_on_downgrade(request: pytest.FixtureRequest) -> Any:
    if (
        "backend_downgrades" in request.fixturenames
        or request.node.get_closest_marker(DOWNGRADE_MARKER) is not None
        or not request.config.getini(DOWNGRADE_INI_OPTION)
    ):
        yield
        return
    watch = _watch(request, _downgrade_message)
    remove = add_downgrade_listener(_once_each(watch.events))
    yield
    remove()
    problem = watch.unreported()  # heard after the test's call (in a fixture's teardown): a teardown error
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(autouse=True)
def _xpupack_fail_on_fallback(request: pytest.FixtureRequest) -> Any:
    if (
        "fallback_calls" in request.fixturenames
        or request.node.get_closest_marker(MARKER) is not None
        or not request.config.getini(INI_OPTION)
    ):
        yield
        return
    watch = _watch(request, _fallback_message)
    remove = add_fallback_listener(watch.events.append)
    yield
    remove()
    problem = watch.unreported()  # heard after the test's call (in a fixture's teardown): a teardown error
    if problem:
        pytest.fail(problem, pytrace=False)
