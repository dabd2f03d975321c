"""The weights' files of format 1 (docs/format.md, "Weights"): one ``model.safetensors``, or past one
shard the Hugging Face layout, ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.

Torch-free: names, sizes, the index and the safetensors headers are read as JSON and bytes, so that
``xpupack verify`` and ``inspect`` check and describe them without importing torch.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from .errors import IntegrityError, PackageFormatError

#: the weights no backend owns, in one file (``save(..., weights=False)``: none)
WEIGHTS = "model.safetensors"
#: past one shard: the index of the shards (Hugging Face's name, which transformers looks for)
WEIGHTS_INDEX = "model.safetensors.index.json"
#: the largest shard `xpupack.save` writes by default: Hugging Face's default, and what the Hub serves well
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
#: a shard's name: Hugging Face's, five digits each
_SHARD = re.compile(r"^model-(?P<index>\d{5})-of-(?P<count>\d{5})\.safetensors$")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"^\s*(?P<number>\d+(\.\d+)?)\s*(?P<unit>[KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """A size in bytes from an int or a string such as ``"5GB"`` (10**9 bytes), ``"500MB"``, ``"2GiB"``.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(value, str) and (match := _SIZE.match(value)):
        value = round(float(match["number"]) * _UNITS[(match["unit"] or "").upper()])
    if type(value) is not int or value <= 0:
        raise ValueError(
            f"max_shard_size={value!r}: give a positive number of bytes, or a size such as '5GB', '500MB' or '2GiB'"
        )
    return value


#: the largest weights file a backend that stores tensors of its own writes (TorchAO's quantized weights):
#: `xpupack.save`'s ``max_shard_size`` while it writes the package
backend_shard_size: ContextVar[int] = ContextVar("xpupack_backend_shard_size", default=DEFAULT_MAX_SHARD_SIZE)


def shard_name(index: int, count: int, stem: str = "model") -> str:
    """The file name of shard ``index`` (from 1) of ``count``: the model's weights', or with ``stem="weights"``
    TorchAO's quantized weights'."""
    return f"{stem}-{index:05d}-of-{count:05d}.safetensors"


def is_weights_file(relative: str) -> bool:
    """Whether a package path is a file of tensors the loader streams (``model.safetensors`` or a shard)."""
    return relative == WEIGHTS or _SHARD.match(relative) is not None


def plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_shard_size`` bytes (a larger tensor gets a shard of its
    own, as transformers does)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards if shards[0] else []


def index_json(shards: dict[str, list[str]], total_size: int) -> dict:
    """The index of ``{shard file: its tensor names}`` in the Hugging Face layout: ``total_size`` is the bytes
    of tensor data (headers left out), ``weight_map`` maps each stored name to its shard."""
    weight_map = {name: file for file, names in shards.items() for name in names}
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def weights_data(manifest: dict) -> list[str]:
    """The files of tensors a package lists (``model.safetensors``, or its shards in order); empty without
    weights. From the manifest alone (`read_weight_map` checks them against the index)."""
    if manifest["model"]["weights"] is None:
        return []
    return sorted(name for name in manifest["files"] if is_weights_file(name))


def read_weight_map(root: Path, manifest: dict) -> dict[str, list[str] | None]:
    """``{file: the names stored there}``: for sharded weights the index's ``weight_map`` (checked: every shard
    named as xpupack names them, listed in the manifest, and no listed shard left out); for one file
    ``{"model.safetensors": None}`` (whatever its header holds). ``{}`` without weights.

    Raises:
        PackageFormatError: the index is not one xpupack writes, or names a file it may not.
    """
    relative = manifest["model"]["weights"]
    if relative is None:
        return {}
    listed = weights_data(manifest)
    if relative == WEIGHTS and listed == [WEIGHTS]:
        return {WEIGHTS: None}
    if relative != WEIGHTS_INDEX:
        raise PackageFormatError(
            f"{root / 'xpupack.json'} names the weights {relative!r} and lists {listed[:3]}; a package holds its "
            f"weights in {WEIGHTS} alone or in shards with {WEIGHTS_INDEX} — rebuild the package",
            path=relative,
        )
    shards: dict[str, list[str]] = {}
    for name, file in _read_index(root)["weight_map"].items():
        shards.setdefault(file, []).append(name)
    expected = [shard_name(k, len(shards)) for k in range(1, len(shards) + 1)]
    unknown = sorted(set(shards) - (set(expected) & set(manifest["files"])))
    if unknown:
        raise PackageFormatError(
            f"{root / WEIGHTS_INDEX} names the shard {unknown[0][:80]!r}, which is not one of "
            f"{expected[0]}..{expected[-1]} listed in xpupack.json; refusing to read it — rebuild the package",
            path=WEIGHTS_INDEX,
        )
    if listed != expected:
        raise PackageFormatError(
            f"{root / WEIGHTS_INDEX} maps no tensor to {sorted(set(listed) - set(expected))[0]}, which the "
            "package lists; the package is damaged — rebuild it",
            path=WEIGHTS_INDEX,
        )
    return {file: sorted(shards[file]) for file in expected}


def _read_index(root: Path) -> dict:
    """The index, checked for the shape xpupack writes (`index_json`)."""
    where = root / WEIGHTS_INDEX
    try:
        index = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PackageFormatError(
            f"cannot read {where} ({str(exc)[:200]}); the package is damaged — rebuild it", path=WEIGHTS_INDEX
        ) from None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(metadata, dict)
        or type(metadata.get("total_size")) is not int
        or not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(file, str) for file in weight_map.values())
    ):
        raise PackageFormatError(
            f"{where} is not a safetensors index ({{'metadata': {{'total_size': bytes}}, 'weight_map': "
            "{name: shard}}); the package is damaged — rebuild it",
            path=WEIGHTS_INDEX,
        )
    return index


#: safetensors' dtype codes -> the names the manifest uses (torch's); a code not here is refused: torch's
#: reader either cannot read it or gives a dtype the manifest does not name
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
#: bytes per element of each code the manifest's dtypes name
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
_ITEMSIZE.update({"U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1})
_ITEMSIZE.update({"F8_E5M2FNUZ": 1, "F8_E8M0": 1})


def read_header(root: Path, relative: str) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, safetensors dtype code)}`` of one safetensors file, as safetensors parses its header.

    Raises:
        PackageFormatError: safetensors refuses the file.
    """
    from safetensors import SafetensorError, safe_open

    path = root / relative
    try:
        with safe_open(str(path), framework="numpy") as stored:
            names = stored.keys()  # a safe_open has no __iter__
            return {name: (stored.get_slice(name).get_shape(), stored.get_slice(name).get_dtype()) for name in names}
    except (SafetensorError, OSError, ValueError) as exc:
        raise PackageFormatError(
            f"{path} is not a readable safetensors file ({str(exc)[:200]}); the package is damaged — rebuild it",
            path=relative,
        ) from None


def check_weights(root: Path, manifest: dict) -> None:
    """The weights files as safetensors parses their headers (torch-free): valid, holding exactly the tensors
    the manifest lists (less those a backend owns, and the aliases) with their shapes and dtypes; for sharded
    weights, each shard holding exactly the names the index maps to it, and the index's ``total_size`` their
    bytes."""
    header: dict[str, tuple[list[int], str]] = {}
    for file, names in read_weight_map(root, manifest).items():
        stored = read_header(root, file)
        if names is not None and sorted(stored) != names:
            other = sorted(set(stored) ^ set(names))[0]
            raise PackageFormatError(
                f"{root / file} {'holds' if other in stored else 'lacks'} the tensor {other!r}, which "
                f"{WEIGHTS_INDEX} maps {'elsewhere' if other in stored else 'to it'}; the package is damaged — "
                "rebuild it",
                path=file,
            )
        header.update(stored)
    total = _total_bytes(header.values())
    if manifest["model"]["weights"] == WEIGHTS_INDEX and total not in (
        None,
        _read_index(root)["metadata"]["total_size"],
    ):
        raise PackageFormatError(
            f"{root / WEIGHTS_INDEX} gives a total_size other than the {total} bytes its shards hold; the package "
            "is damaged — rebuild it",
            path=WEIGHTS_INDEX,
        )
    _check_tensors(root, manifest, header)


def _total_bytes(tensors) -> int | None:
    """The bytes of tensor data of ``(shape, dtype code)`` pairs; None where a code has no whole bytes per element
    here (packed 4-bit types...), which leaves ``total_size`` unchecked."""
    total = 0
    for shape, dtype in tensors:
        if dtype not in _ITEMSIZE:
            return None
        count = _ITEMSIZE[dtype]
        for size in shape:
            count *= size
        total += count
    return total


def _check_tensors(root: Path, manifest: dict, header: dict[str, tuple[list[int], str]]) -> None:
    """The stored tensors, aliases added, are exactly the manifest's less those a backend owns, each with the
    manifest's shape and dtype."""
    if manifest["model"]["weights"] is None:
        return
    relative = manifest["model"]["weights"]
    for alias, name in manifest["model"]["aliases"].items():
        if name not in header:
            raise PackageFormatError(
                f"alias {alias!r} in {root / 'xpupack.json'} names {name!r}, which {relative} does "
                "not hold; the package is damaged — rebuild it",
                path=relative,
            )
        header[alias] = header[name]
    expected: dict[str, Any] = manifest["model"]["tensors"]
    for name, (shape, dtype) in header.items():
        spec = expected.get(name)
        if spec is None or list(shape) != spec["shape"] or SAFETENSORS_DTYPES.get(dtype) != spec["dtype"]:
            raise PackageFormatError(
                f"{root / relative}: tensor {name!r} does not match the manifest; rebuild the package", path=relative
            )
    owned = {
        f"{m['path']}.{name}" if m["path"] else name for m in manifest["modules"] for name in m.get("owned_tensors", [])
    }
    missing = sorted(set(expected) - owned - set(header))
    if missing or set(header) - (set(expected) - owned):
        raise IntegrityError(
            f"{root / relative} lacks {missing[:5]} or holds tensors a backend owns; rebuild the package",
            path=relative,
        )
