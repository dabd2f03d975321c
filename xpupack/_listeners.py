"""Who hears about fallbacks and downgrades: torch-free, so that the pytest plugin can listen without importing torch.

`xpupack.tuned` calls every fallback listener with a `xpupack.tuned.FallbackEvent` each time a
tuned module runs the original module, and every downgrade listener with the module's
`xpupack.tuned.DowngradeEvent` each time a loaded module that runs another backend than its
package's is called; `xpupack.testing` is the main listener.
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


#: called with a module's `DowngradeEvent` on each call of a loaded module that does not run its package's backend
downgrade_listeners: list[Callable[[Any], None]] = []


def add_downgrade_listener(listener: Callable[[Any], None]) -> Callable[[], None]:
    """Calls ``listener`` on every call of a downgraded module; returns a function that removes it."""
    downgrade_listeners.append(listener)
    return lambda: downgrade_listeners.remove(listener)
