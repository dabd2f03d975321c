"""`verify` and `inspect` say what `load` does: every backend × mismatch × on_mismatch × trust the suite can
make on a CPU (docs/safety.md).

One planner (`xpupack.plan`) decides; this checks that its two users agree. For each combination the
verdict of `package_report` / `verify_package` (per module: which backend runs, whether it uses the
package's artifacts or compiles here, or that the package cannot load) must equal what `xpupack.load`
did: the backend `xpupack.stats` reports, whether the restore was handed the artifacts (and, for
Inductor, whether torch was asked to unpickle the package's cache), or the exception it raised.

The packages are built once per module (Inductor's once per session) and copied per case.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import xpupack
from support.emulated_graph import EmulatedGraphs
from support.models import make_stack, stack_samples
from support.package_tools import copy_package, rewrite_manifest
from xpupack import _background, _device
from xpupack.errors import IncompatiblePackageError
from xpupack.report import package_report, verify_package
from xpupack.source import Source

UNTRUSTED = "revision 'main' (commit 0123456789ab) is not pinned by commit hash"
#: every environment key a backend here depends on, changed (graph and eager depend on none)
BUILT_ELSEWHERE = {"torch": "2.9.0", "torchao": "0.1.0"}


def _build(root, backend, *, graphs: bool = False):
    with pytest.MonkeyPatch.context() as patch:
        if graphs:
            patch.setitem(_device.GRAPH_APIS, "cpu", EmulatedGraphs())
        model = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(backend))
        return xpupack.save(model, root)


@pytest.fixture(scope="module")
def packages(tmp_path_factory, inductor_package, graph_inductor_package):
    """``{backend: package}``; graph packages are built through the emulated graphs, loaded without them."""
    root = tmp_path_factory.mktemp("matrix")
    built = {
        "eager": _build(root / "eager", xpupack.EagerBackend()),
        "graph": _build(root / "graph", xpupack.GraphBackend(), graphs=True),
        "inductor": inductor_package[1],
        "graph+inductor": graph_inductor_package[1],
    }
    try:
        built["torchao"] = _build(root / "torchao", xpupack.TorchAOBackend("int8-weight-only"))
    except xpupack.XpupackError as exc:  # no torchao, or int8 weight-only does not run here
        built["torchao"] = exc
    assert "cpu" not in _device.GRAPH_APIS
    return built


def _name(label: str) -> str:
    """The backend name `xpupack.stats` reports for a runs_here label (``torchao:int8-weight-only``,
    ``graph+inductor``)."""
    return label.split("+")[0].split(":")[0]


def _verdicts(source: Source, on_mismatch: str) -> dict:
    """What inspect and verify say happens on load: ``{path: (backend, uses artifacts)}`` or ``"refused"``."""
    report = package_report(source, device="cpu", on_mismatch=on_mismatch)
    verified = verify_package(source, device="cpu", on_mismatch=on_mismatch)
    assert not verified["problems"]
    said = {}
    for module in report["modules"]:
        status = verified["compatibility"][module["path"]]["status"]
        assert status == module["on_load"]  # inspect and verify word it alike
        if module["runs_here"] is None:
            assert status.startswith("cannot load here")
            said[module["path"]] = "refused"
        else:
            said[module["path"]] = (_name(module["runs_here"]), module["artifacts_here"])
    if "refused" in said.values():
        return "refused"  # one module that cannot load fails the whole load
    return said


def _used_artifacts(model, path: str, backend: str, restored: dict) -> bool:
    """Whether the module runs the package's artifacts: for TorchAO (whose restore takes the stored
    quantized weights whatever it is told), whether its weights are torchao tensors; else what the
    restore that serves it was told."""
    if backend == "torchao":
        return any(type(p.data) is not torch.Tensor for p in model.get_submodule(path).parameters())
    return restored[path]


@pytest.mark.parametrize("trusted", [True, False], ids=["local", "untrusted"])
@pytest.mark.parametrize("on_mismatch", ["rebuild", "fallback", "error"])
@pytest.mark.parametrize("mismatch", [False, True], ids=["same-env", "env-changed"])
@pytest.mark.parametrize("backend", ["eager", "graph", "inductor", "graph+inductor", "torchao"])
def test_verify_says_what_load_does(packages, tmp_path, monkeypatch, backend, mismatch, on_mismatch, trusted):
    if isinstance(packages[backend], Exception):
        pytest.skip(f"cannot build a {backend} package here: {packages[backend]}")
    root = copy_package(packages[backend], tmp_path / "pkg")
    if mismatch:
        rewrite_manifest(root, lambda m: m["environment"].update(BUILT_ELSEWHERE))
    source = (
        Source(root, trusted=True, description=str(root), trust_reason="local directory")
        if trusted
        else Source(root, trusted=False, description="org/name@main", trust_reason=UNTRUSTED)
    )

    said = _verdicts(source, on_mismatch)

    # what load does: the restores it ran (the last one per module is what serves it), the cache it unpickled
    load_module = importlib.import_module("xpupack.loading")
    restored, blobs = {}, []
    real_restore = load_module._restore

    def watching(job, context):
        restored[job.path] = job.choice.use_artifacts
        return real_restore(job, context)

    monkeypatch.setattr(load_module, "_restore", watching)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", blobs.append)
    monkeypatch.setattr(load_module, "resolve_source", lambda *a, **k: source)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    # the reference is built before the load: a compile on the background worker puts torch's global RNG
    # back as it found it when it ends (Dynamo does), which can rewind the seeded draws of a model built meanwhile
    packaged = make_stack().eval()
    try:
        model = xpupack.load(make_stack(seed=4), "org/name", device="cpu", on_mismatch=on_mismatch, defer_compile=True)
    except IncompatiblePackageError:
        did = "refused"
    else:
        stats = xpupack.stats(model)
        did = {
            path: (stats[path]["backend"], _used_artifacts(model, path, stats[path]["backend"], restored))
            for path in stats
        }
        x = torch.randn(2, 8)
        with torch.no_grad():  # whatever runs answers as the packaged model would
            torch.testing.assert_close(model(x), packaged(x), atol=0.05, rtol=0.05)

    assert did == said
    _background.wait(300)  # a load that defers its compile reads the artifacts on the worker, after it returned
    # Inductor unpickles the package's cache exactly when a module runs it with the artifacts
    assert bool(blobs) == (
        did != "refused" and any(name == "inductor" and artifacts for name, artifacts in did.values())
    )
    # the trust rule applies to what runs: no compiled artifact from an untrusted source
    if not trusted:
        assert blobs == []


def test_the_cli_reports_for_the_on_mismatch_it_is_given(packages, tmp_path):
    import json

    from click.testing import CliRunner

    from xpupack.cli import main

    root = copy_package(packages["graph"], tmp_path / "pkg")
    for mode, expected in [
        ("rebuild", "no device graphs on cpu: runs the original module"),
        ("error", "cannot load here: "),
    ]:
        result = CliRunner().invoke(main, ["verify", str(root), "--on-mismatch", mode, "--json"])
        assert result.exit_code == 2, result.output
        statuses = {e["status"] for e in json.loads(result.stdout)["compatibility"].values()}
        assert all(status.startswith(expected) for status in statuses), statuses
        result = CliRunner().invoke(main, ["inspect", str(root), "--on-mismatch", mode, "--json"])
        assert {m["on_load"] for m in json.loads(result.stdout)["modules"]} == statuses
