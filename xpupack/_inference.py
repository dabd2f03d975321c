"""Inference tensors: xpupack works whether the caller's code runs under `torch.inference_mode()`, `torch.no_grad()`
or neither (docs/calls-and-fallback.md).

A tensor made under inference mode (an *inference tensor*) cannot be written in place outside
inference mode, ever. Two rules follow:

- every tensor xpupack keeps (a recorded sample, a state copy, a device graph's static buffer) is a
  normal tensor, made outside inference mode whatever mode the call that made it ran in: a normal
  tensor can be written in either mode;
- a tensor of the caller's that xpupack writes (a KV cache put back as it was) or that a call it
  makes writes (a recorded decode step run again at tune time) is written under inference mode when
  it is an inference tensor: it was made there, and only there can it change.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Concatenate, ParamSpec, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn

P = ParamSpec("P")
R = TypeVar("R")


def own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor`` that is a normal tensor, even when made inside inference mode."""
    with torch.inference_mode(False):
        return tensor.detach().clone()


def write(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """``tensor.copy_(values)``, under inference mode when ``tensor`` is an inference tensor."""
    with writing([tensor]):
        tensor.copy_(values)


def writing(tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
    """The mode in which code may write ``tensors`` in place, autograd off: `torch.inference_mode` when any of
    them is an inference tensor, else `torch.no_grad` (which keeps the results normal tensors)."""
    if any(tensor.is_inference() for tensor in tensors):
        return torch.inference_mode()
    return torch.no_grad()


def normal_call(args: tuple, kwargs: dict, leaves: list) -> tuple[contextlib.AbstractContextManager, tuple, dict]:
    """A call of compiled code under inference mode, made the call that tuning and loading compiled for:
    outside inference mode without autograd (`normal_tensors`), its inference tensors copied to normal
    ones. Returns ``(the mode to call in, args, kwargs)``; outside inference mode, the call as it is.

    Compiled code guards on each input's dispatch keys, which inference mode changes: a caller's first
    call under `torch.inference_mode()` would otherwise compile again, on the caller's path, at every
    signature (a second or more each). Only for a call that writes nothing of the caller's (no state, no
    input written in place): an inference tensor may be written only inside inference mode, and a copy's
    writes would never reach the caller. Its outputs are normal tensors, which inference mode takes.
    """
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext(), args, kwargs
    if any(isinstance(leaf, torch.Tensor) and leaf.is_inference() for leaf in leaves):
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: own_copy(t) if t.is_inference() else t, (args, kwargs)
        )
    return _outside_inference_mode_without_grad(), args, kwargs


@contextlib.contextmanager
def _outside_inference_mode_without_grad() -> Iterator[None]:
    with torch.inference_mode(False), torch.no_grad():
        yield


def normal_tensors(model: nn.Module) -> contextlib.AbstractContextManager:
    """A block whose new tensors are normal tensors whatever mode the caller is in, autograd on or off as the
    caller had it (``torch.inference_mode(False)`` alone would switch it on). `tune` and `load` run in one:
    weights or buffers they made under inference mode would make the model unusable outside it.

    A model built under inference mode holds inference tensors and runs only there: its block stays in the
    caller's mode.
    """
    if (
        torch.is_inference_mode_enabled()
        and isinstance(model, nn.Module)
        and any(tensor.is_inference() for tensor in _tensors(model))
    ):
        return contextlib.nullcontext()
    return _normal_tensors()


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


@contextlib.contextmanager
def _normal_tensors() -> Iterator[None]:
    grad = torch.is_grad_enabled()
    with torch.inference_mode(False), torch.set_grad_enabled(grad):
        yield


def outside_inference_mode(function: Callable[Concatenate[nn.Module, P], R]) -> Callable[Concatenate[nn.Module, P], R]:
    """Decorator for a function whose first argument is the model (`load`): it runs in `normal_tensors`."""

    @functools.wraps(function)
    def wrapper(model: nn.Module, *args: P.args, **kwargs: P.kwargs) -> R:
        outer = getattr(_caller, "mode", "")
        _caller.mode = (
            "inference_mode" if torch.is_inference_mode_enabled() else "" if torch.is_grad_enabled() else "no_grad"
        )
        try:
            with normal_tensors(model):
                return function(model, *args, **kwargs)
        finally:
            _caller.mode = outer

    return wrapper


#: per thread, the mode the caller of the `outside_inference_mode` function running was in (`caller_mode`)
_caller = threading.local()


def caller_mode() -> str:
    """The mode the caller of the `outside_inference_mode` function running on this thread (`load`) called it
    in: ``"inference_mode"``, ``"no_grad"`` (grad off, not inference mode), or ``""`` (neither: the caller
    said nothing of the mode it will serve in)."""
    return getattr(_caller, "mode", "")
