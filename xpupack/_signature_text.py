"""How a call signature reads to people: ``(f32[2,16,64], StaticCache[4 state tensors], 2.0)``.

One form for every place that shows a signature (logs, ``stats``, errors, `xpupack inspect`, the model card),
written from the signature's JSON leaves (`xpupack.signature`'s ``to_json``; a package's ``spec.json``), so
that `inspect` reads a package without importing torch.
"""

from __future__ import annotations

from typing import Any

_SHORT_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
    "bool": "bool",
}


def describe_leaves(leaves: list[dict]) -> str:
    """The signature whose JSON leaves are ``leaves`` (tensors, state objects, constants) as one line."""
    return "(" + ", ".join(map(_describe_leaf, leaves)) + ")"


def _describe_leaf(leaf: dict) -> str:
    kind = leaf["kind"]
    if kind == "tensor":
        return f"{_SHORT_DTYPES.get(leaf['dtype'], leaf['dtype'])}[{','.join(map(str, leaf['shape']))}]"
    if kind == "state":
        return f"{leaf['type'].rsplit('.', 1)[-1]}[{len(leaf['tensors'])} state tensors]"
    return _describe_constant(leaf["value"])


def _describe_constant(value: Any) -> str:
    """As ``repr`` shows the constant in Python (``2.0``, ``None``, ``torch.float16``, ``nan``)."""
    if isinstance(value, dict):
        if "float" in value:
            return str(value["float"])
        if "dtype" in value:
            return f"torch.{value['dtype']}"
        if "device" in value:
            device_type, _, index = str(value["device"]).partition(":")
            return f"device(type={device_type!r}" + (f", index={index})" if index else ")")
    return repr(value)
