"""Many ranks, one package: two gloo ranks under torchrun load one package at the same moment, from a
local directory and from the loopback Hub into one shared Hugging Face cache (docs/multi-gpu.md)."""

from __future__ import annotations

import pytest

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import copy_package, listed_files
from support.torchrun import run_ranks
from xpupack.manifest import read_manifest, sha256_of

pytestmark = pytest.mark.slow  # fresh processes

RESULT = {"seeds": [0], "fallbacks": 0, "devices": ["cpu"]}


def _package(tmp_path, backend, name="pkg"):
    model = xpupack.tune(make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(backend))
    return xpupack.save(model, tmp_path / name)


@pytest.mark.parametrize("kind", ["eager", "graph", "inductor"])
def test_two_ranks_load_one_local_package_at_once(kind, tmp_path, request):
    if kind == "graph":
        request.getfixturevalue("emulated_graphs")
        root = _package(tmp_path, xpupack.GraphBackend())
    elif kind == "inductor":  # both put its compiled artifacts into one empty Inductor cache and compile at once
        root = copy_package(request.getfixturevalue("inductor_package")[1], tmp_path / "pkg")
    else:
        root = _package(tmp_path, xpupack.EagerBackend())
    before = {relative: sha256_of(root / relative) for relative in listed_files(root)}
    flags = ["--emulated-graphs"] if kind == "graph" else []
    results = run_ranks(
        "rank_loader.py",
        root,
        *flags,
        out=tmp_path / "out",
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "shared-inductor-cache")},
    )
    assert results == [{**RESULT, "backends": [kind]}] * 2
    assert {relative: sha256_of(root / relative) for relative in listed_files(root)} == before  # untouched


@pytest.mark.parametrize("pinned", [False, True])
def test_two_ranks_download_one_hub_revision_once(pinned, hub, tmp_path):
    """Both ranks ask the loopback Hub for the same revision into one empty shared cache: each file is
    downloaded once, and both get the package."""
    root = _package(tmp_path, xpupack.EagerBackend())
    commit = hub.publish(root, "xpupack-tests/ranks")
    before = len(hub.requests())
    revision = ["--revision", commit] if pinned else []
    results = run_ranks(
        "rank_loader.py",
        "xpupack-tests/ranks",
        *revision,
        out=tmp_path / "out",
        env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "shared-hf-home")},
    )
    assert results == [{**RESULT, "backends": ["eager"]}] * 2
    downloads = [
        r.split("/resolve/", 1)[1].split("/", 1)[1]
        for r in hub.requests()[before:]
        if r.startswith("GET") and "/resolve/" in r
    ]
    assert sorted(downloads) == sorted(["xpupack.json", *read_manifest(root)["files"]])
