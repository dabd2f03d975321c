"""Fuzzing the manifest and spec readers, whole loads of mutated packages, and calls (hypothesis).

The properties:

- a reader given anything raises an `XpupackError` (the spec parser: ``ValueError``) or returns
  something valid — never another exception, never an import;
- a load of a mutated package either raises an `XpupackError` and leaves the model exactly as it
  was, or succeeds, and then every tuned module gives what the same model gives untuned;
- a call with arbitrary inputs gives eager's result or eager's error.

Run with ``--hypothesis-show-statistics`` for the number of examples each property tried;
``XPUPACK_FUZZ_SCALE=20`` multiplies them for a longer search than CI's.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import xpupack
from support.backends import CountingBackend
from support.compare_calls import assert_same_outcome, outcome
from support.emulated_graph import EmulatedGraphs
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, snapshot
from xpupack import _device
from xpupack.backends._megacache import artifact_counts
from xpupack.errors import IntegrityError, PackageFormatError, XpupackError
from xpupack.manifest import MANIFEST, read_manifest
from xpupack.report import package_report, verify_package
from xpupack.signature import Signature
from xpupack.spec import read_module_spec

#: hundreds of mutated inputs per reader: slow (the quick loop has each reader's hand-written refusals)
pytestmark = pytest.mark.slow
SCALE = int(os.environ.get("XPUPACK_FUZZ_SCALE", "1"))
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHEAP = settings(FUZZ, max_examples=500 * SCALE)
LOADS = settings(FUZZ, max_examples=200 * SCALE)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)
#: strings a mutation may put anywhere: paths that escape, names that exist, devices, dtypes, backends
TRICKY_STRINGS = [
    "",
    ".",
    "..",
    "../x",
    "/etc/passwd",
    "a\\b",
    "C:/x",
    "~",
    "x\0y",
    "./model.safetensors",
    "model.safetensors",
    "xpupack.json",
    "README.md",
    ".cache/x",
    ".git/config",
    "modules/layers.0.mlp/spec.json",
    "modules/layers.1.mlp/spec.json",
    "modules/layers.1.mlp",
    "layers.0.mlp",
    "layers.1.mlp",
    "layers",
    "",
    "cpu",
    "meta",
    "cuda:0",
    "warp:0",
    "float64",
    "float16",
    "int64",
    "_dynamo",
    "graph",
    "eager",
    "counting",
    "builtins.dict",
    "collections.defaultdict",
    "os:system",
    "__enum__",
]
tricky = (
    st.sampled_from(TRICKY_STRINGS)
    | st.sampled_from([0, -1, 1, 2, 2**63, 1.5, -0.0, float("nan"), True, False, None, [], {}])
    | json_values
)


@contextlib.contextmanager
def emulated_graphs():
    previous = _device.GRAPH_APIS.get("cpu")
    _device.GRAPH_APIS["cpu"] = EmulatedGraphs()
    try:
        yield
    finally:
        if previous is None:
            _device.GRAPH_APIS.pop("cpu", None)
        else:
            _device.GRAPH_APIS["cpu"] = previous


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """One small package per backend kind: eager, counting (options), graph (emulated)."""
    folder = tmp_path_factory.mktemp("fuzz")
    built = {}
    for kind, backend in (
        ("eager", xpupack.EagerBackend()),
        ("counting", CountingBackend()),
        ("graph", xpupack.GraphBackend()),
    ):
        with emulated_graphs():
            model = xpupack.tune(
                make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(backend)
            )
            built[kind] = xpupack.save(model, folder / kind)
    return built


# -- the readers alone ---------------------------------------------------------------------------------


def _write_manifest(data: bytes) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="xpupack-fuzz-"))
    (folder / MANIFEST).write_bytes(data)
    return folder


def _read_manifest_of(data: bytes) -> None:
    """Reads ``data`` as a manifest: it must parse or be refused with an XpupackError, nothing else."""
    root = _write_manifest(data)
    try:
        read_manifest(root)
    except XpupackError as exc:
        event(f"refused: {type(exc).__name__}")
    finally:
        shutil.rmtree(root)


@CHEAP
@given(st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_manifest_reader_takes_any_bytes(data):
    _read_manifest_of(data)


@CHEAP
@given(json_values)
def test_manifest_reader_takes_any_json(value):
    _read_manifest_of(json.dumps(value).encode())


@CHEAP
@given(st.binary(max_size=400))
def test_mega_cache_reader_takes_any_bytes_behind_a_valid_checksum_and_version(data):
    """What `xpupack inspect` reads of an Inductor package's mega-cache: counts, or a PackageFormatError."""
    body = (1).to_bytes(8, "big") + data
    try:
        counts = artifact_counts(io.BytesIO(zlib.crc32(body).to_bytes(4, "big") + body), "cache.bin")
    except PackageFormatError:
        event("refused")
    else:
        event(f"read {len(counts)} artifact types")
        assert all(name.isidentifier() and n > 0 for name, n in counts.items())


def _containers(value, found=None):
    """Every ``(container, key)`` of a JSON document, the document's own slots included."""
    found = [] if found is None else found
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found.append((value, key))
        _containers(child, found)
    return found


def _like(value):
    """A strategy for values of the same JSON type as ``value``: such changes usually pass the schema and
    reach the code behind it."""
    if isinstance(value, bool):
        return st.just(not value)
    if isinstance(value, (int, float)):
        return st.sampled_from([0, 1, 2, -1, 3, 2**31, 2**63]) | st.integers(-3, 100)
    if isinstance(value, str):
        return (
            st.sampled_from(TRICKY_STRINGS)
            | st.text(max_size=4).map(lambda extra: value + extra)
            | st.integers(0, max(0, len(value) - 1)).map(lambda cut: value[:cut])
        )
    if isinstance(value, list) and value:
        return st.sampled_from([value[1:], value + value[-1:], value[::-1], []])
    if isinstance(value, dict) and value:
        return st.sampled_from(sorted(value)).map(lambda key: {k: v for k, v in value.items() if k != key})
    return tricky


@st.composite
def mutations(draw, document, *, max_changes=3):
    """``document`` with 1-3 random changes: mostly a value replaced by another of its type, else by anything
    (often a tricky string), a key removed or added."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, max_changes))):
        slots = _containers(document)
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["same type"] * 4 + ["replace", "remove", "add"]))
        if action == "same type":
            container[key] = draw(_like(container[key]))
        elif action == "replace":
            container[key] = draw(tricky)
        elif action == "remove":
            del container[key]
        elif isinstance(container, dict):
            container[draw(st.sampled_from(TRICKY_STRINGS) | st.text(max_size=8))] = draw(tricky)
        else:
            container.insert(key, draw(tricky))
    return document


def _signature_documents():
    signature = Signature.of_call(
        (torch.randn(2, 3), [torch.ones(1, dtype=torch.int64), (1, "mode")]),
        {"scale": -0.0, "dtype": torch.float16, "eps": float("inf"), "device": torch.device("cpu"), "mask": None},
    )
    data = signature.to_json()
    return data, json.loads(data["tree"])


@CHEAP
@given(
    json_values
    | st.builds(
        lambda tree, leaves: {"tree": tree, "leaves": leaves}, st.text(max_size=60), st.lists(json_values, max_size=3)
    )
)
def test_signature_parser_takes_any_json(value):
    try:
        Signature.from_json(value)
        event("parsed")
    except ValueError:
        event("refused")


@CHEAP
@given(st.data())
def test_signature_parser_takes_mutated_signatures_and_never_imports(data):
    document, tree = _signature_documents()
    if data.draw(st.booleans()):  # mutate inside the stored tree, where torch's parser would import
        document = {**document, "tree": json.dumps(data.draw(mutations(tree)))}
    else:
        document = data.draw(mutations(document))
    modules = set(sys.modules)
    try:
        parsed = Signature.from_json(document)
        event("parsed")
    except ValueError:
        parsed = None
        event("refused")
    assert set(sys.modules) == modules
    if parsed is not None:  # what parses, round-trips
        again = Signature.from_json(json.loads(json.dumps(parsed.to_json())))
        assert again.tree == parsed.tree and len(again.leaves) == len(parsed.leaves)


@CHEAP
@given(st.data())
def test_spec_reader_takes_any_spec(packages, data):
    root = packages["eager"]
    spec = json.loads((root / "modules/layers.0.mlp/spec.json").read_text())
    document = data.draw(mutations(spec) | json_values)
    folder = Path(tempfile.mkdtemp(prefix="xpupack-fuzz-"))
    try:
        (folder / "spec.json").write_text(json.dumps(document))
        read_module_spec(folder, {"path": "layers.0.mlp", "spec": "spec.json"})
        event("parsed")
    except XpupackError as exc:
        event(f"refused: {type(exc).__name__}")
    finally:
        shutil.rmtree(folder)


# -- whole loads of mutated packages -----------------------------------------------------------------


def _load_and_check(root, fallback_calls):
    """The load property: a clean refusal with the model unchanged, or a model whose tuned modules agree
    with the same model untuned (on a recorded batch size and on one that falls back)."""
    model = make_stack(seed=5).train()
    before = snapshot(model)
    try:
        xpupack.load(model, root)
    except XpupackError as exc:
        event(f"refused: {type(exc).__name__}")
        assert_unchanged(model, before)
        return "refused"
    event("loaded: " + ", ".join(sorted({s["backend"] for s in xpupack.stats(model).values()})))
    inputs = [torch.randn(2, 8), torch.randn(3, 8)]
    with torch.no_grad():
        tuned = [model(x) for x in inputs]
        xpupack.deactivate(model)
        eager = [model(x) for x in inputs]
    for a, e in zip(tuned, eager):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, equal_nan=True)
    fallback_calls.clear()
    return "loaded"


def _copy(root):
    folder = Path(tempfile.mkdtemp(prefix="xpupack-fuzz-"))
    return Path(shutil.copytree(root, folder / "pkg"))


@pytest.mark.slow  # hundreds of package loads
@LOADS
@given(kind=st.sampled_from(["eager", "counting", "graph"]), data=st.data())
def test_loading_a_mutated_manifest(packages, fallback_calls, kind, data):
    manifest = json.loads((packages[kind] / MANIFEST).read_text())
    root = _copy(packages[kind])
    try:
        (root / MANIFEST).write_text(json.dumps(data.draw(mutations(manifest))))
        with emulated_graphs():
            verified = verify_package(root)  # `xpupack verify` and `inspect` take it too
            with contextlib.suppress(XpupackError):
                package_report(root)
            if _load_and_check(root, fallback_calls) == "loaded":
                assert verified["ok"], verified
    finally:
        shutil.rmtree(root.parent)


@pytest.mark.slow  # hundreds of package loads
@LOADS
@given(kind=st.sampled_from(["eager", "counting", "graph"]), data=st.data())
def test_loading_a_mutated_spec_with_matching_digests(packages, fallback_calls, kind, data):
    """A hostile author rewrites a spec and its digest: still a refusal or a correct model; `inspect` raises
    only an XpupackError (malformed ``batch_axes`` gave it KeyError, IndexError, TypeError)."""
    root = _copy(packages[kind])
    try:
        relative = data.draw(st.sampled_from(["modules/layers.0.mlp/spec.json", "modules/layers.1.mlp/spec.json"]))
        spec = json.loads((root / relative).read_text())
        if data.draw(st.booleans()):
            signature = data.draw(st.sampled_from(spec["signatures"]))
            signature["tree"] = json.dumps(data.draw(mutations(json.loads(signature["tree"]))))
        else:
            spec = data.draw(mutations(spec))
        text = json.dumps(spec).encode()
        (root / relative).write_bytes(text)
        manifest = json.loads((root / MANIFEST).read_text())
        manifest["files"][relative] = {"sha256": hashlib.sha256(text).hexdigest(), "size": len(text)}
        (root / MANIFEST).write_text(json.dumps(manifest))
        with emulated_graphs():
            verified = verify_package(root)  # `xpupack verify` and `inspect` take it too, and agree with load
            with contextlib.suppress(XpupackError):
                package_report(root)
            if _load_and_check(root, fallback_calls) == "loaded":
                assert verified["ok"], verified
    finally:
        shutil.rmtree(root.parent)


@pytest.mark.slow  # hundreds of package loads
@LOADS
@given(kind=st.sampled_from(["eager", "graph"]), data=st.data())
def test_loading_a_package_with_flipped_bits(packages, fallback_calls, kind, data):
    """Any file, any byte, any bits: a file with a digest is refused as an IntegrityError; the manifest
    (which holds the digests) is refused or, where the change is harmless (a date), loads correctly."""
    root = _copy(packages[kind])
    try:
        relative = data.draw(
            st.sampled_from(sorted(json.loads((root / MANIFEST).read_text())["files"]) + [MANIFEST] * 3)
        )
        content = bytearray((root / relative).read_bytes())
        position = data.draw(st.integers(0, len(content) - 1))
        content[position] ^= data.draw(st.integers(1, 255))
        (root / relative).write_bytes(bytes(content))
        with emulated_graphs():
            if relative == MANIFEST:
                _load_and_check(root, fallback_calls)
            else:
                with pytest.raises(IntegrityError, match=relative):
                    xpupack.load(make_stack(), root)
                event("refused: IntegrityError")
    finally:
        shutil.rmtree(root.parent)


# -- calls ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_mlp():
    with emulated_graphs():
        model = make_stack()
        samples = stack_samples() + [(x, 0.0) for x in stack_samples()]
        xpupack.tune(model, samples, modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.GraphBackend()))
        yield model.layers[0]["mlp"], make_stack().layers[0]["mlp"]


def _tensor(batch, features, extra_axis, dtype, layout):
    shape = (batch, 1, features) if extra_axis else (batch, features)
    base = torch.randn(*shape, generator=torch.Generator().manual_seed(batch * 100 + features))
    if layout == "transposed":
        base = base.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "every other":
        base = torch.repeat_interleave(base, 2, dim=0)[::2]
    elif layout == "expanded" and batch:
        base = base[:1].expand(*shape)
    return base.to(dtype) if dtype.is_floating_point else (base * 10).to(dtype)


#: each field of a call: its recorded (fitting) value first, then the ways it can be wrong
CALL_FIELDS = {
    "batch": [2, 4, 0, 1, 3],
    "features": [8, 7, 16],
    "extra_axis": [False, True],
    "dtype": [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64],
    "layout": ["contiguous", "transposed", "every other", "expanded"],
    "scale": [1.0, 0.0, -0.0, 1, True, None, 2.5, float("nan"), "1.0", torch.tensor(1.0)],
    "scale_as": ["keyword", "positional", "missing"],
    "bias": ["absent", None, "tensor", "wrong tensor"],
    "extra_keyword": [False, True],
    "requires_grad": [False, True],
    "grad_mode": [False, True],
    "autocast": [False, True],
    "training": [False, True],
}


@st.composite
def calls(draw):
    """A fitting call with 0-3 of its fields changed (one wrong thing at a time reaches the most code)."""
    call = {field: values[0] for field, values in CALL_FIELDS.items()}
    for field in draw(st.lists(st.sampled_from(sorted(CALL_FIELDS)), max_size=3, unique=True)):
        call[field] = draw(st.sampled_from(CALL_FIELDS[field]))
    return call


@settings(FUZZ, max_examples=400 * SCALE)
@given(call=calls())
def test_any_call_gives_eager_result_or_eager_error(graph_mlp, fallback_calls, call):
    tuned, reference = graph_mlp
    x = _tensor(call["batch"], call["features"], call["extra_axis"], call["dtype"], call["layout"])
    if call["requires_grad"] and x.dtype.is_floating_point:
        x.requires_grad_()
    args, kwargs = [x], {}
    if call["scale_as"] == "keyword":
        kwargs["scale"] = call["scale"]
    elif call["scale_as"] == "positional":
        args.append(call["scale"])
    if call["bias"] != "absent":
        kwargs["bias"] = {None: None, "tensor": torch.ones(8), "wrong tensor": torch.ones(3)}[call["bias"]]
    if call["extra_keyword"]:
        kwargs["temperature"] = 0.5

    def run(module):
        grad = torch.enable_grad() if call["grad_mode"] else torch.no_grad()
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=call["autocast"])
        module.train(call["training"])
        try:
            with grad, cast:
                return module(*args, **kwargs)
        finally:
            module.eval()

    with emulated_graphs():
        result = outcome(lambda: run(tuned))
        assert_same_outcome(result, outcome(lambda: run(reference)))
    event(f"{result[0]}, {'fell back' if fallback_calls else 'replayed'}")
    fallback_calls.clear()
