"""What a package can make a loader allocate or do: bounded before anything is allocated, capped by the loader."""

import json

import pytest
from click.testing import CliRunner

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, copy_package, rewrite_json, rewrite_manifest, snapshot
from xpupack.cli import main
from xpupack.errors import PackageLimitError
from xpupack.limits import ENVIRONMENT, LoadLimits, compiles_of, synthesized_bytes
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


# -- compile work is bounded per package (issue 32, item 6) -------------------------------------------------------


def _inductor_everywhere(manifest):
    """Both MLPs ask to be compiled: 2 signatures each, 4 compiles for the package (nothing compiles: the
    limit refuses it first)."""
    for entry in manifest["modules"]:
        entry["backend"] = {"name": "inductor", "options": {}, "config": {}}


def test_compiles_are_bounded_for_the_package_as_a_whole_not_per_module(package, tmp_path, monkeypatch):
    """2 modules × 24 signatures made a loader compile for 43 s: each module was within every limit."""
    root = copy_package(package, tmp_path / "pkg")
    rewrite_manifest(root, _inductor_everywhere)
    error = _refused(root, "max_compiles", limits=LoadLimits(max_compiles=3, max_signatures=2))
    assert (error.limit, error.actual) == (3, 4)
    assert "4 compiles" in str(error) and "LoadLimits(max_compiles=" in str(error)
    monkeypatch.setenv("XPUPACK_MAX_COMPILES", "3")
    error = _refused(root, "max_compiles")
    assert "XPUPACK_MAX_COMPILES=3" in str(error)  # the variable and the value it has


def test_signatures_with_state_of_one_family_share_a_compile():
    """Calls with state compile once per family and size pattern (sizes as symbols), as Inductor does."""
    cache = {
        "kind": "state",
        "type": "transformers.DynamicCache",
        "tensors": [{"shape": [2, 4, 7, 16], "stride": [1] * 4, "dtype": "bfloat16", "device": "cpu"}],
    }
    longer = json.loads(json.dumps(cache))
    longer["tensors"][0]["shape"][2] = 9
    signatures = [
        {"tree": "t", "leaves": [_leaf_of([2, 1], "int64"), cache]},
        {"tree": "t", "leaves": [_leaf_of([2, 1], "int64"), longer]},  # another cache length: the same compile
        {"tree": "t", "leaves": [_leaf_of([2, 5], "int64")]},  # without state: one static compile each
        {"tree": "t", "leaves": [_leaf_of([4, 5], "int64")]},
    ]
    assert compiles_of(signatures) == 3


def test_verify_says_what_a_package_costs_to_load(package, tmp_path):
    assert verify_package(package)["load_work"] == {
        "signatures": 4,
        "compiles": 0,
        "recordings": 0,
        "input_bytes": 384,  # f32[2,8] and f32[4,8] for each MLP
    }
    root = copy_package(package, tmp_path / "pkg")
    rewrite_manifest(root, _inductor_everywhere)
    assert verify_package(root)["load_work"]["compiles"] == 4
    result = CliRunner().invoke(main, ["verify", str(root)])
    assert "load work: 4 signatures, 4 compiles, 0 graph recordings" in result.output


def test_verify_reports_a_package_over_the_compile_limit(package, tmp_path, monkeypatch):
    root = copy_package(package, tmp_path / "pkg")
    rewrite_manifest(root, _inductor_everywhere)
    monkeypatch.setenv("XPUPACK_MAX_COMPILES", "3")
    result = verify_package(root)
    assert not result["ok"] and any("XPUPACK_MAX_COMPILES=3" in problem for problem in result["problems"])


# -- a large spec is read once (issue 32, item 7) -----------------------------------------------------------------


def _count_reads(monkeypatch):
    """Counts, per spec file, how often it is parsed and how often it is schema-checked."""
    import xpupack.manifest as manifest_module

    parsed, checked = {}, {}
    read_json, validate = manifest_module.read_json, manifest_module.validate

    def counting_read(root, relative, schema_name, **kwargs):
        parsed[relative] = parsed.get(relative, 0) + 1
        return read_json(root, relative, schema_name, **kwargs)

    def counting_validate(data, name, where):
        checked[where] = checked.get(where, 0) + 1
        return validate(data, name, where)

    monkeypatch.setattr(manifest_module, "read_json", counting_read)
    monkeypatch.setattr(manifest_module, "validate", counting_validate)
    return parsed, checked


def test_load_and_verify_parse_and_schema_check_each_spec_once(package, monkeypatch):
    """A 100 MB spec took verify 343 s and load 319 s: it was read and schema-checked three times each."""
    parsed, checked = _count_reads(monkeypatch)
    xpupack.load(make_stack(), package)
    assert parsed == {SPEC: 1, SPEC.replace("0", "1"): 1, "xpupack.json": 1}
    assert sorted(checked.values()) == [1, 1, 1]
    parsed.clear(), checked.clear()
    assert verify_package(package)["ok"]
    assert parsed == {SPEC: 1, SPEC.replace("0", "1"): 1, "xpupack.json": 1}
    assert sorted(checked.values()) == [1, 1, 1]


def _wide(spec, signatures, leaves):
    """The spec's first signature, called with ``leaves`` constants more, ``signatures`` times."""
    first = spec["signatures"][0]
    first["leaves"] += [{"kind": "constant", "value": i} for i in range(leaves)]
    first["tree"] = json.dumps(_tree_of(len(first["leaves"])))
    spec["signatures"] = [first] * signatures
    spec["signature_calls"] = [1] * signatures
    spec.pop("batch_axes", None)


def _tree_of(positional):
    """The pytree of ``(args, {})`` with ``positional`` leaf arguments, as torch serialises it."""
    leaf = {"type": None, "context": None, "children_spec": []}
    args = {"type": "builtins.tuple", "context": "null", "children_spec": [leaf] * positional}
    kwargs = {"type": "builtins.dict", "context": "[]", "children_spec": []}
    return [1, {"type": "builtins.tuple", "context": "null", "children_spec": [args, kwargs]}]


@pytest.mark.parametrize("limit", ["max_signatures", "max_leaves"])
def test_a_spec_over_the_limits_is_refused_before_its_schema_check(package, tmp_path, monkeypatch, limit):
    root = copy_package(package, tmp_path / "pkg")
    rewrite_json(root, SPEC, lambda spec: _wide(spec, 40, 100))
    parsed, checked = _count_reads(monkeypatch)
    _refused(root, limit, limits=LoadLimits(**{limit: 30}))
    assert str(root / SPEC) not in checked
    result = verify_package(root)
    assert result["ok"]  # within the default limits
    monkeypatch.setenv(ENVIRONMENT[limit], "30")
    checked.clear()
    result = verify_package(root)
    assert not result["ok"] and limit in result["problems"][0] and str(root / SPEC) not in checked


def test_a_spec_s_leaves_are_checked_without_jsonschema_walking_each_one(package, tmp_path, monkeypatch):
    """jsonschema took ~0.5 ms a leaf (every leaf tried against each of the schema's ``oneOf`` kinds): a spec
    within the limits (256 × 4,096 leaves) cost minutes per check. Its leaves are checked in Python, and
    jsonschema sees only the rest of the spec (and a leaf that fails, to name the field)."""
    import jsonschema

    root = copy_package(package, tmp_path / "pkg")
    rewrite_json(root, SPEC, lambda spec: _wide(spec, 8, 500))
    seen = []
    real = jsonschema.Draft202012Validator

    class Counting:
        def __init__(self, schema):
            self.validator = real(schema)

        def iter_errors(self, instance):
            seen.append(json.dumps(instance).count('"kind"'))
            return self.validator.iter_errors(instance)

    monkeypatch.setattr(jsonschema, "Draft202012Validator", Counting)
    assert verify_package(root)["ok"]
    assert max(seen) == 0


_TENSOR = {"kind": "tensor", "shape": [2, 8], "dtype": "float32", "device": "cpu"}
_STATE = {
    "kind": "state",
    "type": "transformers.DynamicCache",
    "tensors": [{"shape": [1, 2], "stride": [2, 1], "dtype": "bfloat16", "device": "cuda:0"}],
}


def _changed(leaf, **change):
    return {**json.loads(json.dumps(leaf)), **change}


@pytest.mark.parametrize(
    "leaf",
    [
        _TENSOR,
        _STATE,
        *({"kind": "constant", "value": value} for value in (None, True, 0, -3, 2.5, "x", {"float": "nan"})),
        {"kind": "constant", "value": {"dtype": "float16"}},
        {"kind": "constant", "value": {"device": "cpu"}},
        _changed(_TENSOR, shape=[2.0, 8]),  # a JSON Schema integer
        _changed(_TENSOR, shape=[-1]),
        _changed(_TENSOR, shape=[True]),
        _changed(_TENSOR, shape="2,8"),
        _changed(_TENSOR, dtype="Float32"),
        _changed(_TENSOR, dtype="float32\n"),  # the schema's pattern, as jsonschema searches it
        _changed(_TENSOR, device=0),
        _changed(_TENSOR, extra=1),
        {key: value for key, value in _TENSOR.items() if key != "device"},
        _changed(_STATE, tensors=[]),
        _changed(_STATE, tensors=[{**_STATE["tensors"][0], "stride": [1.5]}]),
        _changed(_STATE, type=None),
        {"kind": "constant", "value": {"float": "NaN"}},
        {"kind": "constant", "value": {"dtype": 1}},
        {"kind": "constant", "value": {"dtype": "a", "device": "b"}},
        {"kind": "constant", "value": [1]},
        {"kind": "constant"},
        {"kind": "other", "value": 1},
        [],
        None,
    ],
)
def test_the_python_leaf_check_agrees_with_the_schema(leaf):
    """`manifest._leaf_fits` stands in for the schema's rule of a leaf: the two say the same of every leaf."""
    import jsonschema

    from xpupack.manifest import _leaf_fits, _leaf_schema

    assert _leaf_fits(leaf) == jsonschema.Draft202012Validator(_leaf_schema()).is_valid(leaf)


def test_a_bad_leaf_of_a_large_spec_is_named_by_its_place(package, tmp_path):
    root = copy_package(package, tmp_path / "pkg")

    def spoil(spec):
        _wide(spec, 3, 10)
        spec["signatures"] = json.loads(json.dumps(spec["signatures"]))
        spec["signatures"][2]["leaves"][7]["value"] = {"float": "NaN"}

    rewrite_json(root, SPEC, spoil)
    result = verify_package(root)
    assert not result["ok"] and "does not match the spec schema at signatures/2/leaves/7" in result["problems"][0]
