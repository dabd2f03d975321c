"""TorchAO configs as a package names them: the config names, the allow-listed reading of a stored
config, and the torchao requirement (the backend itself is `xpupack.backends.torchao`).

A package stores a config in the JSON form of ``torchao.core.config.config_to_dict``.
It may name only the config classes in `CONFIG_CLASSES` and the parts in
`_CONFIG_PARTS`; `config_from_json` refuses anything else and builds the
objects itself, so no torchao global is read or changed.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BackendUnavailableError, UnknownConfigError
from ..manifest import check_depth
from ..signature import dtype_from_name

_INSTALL = "pip install 'xpupack[torchao]'"

#: AOBaseConfig classes a package may name, with the SQNR (dB) their outputs must reach against eager
CONFIG_CLASSES: dict[str, float] = {
    "Int8WeightOnlyConfig": 30.0,
    "Int8DynamicActivationInt8WeightConfig": 25.0,
    "Float8WeightOnlyConfig": 20.0,
    "Float8DynamicActivationFloat8WeightConfig": 20.0,
    "Int4WeightOnlyConfig": 15.0,
    "IntxWeightOnlyConfig": 15.0,
}
#: types that may appear inside those configs (granularities, enums, dtypes)
_CONFIG_PARTS = frozenset(
    {
        "torch.dtype",
        "PerRow",
        "PerTensor",
        "PerAxis",
        "PerGroup",
        "MappingType",
        "KernelPreference",
        "Float8MMConfig",
        "Float8PackingFormat",
        "Int4PackingFormat",
        "Int4ChooseQParamsAlgorithm",
        "IntxPackingFormat",
        "IntxChooseQParamsAlgorithm",
    }
)
#: the torchao modules that define `CONFIG_CLASSES` and `_CONFIG_PARTS`, searched in this order
_CONFIG_MODULES = (
    "torchao.quantization",
    "torchao.quantization.quantize_.workflows",
    "torchao.quantization.quantize_.common",
)


@dataclass(frozen=True)
class NamedConfig:
    """A config by name: how to make it, and where it can run.

    Args:
        config_class: the torchao config class's name (a key of `CONFIG_CLASSES`).
        make: makes the config object (imports torchao).
        devices: where it runs, in words (error messages list it).
        unsupported: why it cannot run on a device, or None where it can.
    """

    config_class: str
    make: Callable[[], Any]
    devices: str
    #: why it cannot run on a device, or None where it can
    unsupported: Callable[[torch.device], str | None]

    @property
    def min_sqnr_db(self) -> float:
        """The SQNR (dB) its outputs must reach against eager (`CONFIG_CLASSES`)."""
        return CONFIG_CLASSES[self.config_class]


def _cuda_only(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"needs CUDA (torchao's tinygemm int4 kernels), not {device.type}"


def _float8_device(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"needs CUDA compute capability 8.9 or newer, {torch.cuda.get_device_name(device)} has {major}.{minor}"
    return None


def _anywhere(device: torch.device) -> str | None:
    return None


def _int8_weight_only():
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig(set_inductor_config=False)


def _int8_dynamic():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)


def _int4_weight_only():
    from torchao.quantization import Int4WeightOnlyConfig
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    return Int4WeightOnlyConfig(
        group_size=128, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D, set_inductor_config=False
    )


def _float8_weight_only():
    from torchao.quantization import Float8WeightOnlyConfig

    return Float8WeightOnlyConfig(set_inductor_config=False)


# ``set_inductor_config=False`` everywhere: torchao's setting changes the whole
# process's Inductor options at quantize time, which a loader (that never
# quantizes) would not reproduce.
NAMED_CONFIGS: dict[str, NamedConfig] = {
    "int8-weight-only": NamedConfig("Int8WeightOnlyConfig", _int8_weight_only, "cpu, cuda", _anywhere),
    "int8-dynamic": NamedConfig("Int8DynamicActivationInt8WeightConfig", _int8_dynamic, "cpu, cuda", _anywhere),
    "int4-weight-only": NamedConfig("Int4WeightOnlyConfig", _int4_weight_only, "cuda (bfloat16 models)", _cuda_only),
    "float8-weight-only": NamedConfig(
        "Float8WeightOnlyConfig", _float8_weight_only, "cpu, cuda (compute capability 8.9+)", _float8_device
    ),
}


def torchao_missing() -> str | None:
    """Why torchao cannot be used here, or None when it can."""
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as exc:
        return f"torchao is not installed ({exc}); {_INSTALL}"
    return None


def require_torchao() -> None:
    """Raises unless torchao can be imported.

    Raises:
        BackendUnavailableError: torchao is not installed; the message says how to install it.
    """
    missing = torchao_missing()
    if missing:
        raise BackendUnavailableError(missing)


def check_types(tree: Any, allowed: frozenset[str] | set[str], where: str) -> None:
    """Raises `UnknownConfigError` if a ``_type`` anywhere in the JSON ``tree`` is not in ``allowed``.

    This runs before torchao turns JSON into objects, so a package can only
    name the classes xpupack knows (and ``torch.dtype`` only a dtype).

    Args:
        tree: JSON as read from a package.
        allowed: the type names that may appear.
        where: names the config in the message.

    Raises:
        UnknownConfigError: a type not in ``allowed``, or a ``torch.dtype`` that names no dtype.
    """
    if isinstance(tree, dict):
        if "_type" in tree:  # typed as `_build` and torchao's decoder see it, whatever the value
            kind = tree["_type"]
            if not isinstance(kind, str) or kind not in allowed:
                raise UnknownConfigError(
                    f"{where} names the type {kind!r}, which xpupack does not load; known: "
                    f"{', '.join(sorted(allowed))} — upgrade xpupack if a newer one built the package"
                )
            if kind == "torch.dtype":
                try:
                    dtype_from_name(str(tree.get("_data")))
                except ValueError:
                    raise UnknownConfigError(
                        f"{where} names {tree.get('_data')!r}, which is not a torch dtype"
                    ) from None
        for value in tree.values():
            check_types(value, allowed, where)
    elif isinstance(tree, list):
        for value in tree:
            check_types(value, allowed, where)


def config_from_json(data: Any, where: str = "the torchao config") -> Any:
    """The ``AOBaseConfig`` that ``config_to_dict`` wrote as ``data``, built by xpupack itself.

    Only `CONFIG_CLASSES` at the top and `_CONFIG_PARTS` inside are built, each
    from the fields its class declares and nothing else. torchao's generic
    ``config_from_dict`` is not used: it resolves any class of any module on its
    process-wide allow-list (some of which import transformers, seconds of a
    load), and narrowing that list for a call would change it for every thread.

    Args:
        data: the config as ``config_to_dict`` wrote it.
        where: names the config in messages.

    Returns:
        The torchao config object.

    Raises:
        UnknownConfigError: a class, field or enum member xpupack does not load,
            or values the config class refuses.
        BackendUnavailableError: torchao is not installed.
    """
    kind = data.get("_type") if isinstance(data, dict) else type(data).__name__
    if not isinstance(data, dict) or not isinstance(kind, str) or kind not in CONFIG_CLASSES:
        raise UnknownConfigError(
            f"{where} names the config class {kind!r}, which xpupack does not load; "
            f"known: {', '.join(sorted(CONFIG_CLASSES))}"
        )
    check_depth(data, where)
    check_types(data.get("_data"), _CONFIG_PARTS, where)
    require_torchao()
    return _build(data, where)


def _build(node: Any, where: str) -> Any:
    """The value of one JSON node that `check_types` accepted: a typed node becomes its object."""
    if isinstance(node, list):
        return [_build(value, where) for value in node]
    if not isinstance(node, dict):
        return node
    if "_type" not in node:
        return {key: _build(value, where) for key, value in node.items()}
    kind, data = node["_type"], node.get("_data")
    if kind == "torch.dtype":
        return dtype_from_name(data)
    cls = _torchao_class(kind, where)
    if issubclass(cls, enum.Enum):
        if not isinstance(data, str) or data not in cls.__members__:
            raise UnknownConfigError(
                f"{where} names {kind}.{data}, which this torchao does not have; known: "
                f"{', '.join(cls.__members__)} — rebuild the package with this torchao"
            )
        return cls[data]
    fields = _fields(cls)
    if not isinstance(data, dict) or set(data) - fields:
        extra = sorted(set(data) - fields) if isinstance(data, dict) else data
        raise UnknownConfigError(
            f"{where} gives {kind} {extra!r}, which are not fields of it in this torchao "
            f"(fields: {', '.join(sorted(fields))}) — rebuild the package with this torchao"
        )
    values = {name: _build(value, where) for name, value in data.items()}
    stored = node.get("_version")
    if "_version" in node and type(stored) is not int:
        raise UnknownConfigError(
            f"{where} gives {kind} the version {stored!r}, which is not a version number; "
            "the package is damaged — rebuild it"
        )
    if stored is not None and stored != getattr(cls, "version", stored) and "version" in _fields(cls, all_fields=True):
        values["version"] = stored  # an older layout of the class: torchao reads it as that version
    try:
        return cls(**values)
    except (TypeError, ValueError, AssertionError) as exc:
        raise UnknownConfigError(
            f"{where}: this torchao refuses the {kind} the package names "
            f"({type(exc).__name__}: {exc}) — rebuild the package with this torchao"
        ) from None


def _torchao_class(name: str, where: str) -> type:
    """The torchao class of an allow-listed name, from the modules that define those classes."""
    import importlib

    for module in _CONFIG_MODULES:
        cls = getattr(importlib.import_module(module), name, None)
        if isinstance(cls, type):
            return cls
    raise UnknownConfigError(
        f"{where} names {name!r}, which this torchao does not define — rebuild the package "
        "with this torchao, or install the torchao that built it"
    )


def _fields(cls: type, *, all_fields: bool = False) -> set[str]:
    """The constructor fields ``config_to_dict`` writes for ``cls`` (a dataclass or a NamedTuple); it writes
    ``version`` apart, as ``_version`` (``all_fields`` includes it)."""
    if dataclasses.is_dataclass(cls):
        names = {field.name for field in dataclasses.fields(cls) if field.init}
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        names = set(cls._fields)
    else:
        names = set()
    return names if all_fields else names - {"version"}


def config_to_json(config: Any) -> dict:
    """``config`` as ``config_to_dict`` writes it (the form `config_from_json` reads).

    Args:
        config: a torchao ``AOBaseConfig``.

    Returns:
        Its JSON form.
    """
    from torchao.core.config import config_to_dict

    return config_to_dict(config)
