"""The pytest plugin that users' deploy-after-load tests rely on."""

import pytest

import xpupack
import xpupack._torch_compat
import xpupack.backends.inductor  # noqa: F401 (imported here, never first inside an in-process run: see below)

pytest_plugins = ["pytester"]

# Resolved before any in-process pytester run: a run drops the modules first imported inside it, while
# `xpupack` keeps the public names it resolved, which would then belong to dropped modules (a later run's
# `save` would not see the sessions its `tune` made; a later test's patch of `xpupack._torch_compat` would
# reach a module the backends do not use).
xpupack.tune, xpupack.save, xpupack.load  # noqa: B018 (resolving them is the point)

CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import pytest, torch, xpupack
from support.backends import CountingBackend
from support.models import make_stack, stack_samples

@pytest.fixture
def model():
    return xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"],
                        strategy=xpupack.Only(CountingBackend()))
"""


def test_fallback_without_the_fixture_fails_and_with_it_is_recorded(pytester, fallback_calls):
    """(This test takes ``fallback_calls`` itself because pytester runs the inner session in-process.)"""
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makepyfile(
        test_user="""
        import torch

        def test_recorded_batch(model):
            with torch.no_grad():
                model(torch.randn(2, 8))

        def test_unexpected_fallback(model):
            with torch.no_grad():
                model(torch.randn(16, 8))

        def test_expected_fallback(model, fallback_calls):
            with torch.no_grad():
                model(torch.randn(16, 8))
            assert [e.path for e in fallback_calls] == ["layers.0.mlp", "layers.1.mlp"]
            assert "f32" in fallback_calls[0].reason or "float32" in fallback_calls[0].reason
    """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, failed=1)  # a failure of the test itself, not an error at its teardown
    result.stdout.fnmatch_lines(
        [
            "*_ test_unexpected_fallback _*",
            "*2 call(s) of tuned modules ran the original module*",
            "*layers.0.mlp: no recorded signature fits*",
            "FAILED test_user.py::test_unexpected_fallback*",
        ]
    )
    assert "ERROR" not in result.stdout.str()


def test_a_test_that_fails_on_its_own_reports_its_own_failure_and_the_fallbacks_after_it(pytester, fallback_calls):
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makepyfile(
        test_user="""
        import torch

        def test_wrong_and_fell_back(model):
            with torch.no_grad():
                model(torch.randn(16, 8))
            assert 1 == 2, "the test's own assertion"
    """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*the test's own assertion*", "*2 call(s) of tuned modules ran the original module (fallback)*"]
    )
    assert "ERROR" not in result.stdout.str()


USER_TESTS = """
    import pytest, torch

    def test_unexpected_fallback(model):
        with torch.no_grad():
            model(torch.randn(16, 8))

    @pytest.mark.xpupack_allow_fallbacks
    def test_marked(model):
        with torch.no_grad():
            model(torch.randn(16, 8))
"""


def test_the_marker_allows_fallbacks_under_strict_markers_and_the_failure_names_the_switches(pytester, fallback_calls):
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*take the `fallback_calls` fixture*@pytest.mark.xpupack_allow_fallbacks*xpupack_fail_on_fallback = false*"]
    )
    assert "xpupack_allow_fallbacks" in pytester.runpytest("--markers").stdout.str()


def test_the_ini_option_switches_failing_off_for_a_project(pytester, fallback_calls):
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makeini("[pytest]\nxpupack_fail_on_fallback = false\n")
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=2)


LOADED_CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import pytest, torch, xpupack
from support.backends import CountingBackend
from support.emulated_graph import EmulatedGraphs
from support.models import make_stack, stack_samples
from xpupack import _device

@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    _device.GRAPH_APIS["cpu"] = EmulatedGraphs()  # the graph package is built where device graphs exist
    try:
        graph = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"],
                             strategy=xpupack.Only(xpupack.GraphBackend()))
        graph_root = xpupack.save(graph, tmp_path_factory.mktemp("graph") / "pkg")
    finally:
        del _device.GRAPH_APIS["cpu"]
    counting = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"],
                            strategy=xpupack.Only(CountingBackend()))
    return {{"graph": graph_root, "counting": xpupack.save(counting, tmp_path_factory.mktemp("c") / "pkg")}}

@pytest.fixture(scope="session")
def on_cpu(packages):  # loaded once, before any test listens
    return xpupack.load(make_stack(), packages["graph"])

@pytest.fixture
def restore_failed(packages, monkeypatch):  # as an Inductor package whose compile fails at load
    def fail(*args, **kwargs):
        raise RuntimeError("the compile failed")
    monkeypatch.setattr(CountingBackend, "restore", fail)
    return xpupack.load(make_stack(), packages["counting"])
"""

DOWNGRADED_TESTS = """
    import pytest, torch

    def call(model):
        with torch.no_grad():
            model(torch.randn(2, 8))

    def test_graph_package_on_a_cpu(on_cpu):
        call(on_cpu)

    def test_restore_failed_at_load(restore_failed):
        call(restore_failed)

    def test_expected(on_cpu, backend_downgrades):
        call(on_cpu)
        call(on_cpu)
        assert [(e.path, e.promised, e.running) for e in backend_downgrades] == [
            ("layers.0.mlp", "graph", "eager"), ("layers.1.mlp", "graph", "eager")]
        assert "no device graphs on cpu" in backend_downgrades[0].reason

    @pytest.mark.xpupack_allow_downgrades
    def test_marked(on_cpu):
        call(on_cpu)

    def test_loaded_but_not_called(on_cpu):
        pass
"""


def test_a_module_running_another_backend_than_its_package_fails_the_test_that_calls_it(
    pytester, fallback_calls, backend_downgrades
):
    """Regression: a graph package loaded on a CPU, or a package whose backend failed to restore, ran the
    original module for every call and no fallback was ever reported: deploy tests passed. (This test takes
    both fixtures itself because pytester runs the inner session in-process.)"""
    import os

    pytester.makeconftest(LOADED_CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makepyfile(test_user=DOWNGRADED_TESTS)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_graph_package_on_a_cpu _*",
            "*2 tuned module(s) ran another backend than their package's*",
            "*layers.0.mlp: package graph, runs eager (graph -> original module (no device graphs on cpu))*",
            "*_ test_restore_failed_at_load _*",
            "*layers.0.mlp: package counting, runs eager*restore failed: the compile failed*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*take the `backend_downgrades` fixture*@pytest.mark.xpupack_allow_downgrades*"
            "xpupack_fail_on_downgrade = false*"
        ]
    )
    assert "xpupack_allow_downgrades" in pytester.runpytest("--markers").stdout.str()


def test_the_ini_option_lets_a_project_run_other_backends_than_its_packages(
    pytester, fallback_calls, backend_downgrades
):
    import os

    pytester.makeconftest(LOADED_CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makeini("[pytest]\nxpupack_fail_on_downgrade = false\n")
    pytester.makepyfile(test_user=DOWNGRADED_TESTS)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)


def test_a_deploy_test_of_eager_modules_passes_on_any_batch(pytester, fallback_calls):
    """An eager module runs every call as it would untuned: no call of it is a fallback to fail a test on."""
    import os

    pytester.makeconftest(
        CONFTEST.format(tests=os.path.dirname(__file__)).replace(
            "Only(CountingBackend())", "Only(xpupack.EagerBackend())"
        )
    )
    pytester.makepyfile(
        test_user="""
        import torch

        def test_unrecorded_batch_in_training_mode(model):
            model.train()
            model(torch.randn(16, 8))
    """
    )
    pytester.runpytest().assert_outcomes(passed=1)


DEFERRED_CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import pytest, torch, xpupack
import xpupack.backends.inductor as inductor
from support.models import make_stack, stack_samples
from xpupack import _background

@pytest.fixture(scope="session")
def package(tmp_path_factory):
    tuned = xpupack.tune(make_stack(), stack_samples(), modules=["layers.0.mlp"],
                         strategy=xpupack.Only(xpupack.InductorBackend()))
    return xpupack.save(tuned, tmp_path_factory.mktemp("inductor") / "pkg")

@pytest.fixture
def compile_fails_after_load(package, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("the compile failed on the worker")
    monkeypatch.setattr(inductor, "check_against_original", fail)
    model = xpupack.load(make_stack(), package, defer_compile=True)
    _background.wait(120)  # the compile off the caller's path has failed by now
    return model

@pytest.fixture
def compiled_after_load(package):
    model = xpupack.load(make_stack(), package, defer_compile=True)
    _background.wait(120)
    return model
"""

DEFERRED_TESTS = """
    import torch

    def call(model):
        with torch.no_grad():
            model(torch.randn(2, 8))

    def test_compiled_code_never_came_alive(compile_fails_after_load):
        call(compile_fails_after_load)

    def test_compiled_code_serves(compiled_after_load):
        call(compiled_after_load)
        assert xpupack_stats_ok(compiled_after_load)

    def xpupack_stats_ok(model):
        import xpupack
        return xpupack.stats(model)["layers.0.mlp"]["compiled_serving"] is True
"""


@pytest.mark.slow  # a pytest process of its own that tunes with Inductor
def test_a_deploy_test_fails_when_the_compile_after_load_fails(pytester):
    """Regression (reliability round 4, item 5): with the compile off the caller's path
    (``load(defer_compile=True)``), a compile that failed after ``load()`` returned left the original module
    serving and the deploy test passed; it failed only with the compile not deferred. (In a process of its
    own: its compiles on xpupack's worker thread must not share this one's compiler state.)"""
    import os

    pytester.makeconftest(DEFERRED_CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makepyfile(test_user=DEFERRED_TESTS)
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_compiled_code_never_came_alive _*",
            "*layers.0.mlp: package inductor, runs eager*the compile failed on the worker*",
        ]
    )
