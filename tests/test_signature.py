import json

import pytest
import torch

from xpupack.signature import ConstantLeaf, Signature, TensorLeaf, Unrecordable, fit_key


def key_of(*args, **kwargs):
    return fit_key(args, kwargs)[0]


def test_signature_key_equals_call_key():
    x = torch.randn(2, 3)
    signature = Signature.of_call((x,), {"scale": 2.0, "mask": None})
    assert signature.key == key_of(x, scale=2.0, mask=None)


@pytest.mark.parametrize(
    "other",
    [
        lambda x: ((torch.randn(4, 3),), {"scale": 2.0, "mask": None}),  # batch size
        lambda x: ((x,), {"scale": 3.0, "mask": None}),  # constant
        lambda x: ((x,), {"scale": 2, "mask": None}),  # int vs float constant
        lambda x: ((x,), {"scale": 2.0}),  # missing kwarg
        lambda x: ((x.double(),), {"scale": 2.0, "mask": None}),  # dtype
        lambda x: ((x, 2.0), {"mask": None}),  # positional vs keyword
        lambda x: ((x,), {"scale": 2.0, "mask": torch.ones(2, 3)}),  # None vs tensor
    ],
)
def test_any_static_difference_changes_the_key(other):
    x = torch.randn(2, 3)
    base = key_of(x, scale=2.0, mask=None)
    args, kwargs = other(x)
    assert key_of(*args, **kwargs) != base


def test_nested_calls_use_the_tree_key():
    x = torch.randn(2, 3)
    signature = Signature.of_call(([x, x], {"inner": (x, 1.0)}), {"scale": 2.0})
    assert signature.flat_layout is None
    assert signature.key == key_of([x, x], {"inner": (x, 1.0)}, scale=2.0)
    assert signature.key != key_of([x, x], {"inner": [x, 1.0]}, scale=2.0)  # list vs tuple


def test_flat_and_tree_keys_never_collide():
    x = torch.randn(2, 3)
    assert key_of(x, x) != key_of((x, x))


def test_kwargs_order_does_not_matter():
    x = torch.randn(2, 3)
    assert key_of(x, a=1.0, b=None) == key_of(x, b=None, a=1.0)


def test_the_key_order_of_a_dict_in_a_call_does_not_matter():
    """transformers hands Gemma 2 and 3 their masks as a dict built in the order of a set of strings, which
    another process (its own string hashing) may order the other way (issue 31)."""
    full, sliding = torch.zeros(1, 1, 8, 13), torch.zeros(1, 1, 8, 8)
    one = {"full_attention": full, "sliding_attention": sliding}
    other = {"sliding_attention": sliding, "full_attention": full}
    assert key_of(x=[one]) == key_of(x=[other])
    assert fit_key((), {"mask": one})[1] == fit_key((), {"mask": other})[1] == [full, sliding]
    recorded = Signature.of_call((), {"mask": one})
    assert Signature.from_json(recorded.to_json()).key == Signature.of_call((), {"mask": other}).key
    mixed = {2: full, "a": sliding}  # keys that do not sort keep their order
    assert fit_key((mixed,), {})[1] == [full, sliding]


def test_json_round_trip_keeps_the_key():
    x = torch.randn(2, 3)
    signature = Signature.of_call(
        (x, [x, (1, "mode")]),
        {"dtype": torch.float16, "eps": float("inf"), "device": torch.device("cpu"), "flag": True},
    )
    restored = Signature.from_json(json.loads(json.dumps(signature.to_json())))
    assert restored == signature
    assert restored.key == signature.key


def test_unrecordable_leaf_names_its_type():
    class KVCache:
        pass

    with pytest.raises(Unrecordable, match="KVCache"):
        Signature.of_call((torch.randn(1),), {"cache": KVCache()})


def test_synthesize_matches_the_signature_with_valid_indices():
    ids = torch.randint(5, 9, (2, 7))
    signature = Signature.of_call((ids, torch.randn(2, 7, 4, dtype=torch.float16)), {"scale": 0.5})
    args, kwargs = signature.synthesize()
    assert Signature.of_call(args, kwargs) == signature
    assert int(args[0].max()) == 0  # zeros are a valid index for any embedding


def test_on_device_maps_tensor_leaves():
    signature = Signature.of_call((torch.randn(1),), {})
    moved = signature.on_device({torch.device("cpu"): torch.device("meta")})
    assert moved.leaves[0] == TensorLeaf((1,), torch.float32, torch.device("meta"))


@pytest.mark.parametrize(
    "bad",
    [
        {"tree": "not json", "leaves": []},
        {"tree": Signature.of_call((torch.randn(1),), {}).to_json()["tree"], "leaves": []},
        {
            "tree": Signature.of_call((torch.randn(1),), {}).to_json()["tree"],
            "leaves": [{"kind": "tensor", "shape": [1], "dtype": "no_such_dtype", "device": "cpu"}],
        },
    ],
)
def test_from_json_rejects_malformed_input(bad):
    with pytest.raises((ValueError, KeyError)):
        Signature.from_json(bad)


def test_describe_is_short():
    signature = Signature.of_call((torch.randn(1, 16, 64),), {"scale": 2.0})
    assert signature.describe() == "(f32[1,16,64], 2.0)"
    assert isinstance(signature.leaves[1], ConstantLeaf)


def _tree_with_kwargs_context(context):
    """A stored tree of ``(x,), {one kwarg}`` whose kwargs context is replaced by ``context``."""
    signature = Signature.of_call((torch.randn(1),), {"scale": 1.0})
    data = signature.to_json()
    tree = json.loads(data["tree"])
    tree[1]["children_spec"][1]["context"] = context
    return {**data, "tree": json.dumps(tree)}


@pytest.mark.parametrize(
    "tree",
    [
        # torch's parser imports the module an enum key names
        lambda name: _tree_with_kwargs_context(json.dumps([{"__enum__": True, "fqn": f"{name}:E", "name": "a"}])),
        # ... and the module a defaultdict's default_factory names
        lambda name: {
            "leaves": [],
            "tree": json.dumps(
                [
                    1,
                    {
                        "type": "builtins.tuple",
                        "context": "null",
                        "children_spec": [
                            {
                                "type": "builtins.tuple",
                                "context": "null",
                                "children_spec": [
                                    {
                                        "type": "collections.defaultdict",
                                        "context": {
                                            "default_factory_module": name,
                                            "default_factory_name": "E",
                                            "dict_context": [],
                                        },
                                        "children_spec": [],
                                    }
                                ],
                            },
                            {"type": "builtins.dict", "context": "[]", "children_spec": []},
                        ],
                    },
                ]
            ),
        },
    ],
)
def test_parsing_a_hostile_tree_never_imports_a_module(tree, tmp_path, monkeypatch):
    probe = tmp_path / "xpupack_import_probe.py"
    probe.write_text(
        "import enum, pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).write_text('yes')\n"
        "class E(enum.Enum):\n    a = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="context|not allowed"):
        Signature.from_json(tree("xpupack_import_probe"))
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"tree": 1, "leaves": []},
        {"tree": "[1, {}]", "leaves": []},
        {"tree": "[2, null]", "leaves": []},
        {"tree": json.dumps([1, {"type": None, "context": None, "children_spec": []}]), "leaves": [{}]},
        {"tree": "[" * 10000 + "]" * 10000, "leaves": []},
    ],
)
def test_from_json_raises_only_value_errors(bad):
    with pytest.raises(ValueError):
        Signature.from_json(bad)


@pytest.mark.parametrize(
    "leaf",
    [
        {"kind": "tensor", "shape": [1], "dtype": "float32", "device": "no-such-device"},
        {"kind": "tensor", "shape": [-1], "dtype": "float32", "device": "cpu"},
        {"kind": "tensor", "shape": [1], "dtype": "_dynamo", "device": "cpu"},
        {"kind": "constant", "value": {"device": "warp:0"}},
        {"kind": "constant", "value": [1, 2]},
        {"kind": "mystery"},
    ],
)
def test_bad_leaves_are_value_errors(leaf):
    data = Signature.of_call((torch.randn(1),), {}).to_json()
    with pytest.raises(ValueError):
        Signature.from_json({**data, "leaves": [leaf]})


def test_negative_zero_is_another_constant():
    """``0.0 == -0.0`` in Python, but ``x * -0.0`` has other signs than ``x * 0.0``: no shared recording."""
    x = torch.randn(2, 3)
    assert key_of(x, scale=-0.0) != key_of(x, scale=0.0)
    assert Signature.of_call((x,), {"scale": -0.0}).key == key_of(x, scale=-0.0)
    restored = Signature.from_json(json.loads(json.dumps(Signature.of_call((x,), {"scale": -0.0}).to_json())))
    assert restored.key == key_of(x, scale=-0.0)


@pytest.mark.parametrize("kind", ["tensor", "state"])
def test_a_terabyte_tensor_claim_is_refused_when_parsed(kind):
    from xpupack.signature import _leaf_from_json

    huge = {"shape": [1024, 1024, 1024, 1024], "dtype": "float32", "device": "cpu"}
    data = (
        {"kind": "tensor", **huge}
        if kind == "tensor"
        else {"kind": "state", "type": "x.Cache", "tensors": [{**huge, "stride": [2**30, 2**20, 2**10, 1]}]}
    )
    with pytest.raises(ValueError, match="4096 GiB"):
        _leaf_from_json(data)


def test_the_size_pattern_keeps_zeros_ones_and_which_sizes_are_equal():
    """Dynamo's first compile with sizes as symbols keeps 0 and 1 and gives equal sizes one symbol: calls
    that agree on that share a compile (a longer cache), calls that do not get their own (another batch)."""

    def pattern(batch, length):
        return Signature.of_call((torch.zeros(batch, 1, length), torch.zeros(batch, 2, length, 16)), {}).size_pattern

    assert pattern(1, 13) == ((1, 1, "s0"), (1, "s1", "s0", "s2"))
    assert pattern(1, 40) == pattern(1, 13)  # a longer cache: the same pattern
    assert pattern(3, 13) == (("s0", 1, "s1"), ("s0", "s2", "s1", "s3"))  # 1 is kept as it is, 3 is a symbol
    assert pattern(2, 13) == (("s0", 1, "s1"), ("s0", "s0", "s1", "s2"))  # 2 rows: as many as the heads
    assert pattern(1, 16) != pattern(1, 13)  # a length that equals the head size
