"""Hostile and broken packages, no pickle, wrong models, the load-time check (docs/safety.md).

Every damaged package must raise a specific `XpupackError` whose message
names the file and the fix, and leave the model exactly as it was.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import xpupack
from support.backends import ArtifactBackend, CountingBackend
from support.models import Stack, make_stack, stack_samples
from support.package_tools import (
    assert_unchanged,
    copy_package,
    listed_files,
    redigest,
    rewrite_json,
    rewrite_manifest,
    snapshot,
)
from support.strategies import EAGER
from xpupack.errors import (
    BackendError,
    IntegrityError,
    ModelMismatchError,
    OutputMismatchError,
    PackageFormatError,
    UnknownConfigError,
    XpupackError,
)
from xpupack.manifest import MANIFEST
from xpupack.source import Source

FIXES = ("rebuild", "re-download", "remove it")


def build(tmp_path, strategy=EAGER, name="pkg", **kwargs):
    model = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=strategy)
    return xpupack.save(model, tmp_path / name, **kwargs)


@pytest.fixture
def package(tmp_path):
    return build(tmp_path)


# inductor copies the session's compiled package (an Inductor compile per xdist worker): slow
@pytest.fixture(params=["eager", "graph", pytest.param("inductor", marks=pytest.mark.slow), "torchao"])
def any_package(request, tmp_path):
    """One package per kind of backend (graph through the emulated device graphs)."""
    if request.param == "eager":
        return build(tmp_path)
    if request.param == "graph":
        request.getfixturevalue("emulated_graphs")
        return build(tmp_path, xpupack.Only(xpupack.GraphBackend()))
    if request.param == "torchao":  # quantized weights in modules/*/torchao/; TorchAO wants real sizes
        model = xpupack.tune(
            make_stack(width=128),
            [torch.randn(batch, 128) for batch in (2, 4)],
            modules=["layers.*.mlp"],
            strategy=xpupack.Only(xpupack.TorchAOBackend("int8-weight-only")),
        )
        return xpupack.save(model, tmp_path / "pkg")
    return copy_package(request.getfixturevalue("inductor_package")[1], tmp_path / "pkg")


def refused(root, error=XpupackError, **load_kwargs):
    """Loads ``root`` into a fresh model, expecting ``error``; checks the model is unchanged. Returns the error."""
    model = make_stack(seed=5).train()
    before = snapshot(model)
    with pytest.raises(error) as caught:
        xpupack.load(model, root, **load_kwargs)
    assert_unchanged(model, before)
    return caught.value


def assert_names_file_and_fix(error, relative):
    message = str(error)
    assert relative in message, message
    assert any(fix in message for fix in FIXES), message


# -- every file of a package: flipped, truncated, grown, missing, replaced by a link ------------------


def _flip(path, position):
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGES = {
    "flip the first byte": lambda path, outside: _flip(path, 0),
    "flip a middle byte": lambda path, outside: _flip(path, path.stat().st_size // 2),
    "flip the last byte": lambda path, outside: _flip(path, -1),
    "truncate by one byte": lambda path, outside: path.write_bytes(path.read_bytes()[:-1]),
    "truncate to nothing": lambda path, outside: path.write_bytes(b""),
    "append a byte": lambda path, outside: path.write_bytes(path.read_bytes() + b"\0"),
    "delete": lambda path, outside: path.unlink(),
    "replace by a directory": lambda path, outside: (path.unlink(), path.mkdir()),
    "symlink to an identical copy outside": lambda path, outside: (
        outside.write_bytes(path.read_bytes()),
        path.unlink(),
        path.symlink_to(outside),
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_any_damaged_file_is_refused_by_name(any_package, damage, tmp_path):
    files = listed_files(any_package)
    assert "model.safetensors" in files and "modules/layers.1.mlp/spec.json" in files
    for relative in files:
        root = copy_package(any_package, tmp_path / f"case-{relative.replace('/', '_')}")
        DAMAGES[damage](root / relative, tmp_path / f"outside-{relative.replace('/', '_')}")
        error = refused(root, IntegrityError)
        assert error.path == relative
        assert_names_file_and_fix(error, relative)


def test_the_packages_damaged_above_hold_every_kind_of_file(inductor_package, tmp_path):
    files = listed_files(inductor_package[1])
    assert "backends/inductor/cache.bin" in files
    assert any(f.endswith(".so") for f in files)  # the carried kernels: native code
    model = xpupack.tune(
        make_stack(width=128),
        [torch.randn(2, 128)],
        modules=["layers.*.mlp"],
        strategy=xpupack.Only(xpupack.TorchAOBackend("int8-weight-only")),
    )
    assert "modules/layers.0.mlp/torchao/weights.safetensors" in listed_files(xpupack.save(model, tmp_path / "q"))


@pytest.mark.parametrize(
    "extra",
    [
        "extra.bin",
        ".hidden",
        "modules/layers.0.mlp/extra.json",
        "modules/new/spec.json",
        "backends/x/cache.bin",
        "modules/layers.0.mlp/eager/weights.safetensors",
    ],
)
def test_an_unlisted_file_anywhere_is_refused(package, extra):
    (package / extra).parent.mkdir(parents=True, exist_ok=True)
    (package / extra).write_bytes(b"\x80\x04N.")  # a pickle, as an attacker would add
    error = refused(package, IntegrityError)
    assert error.path == extra
    assert extra in str(error) and "not listed" in str(error) and "remove it or rebuild" in str(error)


@pytest.mark.parametrize("kind", ["fifo", "dangling symlink", "symlink to /etc/passwd", "symlinked folder"])
def test_unlisted_special_files_and_links_are_refused(package, kind, tmp_path):
    if kind == "fifo":
        os.mkfifo(package / "pipe")
    elif kind == "dangling symlink":
        (package / "link").symlink_to(tmp_path / "nowhere")
    elif kind == "symlink to /etc/passwd":
        (package / "link").symlink_to("/etc/passwd")
    else:
        outside = tmp_path / "elsewhere"
        (package / "modules" / "layers.0.mlp").rename(outside)
        (package / "modules" / "layers.0.mlp").symlink_to(outside)
    error = refused(package, IntegrityError)
    assert "symbolic link" in str(error) or "not listed" in str(error)


def test_harmless_unlisted_things_load(package):
    """The model card, .gitattributes, empty folders and the Hub client's .cache/.git folders are not package files."""
    (package / "README.md").write_text("edited card")
    (package / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (package / "empty").mkdir()
    (package / ".cache" / "huggingface").mkdir(parents=True)
    (package / ".cache" / "huggingface" / "download.lock").write_text("")
    (package / ".git").mkdir()
    (package / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    model = xpupack.load(make_stack(seed=3), package)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack()(x))


def _ignoring_unlisted(monkeypatch, root):
    """Loads of ``root`` see it as a Hub snapshot does (a trusted pin): unlisted files are not refused."""
    source = Source(
        root, trusted=True, description="org/name@pinned", trust_reason="pinned by commit hash", ignore_unlisted=True
    )
    monkeypatch.setattr(importlib.import_module("xpupack.loading"), "resolve_source", lambda *a, **k: source)
    return "org/name"


@pytest.mark.parametrize("kind", ["artifact", "torchao"])
def test_files_the_manifest_does_not_list_are_never_read(kind, tmp_path, monkeypatch):
    """Where unlisted files are ignored (Hub snapshots), a backend config still cannot name one: only listed,
    digest-checked files are handed out."""
    if kind == "artifact":
        root = build(tmp_path, xpupack.Only(ArtifactBackend()))
        planted = root / "modules/layers.0.mlp/artifact/planted.json"
        planted.write_text('{"compiled": true}')
        rewrite_manifest(root, lambda m: m["modules"][0]["backend"]["config"].update(artifact="planted.json"))
        model = make_stack(seed=5)
    else:  # the quantized weights, unlisted, with another content than the build wrote
        model = xpupack.tune(
            make_stack(width=128),
            [torch.randn(2, 128)],
            modules=["layers.*.mlp"],
            strategy=xpupack.Only(xpupack.TorchAOBackend("int8-weight-only")),
        )
        root = xpupack.save(model, tmp_path / "pkg")
        planted = root / "modules/layers.0.mlp/torchao/weights.safetensors"
        rewrite_manifest(root, lambda m: m["files"].pop("modules/layers.0.mlp/torchao/weights.safetensors"))
        model = make_stack(seed=5, width=128)
    state = _AUDIT
    state.update(active=True, events=[], opened=[])
    try:
        with pytest.raises(IntegrityError, match="does not list") as caught:
            xpupack.load(model, _ignoring_unlisted(monkeypatch, root))
    finally:
        state["active"] = False
    assert planted.name in str(caught.value) and "rebuild or re-download" in str(caught.value)
    assert str(planted.resolve()) not in [str(Path(p).resolve()) for p in state["opened"]]


# -- the manifest: not JSON, not the schema, another version -------------------------------------------

MANIFEST_DAMAGE = {
    "empty": b"",
    "truncated": None,
    "garbage": b"\x00\xff garbage",
    "not UTF-8": b'{"format_version": 1, "x": "\xff"}',
    "a list": b"[1, 2]",
    "nested too deep": b"[" * 100_000 + b"]" * 100_000,
    "an integer of 5000 digits": b'{"format_version": ' + b"1" * 5000 + b"}",
    "NaN sizes": None,
    "missing key": None,
    "wrong type": None,
    "unknown key": None,
}


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE)
def test_a_manifest_that_is_not_json_or_not_the_schema_is_refused(package, damage):
    path = package / MANIFEST
    text = path.read_text()
    data = json.loads(text)
    if MANIFEST_DAMAGE[damage] is not None:
        path.write_bytes(MANIFEST_DAMAGE[damage])
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "NaN sizes":
        path.write_text(text.replace('"size": ', '"size": NaN, "x": '))
    else:
        {
            "missing key": lambda: data.pop("files"),
            "wrong type": lambda: data.update(modules={}),
            "unknown key": lambda: data.update(run_this="rm -rf /"),
        }[damage]()
        path.write_text(json.dumps(data))
    error = refused(package, PackageFormatError)
    assert_names_file_and_fix(error, MANIFEST)


@pytest.mark.parametrize("version, fix", [(2, "upgrade xpupack"), (99, "upgrade xpupack"), (0, "rebuild the package")])
def test_other_format_versions_say_what_to_do(package, version, fix):
    rewrite_manifest(package, lambda m: m.update(format_version=version))
    error = refused(package, PackageFormatError)
    assert f"unsupported format_version {version}" in str(error) and fix in str(error)
    assert "this xpupack reads 1" in str(error)


def test_a_future_spec_version_says_upgrade(package):
    rewrite_json(package, "modules/layers.0.mlp/spec.json", lambda s: s.update(format_version=2))
    error = refused(package, PackageFormatError)
    assert "spec.json" in str(error) and "upgrade xpupack" in str(error)


BAD_PATHS = [
    "../outside",
    "/etc/passwd",
    "modules/../../outside",
    "C:/Windows/x",
    "modules\\x",
    "~/x",
    ".cache/x",
    ".git/config",
    "x\0y",
    "",
    ".",
    "./model.safetensors",
    "modules//x",
    "modules/",
]
PATH_FIELDS = {
    "files": lambda m, bad: m["files"].update({bad: {"sha256": "0" * 64, "size": 1}}),
    "module folder": lambda m, bad: m["modules"][0].update(folder=bad),
    "module spec": lambda m, bad: m["modules"][0].update(spec=bad),
    "weights": lambda m, bad: m["model"].update(weights=bad),
    "shared backend folder": lambda m, bad: m["backends"].update(eager={"folder": bad, "config": {}}),
}


@pytest.mark.parametrize("bad", BAD_PATHS)
@pytest.mark.parametrize("field", PATH_FIELDS)
def test_paths_that_leave_the_package_are_refused_in_every_field(package, field, bad):
    rewrite_manifest(package, lambda m: PATH_FIELDS[field](m, bad))
    error = refused(package, PackageFormatError)
    assert MANIFEST in str(error)
    assert (repr(bad) in str(error) or bad in str(error)) if bad else "non-empty" in str(error)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda m: m["modules"].append(dict(m["modules"][0])), PackageFormatError, "twice"),
        (lambda m: m["modules"].append({**m["modules"][0], "path": "layers.0"}), PackageFormatError, "overlap"),
        (lambda m: m["modules"].append({**m["modules"][0], "path": ""}), PackageFormatError, "overlap"),
        (lambda m: m["files"].pop("modules/layers.0.mlp/spec.json"), PackageFormatError, "does not list it"),
        (lambda m: m["model"].update(weights="nothing.safetensors"), PackageFormatError, "does not list it"),
        (lambda m: m.update(device="warp:0"), PackageFormatError, "unknown device 'warp:0'"),
        (
            lambda m: m["modules"][0]["backend"].update(options={"bogus": 1}),
            UnknownConfigError,
            "cannot take the options",
        ),
        (
            lambda m: m["modules"][0]["backend"].update(name="counting", options={"offset": 1.0}),
            UnknownConfigError,
            "does not write the options",
        ),
        (
            lambda m: m["modules"][0]["backend"].update(name="graph", options={"base": "inductor"}),
            PackageFormatError,
            "backend/options/base",
        ),
        (
            lambda m: m["modules"][0]["backend"].update(name="graph", options={"base": {"options": {}}}),
            PackageFormatError,
            "backend/options/base",
        ),
    ],
)
def test_inconsistent_manifests_are_refused_before_anything_changes(package, change, error, words):
    rewrite_manifest(package, change)
    caught = refused(package, error)
    assert words in str(caught)
    assert MANIFEST in str(caught) or "backend" in str(caught)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: s.update(path="layers.1.mlp"), "describes the module 'layers.1.mlp'"),
        (lambda s: s["signatures"][0]["leaves"][0].update(device="warp:0"), "unknown device 'warp:0'"),
        (lambda s: s["signatures"][0]["leaves"][0].update(dtype="_dynamo"), "unknown dtype '_dynamo'"),
        (
            lambda s: s["signatures"][0].update(
                tree=json.dumps([1, {"type": "collections.defaultdict", "context": None, "children_spec": []}])
            ),
            "(args, kwargs)",
        ),
    ],
)
def test_specs_that_parse_wrong_are_refused_even_with_right_digests(package, change, words):
    rewrite_json(package, "modules/layers.0.mlp/spec.json", change)
    caught = refused(package, PackageFormatError)
    assert words in str(caught) and "modules/layers.0.mlp/spec.json" in str(caught) and "rebuild" in str(caught)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["batch_axes"][0].update(inputs=[0, None, 0]),  # more axes than leaves
        lambda s: s["batch_axes"][0].update(inputs=[0, 0]),  # an axis of a constant
        lambda s: s["batch_axes"][0].update(inputs=[5, None]),  # beyond the tensor's rank
        lambda s: s["batch_axes"].append(s["batch_axes"][0]),  # more entries than signatures
        lambda s: s["batch_axes"].pop(),
    ],
    ids=["more-axes-than-leaves", "axis-of-a-constant", "axis-beyond-rank", "extra-entry", "missing-entry"],
)
def test_batch_axes_that_do_not_fit_are_refused_by_load_inspect_and_verify(package, change):
    """`inspect` read them with bare indexing (KeyError, IndexError); now `read_spec` checks them for all three."""
    from xpupack.report import package_report, verify_package

    rewrite_json(package, "modules/layers.0.mlp/spec.json", change)
    words = "modules/layers.0.mlp/spec.json: "
    with pytest.raises(PackageFormatError, match="batch"):
        package_report(package)
    result = verify_package(package)
    assert not result["ok"] and words in result["problems"][0] and "batch" in result["problems"][0]
    assert "batch" in str(refused(package, PackageFormatError))


@pytest.mark.parametrize("base", [[1], "x", 3])
def test_a_composed_backend_config_whose_base_is_not_an_object_is_a_format_error(base, tmp_path):
    """A graph+torchao module's config holds torchao's under ``base``; the schema says it is an object."""
    from xpupack.report import package_report, verify_package

    root = build(tmp_path)
    rewrite_manifest(root, lambda m: m["modules"][0]["backend"]["config"].update(base=base))
    rewrite_manifest(root, lambda m: m["modules"][1]["backend"]["options"].update(base=base))
    caught = refused(root, PackageFormatError)
    assert "/backend/config/base" in str(caught) or "/backend/options/base" in str(caught)
    with pytest.raises(PackageFormatError, match="schema"):
        package_report(root)
    assert not verify_package(root)["ok"]


def test_inductor_cache_path_cannot_leave_the_package(inductor_package, tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: loaded.append(blob))
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"\x80\x04N.")
    for bad, error in [
        (str(elsewhere), PackageFormatError),
        ("../../../elsewhere.bin", PackageFormatError),
        (7, PackageFormatError),
        (".", PackageFormatError),
        ("missing.bin", IntegrityError),
    ]:
        root = copy_package(inductor_package[1], tmp_path / f"pkg-{len(loaded)}-{abs(hash(str(bad)))}")
        rewrite_manifest(root, lambda m: m["backends"]["inductor"]["config"].update(cache=bad))  # noqa: B023 (called now)
        caught = refused(root, error)
        assert "backend config" in str(caught) and "rebuild" in str(caught)
    assert loaded == []


@pytest.mark.parametrize(
    "kernels, error",
    [
        (["../../../../elsewhere.so"], PackageFormatError),
        (["/tmp/elsewhere.so"], PackageFormatError),
        ("ab/c.so", PackageFormatError),
        ([3], PackageFormatError),
        (["zz/not-in-the-package.so"], IntegrityError),
    ],
)
def test_carried_inductor_kernels_cannot_come_from_or_go_outside(
    inductor_package, tmp_path, monkeypatch, kernels, error
):
    """Carried kernels are copied into the local Inductor cache: neither end may leave its folder."""
    cache = tmp_path / "inductor-cache"  # its own: other xdist workers write to the run's shared cache
    (cache / "kept").mkdir(parents=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    before = sorted(cache.rglob("*"))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: pytest.fail("loaded artifacts"))
    root = copy_package(inductor_package[1], tmp_path / "pkg")
    rewrite_manifest(root, lambda m: m["backends"]["inductor"]["config"].update(kernels=kernels))
    caught = refused(root, error)
    assert "backend config" in str(caught) and "rebuild" in str(caught)
    assert sorted(cache.rglob("*")) == before


def test_a_missing_kernel_midway_gives_back_the_earlier_tuning(inductor_package, tmp_path):
    """A kernel the manifest does not list is refused (before anything changes, by `check_package`; the
    shared artifacts' restore checks again): the earlier tuning stays active and counting."""
    model = xpupack.load(make_stack(seed=5), inductor_package[1], defer_compile=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    before = xpupack.stats(model)
    root = copy_package(inductor_package[1], tmp_path / "pkg")
    rewrite_manifest(root, lambda m: m["backends"]["inductor"]["config"]["kernels"].append("zz/missing.so"))
    with pytest.raises(IntegrityError, match="zz/missing.so"):
        xpupack.load(model, root)
    assert xpupack.stats(model) == before
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert {s["calls"] for s in xpupack.stats(model).values()} == {before["layers.0.mlp"]["calls"] + 1}
    assert {s["active"] for s in xpupack.stats(model).values()} == {True}


def test_the_temporary_directory_of_a_save_is_not_a_package(package, tmp_path):
    litter = tmp_path / ".pkg.xpupack-tmp-12345-0a1b2c3d"
    copy_package(package, litter)  # a complete copy: still refused by its name
    error = refused(litter, PackageFormatError)
    assert "temporary directory of `xpupack save`" in str(error) and f"load {tmp_path / 'pkg'}" in str(error)


# -- no pickle, and compiled artifacts only under the trust rule ------------------------------------


class _Forbidden(AssertionError):
    pass


@pytest.fixture
def no_unpickling(monkeypatch):
    """Makes every way to unpickle (and torch.load, and Inductor's artifact loader) raise; records
    pickle audit events and every file opened while the test sets ``active``."""
    import _pickle

    def forbidden(*args, **kwargs):
        raise _Forbidden("loading a package must not unpickle")

    for module, names in (
        (pickle, ("load", "loads", "Unpickler")),
        (_pickle, ("load", "loads", "Unpickler")),
        (torch, ("load",)),
        (torch.serialization, ("load",)),
        (torch.compiler, ("load_cache_artifacts",)),
    ):
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    state = _AUDIT
    state.update(active=False, events=[], opened=[])
    yield state
    state["active"] = False


_AUDIT = {"active": False, "events": [], "opened": []}


def _audit(event, args):
    if not _AUDIT["active"]:
        return
    if event in ("pickle.find_class", "ctypes.dlopen"):
        _AUDIT["events"].append((event, args))
    elif event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _AUDIT["opened"].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one does nothing unless a test activates it


def _opened_inside(root, state):
    root = str(Path(root).resolve())
    return {
        str(Path(p).resolve().relative_to(root))
        for p in state["opened"]
        if str(Path(p).resolve()).startswith(root + os.sep)
    }


@pytest.mark.parametrize("kind", ["eager", "graph", "graph over counting", "torchao", "graph over torchao"])
def test_loading_a_package_never_unpickles(kind, tmp_path, request):
    width = 128 if "torchao" in kind else 8  # TorchAO's kernels want real sizes
    base = {
        "graph over counting": CountingBackend(),
        "graph over torchao": xpupack.TorchAOBackend("int8-weight-only"),
    }.get(kind)
    if kind.startswith("graph"):
        request.getfixturevalue("emulated_graphs")
        backend = xpupack.GraphBackend(base=base)
    else:
        backend = xpupack.TorchAOBackend("int8-weight-only") if kind == "torchao" else xpupack.EagerBackend()
    samples = [torch.randn(batch, width) for batch in (2, 4)]
    model = xpupack.tune(make_stack(width=width), samples, modules=["layers.*.mlp"], strategy=xpupack.Only(backend))
    root = xpupack.save(model, tmp_path / "pkg")
    state = request.getfixturevalue("no_unpickling")
    state["active"] = True
    loaded = xpupack.load(make_stack(seed=2, width=width), root)
    state["active"] = False
    assert state["events"] == []
    assert _opened_inside(root, state) <= set(listed_files(root)) | {MANIFEST}
    assert {s["backend"] for s in xpupack.stats(loaded).values()} == {kind.split()[0]}


def test_untrusted_compiled_artifacts_are_only_checked(inductor_package, tmp_path, monkeypatch):
    """From an unpinned Hub revision, Inductor compiles here: the package's artifacts are read for their
    digest and (the mega-cache) their container's fields, and never handed to the loader that unpickles them."""
    root = copy_package(inductor_package[1], tmp_path / "pkg")
    monkeypatch.setattr(
        importlib.import_module("xpupack.loading"),
        "resolve_source",
        lambda *a, **k: Source(root, trusted=False, description="org/name@main"),
    )

    def forbidden(blob):
        raise _Forbidden("untrusted compiled artifacts must not be loaded")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", forbidden)
    _AUDIT.update(active=True, events=[], opened=[])
    try:
        model = xpupack.load(make_stack(), "org/name")
    finally:
        _AUDIT["active"] = False
    cache = str((root / "backends/inductor/cache.bin").resolve())
    # check_files's sha256, check_mega_caches's fields
    assert [str(Path(p).resolve()) for p in _AUDIT["opened"]].count(cache) == 2
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}


def test_trusted_compiled_artifacts_are_used(inductor_package, tmp_path, monkeypatch):
    root = copy_package(inductor_package[1], tmp_path / "pkg")
    blobs = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", blobs.append)
    xpupack.load(make_stack(), root, defer_compile=False)
    assert blobs == [(root / "backends/inductor/cache.bin").read_bytes()]


@pytest.mark.parametrize("mode", ["rebuild", "error"])
def test_a_cache_pytorch_cannot_load_is_compiled_here_or_an_xpupack_error(
    inductor_package, tmp_path, monkeypatch, caplog, mode
):
    """PyTorch's loader raises whatever it meets in a malformed (but listed and digest-checked) cache.bin,
    e.g. AttributeError after unpickling; a user sees an xpupack error or a module compiled here."""
    root = copy_package(inductor_package[1], tmp_path / "pkg")

    def malformed(blob):
        raise AttributeError("'list' object has no attribute 'populate_cache'")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", malformed)
    if mode == "error":
        error = refused(root, BackendError, on_mismatch="error")
        assert "backends/inductor" in str(error) and "AttributeError" in str(error)
        assert "rebuild the package" in str(error)
        return
    model = xpupack.load(make_stack(seed=5), root, defer_compile=False)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}
    assert "cannot be loaded (AttributeError" in caplog.text
    for tuned in xpupack.tuned.session_of(model).modules.values():
        assert "inductor compiled here" in tuned.report[0].reason
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), make_stack()(x))


@pytest.mark.parametrize("device", ["cuda", "xpu", "cuda:99", "warp", "mps", "hpu", "meta", "cpu:1"])
def test_a_device_this_machine_lacks_is_refused_before_anything_changes(package, device):
    from xpupack.environment import devices_here

    if device in ("cuda", "xpu") and any(d.startswith(device) for d in devices_here()):
        pytest.skip(f"this machine has {device}")
    error = refused(package, xpupack.DeviceUnavailableError, device=device)
    assert f"device {device!r} is not available here" in str(error) and "devices here: cpu" in str(error)


@pytest.mark.parametrize("device", ["cuda:99", "warp", "mps", "cpu:1"])
def test_tuning_on_a_device_this_machine_lacks_is_refused_before_anything_changes(device):
    model = make_stack()
    before = snapshot(model)
    with pytest.raises(xpupack.DeviceUnavailableError, match=f"device {device!r} is not available here"):
        xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"], device=device)
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda: xpupack.tune(make_stack(), stack_samples(), batch_sizes=[1, 10**30]),
            xpupack.TuningError,
            "give a list of integers from 1 to 2147483647",
        ),
        (lambda: xpupack.GraphBackend("5"), ValueError, "GraphBackend(base='5'): give a backend"),
        (
            lambda: __import__("xpupack.bench").bench.benchmark(
                xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER), iterations=0
            ),
            xpupack.XpupackError,
            "iterations=0, warmup=5: time at least one call",
        ),
    ],
)
def test_arguments_out_of_range_are_refused_by_name(call, error, words):
    with pytest.raises(error) as caught:
        call()
    assert words in str(caught.value)


# -- the wrong model ---------------------------------------------------------------------------------


class Renamed(nn.Module):
    """The stack's tensors under other names."""

    def __init__(self):
        super().__init__()
        self.blocks = Stack().layers


class WithBuffer(Stack):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))


class Tied(Stack):
    """The stack with both MLPs' ``up`` layers sharing one weight."""

    def __init__(self):
        super().__init__()
        self.layers[1]["mlp"].up.weight = self.layers[0]["mlp"].up.weight


WRONG_MODELS = {
    "deeper": (lambda: Stack(depth=3), "unexpected layers.2.mlp.up.weight"),
    "shallower": (lambda: Stack(depth=1), "missing layers.1.mlp.up.weight"),
    "wider": (lambda: Stack(width=16), "layers.0.mlp.up.weight: package float32[16, 8], model float32[32, 16]"),
    "float64": (lambda: Stack().double(), "package float32[16, 8], model float64[16, 8]"),
    "bfloat16": (lambda: Stack().to(torch.bfloat16), "model bfloat16"),
    "renamed": (Renamed, "missing layers.0.mlp.up.weight"),
    "extra buffer": (WithBuffer, "unexpected steps"),
    "another model": (lambda: nn.Sequential(nn.Linear(8, 8)), "unexpected 0.weight"),
    "tied weights": (Tied, "ties layers.0.mlp.up.weight and layers.1.mlp.up.weight"),
}


@pytest.mark.parametrize("kind", WRONG_MODELS)
def test_a_model_of_another_architecture_is_refused_before_anything_changes(package, kind):
    make, words = WRONG_MODELS[kind]
    model = make().train()
    before = snapshot(model)
    with pytest.raises(ModelMismatchError) as error:
        xpupack.load(model, package)
    assert words in str(error.value)
    assert "build the model with the same" in str(error.value)
    assert_unchanged(model, before)


def test_a_tied_package_loads_into_a_tied_model(tmp_path):
    model = xpupack.tune(Tied(), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(Tied(), root)
    assert loaded.layers[1]["mlp"].up.weight is loaded.layers[0]["mlp"].up.weight
    assert torch.equal(loaded.layers[0]["mlp"].up.weight, model.layers[0]["mlp"].up.weight)


def test_the_same_architecture_under_another_class_loads(package):
    """Only the tensors are compared: another class with the stack's state dict is the same architecture."""

    class Alias(Stack):
        pass

    model = xpupack.load(Alias(), package)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack()(x))


# -- the load-time check against eager, and failures while restoring -----------------------------------


def _wrong_backend_package(tmp_path):
    """A package whose manifest is consistent but whose backend gives other outputs than eager."""
    root = build(tmp_path, xpupack.Only(CountingBackend()))
    rewrite_manifest(root, lambda m: [module["backend"]["options"].update(offset=1.0) for module in m["modules"]])
    return root


def test_a_backend_that_gives_other_answers_than_eager_is_not_used(tmp_path, caplog):
    root = _wrong_backend_package(tmp_path)
    model = xpupack.load(make_stack(seed=3), root)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), make_stack()(x))
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"eager"}
    assert "differs from the original module" in caplog.text


def test_with_on_mismatch_error_a_wrong_backend_raises(tmp_path):
    root = _wrong_backend_package(tmp_path)
    error = refused(root, OutputMismatchError, on_mismatch="error")
    assert "layers.0.mlp" in str(error) and "counting" in str(error)


def test_a_restore_failure_with_on_mismatch_error_is_a_backend_error(tmp_path, monkeypatch):
    root = build(tmp_path, xpupack.Only(CountingBackend()))
    monkeypatch.setattr(CountingBackend, "restore", lambda *a, **k: 1 / 0)
    error = refused(root, BackendError, on_mismatch="error")
    assert "ZeroDivisionError" in str(error) and "on_mismatch='fallback'" in str(error)


def test_a_failed_load_undoes_what_a_backend_replaced(tmp_path, monkeypatch):
    """A backend's restore may replace a module's parameters (TorchAO does); a later failure puts them back."""
    root = build(tmp_path, xpupack.Only(CountingBackend()))
    original_restore = CountingBackend.restore

    def replacing_restore(self, target, spec, config, folder, device, *, use_artifacts):
        if target.path == "layers.1.mlp":
            raise KeyboardInterrupt  # not even an Exception: the load must still roll back
        target.module.up.weight = nn.Parameter(torch.zeros_like(target.module.up.weight))
        target.module.register_buffer("quantized", torch.ones(1))
        return original_restore(self, target, spec, config, folder, device, use_artifacts=use_artifacts)

    monkeypatch.setattr(CountingBackend, "restore", replacing_restore)
    model = make_stack(seed=5).train()
    before = snapshot(model)
    with pytest.raises(KeyboardInterrupt):
        xpupack.load(model, root)
    assert_unchanged(model, before)
    assert "quantized" not in model.layers[0]["mlp"]._buffers


# -- verify and load agree: what load refuses, verify reports as damaged (docs/safety.md) --


def _bad_weights_header(root):
    (root / "model.safetensors").write_bytes(b'\x10\0\0\0\0\0\0\0{"a": "b"}      ')
    redigest(root)


def _defaultdict_tree(root):
    defaultdict = {"type": "collections.defaultdict", "context": "null", "children_spec": []}
    node = json.dumps(
        [
            1,
            {
                "type": "builtins.tuple",
                "context": "null",
                "children_spec": [
                    {"type": "builtins.tuple", "context": "null", "children_spec": [defaultdict]},
                    {"type": "builtins.dict", "context": "[]", "children_spec": []},
                ],
            },
        ]
    )
    rewrite_json(root, "modules/layers.0.mlp/spec.json", lambda s: s["signatures"][0].update(tree=node))


def _zeroed_mega_cache(root):
    """64 zero bytes: no CRC-32 of PyTorch's container (whose loader then only logs a warning)."""
    (root / "backends/inductor/cache.bin").write_bytes(b"\0" * 64)
    redigest(root)


def _weight_of_another_dtype(root):
    """A weight safetensors stores as F8_E8M0, a code the header check did not compare, where the manifest
    says float32."""
    from safetensors.torch import load_file, save_file

    weights = load_file(root / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].to(torch.float8_e8m0fnu)
    save_file(weights, root / "model.safetensors", metadata={"format": "pt"})
    redigest(root)


def _unlisted_kernel(root):
    rewrite_manifest(root, lambda m: m["backends"]["inductor"]["config"]["kernels"].append("zz/absent.so"))


@pytest.mark.parametrize(
    "damage, kind, error, words",
    [
        (_bad_weights_header, "eager", PackageFormatError, "not a readable safetensors file"),
        (_defaultdict_tree, "eager", PackageFormatError, "tree node type 'collections.defaultdict' is not allowed"),
        pytest.param(  # the inductor ones copy the session's compiled package: slow
            _unlisted_kernel,
            "inductor",
            IntegrityError,
            "names backends/inductor/kernels/zz/absent.so, which",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            _zeroed_mega_cache,
            "inductor",
            PackageFormatError,
            "cache.bin is not PyTorch's cache-artifact container",
            marks=pytest.mark.slow,
        ),
        (_weight_of_another_dtype, "eager", PackageFormatError, "does not match the manifest"),
    ],
)
def test_verify_reports_as_damaged_what_load_refuses(damage, kind, error, words, tmp_path, request):
    """`xpupack.load` makes the checks `xpupack verify` makes (`manifest.check_package`, then `read_spec` per
    module), so the two agree on every damaged package; the load refuses it before anything changes, trusted
    or not."""
    from xpupack.report import verify_package

    root = (
        copy_package(request.getfixturevalue("inductor_package")[1], tmp_path / "pkg")
        if kind == "inductor"
        else build(tmp_path)
    )
    damage(root)
    result = verify_package(root)
    assert not result["ok"] and words in result["problems"][0]
    for trusted in (True, False):
        source = Source(root, trusted=trusted, description="pkg", trust_reason="test")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(importlib.import_module("xpupack.loading"), "resolve_source", lambda *a, **k: source)  # noqa: B023 (used within this iteration)
            assert words in str(refused(root, error))


def test_verify_without_torch_refuses_a_tree_node_load_refuses(tmp_path, run_python):
    """In a fresh process `xpupack verify` imports no torch: the tree check it makes is torch-free."""
    root = build(tmp_path)
    _defaultdict_tree(root)
    result = run_python(f"""
        import sys
        from click.testing import CliRunner
        from xpupack.cli import main
        result = CliRunner().invoke(main, ["verify", {str(root)!r}, "--device", "cpu"])
        print(result.exit_code, "torch" in sys.modules)
        print(result.output)
    """)
    assert result.stdout.startswith("1 False"), result.stdout
    assert "collections.defaultdict" in result.stdout
