"""What a package can make a loader allocate or do: bounded before anything is allocated, capped by the loader."""

import json

import pytest
from click.testing import CliRunner

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, copy_package, rewrite_json, rewrite_manifest, snapshot
from xpupack.cli import main
from xpupack.errors import PackageLimitError
from xpupack.limits import LoadLimits, synthesized_bytes
from xpupack.report import verify_package

SPEC = "modules/layers.0.mlp/spec.json"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """An eager package of the stack's MLPs: two signatures each, f32[2,8] and f32[4,8]."""
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.EagerBackend())
    )
    return xpupack.save(model, tmp_path_factory.mktemp("limits") / "pkg")


def _leaf_of(shape, dtype="float32"):
    return {"kind": "tensor", "shape": shape, "dtype": dtype, "device": "cpu"}


def _refused(root, field, **load):
    model = make_stack()
    before = snapshot(model)
    with pytest.raises(PackageLimitError, match=field) as error:
        xpupack.load(model, root, **load)
    assert_unchanged(model, before)
    assert error.value.field == field
    return error.value


def test_a_huge_spec_leaf_is_refused_before_anything_is_allocated(package, tmp_path):
    """A 40 GiB input (under the 64 GiB a single leaf may describe) is over the default total of 32 GiB."""
    root = copy_package(package, tmp_path / "pkg")
    rewrite_json(
        root, SPEC, lambda spec: spec["signatures"][0]["leaves"].__setitem__(0, _leaf_of([10 * 2**30], "float32"))
    )
    error = _refused(root, "max_input_bytes")
    assert error.limit == 32 * 2**30 and error.actual > error.limit
    assert "LoadLimits(max_input_bytes=" in str(error) and "XPUPACK_MAX_INPUT_BYTES" in str(error)


def test_the_loader_caps_the_inputs_a_package_makes_it_synthesise(package):
    """The stack's two MLPs take f32[2,8] and f32[4,8] each: 4 × 96 bytes in all."""
    _refused(package, "max_input_bytes", limits=LoadLimits(max_input_bytes=300))
    model = xpupack.load(make_stack(), package, limits=LoadLimits(max_input_bytes=384))
    assert xpupack.stats(model)["layers.0.mlp"]["signatures"] == 2


def test_signatures_per_module_are_capped_by_an_environment_variable(package, monkeypatch):
    monkeypatch.setenv("XPUPACK_MAX_SIGNATURES", "1")
    error = _refused(package, "max_signatures")
    assert "describes 2 signatures" in str(error) and "XPUPACK_MAX_SIGNATURES" in str(error)
    xpupack.load(make_stack(), package, limits=LoadLimits(max_signatures=2))  # the keyword wins


def test_leaves_per_signature_are_capped(package, tmp_path):
    root = copy_package(package, tmp_path / "pkg")

    def add_leaves(spec):  # batch axes name every leaf: the added ones have none, so none are claimed
        spec["signatures"][0]["leaves"].extend([_leaf_of([1])] * 5000)
        spec.pop("batch_axes", None)

    rewrite_json(root, SPEC, add_leaves)
    error = _refused(root, "max_leaves")
    assert "signature 0 has 5002 leaves" in str(error)  # x, scale and the 5000 added


def test_a_graph_package_cannot_claim_a_billion_recordings(package, tmp_path):
    root = copy_package(package, tmp_path / "pkg")
    rewrite_manifest(
        root,
        lambda manifest: manifest["modules"][0].update(
            backend={"name": "graph", "options": {"max_recordings": 10**9}, "config": {}}
        ),
    )
    error = _refused(root, "max_recordings")
    assert error.actual == 10**9 and error.limit == 256 and "layers.0.mlp" in str(error)
    # raised by the loader, the package's claim passes (and a CPU runs the original module instead)
    model = xpupack.load(make_stack(), root, limits=LoadLimits(max_recordings=10**9))
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "eager"


def test_verify_refuses_what_load_refuses(package, tmp_path, monkeypatch):
    root = copy_package(package, tmp_path / "pkg")
    rewrite_json(
        root, SPEC, lambda spec: spec["signatures"][0]["leaves"].__setitem__(0, _leaf_of([10 * 2**30], "float32"))
    )
    result = verify_package(root)
    assert not result["ok"] and any("max_input_bytes" in problem for problem in result["problems"])
    monkeypatch.setenv("XPUPACK_MAX_INPUT_BYTES", str(64 * 2**30))
    assert verify_package(root)["ok"]


def test_state_leaves_are_never_synthesised_so_they_count_no_bytes():
    """A 70B model's KV cache is tens of GiB: a signature that carries it synthesises nothing at load."""
    cache = {
        "kind": "state",
        "type": "transformers.DynamicCache",
        "tensors": [{"shape": [80, 64, 8, 8192, 128], "stride": [1] * 5, "dtype": "bfloat16", "device": "cuda:0"}],
    }
    assert synthesized_bytes({"leaves": [_leaf_of([64, 1], "int64"), cache]}) == 0
    assert synthesized_bytes({"leaves": [_leaf_of([64, 1], "int64"), _leaf_of([3], "bfloat16")]}) == 64 * 8 + 6


@pytest.mark.parametrize("limits", [dict(max_signatures=0), dict(max_leaves=True), dict(max_input_bytes=1.5)])
def test_limits_are_positive_integers(limits):
    with pytest.raises(ValueError, match="positive integer"):
        LoadLimits(**limits)


def test_a_bad_environment_value_names_the_variable(package, monkeypatch):
    monkeypatch.setenv("XPUPACK_MAX_RECORDINGS", "lots")
    with pytest.raises(ValueError, match="XPUPACK_MAX_RECORDINGS='lots'"):
        xpupack.load(make_stack(), package)


@pytest.mark.parametrize(
    "text",
    ["0", "-1", "\u0663\u0662", "\uff13", "1__0", "1" * 5000],
    ids=["0", "-1", "arabic", "fullwidth", "1__0", "long"],
)
def test_an_environment_value_other_than_ascii_digits_or_below_one_names_the_variable(package, monkeypatch, text):
    """``int()`` takes Arabic-Indic digits (and 0 passed on to `LoadLimits`, whose message did not say where it
    came from): every refusal names the variable, in xpupack's error, which the CLI prints in one line."""
    monkeypatch.setenv("XPUPACK_MAX_SIGNATURES", text)
    with pytest.raises(xpupack.LimitSettingError, match="XPUPACK_MAX_SIGNATURES=.* is not a positive whole") as error:
        xpupack.load(make_stack(), package)
    assert (error.value.variable, error.value.field, error.value.value) == (
        "XPUPACK_MAX_SIGNATURES",
        "max_signatures",
        text,
    )
    result = CliRunner().invoke(main, ["verify", str(package)])
    assert result.exit_code == 3 and result.stderr.startswith("error: XPUPACK_MAX_SIGNATURES=")  # not "damaged"


def test_an_environment_value_may_group_ascii_digits(package, monkeypatch):
    monkeypatch.setenv("XPUPACK_MAX_INPUT_BYTES", " 2_000 ")
    assert LoadLimits.from_environment().max_input_bytes == 2000


def test_limit_errors_name_the_field_in_the_message_and_fields(package):
    error = _refused(package, "max_signatures", limits=LoadLimits(max_signatures=1))
    assert (error.limit, error.actual) == (1, 2)
    assert json.loads((package / "xpupack.json").read_text())["modules"][0]["path"] == "layers.0.mlp"
