"""What runs each module here, and whether its compiled artifacts may (docs/safety.md).

The trust rule applies to whatever actually runs: the package's backend, the
base it falls back to where it cannot run (``graph+inductor`` on a CPU runs
``inductor``), a backend rebuilt after an environment change, the fallback
after a failed restore. `verify` and `inspect` report what `load` does.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import xpupack
from support.backends import ArtifactBackend
from support.emulated_graph import EmulatedGraphs
from support.models import make_stack, stack_samples
from support.package_tools import copy_package, redigest, rewrite_manifest
from xpupack import _background
from xpupack.cli import main
from xpupack.errors import IncompatiblePackageError
from xpupack.report import package_report, verify_package
from xpupack.source import Source

UNTRUSTED = "revision 'main' (commit 0123456789ab) is not pinned by commit hash"


def untrusted(root: Path) -> Source:
    return Source(root, trusted=False, description="org/name@main", trust_reason=UNTRUSTED)


def load_from(monkeypatch, source: Source, **kwargs):
    """`xpupack.load` of ``source`` as if it came from the Hub (the loader sees ``source`` as resolved)."""
    monkeypatch.setattr(importlib.import_module("xpupack.loading"), "resolve_source", lambda *a, **k: source)
    return xpupack.load(make_stack(seed=4), "org/name", **kwargs)


def runners(model):
    return [tuned.runner for tuned in xpupack.tuned.session_of(model).modules.values()]


def reasons(model):
    return [tuned.report[0].reason for tuned in xpupack.tuned.session_of(model).modules.values()]


@pytest.fixture
def graph_artifact_package(tmp_path, monkeypatch):
    """``graph+artifact``: compiled artifacts under a device-graph backend, built through the emulated
    graphs; when the test body runs, this machine has no device graphs again."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(xpupack._device.GRAPH_APIS, "cpu", EmulatedGraphs())
        model = xpupack.tune(
            make_stack(),
            stack_samples(),
            modules=["layers.*.mlp"],
            strategy=xpupack.Only(xpupack.GraphBackend(base=ArtifactBackend())),
        )
        root = xpupack.save(model, tmp_path / "pkg")
    assert "cpu" not in xpupack._device.GRAPH_APIS
    return root


@pytest.mark.parametrize("mode", ["rebuild", "fallback"])
@pytest.mark.parametrize("trusted", [True, False])
def test_the_base_a_fallback_runs_uses_artifacts_only_when_trusted(graph_artifact_package, monkeypatch, mode, trusted):
    source = (
        Source(graph_artifact_package, trusted=True, description="pkg", trust_reason="local directory")
        if trusted
        else untrusted(graph_artifact_package)
    )
    model = load_from(monkeypatch, source, on_mismatch=mode)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"artifact"}
    assert [runner.from_artifacts for runner in runners(model)] == [trusted, trusted]
    for reason in reasons(model):
        assert reason.startswith("graph -> artifact (no device graphs on cpu)")
        assert ("not pinned by commit hash" in reason) is not trusted


def test_with_on_mismatch_error_an_unavailable_backend_raises(graph_artifact_package, monkeypatch):
    with pytest.raises(IncompatiblePackageError, match="no device graphs on cpu.*on_mismatch='rebuild'"):
        load_from(monkeypatch, untrusted(graph_artifact_package), on_mismatch="error")


def test_rebuild_rebuilds_the_base_when_the_environment_changed_too(graph_artifact_package, monkeypatch):
    """The package's backend cannot run here and the artifacts do not fit this torch: 'rebuild' builds the
    base here (no artifacts), 'fallback' runs the original module."""
    rewrite_manifest(graph_artifact_package, lambda m: m["environment"].update(torch="2.9.0"))
    source = Source(graph_artifact_package, trusted=True, description="pkg", trust_reason="local directory")
    model = load_from(monkeypatch, source)
    assert [runner.from_artifacts for runner in runners(model)] == [False, False]
    assert all("artifact rebuilt here (torch: built 2.9.0" in reason for reason in reasons(model))
    model = load_from(monkeypatch, source, on_mismatch="fallback")
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"eager"}


@pytest.mark.parametrize("trusted", [True, False])
def test_a_failed_restore_falls_back_under_the_same_trust_rule(
    graph_artifact_package, monkeypatch, emulated_graphs, trusted
):
    """Device graphs exist here, but recording fails: the module runs the base, with artifacts only if trusted."""
    emulated_graphs.fail_capture = lambda: True
    source = (
        Source(graph_artifact_package, trusted=True, description="pkg", trust_reason="local directory")
        if trusted
        else untrusted(graph_artifact_package)
    )
    model = load_from(monkeypatch, source)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"artifact"}
    assert [runner.from_artifacts for runner in runners(model)] == [trusted, trusted]


def test_verify_and_inspect_say_what_load_runs(graph_artifact_package):
    verified = verify_package(untrusted(graph_artifact_package))
    statuses = {entry["status"] for entry in verified["compatibility"].values()}
    assert statuses == {
        f"no device graphs on cpu: runs artifact; compiled artifacts not trusted ({UNTRUSTED}): compiled on load"
    }
    local = verify_package(graph_artifact_package)
    assert {entry["status"] for entry in local["compatibility"].values()} == {"no device graphs on cpu: runs artifact"}
    report = package_report(untrusted(graph_artifact_package))
    assert {m["on_load"] for m in report["modules"]} == statuses
    text = CliRunner().invoke(main, ["inspect", str(graph_artifact_package)]).stdout
    rows = [line.split("│") for line in text.splitlines() if line.startswith("│")]
    on_load_here = " ".join(row[5].strip() for row in rows)  # the column's cells, wrapped lines joined
    assert "no device graphs on cpu: runs artifact" in on_load_here


# -- the real thing: Inductor's pickled cache behind a graph fallback -----------------------------------

PLANTED = b"planted by a hostile package"


def plant_kernels(root: Path) -> None:
    """Replaces every carried kernel file with a recognisable one, digests updated (a hostile author's
    package is consistent with itself)."""
    kernels = [path for path in root.rglob("kernels/**/*") if path.is_file()]
    assert kernels
    for kernel in kernels:
        kernel.write_bytes(PLANTED)
    redigest(root)


def load_watching_artifacts(monkeypatch, tmp_path, source: Source):
    """Loads ``source`` into an empty Inductor cache of its own; returns ``(model or error, blobs torch was
    asked to unpickle, planted files copied into that cache)``."""
    blobs = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", blobs.append)
    cache = tmp_path / "inductor-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    try:
        model = load_from(monkeypatch, source)
    except xpupack.XpupackError as exc:
        model = exc
    _background.wait(300)  # what a load hands to the worker (the artifacts of a compile it defers) ran too
    copied = [path for path in cache.rglob("*") if path.is_file() and path.read_bytes() == PLANTED]
    return model, blobs, copied


def test_the_planted_artifacts_do_reach_torch_when_trusted(graph_inductor_package, tmp_path, monkeypatch):
    """The control for the test below: the same package, trusted, hands torch its pickles and kernels."""
    root = copy_package(graph_inductor_package[1], tmp_path / "pkg")
    plant_kernels(root)
    _, blobs, copied = load_watching_artifacts(
        monkeypatch, tmp_path, Source(root, trusted=True, description=str(root), trust_reason="local")
    )
    assert blobs and copied


def test_graph_over_inductor_from_an_unpinned_revision_never_unpickles(graph_inductor_package, tmp_path, monkeypatch):
    root = copy_package(graph_inductor_package[1], tmp_path / "pkg")
    plant_kernels(root)
    model, blobs, copied = load_watching_artifacts(monkeypatch, tmp_path, untrusted(root))
    assert blobs == [] and copied == []
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}
    assert all("inductor compiled here" in reason and UNTRUSTED in reason for reason in reasons(model))
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), make_stack()(x))


def test_graph_over_inductor_from_a_local_package_uses_its_artifacts(graph_inductor_package, tmp_path, monkeypatch):
    """The trusted case of the same fallback: the base runs with the package's Inductor artifacts."""
    root = copy_package(graph_inductor_package[1], tmp_path / "pkg")
    blobs = []
    real = torch.compiler.load_cache_artifacts
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: (blobs.append(blob), real(blob))[1])
    model = xpupack.load(make_stack(seed=4), root, defer_compile=False)
    assert blobs == [(root / "backends/graph/cache.bin").read_bytes()]
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}
    result = CliRunner().invoke(main, ["verify", str(root), "--json"])
    assert result.exit_code == 2
    assert {e["status"] for e in json.loads(result.stdout)["compatibility"].values()} == {
        "no device graphs on cpu: runs inductor"
    }
