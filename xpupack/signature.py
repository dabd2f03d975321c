"""Call signatures: what a tuned module was called with, and the fit check.

A signature is the static shape of one call: the tree structure of
``(args, kwargs)``, each tensor leaf's shape, dtype and device, and each
constant leaf's value (``scale=2.0``, ``None``, ``dtype=torch.float16``).
Two calls with the same signature can share one recording.

The *key* of a call is a hashable tuple computed in a few microseconds; it is
the whole fit check of the hot path. The JSON form (``spec.json``) stores the
same information, never the tensor values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import torch
import torch.utils._cxx_pytree as pytree

from ._signature_text import describe_leaves
from .distributed import is_dtensor
from .manifest import check_tree
from .state import STATIC_CACHE, StateNotReady, StateType, state_type, unrecordable_hint

_Tensor = torch.Tensor
_SIMPLE_CONSTANTS = (type(None), bool, int, float, str)
#: how a fit key names a state object that is not ready (`_state_key`)
NOT_READY = "state-not-ready"


class Unrecordable(Exception):
    """A call holds a leaf that is neither a tensor, a JSON-able constant nor a ready state object."""


class Unsynthesizable(ValueError):
    """A signature holds a state leaf (a KV cache): its inputs can only come from a real call."""


def flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """Flattens a call's ``(args, kwargs)`` into leaves and their tree (a pytree ``TreeSpec``; keyword order
    and the key order of the dicts in it ignored: `unflatten` rebuilds them in sorted order)."""
    return pytree.tree_flatten(_keys_sorted((args, kwargs)))


def _keys_sorted(tree: Any) -> Any:
    """``tree`` with each plain dict in it (inside tuples, lists and dicts) in sorted key order, or ``tree``
    itself where that changes nothing. A pytree keeps a dict's insertion order in its leaves and tree, and
    that order may change from one process to the next: transformers builds the masks of a model with
    several layer types (Gemma 2 and 3) as a dict in the order of a set of strings, which each process's
    string hashing orders its own way, so a package's recorded calls fitted no call of another process."""
    kind = type(tree)
    if kind is tuple or kind is list:
        items = [_keys_sorted(item) for item in tree]
        return tree if all(new is old for new, old in zip(items, tree)) else kind(items)
    if kind is not dict:
        return tree
    values = {key: _keys_sorted(value) for key, value in tree.items()}
    try:
        keys = sorted(values)
    except TypeError:  # keys that do not compare (a str beside an int): their order stays
        keys = list(values)
    if keys == list(tree) and all(values[key] is tree[key] for key in keys):
        return tree
    return {key: values[key] for key in keys}


def map_tensors(function: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``function`` applied to every tensor in it (tuples, lists, dicts, named tuples...)."""
    return pytree.tree_map_only(torch.Tensor, function, tree)


def unflatten(leaves: list, tree: Any) -> tuple[tuple, dict]:
    """Inverse of `flatten`."""
    return pytree.tree_unflatten(leaves, tree)


_FLAT_CONSTANTS = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})


def flat_key(args: tuple, kwargs: dict) -> tuple[tuple, list] | None:
    """The fit key and leaves of a call without containers, or None (then use `flatten` + `call_key`).

    This is the hot path of every tuned call: no pytree, one tuple. Its key
    form is ``(number of positional args, keyword names, *leaf keys)``, which
    `Signature.key` reproduces for flat signatures.
    """
    if kwargs:
        names = tuple(sorted(kwargs)) if len(kwargs) > 1 else tuple(kwargs)
        leaves = [*args, *[kwargs[name] for name in names]]
    else:
        names = ()
        leaves = list(args)
    key: list = [len(args), names]
    for x in leaves:
        if isinstance(x, _Tensor):
            key.append((x.shape, x.dtype, x.device))
        elif type(x) in _FLAT_CONSTANTS:
            key.append(_constant_key(x))
        else:
            kind = state_type(x)
            if kind is None:
                return None
            key.append(_state_key(x, kind))
    return tuple(key), leaves


def call_key(tree: Any, leaves: list) -> tuple:
    """The hashable fit key of a flattened call.

    Tensor leaves contribute ``(shape, dtype, device)``; other leaves
    `_constant_key`. Unhashable leaves raise ``TypeError``.
    """
    return (tree, *[(x.shape, x.dtype, x.device) if isinstance(x, _Tensor) else _opaque_key(x) for x in leaves])


def _opaque_key(value: Any) -> tuple:
    kind = state_type(value)
    return _constant_key(value) if kind is None else _state_key(value, kind)


def _state_key(value: Any, kind: StateType) -> tuple:
    """A state object's fit key: its type and its tensors' layouts (their addresses are the runner's
    business). An object that is not ready gets a key no recording has."""
    try:
        tensors = kind.state_tensors(value)
    except StateNotReady:
        return (NOT_READY, kind.name)
    return ("state", kind.name, tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors))


def _constant_key(value: Any) -> tuple:
    """``(type, value)``, so that ``2`` and ``2.0`` (which give different dtypes) never share a
    recording; a float zero also keeps its sign, since ``0.0 == -0.0`` yet ``x * -0.0`` differs."""
    if type(value) is float and not value:
        return (float, value, math.copysign(1.0, value))
    return (type(value), value)


def fit_key(args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """The fit key and flattened leaves of a call: `flat_key` when it applies, else `call_key`.

    The key may hold unhashable constants; looking it up then raises ``TypeError`` (no fit).
    """
    fast = flat_key(args, kwargs)
    if fast is not None:
        return fast
    leaves, tree = flatten(args, kwargs)
    return call_key(tree, leaves), leaves


@dataclass(frozen=True)
class TensorLeaf:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def to_json(self) -> dict:
        return {
            "kind": "tensor",
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
        }


@dataclass(frozen=True)
class StateLeaf:
    """A state object (a KV cache): its type and the layout of its tensors, never their values."""

    type_name: str
    #: ``(shape, stride, dtype, device)`` of each state tensor, in the type's order
    tensors: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], ...]

    @property
    def key(self) -> tuple:
        return ("state", self.type_name, self.tensors)

    def to_json(self) -> dict:
        return {
            "kind": "state",
            "type": self.type_name,
            "tensors": [
                {"shape": list(shape), "stride": list(stride), "dtype": dtype_name(dtype), "device": str(device)}
                for shape, stride, dtype, device in self.tensors
            ],
        }

    def on_device(self, mapping: dict[torch.device, torch.device]) -> StateLeaf:
        return StateLeaf(
            self.type_name,
            tuple((shape, stride, dtype, mapping.get(device, device)) for shape, stride, dtype, device in self.tensors),
        )


@dataclass(frozen=True)
class ConstantLeaf:
    value: Any

    def to_json(self) -> dict:
        return {"kind": "constant", "value": _constant_to_json(self.value)}


@dataclass(frozen=True)
class Signature:
    """The static description of one call; see the module docstring.

    ``tree`` is the pytree structure of ``(args, kwargs)`` (a ``TreeSpec``: "spec" in xpupack names a
    module's `ModuleSpec` only), ``leaves`` one entry per leaf of it."""

    tree: Any
    leaves: tuple[TensorLeaf | ConstantLeaf | StateLeaf, ...]

    @classmethod
    def of_call(cls, args: tuple, kwargs: dict) -> Signature:
        """The signature of a call. Raises `Unrecordable` for opaque leaves (e.g. a KV cache object)."""
        leaves, tree = flatten(args, kwargs)
        return cls(tree, tuple(_leaf_of(x) for x in leaves))

    @property
    def key(self) -> tuple:
        """The fit key of any call this signature describes: `flat_key`'s form for flat calls,
        `call_key`'s otherwise."""
        return self._key(allocated=True)

    @property
    def key_before_allocation(self) -> tuple | None:
        """The fit key of a call of this signature made before its state objects allocated their tensors
        (a prefill into a new StaticCache: `_state_key` keys each as not ready), or None where a state
        object of it is of a type xpupack cannot allocate ahead (`xpupack.state.allocate_ahead`) or it
        has none."""
        if not self.state_slots or any(
            leaf.type_name != STATIC_CACHE for leaf in self.leaves if isinstance(leaf, StateLeaf)
        ):
            return None
        return self._key(allocated=False)

    def _key(self, *, allocated: bool) -> tuple:
        leaf_keys = [
            (leaf.shape, leaf.dtype, leaf.device)
            if isinstance(leaf, TensorLeaf)
            else (leaf.key if allocated else (NOT_READY, leaf.type_name))
            if isinstance(leaf, StateLeaf)
            else _constant_key(leaf.value)
            for leaf in self.leaves
        ]
        layout = self.flat_layout
        if layout is not None:
            return (*layout, *leaf_keys)
        return (self.tree, *leaf_keys)

    @property
    def flat_layout(self) -> tuple[int, tuple[str, ...]] | None:
        """``(number of positional args, sorted keyword names)`` if no argument is a container."""
        args, kwargs = unflatten([_Placeholder()] * len(self.leaves), self.tree)
        if not all(isinstance(x, _Placeholder) for x in (*args, *kwargs.values())):
            return None
        if not all(type(leaf.value) in _FLAT_CONSTANTS for leaf in self.leaves if isinstance(leaf, ConstantLeaf)):
            return None
        return len(args), tuple(sorted(kwargs))

    @property
    def tensor_leaves(self) -> list[TensorLeaf]:
        return [leaf for leaf in self.leaves if isinstance(leaf, TensorLeaf)]

    @property
    def family(self) -> tuple:
        """The signature with every size left out: a call with state whose signature is new but of a
        tuned one's family (a KV cache of another length, a longer mask) is run by the same backend."""
        return (
            self.tree,
            *[
                ("tensor", leaf.dtype, leaf.device, len(leaf.shape))
                if isinstance(leaf, TensorLeaf)
                else (
                    "state",
                    leaf.type_name,
                    tuple((len(shape), dtype, device) for shape, _, dtype, device in leaf.tensors),
                )
                if isinstance(leaf, StateLeaf)
                else _constant_key(leaf.value)
                for leaf in self.leaves
            ],
        )

    @property
    def size_pattern(self) -> tuple:
        """Which of the call's sizes are 0 or 1 and which equal each other, the other sizes left out: what
        Dynamo's first compile of a call with sizes as symbols depends on (it keeps 0 and 1 as they are and
        gives equal sizes one symbol). Calls of one `family` and one pattern share that compile whichever
        comes first (`xpupack.backends.inductor.InductorRunner`)."""
        shapes: list[tuple[int, ...]] = []
        for leaf in self.leaves:
            if isinstance(leaf, TensorLeaf):
                shapes.append(leaf.shape)
            elif isinstance(leaf, StateLeaf):
                shapes += [shape for shape, *_ in leaf.tensors]
        symbols: dict[int, str] = {}
        return tuple(
            tuple(size if size < 2 else symbols.setdefault(size, f"s{len(symbols)}") for size in shape)
            for shape in shapes
        )

    @property
    def state_layout(self) -> tuple:
        """The layouts of the state leaves' tensors (empty without state)."""
        return tuple(leaf.tensors for leaf in self.leaves if isinstance(leaf, StateLeaf))

    @cached_property  # read on every call with state (the leaves never change: the signature is frozen)
    def state_slots(self) -> tuple[int, ...]:
        """Positions of the state leaves among the call's leaves (empty for most signatures)."""
        return tuple(i for i, leaf in enumerate(self.leaves) if isinstance(leaf, StateLeaf))

    def state_tensors(self, leaves: list) -> list[torch.Tensor]:
        """The state tensors of a call of this signature (given its flattened leaves), in order."""
        tensors: list[torch.Tensor] = []
        for slot in self.state_slots:
            tensors += state_type(leaves[slot]).state_tensors(leaves[slot])
        return tensors

    def state_counters(self, leaves: list) -> list[tuple[Any, Any]]:
        """``(counters, object)`` for each state object of a call of this signature that keeps Python-side
        counters (`xpupack.state.SlidingWindowCounters`); empty for most signatures."""
        return [
            (kind.counters, leaves[slot])
            for slot in self.state_slots
            for kind in [state_type(leaves[slot])]
            if kind.counters is not None
        ]

    def describe(self) -> str:
        """A short human-readable form, e.g. ``(f32[2,16,64], 2.0)`` (`xpupack._signature_text`)."""
        return describe_leaves([leaf.to_json() for leaf in self.leaves])

    def on_device(self, mapping: dict[torch.device, torch.device]) -> Signature:
        """The same signature with tensor leaves moved according to ``mapping``."""
        leaves = tuple(
            TensorLeaf(leaf.shape, leaf.dtype, mapping.get(leaf.device, leaf.device))
            if isinstance(leaf, TensorLeaf)
            else leaf.on_device(mapping)
            if isinstance(leaf, StateLeaf)
            else leaf
            for leaf in self.leaves
        )
        return Signature(self.tree, leaves)

    def synthesize(self, *, seed: int = 0) -> tuple[tuple, dict]:
        """Inputs matching this signature, made up from nothing but the signature.

        Floating leaves are seeded normal values; integer and boolean leaves are
        zeros, which are valid indices for any embedding or gather. A signature
        with a state leaf raises `Unsynthesizable`: only a real call brings one.
        """
        if self.state_slots:
            raise Unsynthesizable(f"{self.describe()} holds a state object; only a real call can bring one")
        generator = torch.Generator().manual_seed(seed)
        values = []
        for leaf in cast(tuple[TensorLeaf | ConstantLeaf, ...], self.leaves):  # no state leaf, as checked above
            if isinstance(leaf, ConstantLeaf):
                values.append(leaf.value)
            elif leaf.dtype.is_floating_point or leaf.dtype.is_complex:
                values.append(torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype).to(leaf.device))
            else:
                values.append(torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device))
        return unflatten(values, self.tree)

    def to_json(self) -> dict:
        return {"tree": pytree.treespec_dumps(self.tree), "leaves": [x.to_json() for x in self.leaves]}

    @classmethod
    def from_json(cls, data: Any, trees: dict[str, Any] | None = None) -> Signature:
        """Parses `to_json`'s output. Raises ``ValueError`` on anything malformed.

        The input may come from a hostile package: the tree is checked before
        torch parses it, so that parsing never imports a module. ``trees``: the trees
        parsed so far, by their text, for the signatures of one spec to share (a batch
        ladder's signatures have one tree; a tree of 4,096 leaves takes ~50 ms to check and parse).
        """
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("tree"), str)
            or not isinstance(data.get("leaves"), list)
        ):
            raise ValueError("a signature must be an object with a 'tree' string and a 'leaves' list")
        tree = trees.get(data["tree"]) if trees is not None else None
        if tree is None:
            check_tree(data["tree"])
            try:
                tree = pytree.treespec_loads(data["tree"])
            except Exception as exc:  # treespec_loads raises many kinds on bad input
                raise ValueError(f"unreadable tree structure: {exc}") from None
            if trees is not None:
                trees[data["tree"]] = tree
        leaves = tuple(_leaf_from_json(x) for x in data["leaves"])
        if tree.num_leaves != len(leaves):
            raise ValueError(f"tree has {tree.num_leaves} leaves but {len(leaves)} are described")
        return cls(tree, leaves)


class _Placeholder:
    """Stands for a leaf when only the tree structure matters."""


def _leaf_of(x: Any) -> TensorLeaf | ConstantLeaf | StateLeaf:
    if isinstance(x, _Tensor):
        if type(x) is not _Tensor and is_dtensor(x):  # its fit key would be that of a plain tensor of its global shape
            raise Unrecordable(
                "a DTensor argument (a recording takes plain tensors); call the module with local "
                "tensors, as parallelize_module's default use_local_output=True does"
            )
        return TensorLeaf(tuple(x.shape), x.dtype, x.device)
    kind = state_type(x)
    if kind is not None:
        try:
            tensors = kind.state_tensors(x)
        except StateNotReady as exc:
            raise Unrecordable(f"a {type(x).__name__} argument that is not ready ({exc})") from None
        return StateLeaf(kind.name, tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors))
    try:
        _constant_to_json(x)
    except Unrecordable:
        raise Unrecordable(f"a {type(x).__module__}.{type(x).__qualname__} argument" + unrecordable_hint(x)) from None
    return ConstantLeaf(x)


def _constant_to_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if type(value) in _SIMPLE_CONSTANTS:
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise Unrecordable(type(value).__qualname__)


#: the largest tensor a stored signature may describe: loading synthesises its inputs, and a hostile
#: spec must not make the loader allocate terabytes
MAX_LEAF_BYTES = 64 * 2**30


def _sizes(data: dict, field: str) -> tuple[int, ...]:
    sizes = data.get(field)
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
        raise ValueError(f"tensor {field} must be a list of sizes, not {str(sizes)[:80]}")
    return tuple(sizes)


def _tensor_layout(data: dict) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    shape, dtype = _sizes(data, "shape"), dtype_from_name(data.get("dtype"))
    size = math.prod(shape) * dtype.itemsize
    if size > MAX_LEAF_BYTES:
        raise ValueError(
            f"a tensor of shape {list(shape)} ({size / 2**30:.0f} GiB) is larger than the "
            f"{MAX_LEAF_BYTES // 2**30} GiB a signature may describe"
        )
    return shape, dtype, device_from_name(data.get("device"))


def _leaf_from_json(data: Any) -> TensorLeaf | ConstantLeaf | StateLeaf:
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "tensor":
        return TensorLeaf(*_tensor_layout(data))
    if kind == "state":
        tensors = data.get("tensors")
        if (
            not isinstance(data.get("type"), str)
            or not isinstance(tensors, list)
            or not tensors
            or not all(isinstance(t, dict) for t in tensors)
        ):
            raise ValueError(f"a state leaf needs a type name and a list of tensors, not {str(data)[:80]}")
        layouts = tuple(
            (shape, _sizes(t, "stride"), dtype, device) for t in tensors for shape, dtype, device in [_tensor_layout(t)]
        )
        if any(len(shape) != len(stride) for shape, stride, _, _ in layouts):
            raise ValueError("a state tensor's shape and stride differ in length")
        return StateLeaf(data["type"], layouts)
    if kind != "constant" or "value" not in data:
        raise ValueError(f"a leaf must be a tensor or a constant, not {str(data)[:80]}")
    value = data["value"]
    if isinstance(value, dict):
        if set(value) == {"float"} and value["float"] in ("nan", "inf", "-inf"):
            value = float(value["float"])
        elif set(value) == {"dtype"}:
            value = dtype_from_name(value["dtype"])
        elif set(value) == {"device"}:
            value = device_from_name(value["device"])
        else:
            raise ValueError(f"unknown constant {str(value)[:80]}")
    elif not isinstance(value, _SIMPLE_CONSTANTS):
        raise ValueError(f"unknown constant {str(value)[:80]}")
    return ConstantLeaf(value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    """The dtype ``torch.<name>``; looked up in a table, since ``getattr(torch, ...)`` can import modules."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def device_from_name(name: Any) -> torch.device:
    """``torch.device(name)``, raising ``ValueError`` (not torch's ``RuntimeError``) for a bad name."""
    if isinstance(name, str):
        try:
            return torch.device(name)
        except (RuntimeError, ValueError):
            pass
    raise ValueError(f"unknown device {name!r}")


_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


@dataclass(frozen=True)
class BatchAxes:
    """The batch axis of each leaf of a call (``inputs``) and of its outputs (``outputs``); None: no batch axis.

    What a padded call is cut by (`xpupack.padding`); here, below the spec that holds it
    (`ModuleSpec.batch_axes`) and the backends that read it."""

    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]

    def to_json(self) -> dict:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs)}

    @classmethod
    def from_json(cls, data: Any) -> BatchAxes:
        """Parses `to_json`'s output; raises ``ValueError`` on anything else."""
        if not isinstance(data, dict) or set(data) != {"inputs", "outputs"}:
            raise ValueError(f"batch axes must be an object with 'inputs' and 'outputs', not {str(data)[:80]}")
        axes = []
        for field in ("inputs", "outputs"):
            values = data[field]
            if not isinstance(values, list) or not all(v is None or (type(v) is int and 0 <= v < 64) for v in values):
                raise ValueError(f"batch axes {field} must be a list of axes or nulls, not {str(values)[:80]}")
            axes.append(tuple(values))
        if not any(axis is not None for axis in axes[0]):
            raise ValueError("batch axes name no input axis")
        return cls(*axes)
