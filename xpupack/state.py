"""State arguments: objects whose tensors a module reads and updates in place, call after call.

A KV cache is the common case: transformers' ``StaticCache`` allocates its key
and value tensors once and writes each new token into them at fixed addresses.
Such an object cannot be copied into a static buffer, but a device graph can
read and write its tensors where they are, as long as a later call brings
tensors at the same addresses with the same layout (see
`xpupack.backends.graph`).

A type is a state type when it is registered here: transformers'
``StaticCache`` is known built in (recognised by its module and name, so
transformers is never imported for it), other types through
`register_state`. Everything such an object changes between calls must live
in the tensors its function returns: Python-side counters would be baked
into a recording and replayed stale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class StateNotReady(Exception):
    """The state object cannot be recorded now (e.g. its tensors are not allocated yet); the message says why."""


@dataclass(frozen=True)
class StateType:
    """How to find the state tensors of one type's objects."""

    #: ``module.QualifiedName`` of the type, as stored in a package's spec
    name: str
    tensors: Callable[[Any], list[torch.Tensor]]

    def state_tensors(self, obj: Any) -> list[torch.Tensor]:
        """The object's state tensors; raises `StateNotReady` when there are none to record yet."""
        try:
            tensors = self.tensors(obj)
        except StateNotReady:
            raise
        except Exception as exc:  # a user's function that cannot answer yet
            raise StateNotReady(f"its tensors function raised {type(exc).__name__}: {exc}") from None
        if type(tensors) is not list:
            tensors = list(tensors) if tensors is not None else []
        if not tensors or not all(type(t) is torch.Tensor or isinstance(t, torch.Tensor) for t in tensors):
            raise StateNotReady("its tensors function returned no list of tensors")
        return tensors


#: type -> its StateType, or None once a type was looked at and is not a state type: the registry
#: `register_state` writes (and a cache of lookups). Read without a lock on every call with state; a
#: lookup caches with ``setdefault`` (one atomic step), so caching "not a state type" cannot undo a
#: registration made meanwhile.
_TYPES: dict[type, StateType | None] = {}


def type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_state(cls: type, tensors: Callable[[Any], list[torch.Tensor]]) -> None:
    """Declares ``cls`` a state type (a KV cache, say) whose calls the graph backend can record.

    Args:
        cls: the state object's class (exact type; subclasses need their own call).
        tensors: ``tensors(obj)`` returns every tensor the module reads or updates
            in place through the object, in a fixed order. Raise `StateNotReady`
            (``xpupack.state.StateNotReady``) while they do not exist yet (a lazily
            allocated cache before its first call): such calls run the original module.

    Example:
        >>> xpupack.register_state(MyCache, lambda cache: [cache.keys, cache.values, cache.length])
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_state needs a class, not {cls!r}")
    if not callable(tensors):
        raise TypeError(f"register_state({cls.__name__}, ...) needs a function obj -> list of tensors")
    _TYPES[cls] = StateType(type_name(cls), tensors)


def state_type(obj: Any) -> StateType | None:
    """The state type of ``obj``, or None; one dict lookup once a type was seen."""
    cls = type(obj)
    try:
        return _TYPES[cls]
    except KeyError:
        pass
    found = _builtin(cls)
    return _TYPES.setdefault(cls, found)


def scratch_copy(args: tuple, kwargs: dict, state: list[torch.Tensor]) -> tuple[tuple, dict]:
    """A deep copy of a call in which each of its ``state`` tensors is a new zeroed tensor of the same
    layout: running the copy (to compile for it, say) leaves the caller's state as it was.

    Raises whatever ``copy.deepcopy`` raises for an argument that cannot be copied.
    """
    memo: dict[int, Any] = {id(t): torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()
                            for t in state}
    return copy.deepcopy((args, kwargs), memo)


# -- transformers, without importing it ------------------------------------------------------------

def _builtin(cls: type) -> StateType | None:
    if cls.__module__ == "transformers.cache_utils" and cls.__name__ == "StaticCache":
        return StateType(type_name(cls), _static_cache_tensors)
    return None


#: the one layer class whose whole mutable state is in tensors (sliding-window layers keep a
#: Python-side counter, which a recording would replay stale)
_GRAPH_SAFE_LAYERS = ("StaticLayer",)


#: layer class -> names of its tensor attributes, in order (read off the first initialised layer)
_LAYER_TENSORS: dict[type, tuple[str, ...]] = {}


def _static_cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor attribute of every layer (keys, values, the running length): on the hot path of
    each decode step, so the attribute names are looked up once per layer class."""
    tensors: list[torch.Tensor] = []
    for layer in cache.layers:
        names = _LAYER_TENSORS.get(type(layer))
        if names is None:
            names = _layer_tensor_names(layer)
        if not layer.is_initialized:
            raise StateNotReady("its tensors are allocated on the first call (the prefill)")
        tensors += [getattr(layer, name) for name in names]
    return tensors


def _layer_tensor_names(layer: Any) -> tuple[str, ...]:
    kind = type(layer).__name__
    if kind not in _GRAPH_SAFE_LAYERS:
        raise StateNotReady(f"its {kind} layers keep Python-side state a recording cannot follow")
    if not getattr(layer, "is_initialized", False):
        raise StateNotReady("its tensors are allocated on the first call (the prefill)")
    names = tuple(name for name, value in sorted(vars(layer).items()) if isinstance(value, torch.Tensor))
    _LAYER_TENSORS[type(layer)] = names
    return names


def unrecordable_hint(obj: Any) -> str:
    """Advice for an argument that is not a state type, where there is some (a DynamicCache)."""
    cls = type(obj)
    if cls.__module__.startswith("transformers.") and cls.__name__.endswith("Cache"):
        return ("; pass cache_implementation=\"static\" to generate() (or a StaticCache as the cache) "
                "to have decode steps tuned")
    return ""
