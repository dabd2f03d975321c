"""pytest plugin for deploy-after-load tests (registered through the ``pytest11`` entry point).

A fallback's output equals eager's, so comparing outputs cannot show that a
tuned module silently stopped running its backend. This plugin can:

- the ``fallback_calls`` fixture records every fallback (`FallbackEvent`:
  module path and reason) during the test, for the test to assert on;
- every test that does *not* take ``fallback_calls`` fails when any tuned
  module falls back during it.

Switch the second off for a whole project with the ini option
``xpupack_fail_on_fallback = false`` (``[tool.pytest.ini_options]`` or
``pytest.ini``), or for one test with ``@pytest.mark.xpupack_allow_fallbacks``.

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

from ._listeners import add_fallback_listener

if TYPE_CHECKING:
    from .tuned import FallbackEvent

__all__ = ["FallbackEvent", "fallback_calls"]

#: the ini option that switches failing on unexpected fallbacks off for a project
INI_OPTION = "xpupack_fail_on_fallback"
#: the marker that switches it off for one test
MARKER = "xpupack_allow_fallbacks"


def __getattr__(name: str) -> Any:
    if name == "FallbackEvent":  # defined with the tuned modules, which import torch
        from .tuned import FallbackEvent

        return FallbackEvent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_OPTION, type="bool", default=True,
                  help="xpupack: fail a test that does not take the fallback_calls fixture when a tuned "
                       "module falls back during it (default: true)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: xpupack: let tuned modules fall back during this test "
                                       "without failing it")


@pytest.fixture
def fallback_calls() -> Any:
    """The list of `FallbackEvent` recorded while the test runs."""
    events: list[FallbackEvent] = []
    remove = add_fallback_listener(events.append)
    yield events
    remove()


@pytest.fixture(autouse=True)
def _xpupack_fail_on_fallback(request: pytest.FixtureRequest) -> Any:
    if ("fallback_calls" in request.fixturenames or request.node.get_closest_marker(MARKER) is not None
            or not request.config.getini(INI_OPTION)):
        yield
        return
    events: list[FallbackEvent] = []
    remove = add_fallback_listener(events.append)
    yield
    remove()
    if events:
        listed = "\n".join(f"  {e.path or '<model>'}: {e.reason}" for e in events[:10])
        more = f"\n  ... and {len(events) - 10} more" if len(events) > 10 else ""
        pytest.fail(f"{len(events)} call(s) of tuned modules ran the original module (fallback):\n{listed}{more}\n"
                    "xpupack's pytest plugin fails a test when that happens. If the test expects fallbacks, "
                    "take the `fallback_calls` fixture (and assert on it), mark it "
                    f"@pytest.mark.{MARKER}, or set `{INI_OPTION} = false` in the project's pytest "
                    "configuration", pytrace=False)
