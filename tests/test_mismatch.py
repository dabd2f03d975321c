"""Environment mismatch: a package built with other library versions or on another device
(docs/safety.md).

``ArtifactBackend`` (tests/support/backends.py) stands in for any backend
whose saved artifacts depend on the environment; the Inductor cases use the
real backend (tests/test_inductor.py has the compiling ones).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

import xpupack
from support.backends import ArtifactBackend
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, copy_package, redigest, rewrite_manifest, snapshot
from xpupack.cli import main
from xpupack.environment import environment
from xpupack.errors import IncompatiblePackageError

HERE = environment(torch.device("cpu"))
OTHER = {
    "torch": "2.9.0",
    "torchao": "0.1.0",
    "triton": "3.0.0",
    "device_type": "cuda",
    "device_name": "NVIDIA H200",
    "architecture": "sm_90",
}
KEYS = ["torch", "torchao", "triton", "device_type", "device_name"]


def build(tmp_path, backend):
    model = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(backend))
    return xpupack.save(model, tmp_path / "pkg")


def built_elsewhere(root, **changes):
    """Rewrites the package as if built in another environment; ``device=...`` also moves the specs there."""
    device = changes.pop("device", None)
    rewrite_manifest(root, lambda m: m["environment"].update(changes))
    if device is not None:
        rewrite_manifest(root, lambda m: m.update(device=device))
        for spec in root.glob("modules/*/spec.json"):
            data = json.loads(spec.read_text())
            for signature in data["signatures"]:
                for leaf in signature["leaves"]:
                    if leaf["kind"] == "tensor":
                        leaf["device"] = device
            spec.write_text(json.dumps(data))
        redigest(root)
    return root


def reasons(model):
    return [tuned.report[0].reason for tuned in xpupack.tuned.session_of(model).modules.values()]


def runners(model):
    return [tuned.runner for tuned in xpupack.tuned.session_of(model).modules.values()]


@pytest.fixture
def artifact_package(tmp_path):
    return build(tmp_path, ArtifactBackend())


def test_same_environment_uses_the_artifacts(artifact_package):
    model = xpupack.load(make_stack(), artifact_package, on_mismatch="error")
    assert all(runner.from_artifacts for runner in runners(model))
    assert reasons(model) == ["from package", "from package"]


@pytest.mark.parametrize("key", KEYS)
def test_rebuild_rebuilds_what_the_difference_invalidates(artifact_package, key):
    built_elsewhere(artifact_package, **{key: OTHER[key]})
    model = xpupack.load(make_stack(), artifact_package, on_mismatch="rebuild")
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"artifact"}
    assert not any(runner.from_artifacts for runner in runners(model))
    assert all(f"rebuilt here ({key}: built {OTHER[key]}, here {HERE[key]})" in r for r in reasons(model))


@pytest.mark.parametrize("key", KEYS)
def test_fallback_runs_the_original_modules(artifact_package, key):
    built_elsewhere(artifact_package, **{key: OTHER[key]})
    model = xpupack.load(make_stack(), artifact_package, on_mismatch="fallback")
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"eager"}
    assert all(f"artifact -> original module ({key}: built {OTHER[key]}" in r for r in reasons(model))
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack()(x))


@pytest.mark.parametrize("key", KEYS)
def test_error_names_what_differs_and_changes_nothing(artifact_package, key):
    built_elsewhere(artifact_package, **{key: OTHER[key]})
    model = make_stack(seed=4).train()
    before = snapshot(model)
    with pytest.raises(IncompatiblePackageError) as error:
        xpupack.load(model, artifact_package, on_mismatch="error")
    assert error.value.differences == {key: (OTHER[key], HERE[key])}
    assert f"{key}: built {OTHER[key]}, here {HERE[key]}" in str(error.value)
    assert "on_mismatch='rebuild'" in str(error.value)
    assert_unchanged(model, before)


def test_every_difference_is_named(artifact_package):
    built_elsewhere(artifact_package, **{key: OTHER[key] for key in KEYS})
    with pytest.raises(IncompatiblePackageError) as error:
        xpupack.load(make_stack(), artifact_package, on_mismatch="error")
    assert set(error.value.differences) == set(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_verify_reports_the_same(artifact_package, key):
    built_elsewhere(artifact_package, **{key: OTHER[key]})
    result = CliRunner().invoke(main, ["verify", str(artifact_package), "--json"])
    assert result.exit_code == 2, result.output
    report = json.loads(result.output)
    assert report["ok"]
    for entry in report["compatibility"].values():
        assert entry == {
            "backend": "artifact",
            "compatible": False,
            "status": f"rebuilt on load: {key} built {OTHER[key]}, here {HERE[key]}",
        }
    text = CliRunner().invoke(main, ["verify", str(artifact_package)])
    assert text.exit_code == 2 and f"{key} built {OTHER[key]}" in text.output


def test_verify_says_compatible_when_nothing_differs(artifact_package):
    result = CliRunner().invoke(main, ["verify", str(artifact_package)])
    assert result.exit_code == 0, result.output
    assert "compatible" in result.output and "intact" in result.output


@pytest.mark.parametrize("kind", ["eager", "graph"])
def test_backends_without_artifacts_ignore_version_differences(kind, tmp_path, request):
    """Eager keeps nothing compiled and graphs are recorded again on load: other versions change nothing."""
    if kind == "graph":
        request.getfixturevalue("emulated_graphs")
    backend = xpupack.EagerBackend() if kind == "eager" else xpupack.GraphBackend()
    root = built_elsewhere(
        build(tmp_path, backend),
        torch="2.9.0",
        torchao="0.1.0",
        triton="3.0.0",
        device_name="another CPU",
        architecture="AVX2",
    )
    model = xpupack.load(make_stack(), root, on_mismatch="error")
    assert {s["backend"] for s in xpupack.stats(model).values()} == {kind}
    assert CliRunner().invoke(main, ["verify", str(root)]).exit_code == 0


def test_graph_package_from_a_gpu_records_again_here(emulated_graphs, tmp_path):
    root = built_elsewhere(
        build(tmp_path, xpupack.GraphBackend()), device="cuda:0", device_type="cuda", device_name="NVIDIA H200"
    )
    captures = emulated_graphs.captures
    model = xpupack.load(make_stack(), root, device="cpu", on_mismatch="error")
    assert emulated_graphs.captures == captures + 4  # both batch sizes of both modules, on this device
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), make_stack()(x), atol=1e-6)
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "graph"


@pytest.mark.parametrize("mode", ["rebuild", "fallback", "error"])
def test_graph_package_on_a_machine_without_device_graphs(mode, tmp_path, request):
    emulation = request.getfixturevalue("emulated_graphs")  # to build it
    root = build(tmp_path, xpupack.GraphBackend())
    request.getfixturevalue("monkeypatch").delitem(xpupack._device.GRAPH_APIS, "cpu")
    assert emulation.captures
    if mode == "error":
        with pytest.raises(IncompatiblePackageError, match="no device graphs on cpu.*on_mismatch"):
            xpupack.load(make_stack(), root, on_mismatch=mode)
        return
    model = xpupack.load(make_stack(), root, on_mismatch=mode)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"eager"}
    assert all("no device graphs on cpu" in r for r in reasons(model))
    result = CliRunner().invoke(main, ["verify", str(root)])
    assert result.exit_code == 2 and "no device graphs on cpu: runs the original module" in result.output


@pytest.mark.parametrize("key", ["torch", "triton", "python", "device_name", "architecture"])
def test_inductor_verify_names_what_invalidates_its_artifacts(inductor_package, tmp_path, key):
    root = built_elsewhere(copy_package(inductor_package[1], tmp_path / "pkg"), **{key: "other"})
    result = CliRunner().invoke(main, ["verify", str(root), "--json"])
    assert result.exit_code == 2
    statuses = {e["status"] for e in json.loads(result.output)["compatibility"].values()}
    assert statuses == {f"rebuilt on load: {key} built other, here {HERE[key]}"}


def test_inductor_error_on_another_cpu_instruction_set(inductor_package, tmp_path):
    """Compiled CPU kernels for AVX-512 die of SIGILL on an AVX2 machine: the instruction set is compared."""
    other = "AVX2" if HERE["architecture"] != "AVX2" else "AVX512"
    root = built_elsewhere(copy_package(inductor_package[1], tmp_path / "pkg"), architecture=other)
    with pytest.raises(IncompatiblePackageError, match=f"architecture: built {other}"):
        xpupack.load(make_stack(), root, on_mismatch="error")


def test_the_environment_records_the_cpu_instruction_set():
    assert HERE["architecture"] == torch.backends.cpu.get_cpu_capability()
    assert "architecture" in xpupack.InductorBackend().depends_on
    assert ArtifactBackend.depends_on == tuple(KEYS)


def test_the_environment_records_the_cpu_thread_count():
    """Inductor generates its C++ kernels for ``torch.get_num_threads()`` threads and keys its FX graph cache on it."""
    assert HERE["cpu_threads"] == torch.get_num_threads()
    assert "cpu_threads" in xpupack.InductorBackend().depends_on
    assert "cpu_threads" not in xpupack.AOTIBackend().depends_on  # its libraries are mapped in as built
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert environment(torch.device("cpu"))["cpu_threads"] == threads + 1
    finally:
        torch.set_num_threads(threads)


def built_for_other_threads(inductor_package, tmp_path):
    """A copy of the Inductor package, as if built with one CPU thread more than this process has."""
    return built_elsewhere(copy_package(inductor_package[1], tmp_path / "pkg"), cpu_threads=HERE["cpu_threads"] + 1)


def test_inductor_verify_inspect_and_load_say_that_another_thread_count_compiles_at_load(
    inductor_package, tmp_path, caplog
):
    """Regression: a package built with 2 threads and loaded with 1 missed every carried graph and compiled at
    load, while `verify` said "compatible" and `inspect` "Inductor compiles from the carried caches"."""
    root = built_for_other_threads(inductor_package, tmp_path)
    built, here = HERE["cpu_threads"] + 1, HERE["cpu_threads"]
    fix = f"torch.set_num_threads({built}) before xpupack.load, or OMP_NUM_THREADS={built}"
    said = f"built for {built} CPU threads, this process has {here}: inductor compiles at load"
    result = CliRunner().invoke(main, ["verify", str(root), "--json"])
    assert result.exit_code == 2, result.output
    statuses = {entry["status"] for entry in json.loads(result.output)["compatibility"].values()}
    assert statuses == {f"{said} (the carried kernels do not apply) — {fix}"}
    inspected = json.loads(CliRunner().invoke(main, ["inspect", str(root), "--json"]).output)
    assert {module["on_load"] for module in inspected["modules"]} == statuses
    shown = CliRunner().invoke(main, ["inspect", str(root)]).output
    assert "Inductor compiles without the carried kernels" in shown and "from the carried caches" not in shown

    with caplog.at_level("WARNING", logger="xpupack"):
        model = xpupack.load(make_stack(), root)
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any(f"built for {built} CPU threads, this process has {here}" in m and fix in m for m in warned), warned
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), make_stack()(x))
    with pytest.raises(IncompatiblePackageError, match=f"built for {built} CPU threads.*{re.escape(fix)}"):
        xpupack.load(make_stack(), root, on_mismatch="error")


def test_a_package_that_records_no_thread_count_says_it_is_unknown_and_loads(inductor_package, tmp_path):
    """An older xpupack wrote no ``cpu_threads``: not a difference (it loads, verify passes), but said."""
    root = copy_package(inductor_package[1], tmp_path / "pkg")
    rewrite_manifest(root, lambda manifest: manifest["environment"].pop("cpu_threads", None))
    result = CliRunner().invoke(main, ["verify", str(root), "--json"])
    assert result.exit_code == 0, result.output
    for entry in json.loads(result.output)["compatibility"].values():
        assert entry["compatible"] and entry["status"].startswith(
            "compatible; built for an unknown number of CPU threads"
        ), entry
    model = xpupack.load(make_stack(), root, on_mismatch="error")
    assert all(s["backend"] == "inductor" and s["fallbacks"] == 0 for s in xpupack.stats(model).values())


def test_a_gpu_package_is_not_told_about_cpu_threads():
    """Only CPU kernels depend on the thread count: a GPU's environment records none, and nothing is said of it."""
    from xpupack.plan import Context, choose

    gpu = {**HERE, "device_type": "cuda", "device_name": "NVIDIA H100", "architecture": "sm_90"}
    gpu.pop("cpu_threads")
    choice = choose("m", xpupack.InductorBackend(), Context(torch.device("cpu"), gpu, gpu, trusted=True))
    assert choice.status == "compatible" and choice.use_artifacts


@pytest.fixture
def torchao_package(tmp_path):
    samples = [torch.randn(batch, 128) for batch in (2, 4)]  # TorchAO's kernels want real sizes
    model = xpupack.tune(
        make_stack(width=128),
        samples,
        modules=["layers.*.mlp"],
        strategy=xpupack.Only(xpupack.TorchAOBackend("int8-weight-only")),
    )
    return model, xpupack.save(model, tmp_path / "pkg")


@pytest.mark.parametrize("mode", ["rebuild", "fallback", "error"])
def test_torchao_package_from_another_torchao(torchao_package, mode):
    """The quantized weights are portable: 'rebuild' loads them here; the original weights are not in the
    package, so 'fallback' cannot run originals and says so, like 'error'."""
    tuned, root = torchao_package
    built_elsewhere(root, torchao="0.1.0")
    if mode != "rebuild":
        with pytest.raises(IncompatiblePackageError, match=f"torchao: built 0.1.0, here {HERE['torchao']}"):
            xpupack.load(make_stack(seed=3, width=128), root, on_mismatch=mode)
        return
    model = xpupack.load(make_stack(seed=3, width=128), root, on_mismatch=mode)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"torchao"}
    x = torch.randn(2, 128)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tuned(x))
    result = CliRunner().invoke(main, ["verify", str(root)])
    assert result.exit_code == 2 and f"torchao built 0.1.0, here {HERE['torchao']}" in result.output
