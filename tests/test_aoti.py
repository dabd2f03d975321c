"""The AOTInductor backend: compiled ahead of time, live when `xpupack.load` returns, with no compiler in the
loading process; the module's own tensors as the library's weights; KV caches updated in place."""

import importlib
import json
import threading

import pytest
import torch
from torch import nn

import xpupack
from support.language_models import NEW_TOKENS, generate, prompt, tiny_llama, tune_llm, whole
from support.models import make_stack, stack_samples
from xpupack import _torch_compat
from xpupack.source import Source

pytestmark = pytest.mark.slow  # each signature is a C++ compile (~6 s on a 2-core CPU)
#: the tests of `aoti_package` run on one xdist worker, which builds it once (40-50 s on a 2-core CPU, per worker)
ONE_PACKAGE = pytest.mark.xdist_group("aoti-package")


@pytest.fixture(scope="module")
def aoti_package(tmp_path_factory, _inductor_cache):
    """``(tuned model, package)``: the stack's MLPs compiled ahead of time, once per module."""
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.AOTIBackend())
    )
    return model, xpupack.save(model, tmp_path_factory.mktemp("aoti") / "pkg")


@ONE_PACKAGE
def test_each_signature_is_one_library_listed_in_the_manifest(aoti_package):
    model, root = aoti_package
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"aoti"}
    manifest = json.loads((root / "xpupack.json").read_text())
    config = next(m for m in manifest["modules"] if m["path"] == "layers.0.mlp")["backend"]["config"]
    assert sorted(config["programs"]) == ["0", "1"]  # the two batch sizes recorded
    assert all(f"modules/layers.0.mlp/aoti/{p['file']}" in manifest["files"] for p in config["programs"].values())


@ONE_PACKAGE
def test_inspect_says_the_libraries_are_mapped_in_without_a_compile(aoti_package):
    from click.testing import CliRunner

    from xpupack.cli import main

    _, root = aoti_package
    result = CliRunner().invoke(main, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    assert "compiled code at load: layers.0.mlp, layers.1.mlp: AOTInductor libraries mapped in, no compile" in (
        " ".join(result.output.split())
    )


@ONE_PACKAGE
def test_a_fresh_process_serves_at_once_with_no_compiler_and_no_thread(aoti_package, run_python, tmp_path):
    _, root = aoti_package
    cache = tmp_path / "inductor-cache"
    result = run_python(
        f"""
        import json, sys, threading, torch, xpupack
        from support.models import make_stack
        model = xpupack.load(make_stack(seed=4), {str(root)!r})
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        x = torch.randn(4, 8)
        with torch.no_grad():
            close = torch.allclose(model(x), make_stack()(x), atol=1e-5)
        stats = xpupack.stats(model)
        print(json.dumps({{"close": close, "threads": threads, "dynamo": "torch._dynamo" in sys.modules,
                           "served": sum(s["calls"] - s["fallbacks"] for s in stats.values()),
                           "backends": sorted({{s["backend"] for s in stats.values()}})}}))
        """,
        env={"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(tmp_path / "triton")},
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["close"] and seen["backends"] == ["aoti"] and seen["served"] == 2
    assert seen["threads"] == []  # nothing of the load runs on after it returns
    assert not any(cache.rglob("*.so"))  # nothing compiled here


@ONE_PACKAGE
def test_weights_replaced_after_load_are_the_ones_it_reads(aoti_package):
    _, root = aoti_package
    model = xpupack.load(make_stack(seed=4), root)
    reference = make_stack()
    x = torch.randn(4, 8)
    for module in (model, reference):  # a replaced parameter and a storage swapped in place
        module.layers[0].mlp.up.weight = nn.Parameter(torch.ones_like(module.layers[0].mlp.up.weight))
        module.layers[1].mlp.up.bias.data = torch.full_like(module.layers[1].mlp.up.bias, 0.5)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-5)
    assert all(s["fallbacks"] == 0 for s in xpupack.stats(model).values())


@ONE_PACKAGE
def test_an_untrusted_package_compiles_here_instead_of_running_its_libraries(aoti_package, monkeypatch):
    _, root = aoti_package

    def refuse(*args, **kwargs):
        raise AssertionError("a library of an untrusted package must not be loaded")

    real_load = _torch_compat.aoti_load
    monkeypatch.setattr(
        _torch_compat, "aoti_load", lambda path: refuse() if str(root) in str(path) else real_load(path)
    )
    monkeypatch.setattr(
        importlib.import_module("xpupack.loading"),
        "resolve_source",
        lambda *a, **k: Source(root, trusted=False, description="org/name@main"),
    )
    model = xpupack.load(make_stack(), "org/name")
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), make_stack()(x), atol=1e-5)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"aoti"}


@ONE_PACKAGE
def test_an_output_tree_naming_an_unregistered_type_is_refused_without_importing_it(aoti_package, tmp_path, caplog):
    import shutil

    _, root = aoti_package
    copy = tmp_path / "pkg"
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "xpupack.json").read_text())
    config = next(m for m in manifest["modules"] if m["path"] == "layers.0.mlp")["backend"]["config"]
    config["programs"]["0"]["outputs"]["tree"] = json.dumps(
        [1, {"type": "os.system", "context": "null", "children_spec": []}]
    )
    (copy / "xpupack.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING"):
        model = xpupack.load(make_stack(), copy)
    assert "output tree node type 'os.system' is not registered in this process" in caplog.text
    x = torch.randn(2, 8)
    with torch.no_grad():  # that module runs the original; the other one its library
        assert torch.allclose(model(x), make_stack()(x), atol=1e-5)
    assert xpupack.stats(model)["layers.1.mlp"]["backend"] == "aoti"


@pytest.mark.xpupack_allow_fallbacks  # the prefill of a lazily allocated StaticCache (the real-size issue, item 3)
def test_a_language_model_decodes_through_the_library_with_tokens_equal_to_eager(tmp_path):
    model, reference = tune_llm(xpupack.Only(xpupack.AOTIBackend()))
    ids = prompt()
    expected = generate(reference, ids, NEW_TOKENS, eager=True)
    assert torch.equal(generate(model, ids, NEW_TOKENS), expected)
    stats = whole(model)
    assert stats["backend"] == "aoti" and stats["calls"] - stats["fallbacks"] >= NEW_TOKENS - 1  # every decode step
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(tiny_llama(seed=3), root)
    assert torch.equal(generate(loaded, ids, NEW_TOKENS), expected)
    stats = whole(loaded)
    assert stats["calls"] - stats["fallbacks"] >= NEW_TOKENS - 1
    assert not [t for t in threading.enumerate() if t.name.startswith("xpupack")]
