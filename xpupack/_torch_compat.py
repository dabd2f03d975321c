"""The private PyTorch entry points xpupack relies on, each named once here with the releases it was
checked on; ``tests/test_torch_compat.py`` holds a canary per item that fails loudly on a release that
changes it.

Each item, what xpupack uses it for, and the torch releases it was checked on (`CHECKED_ON` unless said):

- ``torch._C._aoti.AOTIModelPackageLoader``: maps a ``.pt2`` AOTInductor package in without Python's
  loader (which first compiles a vector-ISA probe: ~7 s on a CPU with an empty cache).
- its ``get_constant_fqns`` / ``load_constants``: hands the live model's tensors to the package as
  user-managed constants (no copy of the weights).
- ``torch._inductor.aoti_compile_and_package`` with ``aot_inductor.package_constants_in_so=False`` and
  ``always_keep_tensor_constants=True``: compiles without copying the weights into the library, small
  ones included; it writes ``aot_inductor.metadata`` in place (kept from the process's setting here).
- ``torch._C._tensors_data_ptrs_at_indices_equal``: a storage watch's check of every weight's address in
  one C loop (absent: a Python loop does it).
- ``torch._inductor.cpp_builder.get_cpp_compiler`` and the ``cpp.cxx`` setting: the C++ compiler Inductor
  runs; an AOTInductor compile runs it through a shim that links the libraries with ``-Wl,-Bsymbolic``
  (`aoti_compile`).

Inductor's caches, for the artifacts a package carries (`xpupack.backends.inductor`):

- ``torch._inductor.runtime.cache_dir_utils.cache_dir``: where Inductor keeps its on-disk cache.
- ``torch._dynamo.eval_frame._debug_get_cache_entry_list``: whether Dynamo holds compiled code for a code
  object (absent: assumed so).
- ``torch._dynamo.convert_frame.compile_lock``: Dynamo's compile lock, held while a compile's artifacts are
  recorded so that no other thread's land in the record.
- ``torch._inductor.codecache.write``: every C++ source Inductor writes or finds passes through it (the
  kernel libraries of a compile are found that way; they have no record of their own).
- ``torch._inductor.codecache.PyCodeCache`` and ``torch._inductor.async_compile.CompiledTritonKernels``
  (``cache_clear``): kernels a process loaded before, reused from memory unless forgotten.
- ``torch.compiler._cache.CacheArtifactManager`` (``with_fresh_cache``, ``_new_cache_artifacts``,
  ``_seen_artifacts``) and ``CacheArtifact``: a fresh record of cache artifacts for one compile.
- ``torch._inductor.cpu_vec_isa``'s ``VecISA`` classes and their ``*_code`` programs: the vector-ISA probe
  libraries a CPU compile builds first.
- ``torch._inductor.list_mode_options`` and ``torch._inductor.config.get_config_copy``: a mode's settings,
  and every setting's current value.
- ``torch._dynamo.config.specialize_float``: a module's float attributes traced as constants (`tracing`).

Imported where they are used, being stable in all but name (canaries here too):

- ``torch.utils._cxx_pytree`` / ``torch.utils._pytree``: flattening a call's arguments (`xpupack.signature`,
  the AOTInductor backend's output layout).
- ``torch._dynamo.mark_static_address``: a StaticCache's tensors, as transformers marks them (`xpupack.state`).
- ``torch.utils._python_dispatch.TorchDispatchMode``: seeing the operators a recorded call runs
  (`xpupack._device`).
- the mega-cache container of ``torch.utils._appending_byte_serializer`` (read without torch by
  `xpupack.backends._megacache`, its format version checked there).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch.compiler._cache import CacheArtifact, CacheArtifactManager

#: the torch releases these entry points were checked on
CHECKED_ON = ("2.11", "2.13")

#: ``(tensors, addresses, indices) -> bool``: whether each tensor still has its address; None where absent
data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def aoti_compile(exported: Any, path: Path) -> Path:
    """Compiles an exported program into an AOTInductor package at ``path``, the weights left out of the
    library (a load hands it the model's own tensors: `aoti_load`), linked to bind its own symbols first
    (`own_symbols_compiler`)."""
    import torch._inductor
    import torch._inductor.config as inductor_config

    # torch writes the package's metadata into the process-wide ``aot_inductor.metadata`` in place, and every
    # later Inductor compile of the process keys its graphs on it: a package built after an AOTInductor
    # candidate carried graphs no fresh process looks up. A copy of its own takes the writes.
    settings: dict[str, Any] = {"aot_inductor.metadata": dict(inductor_config.aot_inductor.metadata)}
    compiler = own_symbols_compiler()
    if compiler is not None:
        settings["cpp.cxx"] = (None, compiler)
    with inductor_config.patch(settings):
        result = torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(path),
            # every parameter and buffer stays a constant the loader hands in: Inductor otherwise inlines small
            # ones (1-d with up to 8 values, scalars) into the code, where a changed model would never reach them
            inductor_configs={"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True},
        )
    return Path(result)


def own_symbols_compiler() -> str | None:
    """Inductor's C++ compiler behind a shim that links shared libraries with ``-Wl,-Bsymbolic``; None off Linux.

    An AOTInductor library instantiates ``std::regex`` (its device-string parser) and exports the template
    code; ``libc10`` exports its own copies, built by torch's compiler. Bound to those, the library's calls
    run another GCC's layout on its objects: on an H100 image (g++ 13.3, torch 2.11.0+cu130) every package
    crashed in ``std::regex`` as it loaded (docs/hardware.md). Linked with ``-Bsymbolic``, a library binds
    its own definitions first: there a 2-layer MLP's package built by torch's defaults then loaded and ran
    (2026-12-07), while xpupack's package of it (weights outside, a single-threaded runner) still crashed, so
    AOTInductor stays off on CUDA. On a CPU the libraries load and run as before. The shim is named as the
    compiler is, since Inductor picks its flags by the name (gcc's or clang's).
    """
    if sys.platform != "linux":
        return None
    from torch._inductor import cpp_builder

    return _own_symbols_shim(cpp_builder.get_cpp_compiler())


def _own_symbols_shim(compiler: str) -> str:
    quoted = shlex.quote(shutil.which(compiler) or compiler)
    script = f'#!/bin/sh\ncase " $* " in *" -shared "*) exec {quoted} "$@" -Wl,-Bsymbolic ;; esac\nexec {quoted} "$@"\n'
    # in Inductor's cache, named by its content: the compiler's path is part of Inductor's cache keys, and every
    # process on this cache runs the same file, so one AOTInductor compile's kernels are found by the next
    shim = inductor_cache_dir() / "xpupack-cxx" / hashlib.sha256(script.encode()).hexdigest()[:16] / Path(compiler).name
    if not shim.is_file() or shim.read_text() != script:
        shim.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=shim.parent)
        with os.fdopen(fd, "w") as file:
            file.write(script)
        os.chmod(scratch, 0o700)
        os.replace(scratch, shim)  # whole or not at all: another process may run it meanwhile
    return str(shim)


def aoti_load(path: Path) -> Any:
    """The package's runner on the current device. Single-threaded: the threaded runner's event
    bookkeeping breaks device-graph capture, and xpupack serialises calls itself."""
    loader_class = torch._C._aoti.AOTIModelPackageLoader
    try:  # (path, model name, run single-threaded, runners, device index: -1 is the current one)
        return loader_class(str(path), "model", True, 1, -1)
    except TypeError:  # releases before the runner count and device index were arguments
        return loader_class(str(path), "model", True)  # type: ignore[call-arg]


def aoti_constant_names(loader: Any) -> list[str]:
    """The fully qualified names of the constants (parameters, buffers) the package expects."""
    return list(loader.get_constant_fqns())


def aoti_use_constants(loader: Any, constants: dict[str, torch.Tensor]) -> None:
    """Points the package at ``constants`` themselves (user-managed: no copy; the caller keeps them
    alive and reloads them when the model's storages change). Every name must be given."""
    # (constants, use the inactive buffer, check that every constant is updated, user-managed)
    loader.load_constants(constants, False, True, True)


def aoti_run(loader: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call of the package: its flat tensor outputs."""
    return loader.run(inputs)


# -- Inductor's caches ----------------------------------------------------------------------------


def inductor_cache_dir() -> Path:
    """Inductor's on-disk cache folder (``TORCHINDUCTOR_CACHE_DIR`` or its default), absolute."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()).absolute()


def has_compiled_code(function: Callable[..., Any]) -> bool:
    """Whether Dynamo holds compiled code for ``function``'s code object (True where this torch cannot tell)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return True
    return bool(_debug_get_cache_entry_list(function.__code__))


def compile_lock() -> Any:
    """Dynamo's compile lock (a ``threading.RLock``): held, no other thread compiles."""
    from torch._dynamo.convert_frame import compile_lock as lock

    return lock


@contextlib.contextmanager
def observing_sources(observe: Callable[[Path, str], None]) -> Iterator[None]:
    """Within the block, ``observe(path, extension)`` hears of every source Inductor writes or finds in its
    cache (``codecache.write``, which it calls before it builds or loads a library)."""
    from torch._inductor import codecache

    write = codecache.write

    def observed_write(content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
        key, path = write(content, extension, *args, **kwargs)
        observe(Path(path).absolute(), extension)
        return key, path

    codecache.write = observed_write
    try:
        yield
    finally:
        codecache.write = write


def forget_loaded_kernels() -> None:
    """Makes the compiles that follow load each generated module and Triton kernel again through Inductor's
    on-disk caches, instead of reusing the ones this process loaded before from memory."""
    from torch._inductor.codecache import PyCodeCache

    PyCodeCache.cache_clear()
    try:
        from torch._inductor.async_compile import CompiledTritonKernels
    except ImportError:  # a torch without that cache of kernels by source
        return
    CompiledTritonKernels.cache_clear()


@contextlib.contextmanager
def fresh_artifact_record() -> Iterator[Callable[[], list[CacheArtifact]]]:
    """A fresh record of PyTorch's cache artifacts for the block; yields what returns the artifacts recorded
    in it so far (PyTorch records each artifact once per process, cache hits included)."""
    with CacheArtifactManager.with_fresh_cache():
        yield lambda: list(chain.from_iterable(CacheArtifactManager._new_cache_artifacts.values()))


def add_to_artifact_record(artifacts: Iterable[CacheArtifact]) -> None:
    """Adds recorded artifacts to PyTorch's current record, as ``CacheArtifactManager.record_artifact`` does
    (which cannot take them: it encodes its input again)."""
    for artifact in artifacts:
        if artifact not in CacheArtifactManager._seen_artifacts:
            CacheArtifactManager._new_cache_artifacts[artifact.type()].append(artifact)
            CacheArtifactManager._seen_artifacts.add(artifact)


def vec_isa_programs() -> set[bytes]:
    """The C++ programs of Inductor's vector-ISA probe libraries (one per ISA it knows)."""
    from torch._inductor import cpu_vec_isa

    return {
        value.encode()
        for isa in vars(cpu_vec_isa).values()
        if isinstance(isa, type) and issubclass(isa, cpu_vec_isa.VecISA)
        for name, value in vars(isa).items()
        if name.endswith("_code") and isinstance(value, str)
    }


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Dynamo's settings for xpupack's compiles, around the calls that trace, under Dynamo's compile lock: a
    setting is process-wide, and no other thread's compile (the caller's own) may trace with it.

    Compiled with sizes as symbols (a decode step, a prefill of any length), Dynamo makes every float it
    meets a symbol too, a module's float attributes included (a norm's ``eps``, a rotary embedding's
    ``attention_scaling``, an embedding's ``norm_type``); Inductor then cannot keep some of them symbolic and
    restarts the whole trace with them fixed, its lowering done once for nothing (a load with its warm-up:
    10.9 s against 7.5 s for a tiny Llama on a 2-core CPU, 139.8 s against 32.4 s for Llama-3-8B's shapes
    on an H100). Fixed from the start, the trace runs once; the floats are
    constants of the module, guarded as such."""
    import torch._dynamo.config as dynamo_config

    with compile_lock(), dynamo_config.patch(specialize_float=True):
        yield


def mode_options(mode: str) -> dict[str, Any]:
    """The Inductor settings a ``torch.compile`` mode stands for."""
    return dict(torch._inductor.list_mode_options(mode))


def inductor_settings() -> dict[str, Any]:
    """Every Inductor setting's current value (``torch._inductor.config``)."""
    import torch._inductor.config as inductor_config

    return inductor_config.get_config_copy()
