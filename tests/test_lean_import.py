"""Lean import: ``import xpupack``, ``inspect``, ``verify`` and the pytest plugin import no torch, and importing
xpupack installs nothing process-wide (docs/cli.md; docs/testing.md)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import xpupack
from xpupack.backends._facts import describe
from xpupack.backends.base import BACKENDS, Backend, ComposedBackend, backend_from_json
from xpupack.environment import CPU, _cpu_capability_without_torch

NO_TORCH = "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"


def test_import_xpupack_imports_no_torch(run_python):
    output = run_python(f"""
        import sys
        import xpupack
        {NO_TORCH}
        print(xpupack.__version__)
        try:
            raise xpupack.IntegrityError("x")
        except xpupack.XpupackError:
            pass
        {NO_TORCH}
        assert "tune" in dir(xpupack) and "GraphBackend" in xpupack.__all__
    """).stdout
    assert output.strip() == xpupack.__version__


def test_no_submodule_is_named_like_a_public_name():
    """Importing a submodule sets the package attribute of its name: a module ``xpupack/load.py`` would
    replace the function ``xpupack.load`` once anything imported it."""
    import pkgutil

    submodules = {info.name for info in pkgutil.iter_modules(xpupack.__path__)}
    assert submodules & set(xpupack.__all__) == set()


def test_public_names_resolve_and_stay_functions_after_every_submodule_is_imported(run_python):
    run_python("""
        import importlib, inspect, pkgutil
        import xpupack
        for info in pkgutil.walk_packages(xpupack.__path__, "xpupack."):
            if info.name != "xpupack.__main__":
                importlib.import_module(info.name)
        from xpupack.loading import load
        from xpupack.tuning import tune
        assert xpupack.load is load and xpupack.tune is tune
        for name in xpupack.__all__:
            assert getattr(xpupack, name) is not None, name
        assert inspect.isclass(xpupack.GraphBackend) and callable(xpupack.register_state)
        from xpupack import FirstWins, TorchAOBackend, stats  # noqa: F401
    """)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eager", "inductor"])
def test_inspect_and_verify_of_a_local_package_import_no_torch(
    run_python, eager_package, inductor_package, tmp_path, kind
):
    root = eager_package if kind == "eager" else shutil.copytree(inductor_package[1], tmp_path / "pkg")
    output = run_python(f"""
        import json, sys
        from xpupack.cli import main
        for argv in (["inspect", {str(root)!r}], ["inspect", {str(root)!r}, "--json"],
                     ["verify", {str(root)!r}], ["verify", {str(root)!r}, "--json"]):
            try:
                main(argv)
            except SystemExit as exc:
                assert exc.code in (0, None), (argv, exc.code)
        {NO_TORCH}
    """).stdout
    assert "intact" in output and "compatible" in output
    # the same answers as in this process, where torch is loaded and the real backends decide
    from xpupack.report import verify_package

    expected = verify_package(root)
    verified = json.loads(output[output.rindex('{\n  "compatibility"') :])
    assert verified["compatibility"] == expected["compatibility"]
    assert verified["environment_here"] == expected["environment_here"]


@pytest.mark.slow
def test_xpupack_verify_command_imports_no_torch(eager_package, tmp_path):
    """``python -m xpupack verify DIR`` as a user runs it: the process exits 99 if torch was imported."""
    watch = (
        "import atexit, os, runpy, sys\n"
        "atexit.register(lambda: 'torch' in sys.modules and os._exit(99))\n"
        "runpy.run_module('xpupack', run_name='__main__', alter_sys=True)\n"
    )
    for command in ("verify", "inspect"):
        result = subprocess.run(
            [sys.executable, "-c", watch, command, str(eager_package)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
        )
        assert result.returncode == 0, (command, result.returncode, result.stderr)
        assert "layers.0.mlp" in result.stdout


@pytest.mark.slow
def test_verify_without_torch_reports_what_it_reports_with_torch(run_python, eager_package, tmp_path):
    """A mismatch, a spec of another module, a bad build device: the same verdicts in a fresh process."""
    from support.package_tools import copy_package, rewrite_json, rewrite_manifest
    from xpupack.report import verify_package

    def inductor_built_elsewhere(manifest):
        manifest["environment"]["torch"] = "1.0.0"
        manifest["modules"][0]["backend"]["name"] = "inductor"
        manifest["device"] = "no such device!"

    root = copy_package(eager_package, tmp_path / "pkg")
    rewrite_manifest(root, inductor_built_elsewhere)
    rewrite_json(root, "modules/layers.1.mlp/spec.json", lambda spec: spec.update(path="layers.0.mlp"))
    output = run_python(f"""
        import json, sys
        from xpupack.report import verify_package
        print(json.dumps(verify_package({str(root)!r})))
        {NO_TORCH}
    """).stdout
    result, expected = json.loads(output), json.loads(json.dumps(verify_package(root)))
    assert not result["ok"] and result["compatibility"] == expected["compatibility"]
    assert result["compatibility"]["layers.0.mlp"]["status"].startswith("rebuilt on load: torch built 1.0.0")
    assert [problem.split(":")[0] for problem in result["problems"]] == [
        problem.split(":")[0] for problem in expected["problems"]
    ]
    assert "no such device" in result["problems"][0] and "describes the module" in result["problems"][1]


@pytest.mark.slow  # a fresh pytest process
def test_pytest_plugin_imports_nothing_heavy(tmp_path):
    """A project that never touches torch: the plugin (loaded into every pytest run) costs it nothing."""
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    (tmp_path / "test_plain.py").write_text(
        textwrap.dedent(f"""
        import sys

        def test_plain():
            assert "xpupack.testing" in sys.modules   # the plugin is loaded...
            {NO_TORCH}                                  # ...and imported no torch

        def test_fixture_works_without_torch(fallback_calls):
            assert fallback_calls == []
            {NO_TORCH}
    """)
    )
    registered = any(ep.value == "xpupack.testing" for ep in importlib.metadata.entry_points(group="pytest11"))
    plugin = [] if registered else ["-p", "xpupack.testing"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, str(tmp_path / "test_plain.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_cpu_capability_without_torch_is_torchs():
    capability = _cpu_capability_without_torch()
    if capability is None:
        pytest.skip("not Linux x86-64: torch answers there")
    assert capability == torch.backends.cpu.get_cpu_capability()


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["default", "avx2", "AVX2", "bogus"])
def test_cpu_capability_without_torch_follows_aten_cpu_capability(run_python, setting):
    run_python(
        """
        from xpupack.environment import _cpu_capability_without_torch
        mine = _cpu_capability_without_torch()
        import torch
        assert mine in (None, torch.backends.cpu.get_cpu_capability()), (mine, torch.backends.cpu.get_cpu_capability())
    """,
        env={"ATEN_CPU_CAPABILITY": setting},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [{}, {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "512"}, {"OMP_NUM_THREADS": "x"}, {"MKL_NUM_THREADS": "1"}],
    ids=["default", "omp-1", "omp-beyond-the-cores", "omp-bogus", "mkl-1"],
)
def test_cpu_threads_without_torch_are_torchs(run_python, setting):
    """Inductor keys its CPU kernels on ``torch.get_num_threads()``; `verify` reads it without torch where that is
    sure (a Linux default, ``OMP_NUM_THREADS`` up to the cores), and leaves the rest to torch."""
    run_python(
        """
        import os, sys
        from xpupack.environment import _cpu_threads_without_torch
        mine = _cpu_threads_without_torch()
        settings = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        assert mine is not None or sys.platform != "linux" or any(os.environ.get(name) for name in settings)
        import torch
        assert mine in (None, torch.get_num_threads()), (mine, torch.get_num_threads())
    """,
        env=setting,
    )


def test_device_here_is_this_cpu_without_torch(run_python):
    run_python(f"""
        import sys
        from xpupack.environment import CPU, device_here, environment
        device = device_here(None)
        assert device == CPU() and str(device) == "cpu", device
        assert device_here("cpu") == CPU()
        env = environment(device)
        {NO_TORCH}
        import torch
        assert env == environment(torch.device("cpu")), env
        assert device_here(None) == torch.device("cpu")   # torch loaded: torch answers
    """)


def _options_to_try():
    base_eager = {"name": "eager", "options": {}}
    return [
        ("eager", {}),
        ("eager", {"x": 1}),
        ("graph", {}),
        ("graph", {"max_recordings": 4}),
        ("graph", {"max_recordings": 16}),
        ("graph", {"max_recordings": 0}),
        ("graph", {"max_recordings": True}),
        ("graph", {"max_recordings": "4"}),
        ("graph", {"copy_outputs": False}),
        ("graph", {"copy_outputs": True}),
        ("graph", {"copy_outputs": 0}),
        ("graph", {"max_memory": 1 << 30}),
        ("graph", {"max_memory": 0}),
        ("graph", {"max_memory": True}),
        ("graph", {"max_memory": 1.5}),
        ("graph", {"base": {"name": "inductor", "options": {}}}),
        ("graph", {"base": {"name": "inductor", "options": {"mode": "default"}}, "max_recordings": 2}),
        ("graph", {"base": {"name": "graph", "options": {}}}),
        ("graph", {"base": base_eager}),
        ("graph", {"base": {"name": "torchao", "options": {"config": "int8-weight-only"}}}),
        ("graph", {"base": "inductor"}),
        ("graph", {"other": 1}),
        ("inductor", {}),
        ("inductor", {"mode": "default"}),
        ("inductor", {"mode": "max-autotune-no-cudagraphs"}),
        ("inductor", {"mode": None}),
        ("inductor", {"mode": "reduce-overhead"}),
        ("inductor", {"mode": 3}),
        ("inductor", {"base": {"name": "torchao", "options": {"config": "int8-weight-only"}}}),
        ("inductor", {"base": base_eager}),
        ("torchao", {"config": "int8-weight-only"}),
        ("aoti", {}),
        ("aoti", {"mode": "default"}),
        ("graph", {"base": {"name": "aoti", "options": {}}}),
        ("nope", {}),
        (None, {}),
        ("eager", None),
    ]


@pytest.mark.parametrize("name, options", _options_to_try())
def test_backend_facts_agree_with_the_backends(name, options):
    """`backends._facts` answers without torch only where it says what the real backend says."""
    facts = describe(name, options, CPU())
    try:
        real = backend_from_json(name, options)
    except Exception:
        assert facts is None, "facts for options the real backend refuses"
        return
    if facts is None:
        assert name not in ("eager", "graph", "inductor", "aoti") or "torchao" in json.dumps(options)
        return
    cpu = torch.device("cpu")
    assert (
        facts.name,
        facts.label,
        tuple(facts.depends_on),
        bool(facts.compiled_artifacts),
        facts.rebuildable,
        facts.pads_calls,
    ) == (
        real.name,
        real.label,
        tuple(real.depends_on),
        bool(real.compiled_artifacts),
        real.rebuildable,
        real.pads_calls,
    )
    assert facts.available(CPU()) == real.available(cpu)
    if not real.available(cpu):
        assert facts.why_unavailable(CPU()) == real.why_unavailable(cpu)
    assert set(BACKENDS) >= {"eager", "graph", "inductor", "aoti"}


def test_a_composed_backend_states_its_own_part_and_is_combined_with_its_base_by_one_rule():
    """`ComposedBackend` (with `backends._facts.Composition`, which `BackendFacts` shares) combines a
    backend's own part with its base's: a new composition states only its own."""

    class Base(Backend):
        name = "base"
        depends_on = ("torch", "extra")

        def available(self, device):
            return device.type == "cpu"

        def tolerances(self):
            return {torch.float32: (0.5, 0.5)}

    class Own(ComposedBackend):
        name = "own"
        own_depends_on = ("torch", "triton")
        own_compiled_artifacts = True

        def __init__(self, base=None):
            self._set_base(base)

        def _own_available(self, device):
            return device.type != "meta"

        def _own_compare(self, actual, expected):
            return "its own measure"

    cpu, meta = torch.device("cpu"), torch.device("meta")
    composed = Own(base=Base())
    assert (composed.label, composed.depends_on, composed.compiled_artifacts) == (
        "own+base",
        ("torch", "triton", "extra"),
        True,
    )
    assert composed.available(cpu) and not composed.available(meta)
    assert composed.why_unavailable(meta) == "own cannot run on meta"  # its own part's reason comes first
    assert not Own(base=Base()).available(torch.device("cuda")) and Own().available(torch.device("cuda"))
    # the base's accuracy measure where there is a base, its own without
    assert (
        composed.compare(torch.ones(2), torch.full((2,), 1.2)) is None and composed.tolerances() == Base().tolerances()
    )
    assert Own().compare(torch.ones(2), torch.ones(2)) == "its own measure"


def test_describe_leaves_other_devices_to_torch():
    assert describe("eager", {}, torch.device("cuda", 0)) is None


def test_importing_everything_installs_nothing_process_wide(run_python):
    """Importing xpupack installs nothing process-wide: no hooks, handlers, registrations or option changes."""
    run_python("""
        import copy, logging, sys, warnings
        import torch
        import torch._dynamo, torch._inductor.config
        import torch.utils._pytree as pytree
        from torch.nn.modules import module as nn_module

        def state():
            return {
                "root handlers": list(logging.getLogger().handlers),
                "xpupack handlers": list(logging.getLogger("xpupack").handlers),
                "xpupack level": logging.getLogger("xpupack").level,
                "pytree nodes": set(pytree.SUPPORTED_NODES),
                "inductor config": torch._inductor.config.save_config_portable(),
                "dynamo config": torch._dynamo.config.save_config_portable(),
                "forward hooks": (dict(nn_module._global_forward_hooks), dict(nn_module._global_forward_pre_hooks),
                                  dict(nn_module._global_module_registration_hooks)),
                "meta_path": list(sys.meta_path), "path_hooks": list(sys.path_hooks),
                "warnings": list(warnings.filters), "excepthook": sys.excepthook,
                "default dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            }

        before = state()
        import xpupack
        for name in xpupack.__all__:
            getattr(xpupack, name)
        import xpupack.cli, xpupack.testing, xpupack.report, xpupack.hub, xpupack.publish, xpupack.bench
        import xpupack.examples
        import xpupack.backends.torchao, xpupack.backends.inductor, xpupack.backends.graph
        after = state()
        changed = [key for key in before if before[key] != after[key]]
        assert not changed, {key: (before[key], after[key]) for key in changed}
    """)


def test_tuning_saving_and_loading_a_plain_model_import_neither_dynamo_nor_dtensor(run_python, eager_package, tmp_path):
    # a plain model holds no DTensor, and an eager package compiles nothing: a new server must not pay
    # for importing torch.distributed.tensor (2 s on an H200 host) or the compile stack to find that out
    run_python(f"""
        import sys
        import torch
        import xpupack
        sys.path.insert(0, {os.path.join(os.path.dirname(__file__))!r})
        from support.models import make_stack, stack_samples
        eager = xpupack.Only(xpupack.EagerBackend())
        model = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=eager)
        xpupack.save(model, {str(tmp_path / "again")!r})
        xpupack.load(make_stack(seed=3), {str(eager_package)!r})
        heavy = [m for m in ("torch.distributed.tensor", "torch._dynamo.convert_frame", "torch._inductor.compile_fx")
                 if m in sys.modules]
        assert not heavy, heavy
    """)
