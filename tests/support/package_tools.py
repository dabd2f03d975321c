"""Helpers for tests that damage, rewrite or inspect packages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from xpupack.manifest import MANIFEST, describe_files


def snapshot(model):
    """Everything a failed load must leave unchanged."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [m.training for m in model.modules()],
        [("forward" in m.__dict__) for m in model.modules()],
        [id(p) for p in model.parameters()],
        [p.data_ptr() for p in model.parameters()],
    )


def assert_unchanged(model, before):
    after = snapshot(model)
    assert before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:] == after[1:]  # flags, activation, the same Parameter objects on the same storage


def copy_package(root: Path, destination: Path) -> Path:
    shutil.copytree(root, destination, symlinks=True)
    return destination


def listed_files(root: Path) -> list[str]:
    """Every file the manifest lists (not the manifest itself)."""
    return sorted(json.loads((root / MANIFEST).read_text())["files"])


def rewrite_manifest(root: Path, change) -> None:
    """Applies ``change(manifest)`` to the manifest (digests are not updated: use `redigest` for that)."""
    manifest = json.loads((root / MANIFEST).read_text())
    change(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


def rewrite_json(root: Path, relative: str, change) -> None:
    """Changes a JSON file of the package and updates its digest: a package consistent with itself,
    as another machine (or a hostile author) would write it."""
    path = root / relative
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    redigest(root)


def redigest(root: Path) -> None:
    """Lists every file under ``root`` with its digest, as `save` would."""
    rewrite_manifest(root, lambda manifest: manifest.update(files=describe_files(root)))
