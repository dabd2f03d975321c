"""Canaries for the private PyTorch entry points `xpupack._torch_compat` names: each fails loudly on a torch
release that changes one, before a user meets the change."""

import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from xpupack import _torch_compat


def test_the_storage_check_in_c_compares_addresses():
    tensors = [torch.zeros(2), torch.ones(3)]
    addresses = [t.data_ptr() for t in tensors]
    if _torch_compat.data_ptrs_equal is None:
        pytest.skip(f"torch {torch.__version__} lacks it; the Python loop does the check")
    assert _torch_compat.data_ptrs_equal(tensors, addresses, [0, 1])
    tensors[1].data = torch.ones(3)
    assert not _torch_compat.data_ptrs_equal(tensors, addresses, [0, 1])


@pytest.mark.slow  # a C++ compile
def test_a_package_compiled_without_its_weights_runs_on_the_tensors_it_is_handed(tmp_path):
    module = nn.Linear(4, 3)
    with torch.no_grad():
        exported = torch.export.export(module, (torch.randn(2, 4),), strict=False)
        path = _torch_compat.aoti_compile(exported, tmp_path / "linear.pt2")
    if sys.platform == "linux" and shutil.which("readelf"):  # its library binds its own symbols first
        with zipfile.ZipFile(path) as archive:
            libraries = [name for name in archive.namelist() if name.endswith(".so")]
            archive.extractall(tmp_path / "unpacked", members=libraries)
        assert libraries
        for name in libraries:
            dynamic = subprocess.run(
                ["readelf", "-d", str(tmp_path / "unpacked" / name)], capture_output=True, text=True
            )
            assert "SYMBOLIC" in dynamic.stdout, dynamic.stdout
    loader = _torch_compat.aoti_load(path)
    names = _torch_compat.aoti_constant_names(loader)
    assert sorted(names) == ["bias", "weight"]
    _torch_compat.aoti_use_constants(loader, {"weight": module.weight.detach(), "bias": module.bias.detach()})
    x = torch.randn(2, 4)
    (out,) = _torch_compat.aoti_run(loader, [x])
    assert torch.allclose(out, module(x).detach(), atol=1e-6)
    with torch.no_grad():  # user-managed: the package reads the tensors themselves, not a copy
        module.weight.zero_()
    (out,) = _torch_compat.aoti_run(loader, [x])
    assert torch.allclose(out, module.bias.detach().expand(2, 3), atol=1e-6)
    with pytest.raises(RuntimeError):  # every constant must be handed in
        _torch_compat.aoti_use_constants(_torch_compat.aoti_load(path), {"weight": module.weight.detach()})


@pytest.mark.skipif(sys.platform != "linux", reason="-Bsymbolic is a GNU linker option")
def test_the_own_symbols_compiler_adds_bsymbolic_to_shared_links_only(tmp_path, monkeypatch):
    compiler = tmp_path / "g++"  # prints what it was given
    compiler.write_text('#!/bin/sh\necho "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", lambda: str(compiler))
    shim = _torch_compat.own_symbols_compiler()
    assert shim is not None and Path(shim).name == "g++"  # Inductor reads gcc or clang off the name
    linked = subprocess.run([shim, "a.cpp", "-shared", "-o", "a b.so"], capture_output=True, text=True, check=True)
    assert linked.stdout.split() == ["a.cpp", "-shared", "-o", "a", "b.so", "-Wl,-Bsymbolic"]
    compiled = subprocess.run([shim, "-c", "a.cpp", "-o", "a.o"], capture_output=True, text=True, check=True)
    assert compiled.stdout.split() == ["-c", "a.cpp", "-o", "a.o"]
    # one path per compiler and cache, which Inductor's cache keys name: another process's compiles are found
    assert _torch_compat.own_symbols_compiler() == shim
    assert Path(shim).is_relative_to(_torch_compat.inductor_cache_dir())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another cache"))
    moved = _torch_compat.own_symbols_compiler()
    assert moved != shim and Path(moved).is_relative_to(tmp_path / "another cache") and os.access(moved, os.X_OK)


@pytest.mark.slow  # a C++ compile
def test_an_aoti_compile_leaves_the_processs_inductor_settings_as_they_were(tmp_path):
    """Regression: ``aoti_compile_and_package`` wrote the package's metadata into the process-wide
    ``aot_inductor.metadata``; Inductor keys its graphs on the settings, so an Inductor package built later
    in the process carried graphs a fresh process never looked up (2 misses at its load)."""
    before = repr(_torch_compat.inductor_settings())
    with torch.no_grad():
        exported = torch.export.export(nn.Linear(4, 3), (torch.randn(2, 4),), strict=False)
        _torch_compat.aoti_compile(exported, tmp_path / "linear.pt2")
    assert repr(_torch_compat.inductor_settings()) == before


def test_inductors_cache_folder_follows_its_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert _torch_compat.inductor_cache_dir() == (tmp_path / "cache").absolute()


def test_dynamo_says_whether_it_holds_compiled_code_for_a_function():
    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager")
    assert not _torch_compat.has_compiled_code(double)
    compiled(torch.ones(2))
    assert _torch_compat.has_compiled_code(double)


def test_dynamos_compile_lock_is_reentrant():
    lock = _torch_compat.compile_lock()
    with lock, lock:  # the artifact record is taken under it, and compiles inside take it again
        pass


@pytest.mark.slow  # the worker's first Inductor compile: its imports and a precompiled header
def test_a_compile_inside_a_fresh_record_records_its_artifacts_and_shows_its_sources():
    """What a package's Inductor artifacts are made of: the record of one compile's cache artifacts (hits
    included) and the C++ sources it wrote or found; the outer record gets them back afterwards."""
    sources = []

    def shifted(x):
        return (x + 3).sin()

    with _torch_compat.compile_lock():
        with (
            _torch_compat.fresh_artifact_record() as recorded,
            _torch_compat.observing_sources(lambda path, extension: sources.append((path, extension))),
        ):
            torch.compile(shifted)(torch.randn(8))
            artifacts = recorded()
        _torch_compat.forget_loaded_kernels()
    assert artifacts and all(hasattr(artifact, "type") for artifact in artifacts)
    assert any(extension.endswith("cpp") and path.is_file() for path, extension in sources)
    with _torch_compat.fresh_artifact_record() as recorded:
        _torch_compat.add_to_artifact_record(artifacts)
        assert recorded() == artifacts


def test_inductors_vector_isa_probes_and_settings_are_readable():
    programs = _torch_compat.vec_isa_programs()
    assert programs and all(isinstance(program, bytes) and b"#include" in program for program in programs)
    assert _torch_compat.mode_options("max-autotune-no-cudagraphs").get("max_autotune") is True
    settings = _torch_compat.inductor_settings()
    assert "max_fusion_size" in settings and "coordinate_descent_tuning" in settings


def test_the_stable_private_names_xpupack_imports_are_there():
    import torch._dynamo
    import torch.utils._cxx_pytree as cxx_pytree
    import torch.utils._pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    leaves, spec = cxx_pytree.tree_flatten(((torch.ones(1), 2), {"a": torch.zeros(1)}))
    assert len(leaves) == 3 and cxx_pytree.tree_unflatten(leaves, spec)[0][1] == 2
    assert pytree.tree_leaves([1, (2, 3)]) == [1, 2, 3]
    assert callable(torch._dynamo.mark_static_address)
    assert hasattr(TorchDispatchMode, "__torch_dispatch__")


def test_traced_as_xpupack_traces_a_modules_float_attribute_is_a_constant_not_an_input():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 0.5

        def forward(self, x):
            return x * self.scale

    graphs = []

    def backend(graph, inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(Scaled(), backend=backend, dynamic=True)  # sizes as symbols, as a decode step's
    with _torch_compat.tracing():
        assert compiled(torch.ones(3)).tolist() == [0.5] * 3
    [graph] = graphs
    inputs = [node.name for node in graph.graph.find_nodes(op="placeholder")]
    assert inputs and not [name for name in inputs if "scale" in name], inputs  # without it: an input l_self_scale


def test_no_other_thread_compiles_while_xpupack_traces_with_its_settings():
    got = []

    def other_compile():
        lock = _torch_compat.compile_lock()
        if lock.acquire(timeout=0.2):
            lock.release()
            got.append(True)
        else:
            got.append(False)

    with _torch_compat.tracing():
        thread = threading.Thread(target=other_compile)
        thread.start()
        thread.join()
    assert got == [False]  # the settings are process-wide: a compile of another thread waits
    other_compile()
    assert got == [False, True]
