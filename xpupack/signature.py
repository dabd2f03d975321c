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
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._cxx_pytree as pytree

_Tensor = torch.Tensor
_SIMPLE_CONSTANTS = (type(None), bool, int, float, str)


class Unrecordable(Exception):
    """A call holds a leaf that is neither a tensor nor a JSON-able constant."""


def flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """Flattens a call's ``(args, kwargs)`` into leaves and a tree spec (keyword order ignored)."""
    if len(kwargs) > 1:
        kwargs = {name: kwargs[name] for name in sorted(kwargs)}
    return pytree.tree_flatten((args, kwargs))


def unflatten(leaves: list, spec: Any) -> tuple[tuple, dict]:
    """Inverse of `flatten`."""
    return pytree.tree_unflatten(leaves, spec)


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
            key.append((type(x), x))
        else:
            return None
    return tuple(key), leaves


def call_key(spec: Any, leaves: list) -> tuple:
    """The hashable fit key of a flattened call.

    Tensor leaves contribute ``(shape, dtype, device)``; other leaves
    ``(type, value)`` so that ``2`` and ``2.0`` (which give different dtypes)
    never share a recording. Unhashable leaves raise ``TypeError``.
    """
    return (spec, *[(x.shape, x.dtype, x.device) if isinstance(x, _Tensor) else (type(x), x)
                    for x in leaves])


def fit_key(args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """The fit key and flattened leaves of a call: `flat_key` when it applies, else `call_key`.

    The key may hold unhashable constants; looking it up then raises ``TypeError`` (no fit).
    """
    fast = flat_key(args, kwargs)
    if fast is not None:
        return fast
    leaves, spec = flatten(args, kwargs)
    return call_key(spec, leaves), leaves


@dataclass(frozen=True)
class TensorLeaf:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def to_json(self) -> dict:
        return {"kind": "tensor", "shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "device": str(self.device)}


@dataclass(frozen=True)
class ConstantLeaf:
    value: Any

    def to_json(self) -> dict:
        return {"kind": "constant", "value": _constant_to_json(self.value)}


@dataclass(frozen=True)
class Signature:
    """The static description of one call; see the module docstring."""

    spec: Any
    leaves: tuple[TensorLeaf | ConstantLeaf, ...]

    @classmethod
    def of_call(cls, args: tuple, kwargs: dict) -> "Signature":
        """The signature of a call. Raises `Unrecordable` for opaque leaves (e.g. a KV cache object)."""
        leaves, spec = flatten(args, kwargs)
        return cls(spec, tuple(_leaf_of(x) for x in leaves))

    @property
    def key(self) -> tuple:
        """The fit key of any call this signature describes: `flat_key`'s form for flat calls,
        `call_key`'s otherwise."""
        leaf_keys = [(leaf.shape, leaf.dtype, leaf.device) if isinstance(leaf, TensorLeaf)
                     else (type(leaf.value), leaf.value) for leaf in self.leaves]
        layout = self.flat_layout
        if layout is not None:
            return (*layout, *leaf_keys)
        return (self.spec, *leaf_keys)

    @property
    def flat_layout(self) -> tuple[int, tuple[str, ...]] | None:
        """``(number of positional args, sorted keyword names)`` if no argument is a container."""
        args, kwargs = unflatten([_Placeholder()] * len(self.leaves), self.spec)
        if not all(isinstance(x, _Placeholder) for x in (*args, *kwargs.values())):
            return None
        if not all(type(leaf.value) in _FLAT_CONSTANTS for leaf in self.leaves if isinstance(leaf, ConstantLeaf)):
            return None
        return len(args), tuple(sorted(kwargs))

    @property
    def tensor_leaves(self) -> list[TensorLeaf]:
        return [leaf for leaf in self.leaves if isinstance(leaf, TensorLeaf)]

    def describe(self) -> str:
        """A short human-readable form, e.g. ``(f32[2,16,64], scale=2.0)``."""
        parts = []
        for leaf in self.leaves:
            if isinstance(leaf, TensorLeaf):
                parts.append(f"{_SHORT_DTYPES.get(leaf.dtype, dtype_name(leaf.dtype))}"
                             f"[{','.join(map(str, leaf.shape))}]")
            else:
                parts.append(repr(leaf.value))
        return "(" + ", ".join(parts) + ")"

    def on_device(self, mapping: dict[torch.device, torch.device]) -> "Signature":
        """The same signature with tensor leaves moved according to ``mapping``."""
        leaves = tuple(TensorLeaf(leaf.shape, leaf.dtype, mapping.get(leaf.device, leaf.device))
                       if isinstance(leaf, TensorLeaf) else leaf for leaf in self.leaves)
        return Signature(self.spec, leaves)

    def synthesize(self, *, seed: int = 0) -> tuple[tuple, dict]:
        """Inputs matching this signature, made up from nothing but the signature.

        Floating leaves are seeded normal values; integer and boolean leaves are
        zeros, which are valid indices for any embedding or gather.
        """
        generator = torch.Generator().manual_seed(seed)
        values = []
        for leaf in self.leaves:
            if isinstance(leaf, ConstantLeaf):
                values.append(leaf.value)
            elif leaf.dtype.is_floating_point or leaf.dtype.is_complex:
                values.append(torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype)
                              .to(leaf.device))
            else:
                values.append(torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device))
        return unflatten(values, self.spec)

    def to_json(self) -> dict:
        return {"tree": pytree.treespec_dumps(self.spec), "leaves": [x.to_json() for x in self.leaves]}

    @classmethod
    def from_json(cls, data: dict) -> "Signature":
        """Parses `to_json`'s output. Raises ``ValueError`` on anything malformed."""
        try:
            spec = pytree.treespec_loads(data["tree"])
        except Exception as exc:  # treespec_loads raises many kinds on bad input
            raise ValueError(f"unreadable tree structure: {exc}") from None
        leaves = tuple(_leaf_from_json(x) for x in data["leaves"])
        if spec.num_leaves != len(leaves):
            raise ValueError(f"tree has {spec.num_leaves} leaves but {len(leaves)} are described")
        return cls(spec, leaves)


class _Placeholder:
    """Stands for a leaf when only the tree structure matters."""


def _leaf_of(x: Any) -> TensorLeaf | ConstantLeaf:
    if isinstance(x, _Tensor):
        return TensorLeaf(tuple(x.shape), x.dtype, x.device)
    try:
        _constant_to_json(x)
    except Unrecordable:
        raise Unrecordable(f"a {type(x).__module__}.{type(x).__qualname__} argument") from None
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


def _leaf_from_json(data: dict) -> TensorLeaf | ConstantLeaf:
    if data["kind"] == "tensor":
        return TensorLeaf(tuple(int(n) for n in data["shape"]), dtype_from_name(data["dtype"]),
                          torch.device(data["device"]))
    value = data["value"]
    if isinstance(value, dict):
        if "float" in value:
            value = float(value["float"])
        elif "dtype" in value:
            value = dtype_from_name(value["dtype"])
        elif "device" in value:
            value = torch.device(value["device"])
        else:
            raise ValueError(f"unknown constant {value!r}")
    return ConstantLeaf(value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


_SHORT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                 torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}
