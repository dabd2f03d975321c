"""What a package can make a loader allocate or do, bounded before anything is allocated
(docs/safety.md).

A package says how its modules were called, and a loader acts on it: it
synthesises inputs for every signature without state (a tensor leaf of 1 GiB
made a load take 77 s and 7.4 GiB), records or compiles each signature (about a
second a compile: a package of 2 modules × 24 signatures compiled for 43 s),
and a graph backend keeps up to ``max_recordings`` recordings per module.
`LoadLimits` bounds each of these, the compiles and the input bytes for the
package as a whole; `check_limits` compares a package with them reading JSON
only, so `xpupack.load` refuses an oversized package before it parses a
signature or allocates a tensor, and `xpupack verify` says the same and what
the package costs to load (`load_work`). `early_check` refuses a spec with too
many signatures or leaves before its schema is checked.

State leaves (a KV cache) are never synthesised: only a real call brings one,
so however large a model's cache is, it counts towards no byte limit here.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .backends._facts import GRAPH_MAX_RECORDINGS
from .errors import LimitSettingError, PackageLimitError
from .manifest import read_spec

#: bytes per element of the dtypes a signature can name (``spec.json`` stores ``torch.<name>`` without the
#: prefix); a name missing here counts 16 bytes (never less than it is) and is refused later by the parser
_ITEMSIZE = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "complex128": 16,
    "cdouble": 16,
    "complex64": 8,
    "cfloat": 8,
    "complex32": 4,
    "chalf": 4,
    "int64": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "short": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
_UNKNOWN_ITEMSIZE = 16

#: what an environment variable of a limit may hold: up to 40 digits 0-9 and single underscores between them
_WHOLE_NUMBER = re.compile(r"(?=[0-9_]{1,40}$)[0-9]+(?:_[0-9]+)*")

#: environment variable of each limit, read when a load is not given ``limits=``
ENVIRONMENT = {
    "max_input_bytes": "XPUPACK_MAX_INPUT_BYTES",
    "max_signatures": "XPUPACK_MAX_SIGNATURES",
    "max_leaves": "XPUPACK_MAX_LEAVES",
    "max_recordings": "XPUPACK_MAX_RECORDINGS",
    "max_compiles": "XPUPACK_MAX_COMPILES",
}


@dataclass(frozen=True)
class LoadLimits:
    """The most a package may make `xpupack.load` allocate or do; a package over any of them is refused
    (`PackageLimitError`) before anything is allocated.

    The defaults fit packages of large models (a 70B language model's decoder layers over a batch
    ladder, its KV cache, which is never synthesised, aside); lower them to load packages you do not
    trust on a machine that also serves other work, raise them for a package that needs more.

    Args:
        max_input_bytes: the tensor inputs a load synthesises to check, record and compile each
            signature without state, summed over every module of the package (a graph backend also
            keeps them as its static input buffers). Default 32 GiB.
        max_signatures: signatures per module (each one is recorded or compiled at load). Default 1024.
        max_leaves: leaves (tensors, constants, state objects) per signature. Default 4096.
        max_recordings: the largest ``GraphBackend(max_recordings=...)`` a package may ask for (each
            recording holds device memory; the default of the graph backend is 16). Default 256.
        max_compiles: the ``torch.compile`` runs a load makes (Inductor backends, on or off the caller's
            path: about a second each), summed over every module of the package (`compiles_of`). Default 512.

    Raises:
        LimitSettingError: a limit that is not a positive integer (a ``ValueError``).

    Examples:
        >>> xpupack.load(model, "org/name", limits=xpupack.LoadLimits(max_input_bytes=2 * 2**30))
    """

    max_input_bytes: int = 32 * 2**30
    max_signatures: int = 1024
    max_leaves: int = 4096
    max_recordings: int = 256
    max_compiles: int = 512

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LimitSettingError(
                    f"LoadLimits({item.name}={value!r}): give a positive integer", field=item.name, value=value
                )

    @classmethod
    def from_environment(cls) -> LoadLimits:
        """The defaults, each replaced by its environment variable where set (`ENVIRONMENT`).

        Raises:
            LimitSettingError: a variable that is not a positive whole number in ASCII digits (``_``
                may group them), naming the variable.
        """
        values = {}
        for name, variable in ENVIRONMENT.items():
            text = os.environ.get(variable)
            if text is None or not text.strip():
                continue
            # ASCII digits alone: int() also takes other scripts' digits ("٣٢"), which no one means here
            if not _WHOLE_NUMBER.fullmatch(text.strip()) or int(text) < 1:  # the pattern bounds the length
                unit = "bytes" if "bytes" in name else name.removeprefix("max_")
                shown = text if len(text) <= 40 else text[:40] + "…"
                raise LimitSettingError(
                    f"{variable}={shown!r} is not a positive whole number (of {unit}) in the digits 0-9; set it "
                    f"to one, such as {variable}={getattr(cls, name)}, or unset it for that default",
                    field=name,
                    value=text,
                    variable=variable,
                )
            values[name] = int(text)
        return cls(**values)


def early_check(limits: LoadLimits) -> Callable[[str, dict], None]:
    """What a spec's JSON at ``where`` can be refused for before its schema check (`manifest.read_json`'s
    ``before_schema``): more signatures than ``max_signatures``, a signature of more leaves than
    ``max_leaves``. Checking the schema of a spec within them costs seconds, not minutes."""

    def check(where: str, spec: dict) -> None:
        signatures = spec.get("signatures")
        if not isinstance(signatures, list):
            return  # the schema check says what is wrong
        _check_counts(where, signatures, limits)

    return check


def _check_counts(where: Any, signatures: list, limits: LoadLimits) -> None:
    if len(signatures) > limits.max_signatures:
        _refuse(
            f"{where} describes {len(signatures)} signatures", "max_signatures", limits.max_signatures, len(signatures)
        )
    for index, signature in enumerate(signatures):
        leaves = signature.get("leaves") if isinstance(signature, dict) else None
        if isinstance(leaves, list) and len(leaves) > limits.max_leaves:
            _refuse(
                f"{where}: signature {index} has {len(leaves)} leaves", "max_leaves", limits.max_leaves, len(leaves)
            )


def check_limits(root: Path, manifest: dict, limits: LoadLimits) -> None:
    """Raises `PackageLimitError` naming the first field of the package at ``root`` over ``limits``.

    Reads the manifest's backend options and each module's ``spec.json`` (validated against its
    schema, nothing parsed by torch).
    """
    for entry in manifest["modules"]:
        recordings = _max_recordings(entry["backend"])
        if recordings is not None and recordings > limits.max_recordings:
            _refuse(
                f"{root / 'xpupack.json'}: the graph backend of {entry['path'] or '<model>'} asks for "
                f"max_recordings={recordings}",
                "max_recordings",
                limits.max_recordings,
                recordings,
            )
    total = compiles = 0
    for entry in manifest["modules"]:
        where = root / entry["spec"]
        signatures = read_spec(root, entry)["signatures"]
        _check_counts(where, signatures, limits)
        for index, signature in enumerate(signatures):
            total += synthesized_bytes(signature)
            if total > limits.max_input_bytes:
                _refuse(
                    f"{where}: the inputs a load synthesises for the package's signatures add up to more "
                    f"than {_size(limits.max_input_bytes)} by signature {index} of this module",
                    "max_input_bytes",
                    limits.max_input_bytes,
                    total,
                )
        if "inductor" in _backend_names(entry["backend"]):
            compiles += compiles_of(signatures)
    if compiles > limits.max_compiles:
        _refuse(
            f"{root / 'xpupack.json'}: loading the package makes {compiles} compiles (about a second each) for "
            "its modules' signatures",
            "max_compiles",
            limits.max_compiles,
            compiles,
        )


def load_work(root: Path, manifest: dict) -> dict[str, int]:
    """What loading the package at ``root`` costs, summed over its modules (`xpupack verify` prints it):
    ``signatures`` (each run once beside the original module), ``compiles`` (`compiles_of`, for modules
    whose backend compiles), ``recordings`` (device graphs a graph backend records, at most its
    ``max_recordings`` per module) and ``input_bytes`` (`synthesized_bytes`)."""
    work = {"signatures": 0, "compiles": 0, "recordings": 0, "input_bytes": 0}
    for entry in manifest["modules"]:
        signatures = read_spec(root, entry)["signatures"]
        names = _backend_names(entry["backend"])
        work["signatures"] += len(signatures)
        work["compiles"] += compiles_of(signatures) if "inductor" in names else 0
        if "graph" in names:
            work["recordings"] += min(len(signatures), _max_recordings(entry["backend"]) or GRAPH_MAX_RECORDINGS)
        work["input_bytes"] += sum(synthesized_bytes(signature) for signature in signatures)
    return work


def compiles_of(signatures: list[dict]) -> int:
    """The compiles a compiling backend makes for a module's signatures' JSON: one static compile per
    signature without state; signatures with state (a KV cache) share one compile, sizes as symbols, per
    family and size pattern (`Signature.family`, `Signature.size_pattern`, worked out here from the JSON)."""
    alone, shared = 0, set()
    for signature in signatures:
        if any(leaf.get("kind") == "state" for leaf in signature["leaves"]):
            shared.add(_family_and_pattern(signature))
        else:
            alone += 1
    return alone + len(shared)


def _family_and_pattern(signature: dict) -> tuple:
    family, shapes = [signature["tree"]], []
    for leaf in signature["leaves"]:
        if leaf["kind"] == "tensor":
            family.append(("tensor", leaf["dtype"], leaf["device"], len(leaf["shape"])))
            shapes.append(leaf["shape"])
        elif leaf["kind"] == "state":
            family.append(
                ("state", leaf["type"], tuple((len(t["shape"]), t["dtype"], t["device"]) for t in leaf["tensors"]))
            )
            shapes += [t["shape"] for t in leaf["tensors"]]
        else:
            family.append(("constant", json.dumps(leaf["value"], sort_keys=True)))
    symbols: dict[int, str] = {}
    pattern = tuple(
        tuple(size if size < 2 else symbols.setdefault(size, f"s{len(symbols)}") for size in shape) for shape in shapes
    )
    return tuple(family), pattern


def _backend_names(backend: Any) -> list[Any]:
    """The names of a manifest's backend entry and of its bases (``graph+inductor``: graph, inductor)."""
    names: list[Any] = []
    while isinstance(backend, dict) and len(names) < 16:
        names.append(backend.get("name"))
        options = backend.get("options")
        backend = options.get("base") if isinstance(options, dict) else None
    return names


def synthesized_bytes(signature: dict) -> int:
    """The bytes of the inputs a load synthesises for one signature's JSON: its tensor leaves, or nothing
    for a signature with a state leaf (only a real call brings one)."""
    leaves = signature["leaves"]
    if any(leaf.get("kind") == "state" for leaf in leaves):
        return 0
    return sum(
        math.prod(leaf["shape"]) * _ITEMSIZE.get(leaf["dtype"], _UNKNOWN_ITEMSIZE)
        for leaf in leaves
        if leaf.get("kind") == "tensor"
    )


def _max_recordings(backend: Any) -> int | None:
    """The ``max_recordings`` a manifest's backend entry (or its base) asks for, if it is a number."""
    while isinstance(backend, dict):
        options = backend.get("options")
        if not isinstance(options, dict):
            return None
        value = options.get("max_recordings")
        if backend.get("name") == "graph" and isinstance(value, int) and not isinstance(value, bool):
            return value
        backend = options.get("base")
    return None


def _refuse(what: str, field: str, limit: int, actual: int) -> None:
    shown = _size(limit) if field == "max_input_bytes" else str(limit)
    variable = ENVIRONMENT[field]
    setting = os.environ.get(variable, "")
    # where the limit came from the environment, name the variable with its value: that is what to change
    from_environment = _WHOLE_NUMBER.fullmatch(setting.strip()) and int(setting) == limit
    raise_it = f"raise the environment's {variable}={setting.strip()}" if from_environment else f"set {variable}"
    raise PackageLimitError(
        f"{what}, over the loader's limit {field}={shown}; refusing to load it before allocating anything — "
        f"if you trust the package, load it with limits=xpupack.LoadLimits({field}=...) or {raise_it}",
        field=field,
        limit=limit,
        actual=actual,
    )


def _size(size: int) -> str:
    return f"{size / 2**30:g} GiB" if size >= 2**30 else f"{size} bytes"
