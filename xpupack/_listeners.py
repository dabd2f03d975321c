"""Who hears about fallbacks: torch-free, so that the pytest plugin can listen without importing torch.

`xpupack.tuned` calls every listener with a `xpupack.tuned.FallbackEvent` each time a
tuned module runs the original module; `xpupack.testing` is the main listener.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: called with each `FallbackEvent`, in the order they were added: the registry of the listener
#: mechanism (empty unless a test or a user listens). A list, not a lock, because each append and
#: remove is one atomic step and the fallback path iterates over a copy.
fallback_listeners: list[Callable[[Any], None]] = []


def add_fallback_listener(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Calls ``listener`` on every fallback; returns a function that removes it."""
    fallback_listeners.append(listener)
    return lambda: fallback_listeners.remove(listener)
