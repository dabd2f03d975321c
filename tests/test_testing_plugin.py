"""The pytest plugin that users' deploy-after-load tests rely on."""

pytest_plugins = ["pytester"]

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
    pytester.makepyfile(test_user="""
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
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*2 call(s) of tuned modules ran the original module*",
                                 "*layers.0.mlp: no recorded signature fits*"])


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


def test_the_marker_allows_fallbacks_under_strict_markers_and_the_failure_names_the_switches(
        pytester, fallback_calls):
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*take the `fallback_calls` fixture*@pytest.mark.xpupack_allow_fallbacks*"
                                 "xpupack_fail_on_fallback = false*"])
    assert "xpupack_allow_fallbacks" in pytester.runpytest("--markers").stdout.str()


def test_the_ini_option_switches_failing_off_for_a_project(pytester, fallback_calls):
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__)))
    pytester.makeini("[pytest]\nxpupack_fail_on_fallback = false\n")
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=2)


def test_a_deploy_test_of_eager_modules_passes_on_any_batch(pytester, fallback_calls):
    """An eager module runs every call as it would untuned: no call of it is a fallback to fail a test on."""
    import os

    pytester.makeconftest(CONFTEST.format(tests=os.path.dirname(__file__))
                          .replace("Only(CountingBackend())", "Only(xpupack.EagerBackend())"))
    pytester.makepyfile(test_user="""
        import torch

        def test_unrecorded_batch_in_training_mode(model):
            model.train()
            model(torch.randn(16, 8))
    """)
    pytester.runpytest().assert_outcomes(passed=1)
