"""The package format, version 1 (docs/format.md): manifest, specs, schemas, paths and digests.

Everything here reads or writes JSON and bytes; nothing imports torch, so the
commands that only look at a package stay fast.
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from ._fsutil import interrupted_save_of, moved_aside
from .backends._megacache import artifact_counts
from .digests import Digests, Remembered, hash_ahead, remembering, sha256_of
from .errors import DestinationExistsError, IntegrityError, PackageFormatError, SaveError, XpupackError
from .shards import check_weights, is_weights_file

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "xpupack.json"
MODEL_CARD = "README.md"
#: files a package may hold without listing them (the Hub adds .gitattributes)
UNLISTED_OK = frozenset({MANIFEST, MODEL_CARD, ".gitattributes"})
#: folders a package may hold without listing them (huggingface_hub's local_dir metadata)
UNLISTED_DIRS_OK = frozenset({".cache", ".git"})


@cache
def schema(name: str) -> dict:
    """The JSON Schema ``name`` ("manifest" or "spec"), shipped as package data."""
    text = resources.files("xpupack").joinpath("schemas", f"{name}.schema.json").read_text()
    return json.loads(text)


def validate(data: Any, name: str, where: str) -> None:
    """Raises `PackageFormatError` naming ``where`` and the failing field unless ``data`` fits schema ``name``.

    A spec's leaves are checked in Python (`_leaf_fits`, the schema's rule for a leaf): jsonschema tries each
    leaf against every kind of its ``oneOf`` and took ~0.5 ms a leaf, minutes for a spec within the limits
    (issue 32). It checks the rest of the spec, and a leaf that fails, to name the field."""
    if name == "spec" and isinstance(data, dict) and isinstance(data.get("signatures"), list):
        for index, signature in enumerate(data["signatures"]):
            leaves = signature.get("leaves") if isinstance(signature, dict) else None
            for number, leaf in enumerate(leaves if isinstance(leaves, list) else []):
                if not _leaf_fits(leaf):
                    _check_schema(leaf, _leaf_schema(), where, name, f"signatures/{index}/leaves/{number}/")
        data = {**data, "signatures": [_without_leaves(signature) for signature in data["signatures"]]}
    _check_schema(data, schema(name), where, name)


def _check_schema(data: Any, rules: dict, where: str, name: str, prefix: str = "") -> None:
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(rules).iter_errors(data))
    if error is not None:
        field = prefix + "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise PackageFormatError(
            f"{where} does not match the {name} schema at {field.rstrip('/')}: {error.message}; "
            "the package is damaged or was not written by xpupack — rebuild it",
            path=where,
        )


@cache
def _leaf_schema() -> dict:
    """The spec schema's rule for one leaf of a signature (tensor, state or constant)."""
    return schema("spec")["properties"]["signatures"]["items"]["properties"]["leaves"]["items"]


def _without_leaves(signature: Any) -> Any:
    """A signature with its leaves left out (an empty list), for jsonschema to check the rest."""
    if isinstance(signature, dict) and isinstance(signature.get("leaves"), list):
        return {**signature, "leaves": []}
    return signature


#: the schema's ``pattern`` of a dtype name (jsonschema matches it with ``re.search``, as here)
_DTYPE_NAME = re.compile(r"^[a-z0-9_]+$")
_TENSOR_KEYS = frozenset({"kind", "shape", "dtype", "device"})
_STATE_KEYS = frozenset({"kind", "type", "tensors"})
_STATE_TENSOR_KEYS = frozenset({"shape", "stride", "dtype", "device"})
_CONSTANT_KEYS = frozenset({"kind", "value"})


def _leaf_fits(leaf: Any) -> bool:
    """Whether a leaf's JSON fits the spec schema's rule for a leaf (`_leaf_schema`), exactly: the test
    ``test_limits.py::test_the_python_leaf_check_agrees_with_the_schema`` holds the two together."""
    if not isinstance(leaf, dict):
        return False
    kind, keys = leaf.get("kind"), leaf.keys()
    if kind == "tensor":
        return keys == _TENSOR_KEYS and _sizes_fit(leaf["shape"]) and _layout_fits(leaf)
    if kind == "state":
        tensors = leaf.get("tensors")
        return (
            keys == _STATE_KEYS
            and type(leaf["type"]) is str
            and type(tensors) is list
            and len(tensors) > 0
            and all(
                isinstance(t, dict)
                and t.keys() == _STATE_TENSOR_KEYS
                and _sizes_fit(t["shape"])
                and _sizes_fit(t["stride"])
                and _layout_fits(t)
                for t in tensors
            )
        )
    if kind == "constant" and keys == _CONSTANT_KEYS:
        value = leaf["value"]
        if value is None or type(value) in (bool, int, float, str):
            return True
        if type(value) is dict and len(value) == 1:
            ((key, item),) = value.items()
            return (key == "float" and item in ("nan", "inf", "-inf") and type(item) is str) or (
                key in ("dtype", "device") and type(item) is str
            )
    return False


def _sizes_fit(sizes: Any) -> bool:
    """A list of JSON Schema integers (``2.0`` is one) of at least 0."""
    return type(sizes) is list and all(
        (type(n) is int or (type(n) is float and n.is_integer())) and n >= 0 for n in sizes
    )


def _layout_fits(tensor: dict) -> bool:
    dtype = tensor["dtype"]
    return type(dtype) is str and _DTYPE_NAME.search(dtype) is not None and type(tensor["device"]) is str


def read_json(
    root: Path, relative: str, schema_name: str, *, before_schema: Callable[[str, dict], None] | None = None
) -> dict:
    """Reads and validates one JSON file of a package (manifest or spec); ``before_schema(where, data)`` runs
    on the parsed JSON before the schema check (the loader's limits, which may refuse it at once)."""
    where = str(root / relative)
    if not (root / relative).is_file():  # never open a FIFO or device a hostile package put there
        raise IntegrityError(
            f"{where} is missing or not a regular file; the package is incomplete — rebuild or re-download it",
            path=where,
        )
    try:
        text = (root / relative).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PackageFormatError(
            f"cannot read {where} ({exc}); the package is damaged — rebuild or re-download it", path=where
        ) from None
    try:
        data = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # also numbers out of range (below), nesting too deep
        raise PackageFormatError(
            f"{where} is not valid JSON ({str(exc)[:200]}); the package is damaged — rebuild it with `xpupack build`",
            path=where,
        ) from None
    if not isinstance(data, dict):
        raise PackageFormatError(
            f"{where} must hold a JSON object; the package is damaged — rebuild it with `xpupack build`", path=where
        )
    if before_schema is not None:  # it counts lists only: safe on JSON of any depth
        before_schema(where, data)
    check_depth(data, where, fix="rebuild it with `xpupack build`")
    version = data.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version not in SUPPORTED_VERSIONS:
        newest = max(SUPPORTED_VERSIONS)
        fix = "upgrade xpupack" if version > newest else "rebuild the package with this xpupack"
        raise PackageFormatError(
            f"unsupported format_version {version} in {where}; this xpupack reads "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))} — {fix}",
            path=where,
        )
    validate(data, schema_name, where)
    return data


#: the largest integer a package holds: sizes, shapes and counts are 64-bit wherever they are used, and
#: Python's would reach code that does not expect ``10**400`` (a float of it overflows)
_MAX_INT = 2**63 - 1


def _bounded_int(text: str) -> int:
    """An integer of a package's JSON, refused (``ValueError``) beyond 64 bits."""
    if len(text.lstrip("-")) > len(str(_MAX_INT)) or abs(value := int(text)) > _MAX_INT:
        raise ValueError(f"the integer {text[:24]}{'…' if len(text) > 24 else ''} is out of range (over 2**63 - 1)")
    return value


def _finite_float(text: str) -> float:
    """A number of a package's JSON, refused (``ValueError``) where it overflows to infinity (``1e400``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:24]} is out of range")
    return value


def _not_json(name: str) -> float:
    """``NaN`` and ``Infinity``, which Python's reader takes but JSON has not (``--json`` would print them)."""
    raise ValueError(f"{name} is not a JSON number")


def write_json(path: Path, data: dict) -> None:
    """Writes one JSON file of a package (manifest or spec) as xpupack always does: sorted, indented."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


#: deeper than any JSON xpupack or torchao writes (about 10 levels), shallow enough for any recursive code
MAX_DEPTH = 64


def check_depth(data: Any, where: str, *, fix: str = "rebuild the package") -> None:
    """Raises `PackageFormatError` if the parsed JSON ``data`` nests more than `MAX_DEPTH` levels.

    Iterative, so it cannot itself run out of stack; run it before any recursive walk (a schema
    validator, a type check, torchao's decoder) sees the data.
    """
    # a level at a time, containers only: a spec of a million leaves took 10 s value by value
    level, depth = [data] if isinstance(data, (dict, list)) else [], 1
    while level:
        below = []
        for value in level:
            children = value.values() if isinstance(value, dict) else value
            if children and depth == MAX_DEPTH:  # its children, scalars too, are one level deeper
                raise PackageFormatError(
                    f"{where} is nested deeper than {MAX_DEPTH} levels, which no package "
                    f"holds; the package is damaged — {fix}",
                    path=where,
                )
            below += [child for child in children if isinstance(child, (dict, list))]
        level, depth = below, depth + 1


def read_manifest(root: Path) -> dict:
    """The validated manifest of the package at ``root``, every path and module path in it checked."""
    destination = interrupted_save_of(root)
    if destination is not None:
        raise PackageFormatError(
            f"{root} is a temporary directory of `xpupack save` (a package being written, "
            f"or one moved aside to replace it), not a package: load {destination} — if that "
            "is missing, save again there, which puts back what was moved aside",
            path=str(root),
        )
    if not root.is_dir():
        aside = moved_aside(root)
        fix = (
            f"{aside[-1]} holds the package an interrupted save moved aside: rename it to {root.name}, "
            f"or save again there"
            if aside and not root.exists()
            else "pass the folder `xpupack build` wrote"
        )
        raise PackageFormatError(f"{root} is not a directory; {fix}", path=str(root))
    if not (root / MANIFEST).is_file():
        raise PackageFormatError(
            f"{root} is not an xpupack package: it has no {MANIFEST} — pass the folder "
            "`xpupack build` wrote, or rebuild or re-download the package",
            path=str(root),
        )
    manifest = read_json(root, MANIFEST, "manifest")
    where = str(root / MANIFEST)
    weights = [manifest["model"]["weights"]] if manifest["model"]["weights"] else []
    paths = list(manifest["files"]) + weights
    paths += [m[k] for m in manifest["modules"] for k in ("folder", "spec")]
    paths += [b["folder"] for b in manifest["backends"].values()]
    for relative in paths:
        check_relative(relative, where)
        _refuse_importable(relative, where)
    for relative in [m["spec"] for m in manifest["modules"]] + weights:  # files that load reads: digested
        if relative not in manifest["files"]:
            raise PackageFormatError(
                f"{where} names {relative!r} but does not list it under files, so its "
                "digest cannot be checked; the package is damaged — rebuild it",
                path=relative,
            )
    _check_module_paths(manifest["modules"], where)
    _check_device_slots(manifest, where)
    return manifest


def package_slots(manifest: dict) -> list[str]:
    """The build device of each device slot (``devices``; a package of one device has only ``device``)."""
    return manifest.get("devices") or [manifest["device"]]


def module_slot(entry: dict) -> int:
    """A manifest module entry's device slot (0 where the entry has none)."""
    return entry.get("device_slot", 0)


def _check_device_slots(manifest: dict, where: str) -> None:
    """Every module's slot is one the manifest lists a device for, and slot 0's device is ``device``."""
    slots = package_slots(manifest)
    if slots[0] != manifest["device"]:
        raise PackageFormatError(
            f"{where} lists devices {slots} but device {manifest['device']!r}, which must be "
            "the first of them; the package is damaged — rebuild it",
            path=where,
        )
    for entry in manifest["modules"]:
        if module_slot(entry) >= len(slots):
            raise PackageFormatError(
                f"{where} puts the module {entry['path'] or '<model>'!r} on device slot "
                f"{module_slot(entry)}, but lists {len(slots)} device(s); the package is "
                "damaged — rebuild it",
                path=where,
            )


def _check_module_paths(modules: list[dict], where: str) -> None:
    """Each module once, and never a module together with one of its submodules (`tune` refuses both)."""
    paths = [m["path"] for m in modules]
    listed: set[str] = set()
    for path in paths:
        if path in listed:
            raise PackageFormatError(
                f"{where} lists the module {path or '<model>'!r} twice; the package is damaged — rebuild it", path=where
            )
        listed.add(path)
    for path in paths:
        parts = path.split(".") if path else []
        other = next((a for a in (".".join(parts[:i]) for i in range(len(parts))) if a in listed), None)
        if other is not None:
            raise PackageFormatError(
                f"{where} lists the modules {other or '<model>'!r} and {path or '<model>'!r}, "
                "which overlap; the package is damaged — rebuild it",
                path=where,
            )


#: the specs of one look at a package (`reading_once`): each file's validated JSON, and whether `read_spec`
#: checked it too
_SPECS_READ: ContextVar[dict[str, list] | None] = ContextVar("xpupack_specs_read", default=None)


@contextmanager
def reading_once() -> Iterator[None]:
    """Within it, each spec of a package is parsed, schema-checked and checked by `read_spec` once, however
    many checks read it (a load or a verify: the files, the limits, the signatures). A 100 MB spec read three
    times took minutes (issue 32). Nested uses share the outer one's reading."""
    if _SPECS_READ.get() is not None:
        yield
        return
    token = _SPECS_READ.set({})
    try:
        yield
    finally:
        _SPECS_READ.reset(token)


def _spec_json(root: Path, relative: str, before_schema: Callable[[str, dict], None] | None = None) -> list:
    """``[the spec's validated JSON, whether read_spec checked it]``, read once within `reading_once`."""
    specs, key = _SPECS_READ.get(), str(root / relative)
    if specs is not None and key in specs:
        return specs[key]
    found = [read_json(root, relative, "spec", before_schema=before_schema), False]
    if specs is not None:
        specs[key] = found
    return found


def check_package(
    root: Path,
    *,
    links_within: Path | None = None,
    ignore_unlisted: bool = False,
    before_schema: Callable[[str, dict], None] | None = None,
) -> dict:
    """The manifest of an intact package: schema, paths, every file's size and sha256, the weights' headers,
    every spec. Every file is hashed (a remembered verification is not trusted here, only refreshed).

    Raises `PackageFormatError` or `IntegrityError` naming the first problem.
    """
    manifest, digests = open_package(
        root, links_within=links_within, ignore_unlisted=ignore_unlisted, trusted=False, before_schema=before_schema
    )
    digests.wait()
    return manifest


def open_package(
    root: Path,
    *,
    links_within: Path | None = None,
    ignore_unlisted: bool = False,
    trusted: bool = True,
    before_schema: Callable[[str, dict], None] | None = None,
) -> tuple[dict, Digests]:
    """`check_package` for a load, which hashes the weights files as it streams them: returns before their
    digests are in; `Digests.wait` raises if one is damaged. With ``trusted``, a
    weights file this machine remembers as verified and unchanged is not hashed again (`xpupack.digests`).
    An error raised before the digests are in gives way to a failed digest. ``before_schema(where, spec)``
    sees each spec's JSON before its schema check (`limits.early_check`)."""
    refuse_link(root / MANIFEST, root, links_within)
    manifest = read_manifest(root)
    digests = check_files(
        root, manifest, links_within=links_within, ignore_unlisted=ignore_unlisted, pending=True, trusted=trusted
    )
    with digests.reported_first():
        check_named_files(root, manifest)
        check_mega_caches(root, manifest)
        check_weights(root, manifest)
        for entry in manifest["modules"]:
            _spec_json(root, entry["spec"], before_schema)  # that it describes its module: checked per module
    return manifest, digests


#: the file names backend configs of format 1 use: Inductor's shared cache and kernels (the backend and the
#: report read them from here), TorchAO's weights
CACHE, KERNELS, _TORCHAO_WEIGHTS = "cache", "kernels", "weights.safetensors"


def named_files(manifest: dict) -> list[tuple[str, Any, str]]:
    """``(where, name, folder)`` for every file a backend config of the manifest names: the shared
    configs' ``cache`` and ``kernels`` (Inductor), each module's TorchAO ``weights`` (at any depth of a
    ``base`` chain such as ``graph+torchao``). ``folder`` is where the name is relative to."""
    where = f"{MANIFEST}: the backend config of"
    named = []
    for name, shared in manifest["backends"].items():
        config, folder = shared["config"], shared["folder"]
        if CACHE in config:
            named.append((f"{where} {name}", config[CACHE], folder))
        kernels = config.get(KERNELS, [])
        if not isinstance(kernels, list):
            raise PackageFormatError(
                f"{where} {name} lists the kernels as {str(kernels)[:80]}, not as a list of "
                "files; the package is damaged — rebuild it",
                path=MANIFEST,
            )
        named += [(f"{where} {name}", kernel, f"{folder}/{KERNELS}") for kernel in kernels]
    for entry in manifest["modules"]:
        backend, config, folder = entry["backend"], entry["backend"]["config"], entry["folder"]
        for _ in range(MAX_DEPTH):
            if not isinstance(backend, dict) or not isinstance(config, dict):
                break
            folder = f"{folder}/{backend.get('name')}"
            if backend.get("name") == "torchao":  # one file, or a list of shards
                weights = config.get("weights", _TORCHAO_WEIGHTS)
                for name in weights if isinstance(weights, list) and weights else [weights]:
                    named.append((f"{where} {entry['path'] or '<model>'}", name, folder))
            if backend.get("name") == "aoti":  # one compiled library per signature
                programs = config.get("programs")
                for program in programs.values() if isinstance(programs, dict) else [None]:
                    name = program.get("file") if isinstance(program, dict) else program
                    named.append((f"{where} {entry['path'] or '<model>'}", name, folder))
            backend = backend.get("options", {}).get("base") if isinstance(backend.get("options"), dict) else None
            config = config.get("base", {})
    return named


def _backend_tensor_files(manifest: dict) -> set[str]:
    """The files of tensors a backend stores (TorchAO's quantized weights, as large as a model's): hashed and
    remembered as the weights files are, not on the verify's path. Names `check_named_files` refuses later
    are left out here."""
    try:
        named = named_files(manifest)
    except PackageFormatError:
        return set()
    # named_files puts a backend's files in a folder named after it
    return {f"{folder}/{name}" for _, name, folder in named if isinstance(name, str) and folder.endswith("/torchao")}


def check_named_files(root: Path, manifest: dict) -> None:
    """Every file a backend config names stays in the package and is one the manifest lists (and
    `check_files` digested), whether or not a load here would read it (`artifact_file` checks again
    when a backend opens it)."""
    for where, name, folder in named_files(manifest):
        if not isinstance(name, str):
            raise PackageFormatError(
                f"{where} names the file {str(name)[:80]}, which is not a path; the package is damaged — rebuild it",
                path=MANIFEST,
            )
        check_relative(name, where)
        relative = f"{folder}/{name}"
        if relative not in manifest["files"]:
            raise IntegrityError(
                f"{where} names {relative}, which {MANIFEST} does not list (so no digest covers "
                "it); the package is damaged or incomplete — rebuild or re-download it",
                path=relative,
            )


def check_mega_caches(root: Path, manifest: dict) -> None:
    """Every shared ``cache`` a backend config names (Inductor's mega-cache) is PyTorch's cache-artifact
    container, as `inspect` reads it (a block at a time, no pickle): PyTorch's own loader, which a trusted
    load runs, would only log that it cannot read one and leave the modules to compile here."""
    for shared in manifest["backends"].values():
        if CACHE in shared["config"]:
            relative = f"{shared['folder']}/{shared['config'][CACHE]}"
            with (root / relative).open("rb") as stream:
                artifact_counts(stream, relative)


def read_spec(root: Path, entry: dict) -> dict:
    """The validated ``spec.json`` of the manifest's module ``entry``, checked to describe that module
    (`xpupack.spec` turns it into a `ModuleSpec`)."""
    found = _spec_json(root, entry["spec"])
    data, checked = found
    if checked:
        return data
    if data["path"] != entry["path"]:
        raise PackageFormatError(
            f"{root / entry['spec']} describes the module {data['path']!r}, but "
            f"{root / MANIFEST} lists it for {entry['path']!r}; the package is damaged — "
            "rebuild it",
            path=entry["spec"],
        )
    try:
        for tree in {signature["tree"] for signature in data["signatures"]}:  # a batch ladder's share one tree
            check_tree(tree)
        _check_batch_axes(data)
    except ValueError as exc:
        raise PackageFormatError(
            f"{root / entry['spec']}: {exc}; the package is damaged — rebuild it", path=entry["spec"]
        ) from None
    found[1] = True
    return data


def _check_batch_axes(spec: dict) -> None:
    """Raises ``ValueError`` unless the spec's ``batch_axes`` and ``length_axes`` (which the schema checked
    for types) have one entry per signature, each naming an axis only of a tensor leaf that has it, in a
    signature without state.

    Torch-free, so that `inspect` and `verify` refuse what `xpupack.load` refuses (`xpupack.spec` then
    checks that the axes give each signature one batch)."""
    signatures = spec["signatures"]
    for name in ("batch_axes", "length_axes"):
        entries = spec.get(name) or []
        if entries and len(entries) != len(signatures):
            raise ValueError(f"{name} has {len(entries)} entries for {len(signatures)} signatures")
        for index, (axes, signature) in enumerate(zip(entries, signatures)):
            if axes is None:
                continue
            leaves = signature["leaves"]
            fits = len(axes["inputs"]) == len(leaves) and all(
                leaf["kind"] != "state" and (axis is None or (leaf["kind"] == "tensor" and axis < len(leaf["shape"])))
                for axis, leaf in zip(axes["inputs"], leaves)
            )
            if not fits:
                raise ValueError(f"the {name.replace('_', ' ')} of signature {index} do not fit its leaves")


#: pytree node types a stored tree may name. torch's parser also knows node types
#: whose context names a module to import (``collections.defaultdict``, enum keys):
#: a package must never make the loader import anything, so those are refused.
_TREE_NODES = frozenset(
    {
        "builtins.tuple",
        "builtins.list",
        "builtins.dict",
        "collections.OrderedDict",
        "collections.deque",
        "collections.namedtuple",
        "torch.Size",
    }
)
_MAX_TREE_NODES = 10_000
_MAX_TREE_DEPTH = 100


def check_tree(text: str) -> None:
    """Raises ``ValueError`` unless ``text`` is a serialized tree of ``(args, kwargs)`` made of
    allowed node types (`_TREE_NODES`) whose contexts are plain JSON scalars or lists of them.

    Torch-free, so that `read_spec` (and with it `xpupack verify`) refuses what `xpupack.load` would,
    before PyTorch's own parser (`xpupack.signature`) ever sees the text."""
    try:
        protocol, root = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"unreadable tree structure: {exc}") from None
    if protocol != 1:
        raise ValueError(f"unknown tree protocol {protocol!r}")
    if not (
        _node_type(root) == "builtins.tuple"
        and len(root["children_spec"]) == 2
        and _node_type(root["children_spec"][0]) == "builtins.tuple"
        and _node_type(root["children_spec"][1]) == "builtins.dict"
    ):
        raise ValueError("the tree does not describe (args, kwargs)")
    pending, seen = [(root, 0)], 0
    while pending:
        node, depth = pending.pop()
        seen += 1
        if seen > _MAX_TREE_NODES or depth > _MAX_TREE_DEPTH:
            raise ValueError(f"the tree is larger than {_MAX_TREE_NODES} nodes or deeper than {_MAX_TREE_DEPTH}")
        kind, context, children = _node_type(node), node["context"], node["children_spec"]
        if kind is None:
            if context is not None or children:
                raise ValueError("a tree leaf has a context or children")
            continue
        if kind not in _TREE_NODES:
            raise ValueError(
                f"tree node type {kind!r} is not allowed; a spec may hold {', '.join(sorted(_TREE_NODES))}"
            )
        if not isinstance(context, str) or (kind != "collections.namedtuple" and not _plain(context)):
            raise ValueError(f"the context of a {kind} tree node must be plain JSON, not {context!r}")
        pending.extend((child, depth + 1) for child in children)


def _node_type(node: Any) -> Any:
    """A tree node's ``type``, after checking the node's shape."""
    if not (
        isinstance(node, dict)
        and set(node) == {"type", "context", "children_spec"}
        and isinstance(node["children_spec"], list)
        and isinstance(node["type"], (str, type(None)))
    ):
        raise ValueError(f"malformed tree node {str(node)[:80]}")
    return node["type"]


def _plain(context: str) -> bool:
    """True when ``context`` is JSON null, a scalar or a list of scalars (no objects: torch turns
    objects carrying ``__enum__`` into imports)."""
    try:
        value = json.loads(context)
    except (ValueError, RecursionError):
        return False
    items = value if isinstance(value, list) else [value]
    return all(isinstance(item, (type(None), bool, int, float, str)) for item in items)


def check_relative(relative: str, where: str) -> None:
    """Refuses a path that is absolute, has ``..`` or a backslash, is not in canonical form
    (``./a``, ``a//b``, ``.``), or lies in a folder packages may not use.

    ``where`` names what holds the path (for the message).
    """
    pure = PurePosixPath(relative)
    if (
        pure.is_absolute()
        or "\\" in relative
        or ".." in pure.parts
        or re.match(r"^[A-Za-z]:", relative)
        or relative.startswith("~")
        or "\0" in relative
    ):
        raise PackageFormatError(
            f"{where} names the path {relative!r}, which escapes the package; refusing "
            "to load it — rebuild the package, or get it from a source you trust",
            path=relative,
        )
    if not pure.parts or pure.as_posix() != relative:
        raise PackageFormatError(
            f"{where} names the path {relative!r}, which is not a plain relative path "
            "like 'modules/x/spec.json'; the package is damaged — rebuild it",
            path=relative,
        )
    if pure.parts[0] in UNLISTED_DIRS_OK:
        raise PackageFormatError(
            f"{where} names the path {relative!r} in {pure.parts[0]}/, which holds "
            "unchecked files; refusing to load it — rebuild the package",
            path=relative,
        )


#: the package being loaded, as ``(root, files its manifest lists)``: see `listed_files`
_LOADING: ContextVar[tuple[Path, frozenset[str]] | None] = ContextVar("xpupack_loading", default=None)


@contextmanager
def listed_files(root: Path, manifest: dict) -> Iterator[None]:
    """While a package's backends are restored: `artifact_file` hands out only files its manifest lists.

    `check_files` verified exactly those; a Hub snapshot may hold other, unverified ones.
    """
    token = _LOADING.set((root, frozenset(manifest["files"])))
    try:
        yield
    finally:
        _LOADING.reset(token)


#: file names Python imports (``.py``, ``.pyc``, extension modules) or reads at start-up (``.pth``)
_IMPORTABLE = (*importlib.machinery.all_suffixes(), ".pth")


def _refuse_importable(relative: str, where: str) -> None:
    """Refuses a path that Python could import when the package directory is on ``sys.path`` (it is the
    current directory of ``python -m``, say): a module at the root, or a folder at the root with an
    ``__init__``. xpupack never writes one; a package that has one could shadow a real module."""
    parts = PurePosixPath(relative).parts
    if (len(parts) == 1 and parts[0].endswith(_IMPORTABLE)) or (
        len(parts) == 2 and parts[1].startswith("__init__.") and parts[1].endswith(_IMPORTABLE)
    ):
        raise PackageFormatError(
            f"{where} names {relative!r}, a file Python can import from the package's "
            "root, where it could shadow a module; xpupack never writes one, so refusing "
            "to load it — rebuild the package",
            path=relative,
        )


def artifact_file(folder: Path, name: Any) -> Path:
    """The file ``name`` that a backend config names inside the backend's ``folder``.

    Backends call this for every file their config names: the name cannot
    leave the package, and the file must be one `check_files` verified (one the
    manifest lists, while `listed_files` is in effect).
    """
    where = f"the backend config for {folder}"
    if not isinstance(name, str):
        raise PackageFormatError(
            f"{where} names the file {name!r}, which is not a path; the package is damaged — rebuild it",
            path=str(folder),
        )
    check_relative(name, where)
    path = folder / name
    loading = _LOADING.get()
    if loading is not None:
        root, listed = loading
        relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
        if relative not in listed:
            raise IntegrityError(
                f"{where} names {name!r}, but {MANIFEST} does not list {relative or path}, so "
                "its digest was never checked; refusing to read it — rebuild or re-download "
                "the package",
                path=relative or str(path),
            )
    if not path.is_file():  # a regular file here is listed and verified (symlinks only into the Hub cache)
        raise IntegrityError(
            f"{where} names {name!r}, which is not a file of the package; the package is "
            "incomplete — rebuild or re-download it",
            path=str(path),
        )
    return path


def describe_files(root: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """``{relative path: {sha256, size}}`` for every file under ``root`` but the unlisted ones; the files in
    ``known`` (the weights, hashed as they were written) are taken from there."""
    files = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_file() and relative not in UNLISTED_OK:
            size = path.stat().st_size
            given = (known or {}).get(relative)
            files[relative] = (
                given if given is not None and given["size"] == size else {"sha256": sha256_of(path), "size": size}
            )
    return files


def check_files(
    root: Path,
    manifest: dict,
    *,
    links_within: Path | None = None,
    ignore_unlisted: bool = False,
    pending: bool = False,
    trusted: bool = False,
) -> Digests:
    """Checks every listed file's size and digest, and that no unlisted file is present.

    Symbolic links are refused, except links that resolve inside ``links_within``
    (the Hugging Face cache, whose snapshots link to its blob store). With
    ``ignore_unlisted`` (a Hub snapshot, which may hold the repo's other files),
    unlisted files are not refused; `artifact_file` never hands them out.

    Files are hashed in worker threads. The verifications of the weights files and of the files of tensors a
    backend stores (TorchAO's quantized weights) are remembered
    (`xpupack.digests`); with ``trusted``, a remembered one is not hashed again. With ``pending`` it
    returns before the weights files' digests are in, for the load that reads them to hash them as it
    does (or, where `xpupack.digests.hash_ahead`, while threads hash them): the returned `Digests` raises
    for them on `Digests.wait`.
    """
    listed = manifest["files"]
    for relative, expected in listed.items():
        path = root / relative
        refuse_link(path, root, links_within)
        if not path.is_file():
            raise IntegrityError(
                f"{path} is listed in the manifest but missing; the package is incomplete — rebuild or re-download it",
                path=relative,
            )
        size = path.stat().st_size
        if size != expected["size"]:
            raise IntegrityError(
                f"{path} has {size} bytes, the manifest says {expected['size']}; "
                "the file is truncated or changed — rebuild or re-download the package",
                path=relative,
                expected=str(expected["size"]),
                actual=str(size),
            )
    remembered = Remembered() if remembering() else None
    tensors = _backend_tensor_files(manifest)
    weights = Digests(
        root,
        listed,
        [relative for relative in listed if is_weights_file(relative) or relative in tensors],
        remembered=remembered,
        trust_remembered=trusted,
        by_reader=pending and not hash_ahead(),
    )
    with weights.reported_first():
        Digests(root, listed, [r for r in listed if not is_weights_file(r) and r not in tensors]).wait()
        if not ignore_unlisted:
            _refuse_unlisted(root, listed, links_within)
        if not pending:
            weights.wait()
    return weights


def _refuse_unlisted(root: Path, listed: dict, links_within: Path | None) -> None:
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if relative.parts[0] in UNLISTED_DIRS_OK:
            continue
        if path.is_symlink() and relative.as_posix() not in listed:
            refuse_link(path, root, links_within)
        # anything but a folder counts: a FIFO or socket has no business in a package either
        if not path.is_dir() and relative.as_posix() not in listed and relative.as_posix() not in UNLISTED_OK:
            raise IntegrityError(
                f"{path} is not listed in the manifest; something added it after the "
                "build — remove it or rebuild the package",
                path=relative.as_posix(),
            )


def refuse_link(path: Path, root: Path, links_within: Path | None) -> None:
    """Raises `IntegrityError` if ``path`` or a folder on its way from the package ``root`` is a symbolic
    link, unless it resolves inside ``links_within`` (the Hub cache's blob store): a package's files are
    read only where they are, never through a link out of it."""
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if not current.is_symlink():
            continue
        if links_within is not None and current.resolve().is_relative_to(links_within.resolve()):
            continue
        raise IntegrityError(
            f"{current} is a symbolic link; packages must hold plain files, so xpupack "
            "refuses to follow it — replace the link by the file itself, or rebuild the package",
            path=current.relative_to(root).as_posix(),
        )


def destination(path: str | Path) -> Path:
    """Where `save` writes a package given ``path``: through a link to the package it points to, never
    replacing the link."""
    root = Path(path)
    return root.resolve() if root.is_symlink() else root


def check_destination(root: Path) -> None:
    """Raises unless `save` may write a package at ``root`` (a `destination`): nothing, an empty directory or a
    package xpupack wrote is there, and the nearest folder that exists above it is a directory it can write
    in. `xpupack build` asks before it tunes, `save` again before it writes.

    Raises:
        DestinationExistsError: something `save` would delete is in the way; nothing was changed.
        SaveError: ``root`` names no folder of its own (``"."``, ``".."``, ``"/"``), or the folder above
            cannot hold the package.
    """
    if root.name in ("", ".."):  # ".", "" and "/" have no name; ".." names a parent
        raise SaveError(
            f"cannot write a package at {str(root)!r}: it names the current directory, a parent or the root, "
            "which a save would have to replace as a whole; nothing was changed — save into a folder of its "
            "own, such as xpupack.save(model, 'pkg') (--out pkg)"
        )
    _check_replaceable(root)
    parent = root.absolute().parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise SaveError(
            f"cannot write a package at {root}: {parent} is not a directory; nothing was changed — "
            "save to another directory (--out)"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SaveError(
            f"cannot write a package at {root}: {parent} is not writable; nothing was changed — "
            "check its permissions, or save to another directory (--out)"
        )


def _check_replaceable(root: Path) -> None:
    """Refuses a destination whose replacement could lose anyone's work: anything but nothing, an empty
    directory, or a package xpupack wrote (a manifest that validates, and no file or link it does not list
    besides the model card xpupack writes next to it).

    Raises:
        DestinationExistsError: naming what is in the way; nothing was changed.
    """
    if not root.exists() and not root.is_symlink():
        return

    def refuse(why: str, unexpected: list[str]) -> DestinationExistsError:
        return DestinationExistsError(
            f"{root} {why}; refusing to replace it, which would delete that — save to another directory "
            "(--out), or move those files out or remove the directory yourself",
            path=str(root),
            unexpected=unexpected,
        )

    if not root.is_dir():
        raise refuse("exists and is not a directory", [])
    try:
        if not any(root.iterdir()):
            return
        if not (root / MANIFEST).is_file():
            raise refuse(f"is not an xpupack package (it has no {MANIFEST})", [])
        try:
            manifest = read_manifest(root)
        except XpupackError as exc:
            raise refuse(f"holds an {MANIFEST} that is not a valid xpupack manifest ({exc})", [MANIFEST]) from None
        ours = {MANIFEST, MODEL_CARD, *manifest["files"]}
        unexpected = sorted(
            relative
            for path in root.rglob("*")
            if (relative := path.relative_to(root).as_posix()) not in ours and (path.is_symlink() or not path.is_dir())
        )
    except OSError as exc:
        raise SaveError(
            f"cannot look into {root} ({exc}); nothing was changed — check its permissions, "
            "or save to another directory"
        ) from None
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise refuse(f"holds files that are not part of the package its {MANIFEST} lists ({shown})", unexpected)


def module_folder(path: str) -> str:
    """The package folder of the module at object path ``path`` (``modules/__model__`` for the whole model)."""
    name = path or "__model__"
    return "modules/" + re.sub(r"[^A-Za-z0-9._-]", lambda m: f"_{ord(m.group()):x}_", name)
