"""pytest plugin for deploy-after-load tests (registered through the ``pytest11`` entry point).

A fallback's output equals eager's, so comparing outputs cannot show that a
tuned module silently stopped running its backend. This plugin can:

- the ``fallback_calls`` fixture records every fallback (`FallbackEvent`:
  module path and reason) during the test, for the test to assert on;
- every test that does *not* take ``fallback_calls`` fails when any tuned
  module falls back during it.

Example:
    def test_deploy(fallback_calls):
        model = xpupack.load(make_model(), "pkg/")
        model(torch.randn(8, 16, 64))          # batch 8 was never recorded
        assert [e.path for e in fallback_calls] == ["layers.0.mlp", "layers.1.mlp"]
"""

from __future__ import annotations

import pytest

from .tuned import FallbackEvent, add_fallback_listener

__all__ = ["FallbackEvent", "fallback_calls"]


@pytest.fixture
def fallback_calls():
    """The list of `FallbackEvent` recorded while the test runs."""
    events: list[FallbackEvent] = []
    remove = add_fallback_listener(events.append)
    yield events
    remove()


@pytest.fixture(autouse=True)
def _xpupack_fail_on_fallback(request):
    if "fallback_calls" in request.fixturenames:
        yield
        return
    events: list[FallbackEvent] = []
    remove = add_fallback_listener(events.append)
    yield
    remove()
    if events:
        listed = "\n".join(f"  {e.path or '<model>'}: {e.reason}" for e in events[:10])
        pytest.fail(f"{len(events)} call(s) of tuned modules ran the original module (fallback):\n{listed}\n"
                    "take the `fallback_calls` fixture if the test expects fallbacks", pytrace=False)
