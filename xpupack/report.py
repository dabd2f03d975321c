"""What `xpupack inspect` and `xpupack verify` report about a package.

`package_report` reads the package's JSON (and asks the backend registry
which modules carry compiled code); `verify_package` also checks every digest
and compares the build environment with this machine.

Neither imports torch where the question does not need it (a local package
on a CPU, whose backends `backends._facts` describes): reading JSON and
hashing files should not cost ``import torch``. Where torch is imported
already (in a process that tuned or loaded), the real backends answer. What
stays for `load`, which imports torch anyway, is parsing each signature's
tree with PyTorch's own parser: without torch, `verify` checks the specs
against their schema only.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from ._signature_text import describe_leaves
from .backends._facts import describe
from .backends._megacache import artifact_counts
from .candidate import Candidate
from .errors import PackageFormatError, XpupackError
from .limits import LoadLimits, check_limits, early_check, load_work
from .manifest import (
    CACHE,
    KERNELS,
    MANIFEST,
    artifact_file,
    check_package,
    module_slot,
    package_slots,
    read_manifest,
    read_spec,
    reading_once,
    refuse_link,
)
from .shards import weights_data
from .source import Source


def describe_signature(data: dict) -> str:
    """``(f32[1,16,64], 2.0)`` from a signature's JSON (as `Signature.describe` gives it)."""
    return describe_leaves(data["leaves"])


def _backend(name: Any, options: Any, device: Any = None) -> Any:
    """The backend a manifest names: its `BackendFacts` where those answer without torch, else the
    real backend (`backend_from_json`, which imports torch and refuses bad options with its message)."""
    if "torch" not in sys.modules:
        from .environment import CPU

        facts = describe(name, options, device if device is not None else CPU())
        if facts is not None:
            return facts
    from .backends.base import backend_from_json

    return backend_from_json(name, options)


def compiled_backends(manifest: dict) -> dict[str, str]:
    """``{module path: backend name}`` for the modules whose artifacts are compiled code
    (docs/safety.md).

    The backend registry decides (``Backend.compiled_artifacts``); a backend
    this xpupack does not know is left out here and reported by `verify_package`.
    """
    compiled = {}
    for entry in manifest["modules"]:
        try:
            backend = _backend(entry["backend"]["name"], entry["backend"]["options"])
        except (XpupackError, ValueError):
            continue
        if backend.compiled_artifacts:
            compiled[entry["path"]] = backend.name
    return compiled


def backend_label(backend: Any) -> str:
    """A manifest's backend entry and its bases as ``--backends`` spells them
    (``graph+inductor+torchao:int8-weight-only``)."""
    parts: list[str] = []
    while isinstance(backend, dict) and len(parts) < 16:
        options = backend.get("options")
        config = _config_name(options) if backend.get("name") == "torchao" else None
        parts.append(f"{backend.get('name')}" + (f":{config}" if config else ""))
        backend = options.get("base") if isinstance(options, dict) else None
    return "+".join(parts)


def quantization(backend: Any) -> str | None:
    """The TorchAO configuration a manifest's backend entry (or a base of it) stores its weights in: its
    name (``int8-weight-only``) or config class (``Int8WeightOnlyConfig``); None for weights left as they were."""
    while isinstance(backend, dict):
        options = backend.get("options")
        if backend.get("name") == "torchao":
            return _config_name(options) or "torchao"
        backend = options.get("base") if isinstance(options, dict) else None
    return None


def _config_name(options: Any) -> str | None:
    config = options.get("config") if isinstance(options, dict) else None
    if isinstance(config, dict):  # a torchao config in its config_to_dict form
        config = config.get("_type")
    return config if isinstance(config, str) else None


def plans_here(manifest: dict, source: Source, device=None, on_mismatch: str = "rebuild") -> dict[str, dict]:
    """What `xpupack.load` with ``on_mismatch`` runs for each module on ``device`` here:
    ``{path: {"runs": backend label, "use_artifacts": bool, "compiled": bool, "status": str, "compatible": bool}}``
    (`xpupack.plan`; ``compatible``: it runs as built, whatever caveats ``status`` adds).

    A module whose backend this xpupack does not know, or that cannot load here, gets only a status.
    """
    from .environment import device_here, environment
    from .plan import Context, choose, options_here

    device = device_here(device) if device is None or isinstance(device, str) else device
    context = Context(
        device, environment(device), manifest["environment"], source.trusted, source.untrusted_why, on_mismatch
    )
    plans = {}
    for entry in manifest["modules"]:
        try:
            name, options = entry["backend"]["name"], entry["backend"]["options"]
            backend = _backend(name, options, device)
            options, steps = options_here(name, options, context)
            if steps:
                backend = _backend(name, options, device)
            choice = choose(entry["path"], backend, context, owned=tuple(entry.get("owned_tensors", ())), steps=steps)
        except XpupackError as exc:
            plans[entry["path"]] = {
                "runs": None,
                "use_artifacts": False,
                "compiled": False,
                "status": f"cannot load here: {exc}",
                "compatible": False,
            }
            continue
        plans[entry["path"]] = {
            "runs": choice.backend.label,
            "use_artifacts": choice.use_artifacts,
            "compiled": choice.backend.compiled_artifacts,
            "status": choice.status,
            "compatible": choice.compatible,
        }
    return plans


def describe_options(options: Any, prefix: str = "") -> list[str]:
    """Every option of a manifest's backend entry that changes what runs, as ``key=value`` lines
    (``compile_options.coordinate_descent_tuning=True``, ``record_collectives=True``); a base backend's
    options follow, prefixed with its name (``inductor: ...``)."""
    if not isinstance(options, dict):
        return [f"{prefix}{options!r}"]
    lines = []
    for key, value in sorted(options.items()):
        if key == "base":
            continue
        if isinstance(value, dict) and value:
            lines += [f"{prefix}{key}.{name}={inner!r}" for name, inner in sorted(value.items())]
        else:
            lines.append(f"{prefix}{key}={value!r}")
    base = options.get("base")
    if isinstance(base, dict):
        lines += describe_options(base.get("options", {}), f"{prefix}{base.get('name')}: ")
    elif base is not None:
        lines.append(f"{prefix}base={base!r}")
    return lines


def _padding(spec: dict, entry: dict) -> str | None:
    """What the module's spec says about padding calls up to a recorded batch or sequence length; None for a
    backend that runs any shape itself (eager, TorchAO): it never pads."""
    try:
        if not _backend(entry["backend"]["name"], entry["backend"]["options"]).pads_calls:
            return None
    except (XpupackError, ValueError):
        pass  # a backend this xpupack does not know: the spec says what it may do
    if spec.get("padding_refused"):
        return "never padded: " + spec["padding_refused"]
    lines = []
    if batches := _padded_sizes(spec, "batch_axes"):
        lines.append("smaller batches padded up to " + batches)
    if lengths := _padded_sizes(spec, "length_axes"):
        lines.append("shorter sequences padded up to lengths " + lengths)
    elif spec.get("lengths_refused"):
        lines.append("shorter sequences not padded: " + spec["lengths_refused"])
    return "\n".join(lines) or None


def _padded_sizes(spec: dict, name: str) -> str:
    """The recorded sizes along the spec's ``batch_axes`` or ``length_axes`` (``name``) that calls are padded
    up to, as text ("" where none)."""
    sizes = {
        signature["leaves"][i]["shape"][a]
        for signature, entry in zip(spec["signatures"], spec.get(name) or [])
        if entry
        for i, a in enumerate(entry["inputs"])
        if a is not None
    }
    return ", ".join(map(str, sorted(sizes)))


def _recorded(entry: dict) -> dict | None:
    """The graph backend's recordings on the build device: their memory and what ``max_memory`` skipped
    (None for other backends, for packages saved before xpupack reported it, and for an entry of
    another shape: only `inspect` reads it, a loader records again and measures its own)."""
    recorded = entry["backend"]["config"].get("recorded") if isinstance(entry["backend"]["config"], dict) else None
    if (
        not isinstance(recorded, dict)
        or not _is_count(recorded.get("memory_bytes"))
        or not _is_count(recorded.get("max_memory", 0))
        or not all(map(_is_count, _values(recorded.get("recording_memory", {}))))
        or not all(isinstance(why, str) for why in _values(recorded.get("skipped", {})))
    ):
        return None
    return recorded


def inductor_artifacts(manifest: dict, root: Path, links_within: Path | None = None) -> dict | None:
    """What the package carries for Inductor (None: nothing), read without unpickling any of it.

    ``graphs`` and ``tuning_results`` count the mega-cache's ``inductor`` and ``autotune`` artifacts (the
    autotuned and coordinate-descent configs of Triton kernels, which a load would otherwise tune again),
    ``artifacts`` counts every type; all three are None where the mega-cache cannot be read
    (``unreadable`` says why; a symbolic link is not followed, unless into ``links_within``, the Hub
    cache). ``kernel_sources`` counts the C++ sources carried with the libraries built from them;
    ``bytes`` is everything in the backend's folder.
    """
    shared = manifest["backends"].get("inductor")
    if not isinstance(shared, dict):
        return None
    folder, config = shared["folder"], shared["config"]
    counts: dict[str, int] | None = {}
    unreadable = {}
    if CACHE in config:
        try:
            path = artifact_file(root / folder, config[CACHE])
            refuse_link(path, root, links_within)
            with path.open("rb") as cache:
                counts = artifact_counts(cache, f"{folder}/{config[CACHE]}")
        except (XpupackError, OSError) as exc:
            counts, unreadable = None, {"unreadable": str(exc)}
    kernels = config.get(KERNELS, [])
    return {
        "graphs": None if counts is None else counts.get("inductor", 0),
        "tuning_results": None if counts is None else counts.get("autotune", 0),
        "artifacts": counts,
        "kernel_sources": sum(str(name).endswith(".cpp") for name in kernels) if isinstance(kernels, list) else 0,
        "bytes": sum(f["size"] for name, f in manifest["files"].items() if name.startswith(folder + "/")),
        **unreadable,
    }


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _values(value: Any) -> list:
    """The values of a JSON object; ``[None]`` (which no check accepts) for anything else."""
    return list(value.values()) if isinstance(value, dict) else [None]


def package_report(source: Source | str | Path, device=None, on_mismatch: str = "rebuild") -> dict:
    """Modules, backends, candidates and reasons, signatures, environment, sizes and trust of a package,
    and what `xpupack.load` with ``on_mismatch`` would run for each module on ``device`` (default: the
    best here): ``runs_here`` (None: the load is refused), ``artifacts_here`` (the package's artifacts
    are used, not built here), ``on_load`` (why it differs from the package as built)."""
    _check_on_mismatch(on_mismatch)
    source = source if isinstance(source, Source) else _local(source)
    root = source.root
    refuse_link(root / MANIFEST, root, source.links_within)  # as `verify` does: no file read through a link
    manifest = read_manifest(root)
    compiled = compiled_backends(manifest)
    here = plans_here(manifest, source, device, on_mismatch)
    modules = []
    for entry in manifest["modules"]:
        refuse_link(root / entry["spec"], root, source.links_within)
        spec = read_spec(root, entry)
        prefix = entry["folder"] + "/"
        modules.append(
            {
                "path": entry["path"],
                "backend": entry["backend"]["name"],
                "label": backend_label(entry["backend"]),
                # the TorchAO configuration its weights are stored in (None: as the model had them)
                "quantization": quantization(entry["backend"]),
                "options": entry["backend"]["options"],
                "settings": describe_options(entry["backend"]["options"]),
                # as stored, each read through `Candidate` (a field an older xpupack did not write stays out)
                "candidates": [Candidate.from_json(candidate).to_json() for candidate in entry["candidates"]],
                "signatures": [describe_signature(s) for s in spec["signatures"]],
                "calls_recorded": spec["calls"],
                "unrecordable": spec["unrecordable"],
                "padding": _padding(spec, entry),
                "recorded": _recorded(entry),
                "size_bytes": sum(f["size"] for name, f in manifest["files"].items() if name.startswith(prefix)),
                "compiled_artifacts": entry["path"] in compiled,
                "device_slot": module_slot(entry),
                "runs_here": here[entry["path"]]["runs"],
                "artifacts_here": here[entry["path"]]["use_artifacts"],
                "compiled_here": here[entry["path"]]["compiled"],
                "compatible_here": here[entry["path"]]["compatible"],
                "on_load": here[entry["path"]]["status"],
            }
        )
    return {
        "package": source.description or str(root),
        "format_version": manifest["format_version"],
        "xpupack_version": manifest["xpupack_version"],
        "created": manifest["created"],
        # the mode tuning ran in, where a load's warm-up outside any mode runs (None: the package does not say)
        "samples_mode": manifest.get("samples_mode"),
        "device": manifest["device"],
        "devices": package_slots(manifest),
        "environment": manifest["environment"],
        "model": {
            "class": manifest["model"]["class"],
            "tensors": len(manifest["model"]["tensors"]),
            "weights": manifest["model"]["weights"],
            # one model.safetensors, or its shards (`xpupack.shards`): how many, and their bytes
            "weights_files": len(weights_data(manifest)),
            "weights_bytes": sum(manifest["files"][name]["size"] for name in weights_data(manifest)),
        },
        "modules": modules,
        "recording_memory_bytes": sum(m["recorded"]["memory_bytes"] for m in modules if m["recorded"]),
        "inductor_artifacts": inductor_artifacts(manifest, root, source.links_within),
        "files": {name: f["size"] for name, f in manifest["files"].items()},
        "total_bytes": sum(f["size"] for f in manifest["files"].values()),
        "trusted": source.trusted,
        "trust_reason": source.trust_reason,
    }


def verify_package(source: Source | str | Path, device: str | None = None, on_mismatch: str = "rebuild") -> dict:
    """Schema, digests, specs and compatibility with this machine, for `xpupack.load` with ``on_mismatch``;
    ``ok`` is False on any problem.

    Raises:
        DeviceUnavailableError: ``device`` is not a device of this machine (nothing was checked).
        LimitSettingError: an ``XPUPACK_MAX_*`` variable is not a positive whole number (nothing was checked).
    """
    from .environment import device_here

    _check_on_mismatch(on_mismatch)
    here_device = device_here(device)
    limits = LoadLimits.from_environment()  # a bad setting here is not the package's damage
    source = source if isinstance(source, Source) else _local(source)
    with reading_once():  # each spec read once, as `load` reads it
        return _verify(source, here_device, on_mismatch, limits)


def _verify(source: Source, here_device: Any, on_mismatch: str, limits: LoadLimits) -> dict:
    from .environment import environment

    result: dict = {"package": source.description or str(source.root), "ok": True, "problems": [], "compatibility": {}}
    try:
        manifest = check_package(
            source.root,
            links_within=source.links_within,
            ignore_unlisted=source.ignore_unlisted,
            before_schema=early_check(limits),
        )
    except XpupackError as exc:
        result["ok"] = False
        result["problems"].append(str(exc))
        return result

    result["environment_here"] = environment(here_device)
    try:
        _check_build_device(manifest, source.root)
    except XpupackError as exc:
        result["ok"] = False
        result["problems"].append(str(exc))
    try:  # what `xpupack.load` refuses before it reads a signature (with this environment's limits)
        check_limits(source.root, manifest, limits)
    except XpupackError as exc:
        result["ok"] = False
        result["problems"].append(str(exc))
    with contextlib.suppress(XpupackError):  # a spec that fails its checks: reported per module below
        result["load_work"] = load_work(source.root, manifest)
    plans = plans_here(manifest, source, here_device, on_mismatch)
    for entry in manifest["modules"]:
        path = entry["path"] or "<model>"
        try:  # what load parses before it touches a model
            _check_spec(source.root, entry)
            _backend(entry["backend"]["name"], entry["backend"]["options"], here_device)
        except XpupackError as exc:
            result["ok"] = False
            result["problems"].append(f"{path}: {exc}")
            continue
        status = plans[entry["path"]]["status"]
        settings = describe_options(entry["backend"]["options"])
        result["compatibility"][path] = {
            "backend": entry["backend"]["name"],
            "status": status,
            "compatible": plans[entry["path"]]["compatible"],
            **({"settings": settings} if settings else {}),
        }
    return result


def _check_build_device(manifest: dict, root: Path) -> None:
    """`devices.manifest_devices`'s check where torch is loaded; without torch, that the names look like devices."""
    if "torch" in sys.modules:
        from .device_slots import manifest_devices

        manifest_devices(manifest, root)
        return
    for name in package_slots(manifest):
        device_type, _, index = name.partition(":")
        if not (device_type.isidentifier() and device_type.islower() and (not index or index.isdigit())):
            raise PackageFormatError(
                f"{root / MANIFEST}: unknown device {name!r}; the package is damaged — rebuild it", path=MANIFEST
            )


def _check_spec(root: Path, entry: dict) -> None:
    """`spec.read_module_spec` (every signature parsed by PyTorch's pytree) where torch is loaded;
    without torch, the spec's schema and that it belongs to its module."""
    if "torch" in sys.modules:
        from .spec import read_module_spec

        read_module_spec(root, entry)
        return
    read_spec(root, entry)


def _check_on_mismatch(on_mismatch: str) -> None:
    from .plan import ON_MISMATCH

    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch={on_mismatch!r}; choose one of {', '.join(ON_MISMATCH)}")


def _local(path: str | Path) -> Source:
    """The package ``path`` names, by the rule `xpupack.load` applies (docs/hub.md, "Naming a package")."""
    from .hub import resolve_source

    return resolve_source(path)
