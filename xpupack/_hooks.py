"""Where a tuned module's forward sits: ``module.forward``, or behind accelerate's hook.

accelerate's dispatch (``dispatch_model``, ``from_pretrained(device_map=...)``)
replaces ``module.forward`` of each module it places with a wrapper that moves
the inputs to the module's device and then calls ``module._old_forward``. A
tuned forward put over that wrapper would see the inputs still on the previous
module's device (every call a fallback), and taking it off again would drop the
hook. So for such a module xpupack records its calls, installs its tuned forward
and removes it at ``_old_forward``: behind the hook, where the inputs already
are on the module's device. accelerate is not imported (nor needed) here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

#: what accelerate sets on a module it hooks (``accelerate.hooks.add_hook_to_module``)
_ACCELERATE_HOOK, _ACCELERATE_FORWARD = "_hf_hook", "_old_forward"


def _slot(module: nn.Module) -> str:
    hooked = _ACCELERATE_HOOK in module.__dict__ and _ACCELERATE_FORWARD in module.__dict__
    return _ACCELERATE_FORWARD if hooked else "forward"


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward a tuned module falls back to: the module's own, behind any accelerate hook."""
    return getattr(module, _slot(module))


def install(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Routes the module's calls through ``forward`` (after any accelerate hook has moved the inputs)."""
    setattr(module, _slot(module), forward)


def uninstall(module: nn.Module, forward: Any, original: Callable[..., Any]) -> None:
    """Takes ``forward`` off the module (if it is there), giving the hook back ``original``."""
    name = _slot(module)
    if module.__dict__.get(name) is not forward:
        return
    if name == "forward":
        del module.forward
    else:
        setattr(module, name, original)


class _Observer:
    """Calls ``callback(args, kwargs)`` before each call of a hooked module's ``_old_forward``, and
    ``after(args, kwargs)`` once it returned or raised."""

    def __init__(
        self, module: nn.Module, callback: Callable[[tuple, dict], None], after: Callable[[tuple, dict], None] | None
    ):
        self.module = module
        self.original = getattr(module, _ACCELERATE_FORWARD)

        def observed(*args: Any, **kwargs: Any) -> Any:
            callback(args, kwargs)
            if after is None:
                return self.original(*args, **kwargs)
            try:
                return self.original(*args, **kwargs)
            finally:
                after(args, kwargs)

        self.observed = observed
        setattr(module, _ACCELERATE_FORWARD, observed)

    def remove(self) -> None:
        uninstall(self.module, self.observed, self.original)


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, *handles: Any):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def observe(
    module: nn.Module, callback: Callable[[tuple, dict], None], after: Callable[[tuple, dict], None] | None = None
) -> Any:
    """Calls ``callback(args, kwargs)`` with the inputs the module's forward gets, and ``after(args, kwargs)``
    (if given) once the forward returned or raised; ``.remove()`` stops both.

    Forward hooks, except behind an accelerate hook, which has not moved the inputs yet when
    pre-hooks run.
    """
    if _slot(module) == _ACCELERATE_FORWARD:
        return _Observer(module, callback, after)
    before = module.register_forward_pre_hook(lambda _module, args, kwargs: callback(args, kwargs), with_kwargs=True)
    if after is None:
        return before
    returned = module.register_forward_hook(
        lambda _module, args, kwargs, _output: after(args, kwargs), with_kwargs=True, always_call=True
    )
    return _Handles(before, returned)
