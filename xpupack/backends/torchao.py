"""The TorchAO backend: quantized weights in the package, no re-quantization on load (README: "What it does").

At tune time `build` runs ``torchao.quantization.quantize_`` on the module:
its Linear weights become torchao tensor subclasses (``Int8Tensor``,
``Float8Tensor``...) *in place*, so the original module (the fallback) runs
the quantized weights too — that is what quantizing a model means. `save`
flattens those tensors with torchao's own safetensors support
(``torchao.prototype.safetensors``): plain tensors in
``modules/<path>/torchao/weights.safetensors`` and each tensor's type and
attributes as JSON in that file's header. They replace the fp32 weights:
``model.safetensors`` does not hold them (``owned_tensors``).

`restore` reads that file and puts the quantized tensors back into the
module, without ``quantize_`` and without pickle. Every ``_type`` named in
the header must be on `TENSOR_CLASSES` (and its parts) before torchao
reconstructs anything. Config names and the reading of a stored config live in
`xpupack.backends.torchao_configs`.

A quantized candidate is accepted by its signal-to-quantization-noise ratio
against eager (`CONFIG_CLASSES` holds each config class's minimum), not by
the elementwise tolerances of the exact backends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import _device
from .._compare import mismatch
from ..errors import BackendError, PackageFormatError, UnknownConfigError
from ..manifest import artifact_file, check_depth
from ..module_spec import ModuleSpec, Target
from ..shards import backend_shard_size, plan_shards, shard_name
from ..signature import dtype_name
from .base import Backend, Runner, register_backend
from .torchao_configs import (
    CONFIG_CLASSES,
    NAMED_CONFIGS,
    NamedConfig,
    check_types,
    config_from_json,
    config_to_json,
    require_torchao,
    torchao_missing,
)

WEIGHTS_FILE = "weights.safetensors"
#: torchao's flattening splits names at the last dot, so names in the file get a root segment
_ROOT = "module"

#: torchao tensor subclasses a package may hold (those the configs of `CONFIG_CLASSES` produce)
TENSOR_CLASSES = frozenset(
    {
        "Int8Tensor",
        "Float8Tensor",
        "Int4Tensor",
        "Int4TilePackedTo4dTensor",
        "Int4PlainInt32Tensor",
        "IntxUnpackedToInt8Tensor",
    }
)
#: types that may appear inside those tensors' attributes
_TENSOR_PARTS = frozenset(
    {
        "torch.dtype",
        "PerRow",
        "PerTensor",
        "MappingType",
        "KernelPreference",
        "Float8MMConfig",
        "QuantizeTensorToInt8Kwargs",
        "QuantizeTensorToFloat8Kwargs",
    }
)


class _Swap(NamedTuple):
    """One parameter replaced in a module: undo puts ``original`` back, redo ``replacement``."""

    name: str  # state-dict name relative to the tuned module
    module: nn.Module
    attribute: str
    original: nn.Parameter
    replacement: nn.Parameter


class TorchAORunner(Runner):
    """Runs the module's own forward over its quantized parameters; owns those parameters.

    Args:
        forward: the module's forward (it runs the quantized parameters in place).
        supported: the signatures it takes (all of them).
        swaps: each parameter the quantization replaced: its name, owner, attribute, the original and
            the replacement.
        added: instance attributes ``quantize_`` set on submodules, which `undo` removes.
        config: the torchao config as JSON (``config_to_dict``), for `TorchAOBackend.save`.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        supported: set[int],
        swaps: list[_Swap],
        added: dict[nn.Module, dict[str, Any]] | None = None,
        config: dict | None = None,
    ):
        super().__init__(supported)
        self._forward = forward
        self.swaps = swaps
        self._added = added or {}  # instance attributes quantize_ set (its extra_repr)
        self.config = config or {}

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Calls the module's forward, which runs the quantized weights. See `Runner.run`.

        Args:
            index: the signature the call fits (unused).
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            leaves: unused.

        Returns:
            The module's output.
        """
        return self._forward(*args, **kwargs)

    def owned_tensors(self) -> set[str]:
        """The quantized parameters' names: the package stores them here, not in ``model.safetensors``."""
        return {swap.name for swap in self.swaps}

    def quantized(self) -> dict[str, torch.Tensor]:
        """The quantized tensors by parameter name (relative to the module)."""
        return {swap.name: swap.replacement for swap in self.swaps}

    def undo(self) -> None:
        """Puts the original parameters back and removes what ``quantize_`` added."""
        for swap in reversed(self.swaps):
            swap.module._parameters[swap.attribute] = swap.original
        for module, attributes in self._added.items():
            for name in attributes:
                module.__dict__.pop(name, None)

    def redo(self) -> None:
        """Puts the quantized parameters (the same objects) in again."""
        for swap in self.swaps:
            swap.module._parameters[swap.attribute] = swap.replacement
        for module, attributes in self._added.items():
            module.__dict__.update(attributes)

    def describe(self) -> dict:
        """How many tensors were quantized, and their torchao types."""
        types = sorted({type(swap.replacement).__name__ for swap in self.swaps})
        return {"quantized_tensors": len(self.swaps), "tensor_types": types}


@register_backend
class TorchAOBackend(Backend):
    """Quantizes the module's Linear weights with TorchAO; the package stores the quantized weights.

    Args:
        config: a name from `NAMED_CONFIGS` (``"int8-weight-only"``, ``"int8-dynamic"``,
            ``"int4-weight-only"``, ``"float8-weight-only"``), a torchao ``AOBaseConfig``
            of one of the `CONFIG_CLASSES`, or its ``config_to_dict`` form.
        min_sqnr_db: accept the candidate only if each floating output's
            signal-to-quantization-noise ratio against eager reaches this (dB).
            Default: the config class's value in `CONFIG_CLASSES`.

    Quantizing changes the module's parameters in place: calls that fall back
    run the quantized module too. The module's original parameters are kept
    (not freed), so a rejected candidate or a failed load can put them back.

    Raises:
        UnknownConfigError: an unknown config name, or a config class xpupack cannot package.

    Examples:
        >>> xpupack.tune(model, samples, modules=["layers.*.mlp"],
        ...              strategy=xpupack.FirstWins([xpupack.TorchAOBackend("int8-weight-only")]))
    """

    name = "torchao"
    # the quantized tensors are the weights themselves, not a compiled artifact;
    # a torchao upgrade is reported (on_mismatch="error" refuses it), and a
    # torchao that cannot read them fails the restore with a reason
    depends_on = ("torchao",)
    rebuildable = False  # restore ignores use_artifacts: the package holds no other form of the weights
    # the runner is the module's own forward, exactly what a fallback would run
    supports_autograd = True
    supports_autocast = True
    transforms_module = True

    def __init__(self, config: str | Any | dict = "int8-weight-only", *, min_sqnr_db: float | None = None):
        self._named: NamedConfig | None = None
        self._instance = None
        if isinstance(config, str):
            if config not in NAMED_CONFIGS:
                known = "; ".join(f"{name} ({named.devices})" for name, named in NAMED_CONFIGS.items())
                raise UnknownConfigError(
                    f"unknown torchao config {config!r}; known names: {known} — or pass a torchao AOBaseConfig"
                )
            self._named, self.config_name = NAMED_CONFIGS[config], config
            config_class = self._named.config_class
        elif isinstance(config, dict):
            self._instance = config_from_json(config, "TorchAOBackend(config=...)")
            self.config_name = config_class = config["_type"]
        else:
            config_class = type(config).__name__
            if config_class not in CONFIG_CLASSES:
                raise UnknownConfigError(
                    f"TorchAOBackend cannot package a {config_class}; known config classes: "
                    f"{', '.join(sorted(CONFIG_CLASSES))}"
                )
            self._instance, self.config_name = config, config_class
        self._explicit_sqnr = min_sqnr_db
        self.min_sqnr_db = CONFIG_CLASSES[config_class] if min_sqnr_db is None else float(min_sqnr_db)

    @property
    def config(self) -> Any:
        """The torchao ``AOBaseConfig`` (imports torchao)."""
        require_torchao()
        return self._named.make() if self._named else self._instance

    def options(self) -> dict:
        """``config`` (its name, or its ``config_to_dict`` form) and ``min_sqnr_db`` where given."""
        if self._named is not None:
            options: dict = {"config": self.config_name}
        else:
            from torchao.core.config import config_to_dict

            options = {"config": config_to_dict(self._instance)}
        if self._explicit_sqnr is not None:
            options["min_sqnr_db"] = self._explicit_sqnr
        return options

    @property
    def label(self) -> str:
        """``torchao:<config>``, as ``--backends`` spells it."""
        return f"{self.name}:{self.config_name}"  # as --backends spells it

    def __repr__(self) -> str:
        return f"TorchAOBackend({self.config_name!r})"

    def available(self, device: torch.device) -> bool:
        """Whether torchao is installed and the named config runs on ``device`` (int4: CUDA only).

        Args:
            device: the device tuned or loaded on.

        Returns:
            True where it can run; a config object is left to its build to refuse.
        """
        return self._unavailable(device) is None

    def why_unavailable(self, device: torch.device) -> str:
        """torchao missing (with the install command), or the device the config needs.

        Args:
            device: the device tuned or loaded on.

        Returns:
            One sentence.
        """
        return self._unavailable(device) or super().why_unavailable(device)

    def _unavailable(self, device: torch.device) -> str | None:
        missing = torchao_missing()
        if missing:
            return missing
        why = self._named.unsupported(device) if self._named else None  # instances: let the build say
        return f"{self.config_name} {why}" if why else None

    def inductor_options(self, device: torch.device) -> dict[str, Any]:
        """Inductor settings for compiling the quantized module (``InductorBackend(base=...)``).

        Args:
            device: the device compiled for.

        Returns:
            ``{"pattern_matcher": False}`` for int8 weight-only on CUDA, else nothing.
        """
        # Inductor's pattern matcher turns int8 weight-only linears into aten's _weight_int8pack_mm,
        # whose CUDA kernel is slow at decode shapes: on an H200 it took 87% of a decode step (4-layer
        # Llama, bf16: 276 tok/s with the rewrite, 1349 without). Without it Inductor fuses the int8
        # cast itself. Left alone elsewhere: CPU and XPU have their own kernels for that op.
        config_class = self._named.config_class if self._named else type(self._instance).__name__
        return {"pattern_matcher": False} if config_class == "Int8WeightOnlyConfig" and device.type == "cuda" else {}

    def compare(self, actual: Any, expected: Any) -> str | None:
        """Signal-to-quantization-noise ratio of each floating output against eager, at least ``min_sqnr_db``.

        Args:
            actual: the quantized module's output.
            expected: eager's output.

        Returns:
            A short reason naming the config, or None when ``actual`` is acceptable.
        """
        problem = mismatch(actual, expected, self.tolerances(), min_sqnr_db=self.min_sqnr_db)
        return problem and f"{problem} for {self.config_name} (min_sqnr_db={self.min_sqnr_db:g})"

    # -- tune time -----------------------------------------------------------------
    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        """Quantizes the module in place with ``torchao.quantization.quantize_``. See `Backend.build`.

        Args:
            target: the module.
            spec: its recorded signatures (all are supported).
            device: the device the module is on.

        Returns:
            A `TorchAORunner`; `Runner.undo` puts the original parameters back.

        Raises:
            BackendUnavailableError: torchao is not installed.
            BackendError: the config replaced submodules, quantized nothing, or made tensors xpupack
                cannot store; the module is left as it was.
        """
        require_torchao()
        from torchao.quantization import quantize_

        config = self.config
        module = target.module
        parameters = _parameter_table(module)
        children = {(parent, name): child for parent in module.modules() for name, child in parent._modules.items()}
        attributes = {m: set(m.__dict__) for m in module.modules()}
        try:
            quantize_(module, config)
            swaps = [
                _Swap(name, owner, attribute, original, owner._parameters[attribute])
                for name, (owner, attribute, original) in parameters.items()
                if owner._parameters.get(attribute) is not original
            ]
            added = {
                m: {k: m.__dict__[k] for k in set(m.__dict__) - known}
                for m, known in attributes.items()
                if set(m.__dict__) - known
            }
            runner = TorchAORunner(
                target.forward, set(range(len(spec.signatures))), swaps, added, config_to_json(config)
            )
            _check_quantized(runner, module, children)
        except BaseException:
            for (parent, name), child in children.items():
                parent._modules[name] = child
            for owner, attribute, original in parameters.values():
                owner._parameters[attribute] = original
            for m, known in attributes.items():
                for extra in set(m.__dict__) - known:
                    del m.__dict__[extra]
            raise
        return runner

    def save(self, runner: Runner, folder: Path) -> dict:
        """Writes the quantized tensors to ``weights.safetensors`` (torchao's flattening, no pickle), or past
        `xpupack.save`'s ``max_shard_size`` to shards ``weights-0000k-of-0000n.safetensors``, each a
        safetensors file of its own tensors and header (a tensor larger than the size gets a shard of its own).

        Args:
            runner: the `TorchAORunner`.
            folder: ``modules/<path>/torchao/``.

        Returns:
            The config as JSON, the weights file (a list of them past one shard), and each tensor's type,
            shape and dtype.
        """
        from safetensors.torch import save_file

        assert isinstance(runner, TorchAORunner)
        quantized = runner.quantized()
        sizes = {name: sum(part.nbytes for part in _flattened({name: t})[0].values()) for name, t in quantized.items()}
        groups = plan_shards(sizes, backend_shard_size.get())
        files = (
            [WEIGHTS_FILE]
            if len(groups) == 1
            else [shard_name(k, len(groups), stem="weights") for k in range(1, len(groups) + 1)]
        )
        folder.mkdir(parents=True, exist_ok=True)
        for file, names in zip(files, groups, strict=True):
            data, metadata = _flattened({name: quantized[name] for name in names})
            save_file(
                {key: _device.host_bytes_copy(value.detach()) for key, value in data.items()},
                str(folder / file),
                metadata=metadata,
            )
        return {
            "config": runner.config,
            "weights": files[0] if len(files) == 1 else files,
            "tensors": {
                name: {"type": type(t).__name__, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                for name, t in sorted(quantized.items())
            },
        }

    # -- load time -----------------------------------------------------------------
    def restore(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, *, use_artifacts: bool
    ) -> Runner:
        """Puts the stored quantized tensors into the module; never calls ``quantize_``.

        Args:
            target: the module.
            spec: its signatures (all are supported).
            config: what `save` returned.
            folder: where `save` wrote.
            device: the device the tensors are loaded onto.
            use_artifacts: does not apply: the stored tensors are the weights, and the package holds
                no other form of them to rebuild from.

        Returns:
            A `TorchAORunner`, the quantized tensors in the module.

        Raises:
            BackendUnavailableError: torchao is not installed.
            PackageFormatError: the file does not hold what the config lists, or a tensor does not fit
                the module's parameter.
            UnknownConfigError: the config or a tensor names a type xpupack does not load.
        """
        require_torchao()
        files = [artifact_file(folder, name) for name in weights_files(config)]
        where = str(files[0])
        if "config" in config:
            config_from_json(config["config"], f"{folder} (torchao config)")
        expected = config.get("tensors")
        if not isinstance(expected, dict) or not expected:
            raise PackageFormatError(
                f"the torchao config of {folder} lists no tensors; rebuild the package", path=where
            )
        tensors: dict[str, torch.Tensor] = {}
        for weights in files:
            part = read_quantized(weights, device)
            if set(part) & set(tensors):
                raise PackageFormatError(
                    f"{weights} holds {sorted(set(part) & set(tensors))} again, which another shard holds; "
                    "rebuild the package",
                    path=str(weights),
                )
            tensors.update(part)
        where = str(files[0].parent / "weights*.safetensors") if len(files) > 1 else str(files[0])
        if set(tensors) != set(expected):
            raise PackageFormatError(
                f"{where} holds {sorted(tensors)}, the manifest lists {sorted(expected)}; rebuild the package",
                path=where,
            )
        parameters = _parameter_table(target.module)
        swaps = []
        for name, tensor in sorted(tensors.items()):
            facts = {"type": type(tensor).__name__, "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)}
            if name not in parameters or facts != expected[name]:
                raise PackageFormatError(
                    f"{where}: {name} is {facts}, the manifest says {expected[name]} "
                    f"(module parameter present: {name in parameters}); rebuild the package",
                    path=where,
                )
            owner, attribute, original = parameters[name]
            if list(original.shape) != facts["shape"] or dtype_name(original.dtype) != facts["dtype"]:
                raise PackageFormatError(
                    f"{where}: {name} is {facts['dtype']}{facts['shape']}, the module's "
                    f"is {dtype_name(original.dtype)}{list(original.shape)}",
                    path=where,
                )
            swaps.append(_Swap(name, owner, attribute, original, nn.Parameter(tensor, requires_grad=False)))
        runner = TorchAORunner(target.forward, set(range(len(spec.signatures))), swaps, config=config.get("config"))
        runner.redo()
        return runner


def weights_files(config: dict) -> list[str]:
    """The weights files a stored config names, in order: one name, or a list of shards.

    Raises:
        PackageFormatError: ``weights`` is neither a file name nor a non-empty list of them.
    """
    named = config.get("weights", WEIGHTS_FILE)
    files = [named] if isinstance(named, str) else named
    if not isinstance(files, list) or not files or not all(isinstance(name, str) for name in files):
        raise PackageFormatError(
            f"the torchao config names its weights as {str(named)[:80]}, not a file or a list of files; "
            "rebuild the package",
            path="weights",
        )
    return files


def _flattened(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """torchao's flattening of ``tensors`` (names relative to the module) to plain tensors and a header."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    return flatten_tensor_state_dict({f"{_ROOT}.{name}": t for name, t in tensors.items()})


def read_quantized(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The torchao tensors of a ``weights.safetensors``, by name relative to the module; no pickle.

    The header's JSON is checked against `TENSOR_CLASSES` before torchao's
    ``unflatten_tensor_state_dict`` builds anything from it.

    Args:
        path: the ``weights.safetensors`` file.
        device: where the tensors go.

    Returns:
        Parameter name (relative to the module) -> torchao tensor.

    Raises:
        PackageFormatError: the file is not a safetensors file xpupack wrote.
        UnknownConfigError: its header names a type off the allow-list.
    """
    from safetensors import SafetensorError, safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            metadata = handle.metadata() or {}
            data = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    except (SafetensorError, OSError, ValueError) as exc:
        raise PackageFormatError(
            f"{path} is not a readable safetensors file ({exc}); rebuild the package", path=str(path)
        ) from None
    where = f"{path}: the torchao header"
    try:
        names = json.loads(metadata.get("tensor_names", "null"))
        check_depth(names, where)
        if not isinstance(names, list) or not names:
            raise ValueError("no tensor_names")
        for name in names:
            entry = json.loads(metadata[name])
            check_depth(entry, f"{where} ({name})")
            if not isinstance(entry, dict) or entry.get("_type") not in TENSOR_CLASSES:
                kind = entry.get("_type") if isinstance(entry, dict) else entry
                raise UnknownConfigError(
                    f"{path} holds {name!r} as {kind!r}, which xpupack does not load; "
                    f"known tensor classes: {', '.join(sorted(TENSOR_CLASSES))}"
                )
            check_types(entry.get("_data"), _TENSOR_PARTS, f"{path} ({name})")
        tensors, leftover = unflatten_tensor_state_dict(data, metadata)
    except (UnknownConfigError, PackageFormatError):
        raise
    except RecursionError:
        raise PackageFormatError(f"{where} is nested too deep to parse; rebuild the package", path=str(path)) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PackageFormatError(
            f"{path}: the torchao header cannot be read ({type(exc).__name__}: {exc}); rebuild the package",
            path=str(path),
        ) from None
    if leftover or set(tensors) != set(names):
        raise PackageFormatError(
            f"{path}: tensors {sorted(set(names) - set(tensors)) or sorted(leftover)} "
            "do not match its header; rebuild the package",
            path=str(path),
        )
    prefix = _ROOT + "."
    return {name.removeprefix(prefix): tensor for name, tensor in tensors.items()}


def _parameter_table(module: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Parameter]]:
    """State-dict name (relative to ``module``) -> ``(owning module, attribute, parameter)``."""
    table: dict[str, tuple[nn.Module, str, nn.Parameter]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attribute, parameter in owner._parameters.items():
            if parameter is not None:
                table.setdefault(f"{prefix}.{attribute}" if prefix else attribute, (owner, attribute, parameter))
    return table


def _check_quantized(runner: TorchAORunner, module: nn.Module, children: dict) -> None:
    """Refuses what the package format cannot hold: swapped modules, unknown tensor types, nothing quantized."""
    swapped = [name for (parent, name), child in children.items() if parent._modules.get(name) is not child]
    if swapped:
        raise BackendError(
            f"the config replaced submodules ({', '.join(swapped[:3])}); xpupack packages only "
            "configs that quantize weights in place (tensor subclasses)"
        )
    if not runner.swaps:
        raise BackendError(
            "the config quantized no weight of this module (no nn.Linear, or shapes the config cannot take)"
        )
    unknown = {type(swap.replacement).__name__ for swap in runner.swaps} - TENSOR_CLASSES
    if unknown:
        raise BackendError(
            f"the config produced {', '.join(sorted(unknown))}, which xpupack cannot store; "
            f"known tensor classes: {', '.join(sorted(TENSOR_CLASSES))}"
        )
