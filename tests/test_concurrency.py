"""Several processes loading one package at once (local, Hub cache, over HTTP), and loading while saving."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import copy_package, listed_files
from xpupack.errors import IntegrityError
from xpupack.manifest import check_files, read_manifest, sha256_of

pytestmark = pytest.mark.slow  # fresh processes
TESTS = os.path.dirname(__file__)


def _start(args, env=None):
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    loader = os.path.join(TESTS, "support", "concurrent_loader.py")
    process = subprocess.Popen(
        [sys.executable, loader, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    ready = process.stdout.readline()
    assert ready.strip() == "ready", (ready, process.stderr.read() if process.poll() is not None else "")
    return process


def load_at_once(*argument_lists, env=None):
    """Starts one loader per argument list, lets them all go at the same moment, returns their results."""
    processes = [_start(args, env) for args in argument_lists]
    for process in processes:  # every loader is ready: release them together
        process.stdin.write("go\n")
        process.stdin.flush()
    results = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _tuned_package(tmp_path, strategy, seed=0, name="pkg"):
    model = xpupack.tune(make_stack(seed=seed), stack_samples(), modules=["layers.*.mlp"], strategy=strategy)
    return xpupack.save(model, tmp_path / name)


@pytest.mark.parametrize("kind", ["eager", "graph"])
def test_two_processes_load_one_package_at_once(kind, tmp_path, request):
    if kind == "graph":
        request.getfixturevalue("emulated_graphs")
    strategy = xpupack.Only(xpupack.GraphBackend() if kind == "graph" else xpupack.EagerBackend())
    root = _tuned_package(tmp_path, strategy)
    before = {relative: sha256_of(root / relative) for relative in listed_files(root)}
    flags = ["--emulated-graphs"] if kind == "graph" else []
    results = load_at_once([root, *flags], [root, *flags])
    assert results == [[{"seeds": [0], "backends": [kind], "fallbacks": 0}]] * 2
    assert {relative: sha256_of(root / relative) for relative in listed_files(root)} == before  # untouched


def test_two_processes_load_one_inductor_package_into_one_fresh_cache(inductor_package, tmp_path):
    """Both put the package's compiled artifacts into the same empty Inductor cache and compile at once."""
    root = copy_package(inductor_package[1], tmp_path / "pkg")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "shared-inductor-cache")}
    results = load_at_once([root], [root], env=env)
    assert results == [[{"seeds": [0], "backends": ["inductor"], "fallbacks": 0}]] * 2


def hub_cache_layout(package, cache):
    """The package laid out as huggingface_hub caches a revision: snapshot files link into blobs/."""
    repo = cache / "models--org--name"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    for path in sorted(package.rglob("*")):
        if path.is_file():
            blob = repo / "blobs" / sha256_of(path)
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, blob)
            link = snapshot / path.relative_to(package)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo, snapshot


def test_a_hub_cache_snapshot_passes_its_checks_and_nothing_else_does(tmp_path):
    package = _tuned_package(tmp_path, xpupack.Only(xpupack.EagerBackend()))
    repo, snapshot = hub_cache_layout(package, tmp_path / "hub")
    check_files(snapshot, read_manifest(snapshot), links_within=repo)
    with pytest.raises(IntegrityError, match="symbolic link"):  # without the cache rule: links refused
        check_files(snapshot, read_manifest(snapshot))
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(package / "model.safetensors", outside)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(outside)  # same bytes, but outside the cache
    with pytest.raises(IntegrityError, match="symbolic link"):
        check_files(snapshot, read_manifest(snapshot), links_within=repo)
    (snapshot / "model.safetensors").unlink()
    spec_blob = (snapshot / "modules/layers.0.mlp/spec.json").resolve()
    (snapshot / "model.safetensors").symlink_to(spec_blob)  # inside the cache, but another file
    with pytest.raises(IntegrityError, match="model.safetensors"):
        check_files(snapshot, read_manifest(snapshot), links_within=repo)


def test_two_processes_load_one_hub_revision_at_once(tmp_path):
    package = _tuned_package(tmp_path, xpupack.Only(xpupack.EagerBackend()))
    repo, snapshot = hub_cache_layout(package, tmp_path / "hub")
    results = load_at_once([snapshot, "--hub-cache", repo], [snapshot, "--hub-cache", repo])
    assert results == [[{"seeds": [0], "backends": ["eager"], "fallbacks": 0}]] * 2


@pytest.mark.parametrize("pinned", [False, True])
def test_two_processes_load_one_hub_revision_over_http_at_once(pinned, hub, tmp_path):
    """Both download the same revision (a branch, or a commit hash) into one empty Hugging Face cache at the
    same moment, from a Hub-compatible server (olah on loopback)."""
    root = _tuned_package(tmp_path, xpupack.Only(xpupack.EagerBackend()))
    commit = hub.publish(root, "xpupack-tests/concurrent")
    revision = ["--revision", commit] if pinned else []
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "shared-hf-home")}
    results = load_at_once(["xpupack-tests/concurrent", *revision], ["xpupack-tests/concurrent", *revision], env=env)
    assert results == [[{"seeds": [0], "backends": ["eager"], "fallbacks": 0}]] * 2


def test_loading_while_another_process_saves_gives_one_package_or_a_clean_error(tmp_path):
    """Not a documented promise, but what happens: a load racing a save of the same path gets one of the
    two complete packages (or an XpupackError to retry), never another model's answers."""
    root = _tuned_package(tmp_path, xpupack.Only(xpupack.EagerBackend()), seed=0)
    loader = _start([root, "--repeat", 40])
    saver_code = (
        f"import xpupack; from support.models import make_stack, stack_samples\n"
        f"models = [xpupack.tune(make_stack(seed=s), stack_samples(), modules=['layers.*.mlp'], "
        f"strategy=xpupack.Only(xpupack.EagerBackend())) for s in (0, 1)]\n"
        f"print('ready', flush=True); input()\n"
        f"for i in range(40): xpupack.save(models[i % 2], {str(root)!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    saver = subprocess.Popen(
        [sys.executable, "-c", saver_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert saver.stdout.readline().strip() == "ready", saver.stderr.read()
    for process in (loader, saver):
        process.stdin.write("go\n")
        process.stdin.flush()
    out, err = loader.communicate(timeout=600)
    assert loader.returncode == 0, err
    assert saver.wait(timeout=600) == 0, saver.stderr.read()
    results = json.loads(out.strip().splitlines()[-1])
    assert len(results) == 40
    for result in results:
        assert "error" in result or result["seeds"] in ([0], [1]), result
        if "error" in result:
            assert result["error"].startswith(("IntegrityError", "PackageFormatError")), result
    # nothing left behind but the package and, once a load verified it whole, the remembered verifications
    assert "pkg" in os.listdir(tmp_path) and set(os.listdir(tmp_path)) <= {"pkg", "xpupack-cache"}
