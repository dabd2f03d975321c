"""The Inductor backend: ``torch.compile`` per module, compiled artifacts carried in the package.

At save, PyTorch's portable cache artifacts ("mega-cache", the format of
``torch.compiler.save_cache_artifacts``) go into ``backends/inductor/``; at
load, ``torch.compiler.load_cache_artifacts`` puts them back into the local
Inductor caches before the modules are compiled again from synthesised
inputs, so compilation hits the caches instead of starting from scratch.

The mega-cache holds generated source, not the C++ libraries Inductor builds
from it on CPU (nor the results of its vector-ISA probe, about 7 s on a fresh
cache); so those libraries are carried too (``backends/inductor/kernels/``)
and put back into the local cache, where Inductor finds them by the hash of
their source.

A package carries exactly what its modules' compiles produced or used,
recorded while the backend compiles them (`_collecting_artifacts`): never code that
something else compiled in the process, and all of its own even when every
compile hit a warm cache.

All of these are pickles and native code: they load only when trusted
(docs/safety.md); otherwise the module is compiled locally.

Calls with state (decode steps with a KV cache) are compiled with their sizes
as symbols, so that one compiled step serves every cache length; a new length
while serving is prepared off the caller's path (`InductorRunner.add_signature`;
docs/language-models.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import chain, count
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch

from .. import _background, _device, _torch_compat
from .._compare import LOW_PRECISION_SQNR_DB
from .._inference import normal_call
from ..errors import PackageFormatError, error_line
from ..manifest import CACHE, KERNELS, artifact_file
from ..module_spec import ModuleSpec, Target

if TYPE_CHECKING:
    from torch.compiler._cache import CacheArtifact
from ..signature import Signature, Unsynthesizable, flatten
from ..state import scratch_copy
from ._facts import INDUCTOR_DEPENDS_ON, INDUCTOR_MODES, settings_tag
from .base import Backend, ComposedBackend, Runner, check_against_original, register_backend

log = logging.getLogger(__name__)

CACHE_FILE = "cache.bin"
#: the backend config's entry that says calls with state were compiled per shape, not with sizes as symbols
STATE_SIZES, PER_SHAPE = "state_sizes", "per shape"
#: what Inductor builds from a C++ source ``name.cpp`` in its cache: ``name.so`` (``name.o``: a part linked later)
_BUILT_SUFFIXES = (".so", ".o")


@dataclass
class _Compiled:
    """What compiling one module produced or used: what a package of it carries."""

    #: PyTorch's cache artifacts: Inductor's graphs, AOTAutograd's entries...
    artifacts: list[CacheArtifact] = field(default_factory=list)
    #: C++ sources of the libraries its code loads, as the path relative to the Inductor cache -> the file
    sources: dict[str, Path] = field(default_factory=dict)


#: why a signature counts as not compiled: Dynamo ran its function and left no compiled code for it
NOT_COMPILED = (
    "Dynamo ran it without compiling (torch.compiler.set_stance('force_eager'), a frame Dynamo "
    "skips, or a compile limit); its calls run the original module"
)


#: why a sliding-window call is not compiled per shape
STATIC_COUNTS = (
    "a sliding-window call compiled per shape, whose Python-side token count Dynamo would guard on (it would "
    "compile again for every position); its calls run the original module"
)


class InductorRunner(Runner):
    """Runs each signature through compiled code and knows what compiling recorded (`_Compiled`).

    A signature without state gets a ``torch.compile`` of its own, static: a batch size never becomes a
    symbol, and Dynamo, which keeps compiled code per function and past its recompile limit (8) runs a
    function's further shapes eagerly without a word, compiles each shape once (one function for an
    11-size batch ladder left 3 sizes uncompiled). Signatures with state (decode steps with a KV cache)
    share one compiled with every size a symbol, so that a cache of any length runs the same compiled
    code (Dynamo keeps a size of 1, and the weights' sizes, fixed); where that compile failed at tune
    time, each gets a static one. Whether Dynamo really compiled a signature is checked on its first
    call; one it did not is taken out of ``supported`` and listed under ``not_compiled``, and its calls
    run the original module (`stats` counts them).

    Args:
        path: the module's object path (for messages).
        spec: its signatures.
        device: the device compiled for.
        compile_one: ``compile_one(dynamic)`` makes ``(entry, compiled)``: a function of its own and its
            ``torch.compile``.
        symbolic_state: whether calls with state share one compile with sizes as symbols.
    """

    def __init__(
        self,
        path: str,
        spec: ModuleSpec,
        device: torch.device,
        compile_one: Callable[[bool], tuple[Callable[..., Any], Callable[..., Any]]],
        *,
        symbolic_state: bool,
    ):
        super().__init__(set())
        self.path = path
        self.spec = spec
        #: index -> signature: the spec's, then those `add_signature` handed it while serving
        self.signatures: dict[int, Signature] = dict(enumerate(spec.signatures))
        self.device = device
        #: ``compile_one(dynamic)`` makes ``(entry, compiled)``: a function of its own and its ``torch.compile``
        self._compile_one = compile_one
        #: whether calls with state share the compile with sizes as symbols
        self.symbolic_state = symbolic_state and any(signature.state_slots for signature in spec.signatures)
        #: a signature's family and size pattern (`Signature.size_pattern`) -> the compile with sizes as symbols
        #: its calls with state share, each its own function to Dynamo: its graph is then the same whichever
        #: of them compiles first, at tune time as at load, and so the load hits the package's graph. (One
        #: function for all would make Dynamo compile the others again with what the first taught it.)
        self._symbolic: dict[tuple, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        #: signature index -> the compiled function of the signatures checked to be compiled
        self._ready: dict[int, Callable[..., Any]] = {}
        self._pending: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        #: signature index -> its compile off the caller's path for a call with state, after a load's (`_prepared`)
        self._preparing: dict[int, Future] = {}
        #: signature index -> why its calls are not compiled (they fall back)
        self.not_compiled: dict[int, str] = {}
        self.compiled = _Compiled()
        self._lock = threading.Lock()
        #: the module's own forward, serving while a load's compile off the caller's path is not done
        #: (`compile_later`, `compile_state_calls_later`); None: every call runs the compiled code
        self._original: Callable[..., Any] | None = None
        #: whether the compiled code may serve (its compile off the caller's path checked)
        self._compiled_checked = False
        self.compiling = 0
        self.upgrade_error: str | None = None

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Runs the call through the signature's compiled code (compiling it on its first call).

        While a load's compile off the caller's path is pending, the original module runs instead
        (counted as ``compiling``); so it does for a call with state that compile could not reach (a KV
        cache comes only with a real call) until it is compiled off the caller's path too (`prepare`).
        See `Runner.run`.

        Args:
            index: the signature the call fits.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            leaves: the call's inputs in the signature's leaf order.

        Returns:
            The module's output.

        Raises:
            RuntimeError: Dynamo left no compiled code for the signature.
        """
        with _background.between_jobs():  # the model's Python never runs beside a trace on the worker
            if self._original is not None and (not self._compiled_checked or not self._prepared(index, args, kwargs)):
                self.compiling += 1  # compiled off the caller's path (a load's): not yet, or never
                return self._original(*args, **kwargs)
            return self.run_compiled(index, args, kwargs, leaves)

    def _prepared(self, index: int, args: tuple, kwargs: dict) -> bool:
        """After a load's compile off the caller's path: whether signature ``index`` is compiled, starting its
        compile off the caller's path (`prepare`) for a call with state it did not reach.

        Raises:
            RuntimeError: that compile failed (the call and those after it run the original module).
        """
        if index in self._ready or not self.signatures[index].state_slots:
            return True
        with self._lock:
            future = self._preparing.get(index)
            if future is None:
                future = self.prepare(index, args, kwargs)
                if future is None:  # compiled meanwhile
                    return True
                self._preparing[index] = future
        if not future.done():
            return False
        if future.exception() is not None:
            raise RuntimeError(f"compiling off the caller's path: {error_line(future.exception())}")
        return True

    def run_compiled(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """`run` through the compiled code, also before a load's compile off the caller's path was checked
        (the check itself runs this way).

        Args:
            index: the signature the call fits.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            leaves: the call's inputs in the signature's leaf order.

        Returns:
            The module's output.
        """
        mode = contextlib.nullcontext()
        if not (self.signatures[index].state_slots or self.spec.mutates_inputs):  # it writes nothing of the caller's
            mode, args, kwargs = normal_call(args, kwargs, leaves)
        with mode:
            function = self._ready.get(index)
            if function is not None:
                return function(*args, **kwargs)
            return self._first_call(index, args, kwargs)

    def failed_upgrade(self) -> tuple[str, str] | None:
        """``("eager", why)`` once the compile off the caller's path failed (`Runner.failed_upgrade`)."""
        return ("eager", self.upgrade_error) if self.upgrade_error else None

    def compile_later(self, original: Callable[..., Any], work: Future) -> None:
        """Runs ``original`` (the module's own forward) for every call until ``work`` (the compile off the
        caller's path) is done; a compile that failed leaves it running them (`upgrade_error` says why).

        Args:
            original: the module's own forward.
            work: the compile and its check, queued with `xpupack._background.later`.
        """
        self._original = original
        self.checked_where_compiled = True

        def settle(done: Future) -> None:
            if done.cancelled():  # the process exits (or the load failed): no call will come, nothing failed
                return
            if done.exception() is None:
                self._compiled_checked = True  # only now may a call run the compiled code
                return
            why = f"{type(done.exception()).__name__}: {done.exception()}"
            self.upgrade_error = f"compiling off the caller's path failed: {why}"
            log.warning("%s: %s; the original module keeps serving", self.path or "<model>", self.upgrade_error)

        work.add_done_callback(settle)

    def compile_state_calls_later(self, original: Callable[..., Any]) -> None:
        """Runs ``original`` for a call with state until its signature is compiled off the caller's path
        (`prepare`); every other signature is compiled and checked already. A load over a base that changes
        the module (TorchAO) compiles those now, since it cannot run the module meanwhile unchanged, but
        a decode step compiles only with a real call's cache.

        Args:
            original: the module's own forward, over the base's changes (the quantized module).
        """
        self._original, self._compiled_checked = original, True
        self.prepares_state_calls = True

    def is_symbolic(self, index: int) -> bool:
        """Whether signature ``index`` runs the compile shared by calls with state, sizes as symbols.

        Args:
            index: a signature's index (`signatures`).

        Returns:
            True for a signature with state while ``symbolic_state`` holds.
        """
        return self.symbolic_state and bool(self.signatures[index].state_slots)

    def compile_state_per_shape(self) -> None:
        """Calls with state get a static compile each (their compile with sizes as symbols failed): a
        new cache length then compiles once more (off the caller's path, `add_signature`)."""
        with self._lock:
            self.symbolic_state, self._symbolic = False, {}
            for index in [i for i in self._ready if self.signatures[i].state_slots]:
                del self._ready[index]

    def _compiled_for(self, index: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
        with self._lock:
            if self.is_symbolic(index):
                signature = self.signatures[index]
                shared = (signature.family, signature.size_pattern)
                if shared not in self._symbolic:
                    self._symbolic[shared] = self._compile_one(True)
                return self._symbolic[shared]
            if index not in self._pending:
                self._pending[index] = self._compile_one(False)
            return self._pending[index]

    def _first_call(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A signature's first call compiles it (at tune or load time, or for a call with state while
        serving) and checks that Dynamo left compiled code for it."""
        if index in self.not_compiled:
            raise RuntimeError(f"not compiled: {self.not_compiled[index]}")
        before = [
            counters.read(obj) for counters, obj in self.signatures[index].state_counters(flatten(args, kwargs)[0])
        ]
        if any(before) and not self.is_symbolic(index):
            raise RuntimeError(f"not compiled: {STATIC_COUNTS}")
        entry, function = self._compiled_for(index)
        with _torch_compat.tracing():
            output = function(*args, **kwargs)
        if _torch_compat.has_compiled_code(entry):
            self._ready[index] = function
            if any(before):
                try:
                    with _torch_compat.tracing():
                        self._compile_other_paths(index, function, args, kwargs, before)
                except Exception as exc:  # the call itself ran: its output stands, another path compiles when met
                    log.warning(
                        "%s: compiling the other paths of %s ahead failed (%s); each compiles on its first call",
                        self.path or "<model>",
                        self.signatures[index].describe(),
                        error_line(exc),
                    )
        else:
            self.not_compiled[index] = NOT_COMPILED
            self.supported.discard(index)
            log.warning(
                "%s: %s was not compiled: %s",
                self.path or "<model>",
                self.signatures[index].describe(),
                NOT_COMPILED,
            )
        return output

    def _compile_other_paths(
        self, index: int, function: Callable[..., Any], args: tuple, kwargs: dict, before: list[tuple]
    ) -> None:
        """Compiles the other Python paths of a sliding-window decode step (`SlidingWindowCounters.other_paths`:
        the window filling, the window full) now, on a scratch copy of the call (``before``: its counts before
        it ran) moved onto each: else the first call on another path would compile on the caller's path, and a
        package would not carry its graph. Its count is a symbol in each graph, so no position compiles again."""
        leaves = flatten(args, kwargs)[0]
        signature = self.signatures[index]
        others = [
            counters.other_paths(obj, counts, tuple(now - then for now, then in zip(counters.read(obj), counts)))
            for (counters, obj), counts in zip(signature.state_counters(leaves), before)
        ]
        if not any(others):  # a prefill, or a cache without sliding-window layers
            return
        scratch_args, scratch_kwargs = scratch_copy(args, kwargs, signature.state_tensors(leaves))
        for (counters, obj), paths in zip(signature.state_counters(flatten(scratch_args, scratch_kwargs)[0]), others):
            for counts in paths:
                counters.write(obj, counts)
                function(*scratch_args, **scratch_kwargs)

    def add_signature(self, index: int, signature: Signature, args: tuple, kwargs: dict) -> Future | None:
        """A new size of a tuned signature with state: compiled off the caller's path (`prepare`).

        Args:
            index: the new signature's index.
            signature: the new signature.
            args: its first call's positional arguments.
            kwargs: its first call's keyword arguments.

        Returns:
            The compile's future, or None when it is compiled already.
        """
        self.signatures[index] = signature
        # its base (TorchAO) takes any size as it is: nothing to wait for
        super().add_signature(index, signature, args, kwargs)
        return self.prepare(index, args, kwargs)

    def prepare(
        self, index: int, args: tuple, kwargs: dict, *, ready: Callable[[], bool] | None = None
    ) -> Future | None:
        """Runs a call like this one on a scratch copy of its state on the background worker
        (`xpupack._background`), where signature ``index`` compiles if it must (the first call of the
        process, or a size Dynamo could not keep symbolic), with the caller's grad and inference modes.

        Args:
            index: the signature's index (`signatures`).
            args: a call's positional arguments.
            kwargs: a call's keyword arguments.
            ready: the compile starts once this returns True (the caller paused).

        Returns:
            The compile's future (it fails when no scratch copy of the state can be made), or None when
            the signature is compiled already.
        """
        if index in self._ready:
            return None
        try:
            scratch_args, scratch_kwargs = scratch_copy(
                args, kwargs, self.signatures[index].state_tensors(flatten(args, kwargs)[0])
            )
        except Exception as exc:
            failed: Future = Future()
            failed.set_exception(
                RuntimeError(
                    f"no scratch copy of the call to compile on ({type(exc).__name__}: "
                    f"{exc}); its calls run the original module"
                )
            )
            return failed
        grad, inference, device = torch.is_grad_enabled(), torch.is_inference_mode_enabled(), self.device

        def compile_off_the_callers_path() -> None:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), _device.on_device(device):
                self._first_call(index, scratch_args, scratch_kwargs)
            if index not in self._ready:
                raise RuntimeError(f"not compiled: {self.not_compiled.get(index, NOT_COMPILED)}")

        return _background.submit(compile_off_the_callers_path, ready=ready)

    def unbuilt(self) -> dict[int, str]:
        """The signatures Dynamo did not compile, and why."""
        return {index: f"not compiled: {why}" for index, why in self.not_compiled.items()}

    def describe(self) -> dict:
        """``compiling``, ``compiled_serving``, ``upgrade_error`` and ``not_compiled``, where they apply."""
        facts: dict = {}
        if self._original is not None:
            facts["compiling"] = self.compiling
            facts["compiled_serving"] = self._compiled_checked
        if self.upgrade_error:
            facts["upgrade_error"] = self.upgrade_error
        if self.not_compiled:
            facts["not_compiled"] = {self.signatures[i].describe(): why for i, why in self.not_compiled.items()}
        return facts


class _CompiledCode(Runner):
    """An `InductorRunner`'s compiled code, whatever its gate says (what a load's compile off the caller's
    path checks against the original module before any call runs it)."""

    def __init__(self, runner: InductorRunner):
        super().__init__(runner.supported)
        self.run = runner.run_compiled  # type: ignore[method-assign]


@contextlib.contextmanager
def _collecting_artifacts(*, reload_kernels: bool = False) -> Iterator[_Compiled]:
    """Records what the compiles inside the block produce or use.

    PyTorch records cache artifacts for the whole process, each artifact once:
    saving that record put code compiled for other models into a package, and
    left out a module's graphs that an earlier compile had recorded. A fresh
    record for the block (as ``torch._inductor.standalone_compile`` keeps one)
    holds exactly the block's artifacts, cache hits included; they are added
    to the process's record afterwards, which thus sees what it always saw.

    Kernel libraries have no record and file times cannot tell whose they are:
    Inductor writes or finds each C++ source through ``codecache.write`` before
    it builds or loads the library, whether or not it built it before, so the
    sources passing through there are those of the block's libraries.

    Dynamo's compile lock, held throughout, keeps other threads' compiles out.

    ``reload_kernels``: `_torch_compat.forget_loaded_kernels` first, so that the tuning results of kernels this
    process tuned before are recorded too (at tune time: a load records nothing it will save).
    """
    compiled = _Compiled()
    root = _torch_compat.inductor_cache_dir()

    def observe(source: Path, extension: str) -> None:
        if extension.endswith("cpp") and source.is_relative_to(root):
            compiled.sources[source.relative_to(root).as_posix()] = source

    with _torch_compat.compile_lock():
        if reload_kernels:
            _torch_compat.forget_loaded_kernels()
        with _torch_compat.fresh_artifact_record() as recorded, _torch_compat.observing_sources(observe):
            yield compiled
            compiled.artifacts = recorded()
        _torch_compat.add_to_artifact_record(compiled.artifacts)


def _serialize(artifacts: Iterable[CacheArtifact]) -> bytes | None:
    """The mega-cache of exactly these artifacts (None when there are none)."""
    with _torch_compat.fresh_artifact_record():
        _torch_compat.add_to_artifact_record(artifacts)
        saved = torch.compiler.save_cache_artifacts()
    return None if saved is None else saved[0]


def _own_entry(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` behind a code object of its own, for ``torch.compile``.

    Dynamo keeps compiled code per code object and reuses it for any equal
    ``torch.compile`` whose guards pass: compiling a module whose class (same
    shapes) was compiled before in the process would compile nothing, and so
    record nothing. Its own code object makes Dynamo compile it (cheaply when
    Inductor's caches hold the result).

    It has a name of its own too: Dynamo keeps what it learnt of input sizes
    (its automatic-dynamic state) per file, line and name, not per code
    object. Sharing it, a decode step's compile took what an earlier compile
    of another call form had met (a hand-written loop's cache, then
    ``generate()``'s) and made another graph than a load makes, where that
    form compiles first: the load missed the package's graph.
    """

    def entry(*args, **kwargs):
        return function(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"xpupack_entry_{next(_ENTRIES)}")
    return entry


#: numbers the entries `_own_entry` makes, for their names
_ENTRIES = count()


def _vec_isa_probes(root: Path) -> dict[str, Path]:
    """The sources of Inductor's vector-ISA probe libraries in its cache at ``root`` (they hold no model code).

    The probe runs once per process, at the first CPU compile (perhaps not one
    of this backend's), so it is found by its programs, torch's own, not recorded.
    Probes built by other torch versions or compilers in the same cache come along too.
    """
    programs = _torch_compat.vec_isa_programs()
    sizes = {len(program) for program in programs}
    return {
        source.relative_to(root).as_posix(): source
        for source in sorted(root.glob("*/*.cpp"))
        if source.stat().st_size in sizes and source.read_bytes() in programs and source.with_suffix(".so").is_file()
    }


@register_backend
class InductorBackend(ComposedBackend):
    """Compiles the module with Torch Inductor, one static compilation per recorded signature.

    Args:
        mode: ``torch.compile`` mode (``None``, ``"max-autotune-no-cudagraphs"``...).
            Modes that use CUDA graphs are refused: the graph backend does that job.
        base: a backend that transforms the module in place, compiled on top:
            ``InductorBackend(base=TorchAOBackend("int8-weight-only"))`` compiles
            the quantized module. Its artifacts (quantized weights) are saved with it.
        compile_options: Inductor settings for this compilation only (``torch.compile``'s
            ``options``; keys of ``torch._inductor.config``, JSON values), saved in the
            package so that a loader compiles the same way. A base may add its own
            defaults (`Backend.inductor_options`); these override them.

    Raises:
        ValueError: a mode that records CUDA graphs, a base that does not transform the module, or a
            compile option that is not an Inductor setting, does more than change speed, or has a value
            of the wrong kind.

    Examples:
        >>> xpupack.InductorBackend(mode="max-autotune-no-cudagraphs")
        >>> xpupack.GraphBackend(base=xpupack.InductorBackend())  # compiled, then recorded as a device graph
    """

    name = "inductor"
    pads_calls = True
    #: fusions round differently from eager's op-by-op kernels, and through a deep model (an LLM's logits)
    #: that adds up past any elementwise bound fit for one op, while a wrong kernel falls far below
    low_precision_sqnr_db = LOW_PRECISION_SQNR_DB
    own_compiled_artifacts = True  # grad-mode calls fall back: tuning compiled for inference only
    own_depends_on = INDUCTOR_DEPENDS_ON
    supports_autocast = True  # Dynamo guards on the autocast state and compiles again

    def __init__(
        self,
        mode: str | None = None,
        *,
        base: Backend | dict | None = None,
        compile_options: dict[str, Any] | None = None,
    ):
        if mode is not None and mode not in INDUCTOR_MODES:
            raise ValueError(
                f"InductorBackend(mode={mode!r}) would record CUDA graphs; "
                "use GraphBackend for that, or mode='max-autotune-no-cudagraphs'"
            )
        self._set_base(base)
        if self.base is not None and not self.base.transforms_module:
            raise ValueError(
                f"InductorBackend(base={self.base!r}): only a backend that transforms the module "
                "in place (TorchAOBackend) can be compiled on top"
            )
        self.mode = mode
        self.compile_options = _checked_compile_options(compile_options)

    def options(self) -> dict:
        """``mode``, ``compile_options`` and ``base``, where set."""
        return {
            **({"mode": self.mode} if self.mode else {}),
            **({"compile_options": dict(self.compile_options)} if self.compile_options else {}),
            **self._base_options(),
        }

    def _own_label(self) -> str:
        """``inductor``, with its settings where they are not the defaults (``inductor[coordinate_descent_tuning]``)."""
        return self.name + settings_tag(self.options())

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        """Builds the base (if any), then compiles every recorded signature now. See `Backend.build`.

        Args:
            target: the module.
            spec: its recorded signatures and samples.
            device: the device to compile for.

        Returns:
            An `InductorRunner`.

        Raises:
            RuntimeError: no signature was compiled.
        """
        return self._compile_or_undo(target, spec, device, self._build_base(target, spec, device))

    def _compile_or_undo(
        self,
        target: Target,
        spec: ModuleSpec,
        device: torch.device,
        base_runner: Runner | None,
        *,
        symbolic_state: bool = True,
    ) -> Runner:
        """Compiles; if that fails, the base's changes to the module are taken back."""
        try:
            return self._compile(target, spec, device, base_runner, symbolic_state=symbolic_state)
        except BaseException:
            if base_runner is not None:
                base_runner.undo()
            raise

    def compile_settings(self, device: torch.device, *, loading: bool = False) -> dict[str, Any]:
        """``torch.compile``'s mode or options: ``mode`` alone unless a base or the caller sets options (what a
        hand-compiled comparison passes to ``torch.compile`` to compile as this backend does).

        ``loading``: compiles from the package's carried caches run in this process (``compile_threads=1``,
        which Inductor leaves out of its cache keys): Inductor would otherwise start its pool of compile
        worker processes, one per core and each importing torch, on a server that has nothing to compile."""
        options = {**(self.base.inductor_options(device) if self.base else {}), **self.compile_options}
        if loading:
            options["compile_threads"] = 1
        if not options:
            return {"mode": self.mode}
        # torch.compile takes a mode or options, not both: the mode's own options go first
        return {"options": {**(_torch_compat.mode_options(self.mode) if self.mode else {}), **options}}

    def _runner(
        self, target: Target, spec: ModuleSpec, device: torch.device, *, symbolic_state: bool
    ) -> InductorRunner:
        settings = self.compile_settings(device, loading=spec.samples is None)  # samples: at tune time

        def compile_one(dynamic: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
            # a base transforms the module in place, so its own forward is what gets compiled
            entry = _own_entry(target.forward)
            return entry, torch.compile(entry, dynamic=dynamic, **settings)

        return InductorRunner(target.path, spec, device, compile_one, symbolic_state=symbolic_state)

    def _compile(
        self,
        target: Target,
        spec: ModuleSpec,
        device: torch.device,
        base_runner: Runner | None,
        *,
        symbolic_state: bool,
    ) -> Runner:
        runner = self._runner(target, spec, device, symbolic_state=symbolic_state)
        self._compile_into(runner, target, spec)
        runner.base_runner = base_runner
        return runner

    def _compile_into(self, runner: InductorRunner, target: Target, spec: ModuleSpec) -> None:
        """Compiles every signature of ``runner`` that has an example (now, not on the user's first call)."""
        with _collecting_artifacts(reload_kernels=spec.samples is not None) as recorded:  # samples: at tune time
            try:
                attempted = _compile_examples(runner, spec)
            except _SymbolicSizesFailed as failed:
                log.warning(
                    "%s: its calls with state do not compile with sizes as symbols (%s); they are "
                    "compiled per cache length instead",
                    target.path or "<model>",
                    failed.__cause__,
                )
                runner.compile_state_per_shape()
                attempted = _compile_examples(runner, spec)
        runner.compiled = recorded
        if attempted and not runner.supported:
            raise RuntimeError(f"no signature was compiled: {NOT_COMPILED}")

    def save(self, runner: Runner, folder: Path) -> dict:
        """The base's config, and whether calls with state were compiled per shape; the compiled code
        itself goes into the shared artifacts (`save_shared`).

        Args:
            runner: the `InductorRunner`.
            folder: ``modules/<path>/inductor/``.

        Returns:
            The config.
        """
        config = super().save(runner, folder)
        if any(signature.state_slots for signature in runner.spec.signatures) and not runner.symbolic_state:
            config[STATE_SIZES] = PER_SHAPE  # a loader compiles them the same way
        return config

    def restore(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, *, use_artifacts: bool
    ) -> Runner:
        """Compiles every signature again from synthesised inputs, hitting the caches `restore_shared`
        filled. Within ``xpupack.load(..., defer_compile=True)`` it compiles off the caller's path, the
        original module serving meanwhile (docs/cold-start.md). See `Backend.restore`.

        Args:
            target: the module.
            spec: its signatures.
            config: what `save` returned.
            folder: where `save` wrote.
            device: the device to compile for.
            use_artifacts: passed on to the base (the compiled artifacts are shared: `restore_shared`).

        Returns:
            An `InductorRunner`.

        Raises:
            RuntimeError: no signature was compiled.
        """
        symbolic_state = config.get(STATE_SIZES) != PER_SHAPE
        if self._defers(spec):
            return self._compiled_later(target, spec, device, symbolic_state)
        runner = self._compile_or_undo(
            target,
            spec,
            device,
            self._restore_base(target, spec, config, folder, device, use_artifacts),
            symbolic_state=symbolic_state,
        )
        if self._defers_state_calls(spec):
            runner.compile_state_calls_later(target.forward)
        return runner

    def _defers(self, spec: ModuleSpec | None = None) -> bool:
        """Whether this load compiles off the caller's path (docs/cold-start.md), the original module
        serving meanwhile: without a base (a base such as TorchAO changes the module first) and for a
        module that writes none of its buffers (the worker runs it while calls do)."""
        return _background.deferred() and self.base is None and not (spec is not None and spec.writes_buffers)

    def _defers_state_calls(self, spec: ModuleSpec) -> bool:
        """Whether this load, compiling now over a base (`_defers` does not hold), compiles its calls with state
        off the caller's path, as a load without a base does (`InductorRunner.compile_state_calls_later`)."""
        return (
            _background.deferred()
            and self.base is not None
            and not spec.writes_buffers
            and any(signature.state_slots for signature in spec.signatures)
        )

    def _compiled_later(self, target: Target, spec: ModuleSpec, device: torch.device, symbolic_state: bool) -> Runner:
        """A runner that runs the original module until the worker has compiled every signature it can
        and checked the compiled module against the original; one that fails keeps the original."""
        runner = self._runner(target, spec, device, symbolic_state=symbolic_state)
        runner.supported.update(index for index in range(len(spec.signatures)) if _compiles(runner, spec, index))

        def compile_and_check() -> None:
            with _device.on_device(device):
                self._compile_into(runner, target, spec)
                check_against_original(target, spec, self, _CompiledCode(runner))

        runner.compile_later(target.forward, _background.later(compile_and_check))
        return runner

    def save_shared(self, folder: Path, runners: list[Runner]) -> dict:
        """Writes what compiling the modules of ``runners`` recorded (all modules share one blob).

        The vector-ISA probe's libraries come along with the kernels, so that a
        loader with an empty Inductor cache does not run the probe's compiles.

        Args:
            folder: ``backends/inductor/``.
            runners: the runners of every module this backend runs.

        Returns:
            The shared config: the cache file and the kernels' paths.
        """
        compiled = [runner.compiled for runner in runners if isinstance(runner, InductorRunner)]
        config = {}
        blob = _serialize(chain.from_iterable(record.artifacts for record in compiled))
        if blob is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / CACHE_FILE).write_bytes(blob)
            config[CACHE] = CACHE_FILE
        sources = {relative: source for record in compiled for relative, source in record.sources.items()}
        if sources:
            sources.update(_vec_isa_probes(_torch_compat.inductor_cache_dir()))
        config[KERNELS] = _save_kernels(sources, folder / KERNELS)
        return config

    def restore_shared(self, config: dict, folder: Path, *, use_artifacts: bool) -> None:
        """Puts the package's cache artifacts and kernels into the local Inductor cache, when trusted.

        Within a load that defers compiles, that happens on the background worker.

        Args:
            config: what `save_shared` returned.
            folder: where it wrote.
            use_artifacts: False: nothing is loaded (the modules compile from scratch).

        Raises:
            PackageFormatError: the config's file list is damaged, or names a path outside the package.
        """
        if not use_artifacts:
            return
        # every name is checked, even from a trusted source: none may reach outside the package
        # (nor, for kernels, outside the Inductor cache they are copied into)
        kernels = config.get(KERNELS, [])
        if not isinstance(kernels, list):
            raise PackageFormatError(
                f"the backend config for {folder} lists the kernels as {kernels!r}, not as "
                "a list of files; the package is damaged — rebuild it",
                path=str(folder),
            )
        sources = [artifact_file(folder / KERNELS, relative) for relative in kernels]
        cache = artifact_file(folder, config[CACHE]) if CACHE in config else None
        if self._defers():  # on the worker, before the modules' compiles it queues (importing Inductor: seconds)

            def install() -> None:
                try:
                    self._install_shared(cache, kernels, sources, folder)
                except Exception as exc:  # the modules then compile here, off the caller's path all the same
                    log.warning(
                        "the shared Inductor artifacts in %s cannot be loaded (%s: %s); compiling here instead",
                        folder,
                        type(exc).__name__,
                        exc,
                    )

            _background.later(install)
            return
        self._install_shared(cache, kernels, sources, folder)

    def _install_shared(self, cache: Path | None, kernels: list[str], sources: list[Path], folder: Path) -> None:
        """Puts the package's cache artifacts and kernels into the local Inductor cache."""
        if cache is not None:
            torch.compiler.load_cache_artifacts(cache.read_bytes())
        root = _torch_compat.inductor_cache_dir()
        for relative, source in zip(kernels, sources):
            destination = root / relative
            if not destination.exists():  # never overwrite what this machine built itself
                destination.parent.mkdir(parents=True, exist_ok=True)
                temporary = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
                shutil.copy2(source, temporary)
                os.replace(temporary, destination)
        log.info("loaded Inductor cache artifacts and %d compiled kernels from %s", len(kernels), folder)


#: Inductor settings a package may carry, with the values each may take: every one of them changes
#: only how fast the compiled code runs (which kernels, fusions, tilings and autotuning), never what
#: it checks, where it writes or what it runs. A package is untrusted input, and its settings reach a
#: compilation on the loader's machine even where its compiled artifacts may not run, so nothing else
#: comes from one: not a setting that removes a safety check (``assert_indirect_indexing=False`` lets
#: an out-of-range token id read past an embedding table, or crash the process, where eager raises),
#: nor debugging or tracing (``trace.enabled`` writes tensors into the working directory), nor a
#: testing hook (``sleep_sec_TESTING_ONLY``), nor a string (a compiler, an include directory, a file).
SPEED_SETTINGS: dict[str, type | range] = {
    **dict.fromkeys(
        (
            "max_autotune",
            "max_autotune_gemm",
            "max_autotune_pointwise",
            "coordinate_descent_tuning",
            "coordinate_descent_check_all_directions",
            "epilogue_fusion",
            "epilogue_fusion_first",
            "prologue_fusion",
            "aggressive_fusion",
            "benchmark_fusion",
            "benchmark_epilogue_fusion",
            "loop_ordering_after_fusion",
            "combo_kernels",
            "benchmark_combo_kernel",
            "pattern_matcher",
            "group_fusion",
            "batch_fusion",
            "split_cat_fx_passes",
            "permute_fusion",
            "reorder_for_locality",
            "reorder_for_peak_memory",
            "shape_padding",
            "comprehensive_padding",
            "layout_optimization",
            "conv_1x1_as_mm",
            "split_reductions",
            "use_mixed_mm",
            "inplace_buffers",
            "allow_buffer_reuse",
            "triton.autotune_pointwise",
            "triton.autotune_cublasLt",
            "triton.persistent_reductions",
            "triton.prefer_nd_tiling",
            "triton.tile_reductions",
            "triton.cooperative_reductions",
            "triton.use_block_ptr",
            # programmatic dependent launch (Hopper and later): a kernel's start overlaps the last one's end
            "triton.enable_pdl",
            # how Triton kernels are launched; off, a load reads coordinate descent's results through the
            # autotune cache, which Inductor's static launcher path does not mark as tuned (pytorch#172819)
            "use_static_cuda_launcher",
            "cpp.enable_tiling_heuristics",
            "cpp.enable_loop_tail_vec",
        ),
        bool,
    ),
    # numbers, bounded: a package must not make a loader's compile search without end
    "coordinate_descent_search_radius": range(1, 5),
    "max_fusion_size": range(1, 1025),
    "unroll_reductions_threshold": range(1, 65),
    "triton.max_tiles": range(1, 4),
    "cpp.max_horizontal_fusion_size": range(0, 65),
}


def _compiles(runner: InductorRunner, spec: ModuleSpec, index: int) -> bool:
    """Whether Inductor takes signature ``index``: a sliding-window call only with sizes as symbols, where its
    Python-side token count is a symbol too (compiled per shape, Dynamo would guard on its value and compile
    again for every position, up to its recompile limit)."""
    return spec.samples is None or not spec.samples.counted(index) or runner.is_symbolic(index)


class _SymbolicSizesFailed(Exception):
    """Compiling a call with state with its sizes as symbols raised (the cause)."""


def _compile_examples(runner: InductorRunner, spec: ModuleSpec) -> int:
    """Runs each signature's example through its compiled function: the compile happens now, not on
    the user's first call. Returns how many signatures it took. Raises `_SymbolicSizesFailed` when the
    compile with sizes as symbols fails. Signatures Inductor does not take (`_compiles`) are left to others.
    """
    attempted = 0
    for index in range(len(spec.signatures)):
        if not _compiles(runner, spec, index):
            continue
        runner.supported.add(index)
        attempted += 1
        with spec.samples.mode(index) if spec.samples is not None else torch.no_grad():
            try:
                args, kwargs = spec.example(index)  # a recorded call with state gets its state back as recorded
            except Unsynthesizable:
                continue  # a call with a KV cache at load: it compiles on its first real call
            try:
                runner.run_compiled(index, args, kwargs, [])
            except Exception as exc:
                if runner.is_symbolic(index):
                    raise _SymbolicSizesFailed() from exc
                raise
    return attempted


def _refusal(key: str) -> str:
    """Why a setting of ``torch._inductor.config`` that is not in `SPEED_SETTINGS` never comes from a package."""
    if "cudagraph" in key:  # as the modes that record them are refused
        return "is a CUDA graph setting; use GraphBackend for that"
    if key.endswith("_TESTING_ONLY") or key.startswith("test_configs."):
        return "is a testing hook"
    if key.startswith(("trace.", "debug")) or "debug" in key or "profil" in key or key in _DEBUG_SETTINGS:
        return "is a debugging or tracing setting (it writes files or changes what a compile does)"
    if "assert" in key or key.startswith(("unsafe", "assume_")) or key in _SAFETY_SETTINGS:
        return "turns off or weakens a safety check of the compiled code"
    return "is not one of the settings that only change speed"


#: settings `_refusal` names for what they are (the rest of what is refused gets the general reason)
_DEBUG_SETTINGS = frozenset(
    {
        "benchmark_harness",
        "benchmark_kernel",
        "comment_origin",
        "save_args",
        "log_tlparse",
        "developer_warnings",
        "generate_intermediate_hooks",
    }
)
_SAFETY_SETTINGS = frozenset(
    {"triton.divisible_by_16", "fallback_random", "freezing", "use_fast_math", "cpp.enable_unsafe_math_opt_flag"}
)


def _checked_compile_options(options: Any) -> dict[str, Any]:
    """``compile_options`` checked the same at tune time, when a package's manifest names them, and when
    a loader passes its own: only `SPEED_SETTINGS`, with the values they allow, and only where this
    torch has them (keys of ``torch._inductor.config``)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"InductorBackend(compile_options={options!r}): give a dict of Inductor settings")
    settings = _torch_compat.inductor_settings()
    where = "InductorBackend(compile_options=...)"
    for key, value in options.items():
        if not isinstance(key, str) or key not in settings or key.startswith("_"):
            raise ValueError(f"{where}: {key!r} is not a setting of torch._inductor.config")
        allowed = SPEED_SETTINGS.get(key)
        if allowed is None:
            raise ValueError(
                f"{where}: {key} {_refusal(key)}; a package carries only settings that change "
                f"speed ({', '.join(sorted(SPEED_SETTINGS))}), since a loader compiles with them"
            )
        if allowed is bool and not isinstance(value, bool):
            raise ValueError(f"{where}: {key}={value!r} is not a boolean (True or False)")
        if isinstance(allowed, range) and (
            isinstance(value, bool) or not isinstance(value, int) or value not in allowed
        ):
            raise ValueError(f"{where}: {key}={value!r} is not an integer from {allowed.start} to {allowed.stop - 1}")
    return dict(options)


def _save_kernels(sources: dict[str, Path], folder: Path) -> list[str]:
    """Copies each C++ source and what was built from it into ``folder``; returns their relative paths."""
    saved = []
    for relative, source in sorted(sources.items()):
        for name, path in [
            (relative, source),
            *(
                (str(PurePosixPath(relative).with_suffix(suffix)), source.with_suffix(suffix))
                for suffix in _BUILT_SUFFIXES
            ),
        ]:
            if path.is_file() and not path.is_symlink():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, folder / name)
                saved.append(name)
    return saved
