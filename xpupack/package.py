"""`xpupack.save`: writes a package directory, atomically (docs/packages.md; the format: docs/format.md)."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _fsutil, device_slots, distributed
from ._version import __version__
from ._weights_io import write_weights
from .card import model_card
from .errors import SaveError, XpupackError
from .manifest import (
    FORMAT_VERSION,
    MANIFEST,
    MODEL_CARD,
    check_destination,
    describe_files,
    destination,
    module_folder,
    validate,
    write_json,
)
from .shards import backend_shard_size, check_weights, parse_size
from .spec import spec_to_json
from .tuned import session_of


def save(model: nn.Module, path: str | Path, *, weights: bool = True, max_shard_size: int | str = "5GB") -> Path:
    """Writes the tuned ``model`` as a package directory at ``path``.

    The package is written into a hidden sibling directory and moved into
    place only when complete, so an existing package at ``path`` stays intact
    until the new one replaces it. Recorded sample data is never written.

    A tensor-parallel model (DTensor parameters) is saved by calling this on every
    rank: each gathers the full weights, rank 0 writes them once, the others wait.

    Args:
        model: a model tuned by `xpupack.tune` (or loaded by `xpupack.load`).
        path: the package directory. An existing package there is replaced only if
            xpupack wrote it: its manifest validates and it holds no other files.
        weights: store the model's weights (``model.safetensors``). Without them,
            a loader keeps whatever weights its model holds (the package still records their
            names, shapes and dtypes, and a load checks the model against them).
        max_shard_size: the most bytes of tensors in one weights file, in bytes or as ``"5GB"``,
            ``"500MB"``, ``"2GiB"``. Weights past it are written as shards
            ``model-00001-of-0000n.safetensors`` with ``model.safetensors.index.json``, the
            Hugging Face layout (a tensor larger than it gets a shard of its own). Each shard
            comes to the host on its own, a tensor at a time: never the whole model at once.
            A backend's own tensors (TorchAO's quantized weights) are cut at the same size.

    Returns:
        The package directory.

    Raises:
        NotTunedError: the model was never tuned.
        DestinationExistsError: the destination exists and is not a package xpupack wrote (a
            directory holding anything its manifest does not list); nothing is changed.
        SaveError: writing failed; any previous package there is unchanged.
        ValueError: ``max_shard_size`` is not a positive size.

    Examples:
        >>> xpupack.save(model, "pkg/")
    """
    shard_bytes = parse_size(max_shard_size)
    session = session_of(model)
    root = destination(path)
    state = model.state_dict()
    # a tensor-parallel model: every rank gathers the full weights (a collective), rank 0 alone writes them
    full = distributed.full_state(state)
    token = backend_shard_size.set(shard_bytes)
    try:
        distributed.on_rank0(state, lambda: _save(model, session, full, root, shard_bytes if weights else 0))
    finally:
        backend_shard_size.reset(token)
    return root


def _save(model: nn.Module, session, state: dict[str, torch.Tensor], root: Path, weights: int) -> None:
    """``weights``: the largest shard in bytes, 0 for none."""
    check_destination(root)
    staging = None
    try:
        staging = _fsutil.temporary_sibling(root)
        manifest = _write_package(model, session, state, staging, weights)
        described = {path: [sig.describe() for sig in tuned.signatures] for path, tuned in session.modules.items()}
        (staging / MODEL_CARD).write_text(model_card(manifest, described), encoding="utf-8")
        write_json(staging / MANIFEST, manifest)  # written last: a staging dir without it is litter
        _fsutil.replace_dir(staging, root)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, XpupackError) or not isinstance(exc, Exception):
            raise
        raise SaveError(
            f"writing {root} failed: {type(exc).__name__}: {exc}; any previous package there is unchanged"
        ) from exc


def _write_package(model: nn.Module, session, state: dict[str, torch.Tensor], staging: Path, weights: int) -> dict:
    owned = {
        f"{path}.{name}" if path else name
        for path, tuned in session.modules.items()
        for name in tuned.runner.owned_tensors()
    }
    aliases: dict[str, str] = {}
    weights_path: str | None = None
    hashed: dict[str, dict] = {}
    if weights:
        unique, aliases = _deduplicate({k: v for k, v in state.items() if k not in owned})
        weights_path, hashed = write_weights(unique, staging, weights)

    slots = device_slots.slot_order(session.device_of(path) for path in session.modules)
    modules: list[dict] = []
    used_backends: dict[str, Any] = {}
    runners: dict[str, list] = {}
    for path, tuned in session.modules.items():
        folder = module_folder(path)
        (staging / folder).mkdir(parents=True)
        spec_file = f"{folder}/spec.json"
        spec_data = spec_to_json(path, tuned.served_spec)
        validate(spec_data, "spec", spec_file)
        write_json(staging / spec_file, spec_data)
        backend = tuned.backend
        config = backend.save(tuned.runner, staging / folder / backend.name)
        used_backends.setdefault(backend.name, backend)
        runners.setdefault(backend.name, []).append(tuned.runner)
        modules.append(
            {
                "path": path,
                "folder": folder,
                "spec": spec_file,
                "owned_tensors": sorted(tuned.runner.owned_tensors()),
                "backend": {"name": backend.name, "options": backend.options(), "config": config},
                "candidates": [candidate.to_json() for candidate in tuned.report],
                # written for split models only: a single-device package stays readable by older xpupacks
                **({"device_slot": slots.index(session.device_of(path))} if len(slots) > 1 else {}),
            }
        )

    shared = {}
    for name, backend in used_backends.items():
        folder = f"backends/{name}"
        config = backend.save_shared(staging / folder, runners[name])
        if config is not None:
            shared[name] = {"folder": folder, "config": config}

    manifest = {
        "format_version": FORMAT_VERSION,
        "xpupack_version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": session.environment,
        "device": str(slots[0] if slots else session.device),
        **({"devices": [str(device) for device in slots]} if len(slots) > 1 else {}),
        "strategy": session.strategy,
        **({"samples_mode": session.samples_mode} if session.samples_mode else {}),
        "model": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "tensors": session.architecture,
            "weights": weights_path,
            "aliases": aliases,
        },
        "modules": modules,
        "backends": shared,
        "files": describe_files(staging, known=hashed),
    }
    validate(manifest, "manifest", MANIFEST)
    try:
        check_weights(staging, manifest)  # safetensors' own parser reads back what `write_weights` wrote
    except XpupackError as exc:
        raise SaveError(f"the weights written do not read back ({exc}); nothing was saved — report this") from exc
    return manifest


def _deduplicate(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stores tensors that are views of the same memory (tied weights) once; the rest become aliases."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[Any, str] = {}
    for name, tensor in state.items():
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = tensor
    return unique, aliases
