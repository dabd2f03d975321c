"""The undo log of a load: every change `xpupack.load` makes to a model, and how to take it back.

A failed load calls `ModelEdit.rollback`, which leaves the model exactly as it was. Edits of one
model run one at a time (`model_lock`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _device

if TYPE_CHECKING:
    from .backends.base import Runner


_model_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The lock that `load`, `tune`, `activate` and `deactivate` hold (`edits_model`) while they change
    which forwards ``model``'s modules run: two loads into one model interleaving could leave a module
    running the replaced load's forward, out of `stats` and out of reach of `deactivate`. Reentrant, so
    that a call that edits the model from inside another (a ``run`` callback of `tune`) does not wait on itself."""
    with _model_locks_guard:
        try:
            lock = _model_locks.get(model)
            if lock is None:
                lock = _model_locks[model] = threading.RLock()
        except TypeError:  # no module (no weak reference to it): the function's own checks will say so
            lock = threading.RLock()
        return lock


def edits_model(function: Callable[..., Any]) -> Callable[..., Any]:
    """Runs ``function(model, ...)`` holding ``model``'s `model_lock`."""

    @functools.wraps(function)
    def locked(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with model_lock(model):
            return function(model, *args, **kwargs)

    return locked


class ModelEdit:
    """Changes to a model that can all be undone: tensors replaced or written, training flags, runners' changes.

    It also keeps each module's parameter, buffer and submodule entries as they
    were, for whatever a backend's `restore` replaced without undoing it.
    """

    def __init__(self, model: nn.Module):
        self._undo: list[Callable[[], None]] = []
        self._entries = [(m, dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]

    def replace_tensor(self, module: nn.Module, name: str, tensor: torch.Tensor, new: torch.Tensor) -> None:
        """Puts ``new`` in place of the parameter or buffer ``tensor`` (``module``'s ``name``): a parameter keeps its
        Parameter object and takes ``new`` as its data (an empty model's, on the meta device, its contents
        swapped), a buffer entry is replaced. Rollback puts the old tensor
        back; the undo log holds a reference to it, no copy."""
        if name in module._parameters and tensor.is_meta and not new.is_meta:
            # an empty model's parameter: ``.data`` cannot change a meta tensor into another kind, so the
            # Parameter object trades contents with one over ``new`` (ties and references to it stay valid)
            replacement = nn.Parameter(new, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, replacement)
            self._undo.append(functools.partial(torch.utils.swap_tensors, tensor, replacement))
        elif name in module._parameters:
            old = tensor.data
            tensor.data = new
            self._undo.append(functools.partial(setattr, tensor, "data", old))
        else:
            module._buffers[name] = new
            self._undo.append(functools.partial(module._buffers.__setitem__, name, tensor))

    def copy_into(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Writes ``values`` into ``tensor`` in place (same object, same memory); rollback writes the old values back.

        For a tensor that stays on its accelerator: the old values wait for a rollback in host memory, so the
        load needs no device memory beyond the model's own (`replace_tensor` would hold the old tensor on the
        device until the load is over: a second model's worth). Also a DTensor's local shard, whose Parameter
        cannot take new data.
        """
        old = _device.host_copy(tensor.detach())
        with torch.no_grad():
            tensor.copy_(values)

        def undo() -> None:
            with torch.no_grad():
                tensor.copy_(old)

        self._undo.append(undo)

    def keep_runner(self, runner: Runner) -> None:
        """A restored runner: rollback undoes what it changed in its module (e.g. quantized weights)."""
        self._undo.append(runner.undo)

    def undo_runner(self, runner: Runner) -> None:
        """An earlier tuning's runner: its changes are undone now and redone on rollback."""
        runner.undo()
        self._undo.append(runner.redo)

    def set_eval(self, model: nn.Module) -> None:
        flags = [(m, m.training) for m in model.modules()]
        model.eval()

        def undo() -> None:
            for module, flag in flags:
                module.training = flag

        self._undo.append(undo)

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        # and whatever a backend's restore replaced in a module without undoing it
        for module, parameters, buffers, submodules in self._entries:
            for table, saved in (
                (module._parameters, parameters),
                (module._buffers, buffers),
                (module._modules, submodules),
            ):
                table.clear()
                table.update(saved)  # type: ignore[arg-type]  # each table gets its own saved copy


def named_tensors(model: nn.Module):
    """``(module, state-dict name, attribute name, tensor)`` for each parameter and buffer."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is not None:
                yield module, f"{prefix}.{name}" if prefix else name, name, tensor
