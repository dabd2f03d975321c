"""The Inductor backend: compile, carry the compiled artifacts, load without compiling from scratch."""

import importlib
import json

import pytest
import torch

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, copy_package, rewrite_manifest, snapshot
from xpupack.errors import IncompatiblePackageError, UnknownConfigError
from xpupack.source import Source

pytestmark = pytest.mark.slow


def test_compiled_modules_match_eager(inductor_package):
    model, root = inductor_package
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), make_stack()(x), atol=1e-5)
    manifest = json.loads((root / "xpupack.json").read_text())
    shared = manifest["backends"]["inductor"]
    assert shared["folder"] == "backends/inductor" and shared["config"]["cache"] == "cache.bin"
    assert "backends/inductor/cache.bin" in manifest["files"]
    kernels = shared["config"]["kernels"]
    assert any(k.endswith(".so") for k in kernels)  # the compiled CPU libraries travel too
    assert all(f"backends/inductor/kernels/{k}" in manifest["files"] for k in kernels)


def _load_in_fresh_process(root, run_python, cache) -> dict:
    """Loads the package in a fresh process whose Inductor cache (``cache``) starts empty; returns what it saw.

    ``built``: the libraries in that cache afterwards; ``carried``: the kernels the package lists.
    """
    result = run_python(
        f"""
        import json, torch, xpupack
        from torch._dynamo.utils import counters
        from support.models import make_stack
        from xpupack import _background
        model = xpupack.load(make_stack(seed=4), {str(root)!r}, defer_compile=True)
        _background.wait(300)  # the compile a load defers (its hits count all the same)
        x = torch.randn(4, 8)
        with torch.no_grad():
            close = torch.allclose(model(x), make_stack()(x), atol=1e-5)
        print(json.dumps({{"close": close, "stats": xpupack.stats(model), **counters["inductor"]}}))
    """,
        env={"TORCHINDUCTOR_CACHE_DIR": str(cache)},
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["built"] = {p.relative_to(cache).as_posix() for p in cache.rglob("*.so")}
    report["carried"] = set(
        json.loads((root / "xpupack.json").read_text())["backends"]["inductor"]["config"].get("kernels", [])
    )
    return report


def _assert_loaded_from_the_package(report):
    assert report["close"]
    assert report.get("fxgraph_cache_hit", 0) >= 1
    assert report.get("fxgraph_cache_miss", 0) == 0
    assert report["stats"]["layers.0.mlp"]["fallbacks"] == 0
    assert report["built"] <= report["carried"]  # every library the load needed came from the package


def test_fresh_process_loads_from_the_carried_artifacts(inductor_package, run_python, tmp_path):
    """A fresh process with an empty Inductor cache hits the package's artifacts: nothing compiles from scratch."""
    _assert_loaded_from_the_package(_load_in_fresh_process(inductor_package[1], run_python, tmp_path / "fresh-cache"))


LOAD_WITH_THREADS = """
import json, torch
{set_threads}
import xpupack
from torch._dynamo.utils import counters
from support.models import make_stack
from xpupack.report import verify_package

verified = verify_package({root!r})["compatibility"]
model = xpupack.load(make_stack(seed=4), {root!r})
with torch.no_grad():
    model(torch.randn(4, 8))
print(json.dumps({{"threads": torch.get_num_threads(), "verified": verified, **counters["inductor"]}}))
"""


@pytest.mark.parametrize("how", ["same", "torch.set_num_threads", "OMP_NUM_THREADS"])
def test_a_fresh_process_hits_the_carried_graphs_only_at_the_thread_count_verify_names(
    inductor_package, run_python, tmp_path, how
):
    """Regression: Inductor keys its CPU kernels on the thread count, so a process with another one missed every
    carried graph and compiled at load, while `verify` said "compatible". Now what verify says (in the loading
    process) matches what happens: the build's count hits every graph, another count compiles and says so."""
    built = torch.get_num_threads()  # the session's package is built in this process
    other = 1 if built > 1 else 2
    if how == "OMP_NUM_THREADS" and other > built:
        pytest.skip("OMP_NUM_THREADS beyond the cores is capped by MKL: one thread is the only count below")
    set_threads = f"torch.set_num_threads({built if how == 'same' else other})" if how != "OMP_NUM_THREADS" else ""
    result = run_python(
        LOAD_WITH_THREADS.format(root=str(inductor_package[1]), set_threads=set_threads),
        env={
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty"),
            **({"OMP_NUM_THREADS": str(other)} if how == "OMP_NUM_THREADS" else {}),
        },
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    statuses = {entry["status"] for entry in report["verified"].values()}
    if how == "same":
        assert report["threads"] == built and statuses == {"compatible"}, report
        assert report.get("fxgraph_cache_miss", 0) == 0 and report.get("fxgraph_cache_hit", 0) >= 1, report
        return
    assert report["threads"] == other, report
    assert report.get("fxgraph_cache_miss", 0) >= 1, report  # what verify must not call compatible
    assert all(not entry["compatible"] for entry in report["verified"].values()), report
    assert all(
        status.startswith(f"built for {built} CPU threads, this process has {other}: inductor compiles at load")
        for status in statuses
    ), report


def _carried_files(root) -> dict[str, bytes]:
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in (root / "backends" / "inductor").rglob("*")
        if path.is_file()
    }


def _generated_kernels(carried: dict[str, bytes]) -> list[str]:
    """The carried C++ sources that Inductor generated for a model (the vector-ISA probe's programs aside)."""
    return [name for name, data in carried.items() if name.endswith(".cpp") and b"cpp_prefix.h" in data]


def _unrelated_before(x):
    return torch.atan2(x, x + 1.0)  # ops the stack's MLPs never use: finding their names in a package is a leak


def _unrelated_after(x):
    return torch.hypot(x, x - 1.0)


def test_unrelated_compiles_stay_out_of_the_package(tmp_path):
    """Code compiled in the process, before tuning or between tuning and save, does not travel in the package."""
    x = torch.randn(3, 5)
    torch.compile(_unrelated_before)(x)
    model = xpupack.tune(
        make_stack(seed=5), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.InductorBackend())
    )
    torch.compile(_unrelated_after)(x)
    root = xpupack.save(model, tmp_path / "pkg")
    carried = _carried_files(root)
    assert "backends/inductor/cache.bin" in carried
    assert _generated_kernels(carried)  # the package's own kernels are there
    for marker in (b"atan2", b"hypot"):
        assert [name for name, data in carried.items() if marker in data] == []


def test_warm_cache_package_carries_its_own_kernels(inductor_package, run_python, tmp_path):
    """Tuning where the kernels exist already (older files; the same module compiled earlier in the process too)
    still carries every artifact a fresh process needs."""
    # the session's Inductor cache, which this process inherits, already holds the stack's kernels
    root = tmp_path / "pkg"
    run_python(f"""
        import torch, xpupack
        from support.models import make_stack, stack_samples
        model = make_stack()  # the weights the load compares with
        compiled = torch.compile(model.layers[0]["mlp"].forward, dynamic=False)
        with torch.no_grad():
            for sample in stack_samples():
                compiled(sample)
        model = xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"],
                             strategy=xpupack.Only(xpupack.InductorBackend()))
        xpupack.save(model, {str(root)!r})
    """)
    report = _load_in_fresh_process(root, run_python, tmp_path / "fresh-cache")
    assert _generated_kernels(_carried_files(root))
    _assert_loaded_from_the_package(report)


def _forbid_artifacts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled artifacts must not be loaded here")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", refuse)


def test_untrusted_source_compiles_locally(inductor_package, monkeypatch, caplog):
    _, root = inductor_package
    _forbid_artifacts(monkeypatch)
    monkeypatch.setattr(
        importlib.import_module("xpupack.loading"),
        "resolve_source",
        lambda *a, **k: Source(root, trusted=False, description="org/name@main"),
    )
    model = xpupack.load(make_stack(), "org/name")
    tuned = xpupack.tuned.session_of(model).modules["layers.0.mlp"]
    assert tuned.backend_name == "inductor"
    assert "not pinned by commit hash" in tuned.report[0].reason
    assert "trust_compiled=True" in caplog.text


def _with_other_torch(root, tmp_path):
    copy = tmp_path / "pkg"
    import shutil

    shutil.copytree(root, copy)
    manifest = json.loads((copy / "xpupack.json").read_text())
    manifest["environment"]["torch"] = "1.0.0"
    (copy / "xpupack.json").write_text(json.dumps(manifest))
    return copy


def test_environment_mismatch_error_names_what_differs(inductor_package, tmp_path):
    root = _with_other_torch(inductor_package[1], tmp_path)
    model = make_stack()
    with pytest.raises(IncompatiblePackageError, match="torch: built 1.0.0") as error:
        xpupack.load(model, root, on_mismatch="error")
    assert error.value.differences == {"torch": ("1.0.0", torch.__version__)}
    assert "forward" not in model.layers[0]["mlp"].__dict__


def test_environment_mismatch_fallback_runs_originals(inductor_package, tmp_path):
    root = _with_other_torch(inductor_package[1], tmp_path)
    model = xpupack.load(make_stack(), root, on_mismatch="fallback")
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"eager"}


def test_environment_mismatch_rebuild_compiles_here(inductor_package, tmp_path, monkeypatch):
    root = _with_other_torch(inductor_package[1], tmp_path)
    _forbid_artifacts(monkeypatch)
    # made before the load: Dynamo puts the global random state back when a compile ends, and this load
    # compiles on the worker, so a model seeded and built meanwhile could get other weights (docs: "Language
    # models", sampling during a background compile)
    reference, x = make_stack(), torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    model = xpupack.load(make_stack(), root, on_mismatch="rebuild")
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"inductor"}
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-5)


def test_cudagraph_modes_are_refused():
    with pytest.raises(ValueError, match="GraphBackend"):
        xpupack.InductorBackend(mode="reduce-overhead")


def test_compile_options_reach_torch_compile_at_tune_and_at_load(tmp_path, monkeypatch):
    """``compile_options`` is this compilation's Inductor settings: stored in the package, used again at load."""
    seen = []
    compile_ = torch.compile

    def spy(function, **settings):
        seen.append(settings)
        return compile_(function, **settings)

    monkeypatch.setattr(torch, "compile", spy)
    backend = xpupack.InductorBackend(compile_options={"epilogue_fusion": False})
    model = xpupack.tune(make_stack(seed=6), stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(backend))
    root = xpupack.save(model, tmp_path / "pkg")
    [entry] = json.loads((root / "xpupack.json").read_text())["modules"]
    assert entry["backend"]["options"] == {"compile_options": {"epilogue_fusion": False}}
    loaded = xpupack.load(make_stack(seed=6), root, defer_compile=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.allclose(loaded(x), make_stack(seed=6)(x), atol=1e-5)
    # one compilation per signature (two), at tune time and again at load (in the loading process)
    assert (
        seen
        == [{"dynamic": False, "options": {"epilogue_fusion": False}}] * 2
        + [{"dynamic": False, "options": {"epilogue_fusion": False, "compile_threads": 1}}] * 2
    )


def test_compile_options_with_a_mode_keep_the_mode_settings():
    backend = xpupack.InductorBackend("max-autotune-no-cudagraphs", compile_options={"epilogue_fusion": False})
    settings = backend.compile_settings(torch.device("cpu"))["options"]
    assert settings["max_autotune"] is True and settings["epilogue_fusion"] is False
    assert xpupack.InductorBackend("max-autotune-no-cudagraphs").compile_settings(torch.device("cpu")) == {
        "mode": "max-autotune-no-cudagraphs"
    }


def test_a_package_may_carry_the_choice_of_triton_launcher():
    """Off, Inductor reads coordinate descent's carried results through the autotune cache, where its static
    launcher's path loses them (pytorch#172819); the choice must travel, since a compile's cache key has it."""
    options = {"coordinate_descent_tuning": True, "use_static_cuda_launcher": False}
    backend = xpupack.InductorBackend(compile_options=options)
    assert backend.compile_settings(torch.device("cpu"))["options"]["use_static_cuda_launcher"] is False
    with pytest.raises(ValueError, match="not a boolean"):
        xpupack.InductorBackend(compile_options={"use_static_cuda_launcher": "no"})


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"no_such_setting": 1}, "not a setting"),
        ({"epilogue_fusion": [1]}, "not a boolean"),
        ({"epilogue_fusion": 1}, "not a boolean"),
        ({"coordinate_descent_search_radius": 10**6}, "from 1 to 4"),
        ("max_autotune", "give a dict"),
        # names a loader must not take from a package
        ({"cpp.cxx": "/tmp/evil-cc"}, "only change speed"),
        ({"cuda.cutlass_dir": "/tmp/pkg"}, "only change speed"),
        ({"trace.debug_dir": "/home"}, "debugging or tracing"),
        ({"load_config": 1}, "not a setting"),
        ({"triton.cudagraphs": True}, "GraphBackend"),
        ({"_cache_config_ignore_prefix": 1}, "not a setting"),
    ],
)
def test_compile_options_are_checked(options, problem):
    with pytest.raises(ValueError, match=problem):
        xpupack.InductorBackend(compile_options=options)


#: settings that remove safety from what a loader compiles, and why each is refused
UNSAFE_OPTIONS = [
    ({"assert_indirect_indexing": False}, "safety check"),  # out-of-range ids read past a table
    ({"size_asserts": False}, "safety check"),
    ({"trace.enabled": True}, "debugging or tracing"),  # writes torch_compile_debug/ into the cwd
    ({"sleep_sec_TESTING_ONLY": 5}, "testing hook"),
    ({"freezing": True}, "safety check"),
]  # bakes weights in: load_state_dict would be ignored


@pytest.mark.parametrize("options, problem", UNSAFE_OPTIONS)
def test_tuning_refuses_compile_options_that_remove_safety(options, problem):
    with pytest.raises(ValueError, match=f"{next(iter(options))} .*{problem}.*only settings that change speed"):
        xpupack.InductorBackend(compile_options=options)


def test_a_manifest_cannot_hand_the_loader_a_compiler():
    """compile_options come back from an untrusted package through `backend_from_json`: the same check."""
    from xpupack.backends.base import backend_from_json

    with pytest.raises(UnknownConfigError, match="only change speed"):
        backend_from_json("inductor", {"compile_options": {"cpp.cxx": "/tmp/evil-cc"}})


def _as_inductor_package(root, tmp_path, compile_options):
    """``root`` with its modules handed to Inductor with ``compile_options``, as a package's author could write it."""
    copy = copy_package(root, tmp_path / "pkg")
    rewrite_manifest(
        copy,
        lambda manifest: [
            module.update(backend={"name": "inductor", "options": {"compile_options": compile_options}, "config": {}})
            for module in manifest["modules"]
        ],
    )
    return copy


@pytest.mark.parametrize("options, problem", UNSAFE_OPTIONS)
def test_a_package_with_compile_options_that_remove_safety_is_refused_at_load(
    eager_package, tmp_path, options, problem, monkeypatch
):
    root = _as_inductor_package(eager_package, tmp_path, options)
    monkeypatch.chdir(tmp_path)
    model = make_stack()
    before = snapshot(model)
    with pytest.raises(UnknownConfigError, match=f"{next(iter(options))} .*{problem}"):
        xpupack.load(model, root)
    assert_unchanged(model, before)
    assert not (tmp_path / "torch_compile_debug").exists()
    # the loader's own settings replace the package's, but the package is still refused: it is hostile
    with pytest.raises(UnknownConfigError, match=next(iter(options))):
        xpupack.load(model, root, compile_options={})


def test_the_loader_overrides_the_package_compile_options(eager_package, tmp_path, monkeypatch):
    seen = []
    compile_ = torch.compile

    def spy(function, **settings):  # compiles cheaply through Dynamo alone; what matters is what was asked
        seen.append(settings)
        return compile_(function, backend="eager")

    monkeypatch.setattr(torch, "compile", spy)
    root = _as_inductor_package(eager_package, tmp_path, {"coordinate_descent_tuning": True})
    model = xpupack.load(make_stack(), root, defer_compile=False)
    assert seen[-1] == {"dynamic": False, "options": {"coordinate_descent_tuning": True, "compile_threads": 1}}
    seen.clear()
    model = xpupack.load(make_stack(), root, compile_options={}, defer_compile=False)
    assert seen and all(settings == {"dynamic": False, "options": {"compile_threads": 1}} for settings in seen)
    assert "the loader's compile_options {}" in xpupack.tuned.session_of(model).modules["layers.0.mlp"].report[0].reason
    seen.clear()
    xpupack.load(make_stack(), root, compile_options={"epilogue_fusion": False}, defer_compile=False)
    assert all(settings["options"] == {"epilogue_fusion": False, "compile_threads": 1} for settings in seen)
    with pytest.raises(ValueError, match="trace.enabled .*debugging"):
        xpupack.load(make_stack(), root, compile_options={"trace.enabled": True}, defer_compile=True)


#: the README's batch ladder: more sizes than Dynamo's recompile limit (8) lets one function compile
LADDER = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]


def _dynamo_only(monkeypatch, skip: set[int] = frozenset()):
    """``torch.compile`` through Dynamo with a backend that notes each graph's batch size (no Inductor: cheap,
    and Dynamo's recompile limit is the same); the compiles numbered in ``skip`` return the function as it
    is, as Dynamo does when it gives up on a frame. Returns the batch sizes compiled."""
    compiled, calls = [], []
    compile_ = torch.compile

    def noting(graph, inputs):
        compiled.append(
            next(
                x.shape[0]
                for x in inputs
                if isinstance(x, torch.Tensor) and x.dim() == 2 and not isinstance(x, torch.nn.Parameter)
            )
        )
        return graph.forward

    def spy(function, **settings):
        calls.append(settings)
        return function if len(calls) in skip else compile_(function, backend=noting, dynamic=False)

    monkeypatch.setattr(torch, "compile", spy)
    return compiled


def test_every_signature_of_a_long_batch_ladder_is_compiled(monkeypatch):
    """Dynamo stops compiling a function after 8 recompiles and runs it eagerly without a word: over the
    11-size ladder 3 sizes ran eager while stats said inductor with 11 of 11 active."""
    compiled = _dynamo_only(monkeypatch)
    model = xpupack.tune(
        make_stack(),
        [torch.randn(n, 8) for n in LADDER],
        modules=["layers.0.mlp"],
        strategy=xpupack.Only(xpupack.InductorBackend()),
    )
    assert sorted(set(compiled)) == LADDER
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["active_signatures"] == stats["signatures"] == len(LADDER) and "not_compiled" not in stats


def test_stats_tell_when_a_signature_is_not_compiled(monkeypatch, fallback_calls):
    """A signature Dynamo ran without compiling is no active signature of the module: its calls run the
    original module and count as fallbacks, with the reason."""
    compiled = _dynamo_only(monkeypatch, skip={3})  # signatures compile in the samples' order: 8 is skipped
    model = xpupack.tune(
        make_stack(),
        [torch.randn(n, 8) for n in (2, 4, 8)],
        modules=["layers.0.mlp"],
        strategy=xpupack.Only(xpupack.InductorBackend()),
    )
    [skipped] = {2, 4, 8} - set(compiled)  # the largest: no call of it can be padded up to another
    with torch.no_grad():
        model(torch.randn(skipped, 8))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["active_signatures"] == 2 and stats["signatures"] == 3
    assert list(stats["not_compiled"]) == [f"(f32[{skipped},8], 1.0)"]
    assert stats["fallbacks"] == 1 and stats["fallback_reasons"] == {"not built": 1}
    assert "not compiled" in fallback_calls[0].reason


def test_int8_weight_only_turns_off_the_cpu_int8_rewrite_on_cuda_only():
    pytest.importorskip("torchao")
    int8 = xpupack.TorchAOBackend("int8-weight-only")
    assert int8.inductor_options(torch.device("cuda")) == {"pattern_matcher": False}
    assert int8.inductor_options(torch.device("cpu")) == {}
    assert xpupack.TorchAOBackend("int8-dynamic").inductor_options(torch.device("cuda")) == {}
    composed = xpupack.InductorBackend(base=int8, compile_options={"epilogue_fusion": False})
    assert composed.compile_settings(torch.device("cuda")) == {
        "options": {"pattern_matcher": False, "epilogue_fusion": False}
    }


def test_a_load_compiles_in_its_own_process_where_tuning_leaves_inductor_its_worker_pool(tmp_path, monkeypatch):
    # a load compiles from the carried caches: Inductor's pool of compile processes (one per core, each
    # importing torch) would only slow a fresh server down; compile_threads is outside Inductor's cache keys
    settings = []

    def spy(function, **options):
        settings.append(options)
        return function

    monkeypatch.setattr(torch, "compile", spy)
    monkeypatch.setattr("xpupack._torch_compat.has_compiled_code", lambda entry: True)
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(xpupack.InductorBackend())
    )
    root = xpupack.save(model, tmp_path / "pkg")
    tuned = list(settings)
    settings.clear()
    xpupack.load(make_stack(), root, defer_compile=False)
    assert tuned and all("compile_threads" not in options.get("options", {}) for options in tuned)
    assert settings and all(options["options"]["compile_threads"] == 1 for options in settings)
