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

The one built-in exception is the sliding-window layer of a ``StaticCache``
(Mistral, Gemma 2, Gemma 3), which counts its tokens in a Python int and
takes one of three Python paths on it (filling the window, becoming full,
full). `SlidingWindowCounters` follows that int for the graph backend: a
recording is made and replayed per path, never across a path change, the
counter is advanced after each replay as the call would have, and while a
call is captured the layer's reads of its length go through a tensor, so
that no position is baked into the recording (docs/language-models.md).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class StateNotReady(Exception):
    """The state object cannot be recorded now (e.g. its tensors are not allocated yet); the message says why."""


@dataclass(frozen=True)
class StateType:
    """How to find the state tensors of one type's objects."""

    #: ``module.QualifiedName`` of the type, as stored in a package's spec
    name: str
    tensors: Callable[[Any], list[torch.Tensor]]
    #: the Python-side counters its objects keep beside their tensors (built-in types only), or None
    counters: SlidingWindowCounters | None = None

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
    """``module.QualifiedName`` of ``cls``, as a package's spec names a state type.

    Args:
        cls: a class.

    Returns:
        Its dotted name.
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def register_state(cls: type, tensors: Callable[[Any], list[torch.Tensor]]) -> None:
    """Declares ``cls`` a state type (a KV cache, say) whose calls the graph backend can record.

    Args:
        cls: the state object's class (exact type; subclasses need their own call).
        tensors: ``tensors(obj)`` returns every tensor the module reads or updates
            in place through the object, in a fixed order. Raise `StateNotReady`
            (``xpupack.state.StateNotReady``) while they do not exist yet (a lazily
            allocated cache before its first call): such calls run the original module.

    Raises:
        TypeError: ``cls`` is not a class, or ``tensors`` is not callable.

    Registering a type again replaces its function. Everything the object changes between calls must
    live in those tensors: a Python-side counter would be baked into a recording (docs/language-models.md).

    Examples:
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
    layout: running the copy (to compile for it, say) leaves the caller's state as it was. Its other
    tensors become copies of their own, not views of a copied base as a deep copy would make them.

    Each tensor of the copy is an inference tensor exactly where the call's is: Dynamo guards on that, so
    a compile made on the copy serves the call only if they agree. A caller hands the call as its compiled
    code will meet it (a graph runner: as its recordings give it, `own_copy`; Inductor alone: the caller's
    own tensors, inference tensors under ``torch.inference_mode``).

    Raises whatever ``copy.deepcopy`` raises for an argument that cannot be copied.
    """
    memo: dict[int, Any] = {id(t): _zeroed_like(t) for t in state}
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
            with torch.inference_mode(leaf.is_inference()):
                memo[id(leaf)] = leaf.detach().clone()
    return copy.deepcopy((args, kwargs), memo)


def _zeroed_like(tensor: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor of ``tensor``'s layout, an inference tensor where ``tensor`` is, marked a static address
    where ``tensor`` is (transformers marks a StaticCache's tensors so): Dynamo compiles a call whose inputs
    are marked otherwise than one whose inputs are not, and a compile for the scratch copy must be the
    compile tuning made and the package carries, or a load compiles the decode step from scratch."""
    with torch.inference_mode(tensor.is_inference()):
        zeroed = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device).zero_()
    marked = getattr(tensor, "_dynamo_static_input_type", None)
    if marked is not None:
        from torch._dynamo import mark_static_address

        mark_static_address(zeroed, guard=marked == "guarded")
    return zeroed


# -- transformers, without importing it ------------------------------------------------------------


def _builtin(cls: type) -> StateType | None:
    if cls.__module__ == "transformers.cache_utils" and cls.__name__ == "StaticCache":
        return StateType(type_name(cls), _static_cache_tensors, SlidingWindowCounters())
    return None


#: the layer classes a recording can follow: ``StaticLayer`` keeps all its mutable state in tensors, the
#: sliding-window layer also a Python count that `SlidingWindowCounters` follows. Exact class names:
#: a subclass (a linear-attention hybrid, an indexed layer) may keep more Python-side state.
_SLIDING_LAYER = "StaticSlidingWindowLayer"
_GRAPH_SAFE_LAYERS = ("StaticLayer", _SLIDING_LAYER)


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
        return (
            '; pass cache_implementation="static" to generate() (or a StaticCache as the cache) '
            "to have decode steps tuned"
        )
    return ""


# -- Python-side counters: the sliding-window layers of a StaticCache ------------------------------

#: the Python path of one sliding-window layer in a call, per `SlidingWindowCounters.path`
FILLING, FULL = "filling", "full"


class SlidingWindowCounters:
    """Follows the Python token count (``cumulative_length_int``) of a ``StaticCache``'s sliding-window layers.

    The count decides which Python path the layer's ``update`` and ``get_mask_sizes`` take, and
    ``get_seq_length`` (the model's positions, the query offset of its masks) returns it. A device graph
    runs none of that Python: it replays the path and the values the capture saw. So the graph backend
    records and replays per path (`path`), captures with the layer's reads of its length going through a
    tensor (`following`), writes the count into that tensor before each replay (`sync`), and advances the
    count after each replay by what the recorded call added (`write`). The counts of one cache are a
    tuple, one int per sliding layer; a cache without sliding layers has the empty tuple.

    While the window fills, the layer's own tensor count equals its int (transformers writes at the
    tensor count). Once it is full, transformers stops counting in the tensor; the recording then reads
    a 0-d tensor of xpupack's own per layer (`tensors`; its address is part of the recording's key), so
    that the cache's own tensors stay exactly as eager leaves them.
    """

    def read(self, cache: Any) -> tuple[int, ...]:
        """The token count of each sliding-window layer of ``cache``.

        Args:
            cache: a ``StaticCache``.

        Returns:
            One count per sliding-window layer.
        """
        return tuple(layer.cumulative_length_int for layer in _sliding_layers(cache))

    def write(self, cache: Any, counts: tuple[int, ...]) -> None:
        """Sets the token count of each sliding-window layer of ``cache`` (what `read` returned).

        Args:
            cache: a ``StaticCache``.
            counts: one count per sliding-window layer.
        """
        for layer, count in zip(_sliding_layers(cache), counts):
            layer.cumulative_length_int = count

    def path(self, cache: Any, before: tuple[int, ...], added: tuple[int, ...]) -> Hashable | None:
        """The Python path of a call that adds ``added`` tokens to counts ``before``: one recording serves
        every call of the same signature and path. None where a recording would bake the call's position
        (the window becoming full within the call, or several tokens into a full window): such calls run
        the original module."""
        paths = []
        for layer, count, tokens in zip(_sliding_layers(cache), before, added):
            window = layer.max_cache_len
            if count + tokens <= window:
                paths.append(FILLING)  # writes at the tensor count; masks sized (window, 0)
            elif count >= window and tokens == 1:
                paths.append(FULL)  # rolls the window by one; masks offset by the count
            else:
                return None
        return tuple(paths)

    def tensors(self, cache: Any) -> list[torch.Tensor]:
        """xpupack's count tensor of each sliding layer whose window is full (made on first use)."""
        return [
            _full_count(layer) for layer in _sliding_layers(cache) if layer.cumulative_length_int >= layer.max_cache_len
        ]

    def sync(self, cache: Any) -> None:
        """Writes each full layer's count into the tensor its recordings read."""
        for layer in _sliding_layers(cache):
            if layer.cumulative_length_int >= layer.max_cache_len:
                _full_count(layer).fill_(layer.cumulative_length_int)

    @contextmanager
    def following(self, cache: Any) -> Iterator[None]:
        """While a call is captured (after `sync`): the layers' reads of their length go through tensors
        (the same values, which a replay reads afresh). Instance attributes, removed afterwards."""
        layers = _sliding_layers(cache)
        try:
            for layer in layers:
                full = layer.cumulative_length_int >= layer.max_cache_len
                length = _full_count(layer) if full else layer.cumulative_length
                layer.get_seq_length = _constant(length)
                if full:
                    layer.get_mask_sizes = _full_mask_sizes(layer.max_cache_len, length)
            yield
        finally:
            for layer in layers:
                vars(layer).pop("get_seq_length", None)
                vars(layer).pop("get_mask_sizes", None)


#: sliding layer -> xpupack's count tensor for it once its window is full (dropped with the layer)
_FULL_COUNTS: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


def _full_count(layer: Any) -> torch.Tensor:
    count = _FULL_COUNTS.get(layer)
    if count is None:
        count = _FULL_COUNTS.setdefault(
            layer, torch.zeros((), dtype=layer.cumulative_length.dtype, device=layer.cumulative_length.device)
        )
    return count


def _constant(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: value


def _full_mask_sizes(window: int, length: torch.Tensor) -> Callable[[int], tuple]:
    """transformers' sizes for a full window, ``(window + q - 1, length - window + 1)``, with the offset (which
    moves with every token) a tensor."""
    return lambda query_length: (window + query_length - 1, length - window + 1)


def _sliding_layers(cache: Any) -> list:
    return [layer for layer in cache.layers if type(layer).__name__ == _SLIDING_LAYER]
