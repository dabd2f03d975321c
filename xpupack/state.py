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
Inductor needs none of that: with sizes as symbols Dynamo makes the int a
symbol, and `SlidingWindowCounters.other_paths` gives the counts it compiles
the other path at ahead.
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


#: the name of the one state type whose objects xpupack can allocate ahead of their first call
#: (`allocate_ahead`): transformers' StaticCache
STATIC_CACHE = "transformers.cache_utils.StaticCache"


def unallocated(obj: Any) -> bool:
    """Whether ``obj`` is a StaticCache that has allocated none of its layers' tensors yet and counts no token:
    its first call (the prefill) allocates them as zeros (``lazy_initialization``), which `allocate_ahead`
    can do before the call, and which tuning records as the state that call started from."""
    kind = state_type(obj)
    if kind is None or kind.tensors is not _static_cache_tensors:
        return False
    layers = getattr(obj, "layers", None)
    if not layers:
        return False
    for layer in layers:
        if type(layer).__name__ not in _GRAPH_SAFE_LAYERS or layer.is_initialized:
            return False
        length = getattr(layer, "cumulative_length", None)
        if not isinstance(length, torch.Tensor) or length.dim() != 0 or bool(length != 0):
            return False
        if getattr(layer, "cumulative_length_int", 0) != 0:
            return False
    return True


def allocate_ahead(cache: Any, layouts: tuple) -> Callable[[], None] | None:
    """Allocates the layers of ``cache`` (an `unallocated` StaticCache) before its first call, exactly as
    transformers' own ``lazy_initialization`` would in that call (zeros, the running length moved to the
    device, the tensors marked static addresses), in the layout ``layouts`` gives them: the tensors of a
    recorded `xpupack.signature.StateLeaf`, per layer its keys then its values (their only 4-d tensors).

    Args:
        cache: a StaticCache none of whose layers is allocated.
        layouts: ``(shape, stride, dtype, device)`` of each of its state tensors once allocated.

    Returns:
        The undo, which puts the layers back as they were (unallocated, their running length as it was), or
        None, nothing done, where ``layouts`` cannot be this cache's (another layer count or cache length).
    """
    if not unallocated(cache) or not layouts or len(layouts) % len(cache.layers):
        return None
    per_layer = len(layouts) // len(cache.layers)
    fakes = []
    for number, layer in enumerate(cache.layers):
        keys_values = [
            (shape, dtype, device)
            for shape, _, dtype, device in layouts[number * per_layer : (number + 1) * per_layer]
            if len(shape) == 4
        ]
        if len(keys_values) != 2 or any(shape[2] != layer.max_cache_len for shape, _, _ in keys_values):
            return None
        fakes.append(keys_values)
    saved = [(layer, dict(vars(layer))) for layer in cache.layers]
    lengths = [
        (length, length.clone(), "_dynamo_static_input_type" in vars(length))
        for length in (layer.cumulative_length for layer in cache.layers)
    ]

    def undo() -> None:
        for layer, attributes in saved:
            vars(layer).clear()
            vars(layer).update(attributes)
        for length, value, marked in lengths:
            if not marked:  # transformers marks the length it moved; here that was the same tensor
                vars(length).pop("_dynamo_static_input_type", None)
            if not torch.equal(length, value):  # a backend that failed amid the call may have counted
                with torch.inference_mode(length.is_inference()):
                    length.copy_(value)

    try:
        for layer, ((key_shape, key_dtype, device), (value_shape, value_dtype, _)) in zip(cache.layers, fakes):
            # what transformers' own early_initialization hands in: tensors of the layout with no tokens
            keys = torch.zeros((*key_shape[:2], 0, key_shape[3]), dtype=key_dtype, device=device)
            values = torch.zeros((*value_shape[:2], 0, value_shape[3]), dtype=value_dtype, device=device)
            layer.lazy_initialization(keys, values)
    except Exception:  # a device or dtype this process cannot allocate: the call allocates as it would
        undo()
        return None
    return undo


@contextmanager
def tensors_replaced(obj: Any, tensors: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, ``obj`` (a state object) holds ``tensors`` in place of its own state tensors (in
    `StateType.tensors` order): how an exported program takes a KV cache's tensors as inputs. Only where
    xpupack knows where the tensors live and the object keeps no other state: transformers' StaticCache
    without sliding-window layers. Raises `StateNotReady` otherwise."""
    kind = state_type(obj)
    if kind is None or kind.tensors is not _static_cache_tensors:
        raise StateNotReady("xpupack cannot hand its tensors in as inputs (only a StaticCache's)")
    if _sliding_layers(obj):
        raise StateNotReady("its sliding-window layers keep a Python-side count beside their tensors")
    _static_cache_tensors(obj)  # raises while its tensors are not allocated; learns the layers' names
    slots = [(layer, name) for layer in obj.layers for name in _LAYER_TENSORS[type(layer)]]
    if len(slots) != len(tensors):
        raise StateNotReady(f"it holds {len(slots)} state tensors, not {len(tensors)}")
    saved = [getattr(layer, name) for layer, name in slots]
    for (layer, name), tensor in zip(slots, tensors):
        setattr(layer, name, tensor)
    try:
        yield
    finally:
        for (layer, name), tensor in zip(slots, saved):
            setattr(layer, name, tensor)


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

    def other_paths(self, cache: Any, before: tuple[int, ...], added: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Counts that put a decode step (one token per layer) on each path of `path` but the one it took from
        ``before``: every window filling (its last step), every window full (its first step). Empty for a
        call of several tokens (a prefill: at a count of 0 in every ``generate()``).

        Args:
            cache: a ``StaticCache``.
            before: the counts the call started from.
            added: what the call added to them.

        Returns:
            Counts, one per sliding-window layer, for each other path.
        """
        if any(tokens != 1 for tokens in added):
            return []
        layers = _sliding_layers(cache)
        taken = self.path(cache, before, added)
        return [
            counts
            for counts in (
                tuple(layer.max_cache_len - 1 for layer in layers),
                tuple(layer.max_cache_len for layer in layers),
            )
            if min(counts, default=0) > 0 and self.path(cache, counts, added) not in (None, taken)
        ]

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
