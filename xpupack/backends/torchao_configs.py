"""TorchAO configs as a package names them: the config names, the allow-listed reading of a stored
config, and the torchao requirement (the backend itself is `xpupack.backends.torchao`).

A package's JSON may name only the config classes in `CONFIG_CLASSES` and the
parts in `_CONFIG_PARTS`; `check_types` refuses anything else before torchao
builds an object from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import BackendUnavailableError, UnknownConfigError
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
_CONFIG_PARTS = frozenset({
    "torch.dtype", "PerRow", "PerTensor", "PerAxis", "PerGroup", "MappingType", "KernelPreference",
    "Float8MMConfig", "Float8PackingFormat", "Int4PackingFormat", "Int4ChooseQParamsAlgorithm",
    "IntxPackingFormat", "IntxChooseQParamsAlgorithm",
})
#: the torchao modules that define `CONFIG_CLASSES` and `_CONFIG_PARTS`, searched in this order
_CONFIG_MODULES = ("torchao.quantization", "torchao.quantization.quantize_.workflows",
                   "torchao.quantization.quantize_.common")
@dataclass(frozen=True)
class NamedConfig:
    """A config by name: how to make it, and where it can run."""

    config_class: str
    make: Callable[[], Any]
    devices: str
    #: why it cannot run on a device, or None where it can
    unsupported: Callable[[torch.device], str | None]

    @property
    def min_sqnr_db(self) -> float:
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

    return Int4WeightOnlyConfig(group_size=128, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
                                set_inductor_config=False)


def _float8_weight_only():
    from torchao.quantization import Float8WeightOnlyConfig

    return Float8WeightOnlyConfig(set_inductor_config=False)


# ``set_inductor_config=False`` everywhere: torchao's setting changes the whole
# process's Inductor options at quantize time, which a loader (that never
# quantizes) would not reproduce.
NAMED_CONFIGS: dict[str, NamedConfig] = {
    "int8-weight-only": NamedConfig("Int8WeightOnlyConfig", _int8_weight_only, "cpu, cuda", _anywhere),
    "int8-dynamic": NamedConfig("Int8DynamicActivationInt8WeightConfig", _int8_dynamic, "cpu, cuda", _anywhere),
    "int4-weight-only": NamedConfig("Int4WeightOnlyConfig", _int4_weight_only, "cuda (bfloat16 models)",
                                    _cuda_only),
    "float8-weight-only": NamedConfig("Float8WeightOnlyConfig", _float8_weight_only,
                                      "cpu, cuda (compute capability 8.9+)", _float8_device),
}


def torchao_missing() -> str | None:
    """Why torchao cannot be used here, or None when it can."""
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as exc:
        return f"torchao is not installed ({exc}); {_INSTALL}"
    return None


def require_torchao() -> None:
    missing = torchao_missing()
    if missing:
        raise BackendUnavailableError(missing)


def check_types(tree: Any, allowed: frozenset[str] | set[str], where: str) -> None:
    """Raises `UnknownConfigError` if a ``_type`` anywhere in the JSON ``tree`` is not in ``allowed``.

    This runs before torchao turns JSON into objects, so a package can only
    name the classes xpupack knows (and ``torch.dtype`` only a dtype).
    """
    if isinstance(tree, dict):
        kind = tree.get("_type")
        if kind is not None:
            if kind not in allowed:
                raise UnknownConfigError(
                    f"{where} names the type {kind!r}, which xpupack does not load; known: "
                    f"{', '.join(sorted(allowed))} — upgrade xpupack if a newer one built the package")
            if kind == "torch.dtype":
                try:
                    dtype_from_name(str(tree.get("_data")))
                except ValueError:
                    raise UnknownConfigError(f"{where} names {tree.get('_data')!r}, which is not a torch dtype") from None
        for value in tree.values():
            check_types(value, allowed, where)
    elif isinstance(tree, list):
        for value in tree:
            check_types(value, allowed, where)


def config_from_json(data: Any, where: str = "the torchao config") -> Any:
    """The ``AOBaseConfig`` of a ``config_to_dict`` dict, resolving only `CONFIG_CLASSES`."""
    if not isinstance(data, dict) or data.get("_type") not in CONFIG_CLASSES:
        kind = data.get("_type") if isinstance(data, dict) else type(data).__name__
        raise UnknownConfigError(f"{where} names the config class {kind!r}, which xpupack does not load; "
                                 f"known: {', '.join(sorted(CONFIG_CLASSES))}")
    check_types(data.get("_data"), _CONFIG_PARTS, where)
    require_torchao()
    import torchao.core.config as torchao_config

    # torchao tries every module of its own allow-list, a set in no fixed order,
    # until one has the class; some (torchao.prototype.parq) import transformers,
    # seconds of a load. The classes xpupack accepts all live in these three.
    # torchao has no argument for that, so its process-wide list is narrowed for the
    # call; the lock keeps two of xpupack's own loads from interleaving there (one
    # would put back the other's narrowed list). A thread calling torchao's
    # config_from_dict directly meanwhile still sees the narrowed list.
    with _NARROWING:
        allowed = torchao_config.ALLOWED_AO_MODULES
        torchao_config.ALLOWED_AO_MODULES = _CONFIG_MODULES
        try:
            return torchao_config.config_from_dict(data)
        finally:
            torchao_config.ALLOWED_AO_MODULES = allowed


_NARROWING = threading.Lock()


def config_to_json(config: Any) -> dict:
    from torchao.core.config import config_to_dict

    return config_to_dict(config)
