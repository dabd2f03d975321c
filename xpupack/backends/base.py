"""The backend interface (the contract: `xpupack.backends`) and the registry that resolves backends by name.

A backend turns one module into a *runner*: an object that executes calls of
the signatures it was built for. Backends never decide whether a call fits;
the dispatcher in `xpupack.tuned` does that and hands the runner only calls
whose signature it recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import torch

from .. import _background
from .._compare import DEFAULT_TOLERANCES, mismatch
from ..errors import OutputMismatchError, UnknownConfigError
from ..module_spec import ModuleSpec, Target
from ..signature import Signature, flatten
from ._facts import Composition


def check_against_original(
    target: Target, spec: ModuleSpec, backend: Backend, runner: Runner, *, reset: Callable[[], object] = lambda: None
) -> None:
    """Runs every restored signature once through ``runner`` and once through the original module; raises
    `OutputMismatchError` where ``backend.compare`` finds them apart. ``reset`` runs before each run (a
    loader puts the module's buffers back there).

    The inputs are synthesised from the signature with another seed than the
    recording's, so a replay that ignored its inputs would show. A package's
    backends were checked against eager when it was built; this catches what
    changed since: a damaged or hostile package that still passes its digests,
    artifacts that do not fit this machine.

    Args:
        target: the module.
        spec: its signatures (signatures with state are skipped).
        backend: the backend whose `Backend.compare` judges the outputs.
        runner: the restored runner.
        reset: called before each run.

    Raises:
        OutputMismatchError: the runner answers differently from the original module.
    """
    with torch.no_grad():
        for index, signature in enumerate(spec.signatures):
            # only a real call brings a KV cache (a new size met while serving, `Runner.add_signature`, has
            # one too); its recording was checked when tuning
            if index not in runner.supported or signature.state_slots:
                continue
            args, kwargs = signature.synthesize(seed=index + 1)
            reset()
            expected = target.forward(*args, **kwargs)
            reset()
            leaves, _ = flatten(args, kwargs)
            problem = backend.compare(runner.run(index, args, kwargs, leaves), expected)
            if problem:
                raise OutputMismatchError(
                    f"{target.path or '<model>'}: the restored {backend.name} backend "
                    f"differs from the original module on {signature.describe()}"
                    f" ({problem})"
                )


class Runner:
    """Executes calls of a tuned module. Subclasses override `run`.

    `Backend.build` and `Backend.restore` return one; the dispatcher (`xpupack.tuned`) hands it only
    calls that fit one of its ``supported`` signatures. The other methods have defaults that suit a
    runner that changes nothing in the module and holds nothing on the device.

    Args:
        supported: positions in ``spec.signatures`` of the signatures this runner can execute.
    """

    #: indices of signatures this runner can execute (others fall back)
    supported: set[int]
    #: the runner of the backend this one builds on (``GraphBackend(base=...)``); what it owns
    #: and what it changed in the module are this runner's too
    base_runner: Runner | None = None
    #: ``run_padded(index, leaves, axes, batch)`` where a runner pads a smaller batch into its own
    #: buffers (the graph backend); None: `TunedModule` pads a copy of the call and uses `run`
    run_padded: Callable[..., Any] | None = None
    #: True when the runner's compiled code is checked against the original module where it is
    #: compiled, off the caller's path (a load's ``defer_compile``): the load itself has nothing to check
    checked_where_compiled: bool = False
    #: True when the runner's calls with state run the original module until their compile off the caller's
    #: path is done (`Runner.prepare`): a graph runner over it records those calls over it only once it is
    #: ready for them (`GraphRunner.prepare_state_calls`)
    prepares_state_calls: bool = False

    def __init__(self, supported: set[int]):
        self.supported = set(supported)

    def failed_upgrade(self) -> tuple[str, str] | None:
        """For a load that compiles off the caller's path (``defer_compile``): once that compile failed,
        ``(what serves instead, why)``, a downgrade the pytest plugin reports; None otherwise."""
        return None

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Runs one call of signature ``index``: the extension point of a runner.

        Called on the hot path of every tuned call, so it should do no more than the work itself:
        the dispatcher has already checked that the call fits the signature (same tree structure,
        shapes, dtypes, devices and constants) and counted it. Calls arrive one at a time per
        thread; a runner shared by threads guards its own buffers.

        Args:
            index: the signature the call fits, one of ``supported``.
            args: the call's positional arguments, as the caller passed them.
            kwargs: the call's keyword arguments.
            leaves: the same inputs flattened in the signature's leaf order (what a device graph
                copies into its static buffers).

        Returns:
            What the original module would return for the call (within the backend's tolerances).

        Raises:
            Exception: whatever running fails with. A runner that cannot take a call raises rather than
                answer wrongly: the dispatcher then runs the original module for this call and every
                later call of the signature (a ``"backend error"`` fallback in `xpupack.stats`).

        Examples:
            >>> class Forwarding(Runner):
            ...     def __init__(self, forward, supported):
            ...         super().__init__(supported)
            ...         self.forward = forward
            ...     def run(self, index, args, kwargs, leaves):
            ...         return self.forward(*args, **kwargs)
        """
        raise NotImplementedError

    def add_signature(self, index: int, signature: Signature, args: tuple, kwargs: dict) -> Future | None:
        """Takes calls of a signature the dispatcher meets while serving (a call with state of a tuned
        signature's family, e.g. a KV cache of another length); ``args`` and ``kwargs`` are its first call.

        The dispatcher (`xpupack.tuned.TunedModule`) numbers served signatures after the spec's: ``index``
        is ``len(spec.signatures)`` for the first one, and `run` gets calls of it under that index. The spec
        itself never changes; a runner that reads a signature by its index keeps ``signature``.

        Returns None when `run` can take its calls now, or a future that finishes once the work they
        need (a compile) is done off the caller's path: until then its calls run the original module,
        and if the future fails they do for good. That work must not change the call's state objects.

        Args:
            index: the new signature's index.
            signature: the new signature.
            args: its first call's positional arguments.
            kwargs: its first call's keyword arguments.

        Returns:
            None, or a future of the work off the caller's path: by default the base runner's, which
            takes the signature too.
        """
        self.supported.add(index)
        if self.base_runner is None:
            return None
        return self.base_runner.add_signature(index, signature, args, kwargs)

    def prepare(
        self, index: int, args: tuple, kwargs: dict, *, ready: Callable[[], bool] | None = None
    ) -> Future | None:
        """Gets signature ``index`` ready off the caller's path for calls like this one (a compile of a call
        with state, on a scratch copy of its state), for a runner that takes over from recordings of the
        original module while serving (`GraphRunner.upgrade_when_ready`). Returns a future of that work,
        or None when the runner is ready for such calls now (the default).

        Args:
            index: the signature's index (a position in ``spec.signatures``, or one `add_signature` gave).
            args: a call's positional arguments.
            kwargs: a call's keyword arguments.
            ready: the work starts once this returns True (`xpupack._background.submit`): the caller's pause.

        Returns:
            None, or a future of the work off the caller's path.
        """
        return None

    def release(self) -> None:
        """Frees what the runner holds on the device (called on deactivate); `run` must still work after."""

    def unbuilt(self) -> dict[int, str]:
        """Signature index -> why the backend does not take that signature's calls, for the signatures it
        could not build (they run the original module, counted as ``"not built"`` fallbacks)."""
        return {}

    def owned_tensors(self) -> set[str]:
        """State-dict names (relative to the module) whose values the backend saves itself.

        They are left out of ``model.safetensors`` (e.g. quantized weights).
        """
        return self.base_runner.owned_tensors() if self.base_runner else set()

    def undo(self) -> None:
        """Puts back whatever building or restoring this runner changed in the module.

        Most runners change nothing. A backend that transforms the module in
        place (TorchAO swaps in quantized parameters) undoes that here, so a
        rejected candidate, a candidate `Fastest` did not keep, or a failed
        load leaves the module as it was. The runner must not run until `redo`.
        """
        if self.base_runner is not None:
            self.base_runner.undo()

    def redo(self) -> None:
        """Applies the changes that `undo` took back, the same objects again."""
        if self.base_runner is not None:
            self.base_runner.redo()

    def memory_bytes(self) -> int:
        """Device memory this runner holds beyond the module's own weights."""
        return 0

    def describe(self) -> dict:
        """Extra facts for `stats` and `inspect`."""
        return {}


class CallableRunner(Runner):
    """A runner that calls one function for every signature (eager, compiled...).

    Args:
        function: called as ``function(*args, **kwargs)`` for every call.
        supported: the signatures it takes.

    Examples:
        >>> runner = CallableRunner(target.forward, set(range(len(spec.signatures))))
    """

    def __init__(self, function: Callable[..., Any], supported: set[int]):
        super().__init__(supported)
        self.function = function

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Calls the function with the call's arguments. See `Runner.run`.

        Args:
            index: the signature (unused: every signature runs the same function).
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            leaves: unused.

        Returns:
            What the function returns.
        """
        with _background.between_jobs():  # the model's Python never runs beside a trace on xpupack's worker
            return self.function(*args, **kwargs)


class Backend:
    """Base class of backends; see the contract in `xpupack.backends` and the README's "What it does".

    A backend of your own subclasses it, sets ``name``, implements `build` (and `save`/`restore` where
    it has artifacts), and registers with `register_backend` so that a manifest can name it. The class
    attributes below tell the loader and the dispatcher what the backend can do.

    Examples:
        >>> @register_backend
        ... class ChannelsLast(Backend):
        ...     name = "channels-last"
        ...     def build(self, target, spec, device):
        ...         target.module.to(memory_format=torch.channels_last)
        ...         return CallableRunner(target.forward, set(range(len(spec.signatures))))
        >>> xpupack.tune(model, samples, strategy=xpupack.FirstWins([ChannelsLast(), xpupack.EagerBackend()]))
    """

    name: ClassVar[str]
    #: environment keys whose change invalidates this backend's saved artifacts
    depends_on: ClassVar[tuple[str, ...]] = ()
    #: True when saved artifacts may unpickle or run native code (docs/safety.md)
    compiled_artifacts: ClassVar[bool] = False
    #: False when the saved artifacts are the only form of what runs (TorchAO's quantized weights):
    #: ``on_mismatch="rebuild"`` then uses them as stored, since there is nothing to rebuild from
    rebuildable: ClassVar[bool] = True
    #: True when the runner's outputs carry autograd history like eager's (device graphs do not)
    supports_autograd: ClassVar[bool] = False
    #: True when the runner follows ``torch.autocast`` like eager (a device graph replays the
    #: precision it recorded, so calls under autocast fall back)
    supports_autocast: ClassVar[bool] = False
    #: True when build/restore change the module itself and the runner runs the module's own
    #: forward (TorchAO quantizes in place): another backend can then compile it (``base=``)
    transforms_module: ClassVar[bool] = False
    #: True when restoring runs a compiler (Inductor loads its carried caches through Dynamo: seconds), which a
    #: load's ``defer_compile`` may move off the caller's path; False where the compiled code maps in (AOTInductor)
    compiles_at_load: ClassVar[bool] = True
    #: True when the runner takes only the recorded shapes (graph, Inductor): a smaller batch is
    #: then padded up to a recorded one where the module allows it (`xpupack.padding`)
    pads_calls: ClassVar[bool] = False
    #: SQNR (dB) against eager that a bfloat16/float16 output missing the elementwise tolerance must still
    #: reach, for compiled or replayed code whose kernels round otherwise than eager's
    #: (`xpupack._compare.LOW_PRECISION_SQNR_DB`); None: the elementwise tolerance alone
    low_precision_sqnr_db: ClassVar[float | None] = None

    def available(self, device: torch.device) -> bool:
        """Whether the backend can run on ``device`` at all (no device graphs on a CPU).

        Args:
            device: the device tuned or loaded on.

        Returns:
            True by default.
        """
        return True

    def why_unavailable(self, device: torch.device) -> str:
        """Why `available` is False on ``device``, for reports and refusals.

        Args:
            device: the device tuned or loaded on.

        Returns:
            One sentence, e.g. ``"no device graphs on cpu"``.
        """
        return f"{self.name} cannot run on {device.type}"

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        """Builds what runs the module's calls, at tune time: the extension point of a backend.

        Records device graphs, compiles, or quantizes, for the signatures in ``spec``, whose ``samples``
        (`Samples`) hold recorded calls now; `ModuleSpec.example` gives one call of a signature. The
        strategy then checks the runner's outputs against eager's (`compare`) and may reject it, calling
        `Runner.undo`; a build that fails must leave the module as it found it.

        Args:
            target: the module to tune (its path, the module, its original forward).
            spec: its recorded signatures, with ``spec.samples`` set.
            device: the device to build for; the module is on it.

        Returns:
            A runner whose ``supported`` holds the signatures it built (at least one).

        Raises:
            Exception: any failure to build; the strategy records it as the candidate's refusal
                (``"build failed: ..."``) and tries the next candidate.
        """
        raise NotImplementedError

    def save(self, runner: Runner, folder: Path) -> dict:
        """Writes the runner's artifacts into ``folder``; returns its JSON config.

        Called by `xpupack.save` once per module this backend runs. Tensors go into safetensors files,
        everything else into the returned JSON; no pickle (docs/packages.md).

        Args:
            runner: the runner `build` or `restore` returned.
            folder: ``modules/<path>/<name>/`` in the package being written (not created yet).

        Returns:
            The backend config the manifest stores for the module; `restore` gets it back. Every file
            it names is relative to ``folder``.
        """
        return {}

    def restore(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, *, use_artifacts: bool
    ) -> Runner:
        """Rebuilds the runner at load time from ``spec``'s signatures and saved artifacts.

        No recorded samples exist here (``spec.samples`` is None): inputs are synthesised from the
        signatures (`ModuleSpec.example`). The loader then checks the runner against the original module, and a
        failure leaves the model exactly as it was. The default builds again.

        Args:
            target: the module in the model being loaded into.
            spec: its signatures as the package stores them.
            config: the config `save` returned.
            folder: where `save` wrote; open files through `xpupack.manifest.artifact_file`.
            device: the device the module runs on here.
            use_artifacts: False when the saved compiled artifacts must not run (untrusted source or
                environment mismatch): rebuild from portable parts.

        Returns:
            A runner, like `build`'s.

        Raises:
            Exception: any failure; `xpupack.load` falls back to the original module for it, or raises
                it with ``on_mismatch="error"``.
        """
        return self.build(target, spec, device)

    def save_shared(self, folder: Path, runners: list[Runner]) -> dict | None:
        """Writes artifacts that all modules this backend runs share (Inductor's cache) into ``folder``.

        Called once per backend name, after every `save`.

        Args:
            folder: ``backends/<name>/`` in the package being written.
            runners: the runners of every module this backend runs.

        Returns:
            Their JSON config (the manifest's ``backends`` entry), or None when the backend
            shares nothing (no entry).
        """
        return None

    def restore_shared(self, config: dict, folder: Path, *, use_artifacts: bool) -> None:
        """Reads what `save_shared` wrote, once, before any module's `restore`.

        Args:
            config: the config `save_shared` returned.
            folder: where it wrote.
            use_artifacts: False unless every module that will run this backend may use
                compiled artifacts; the shared ones must then not be loaded.
        """

    @property
    def label(self) -> str:
        """How reports name this candidate (``graph+torchao`` for a composition)."""
        return self.name

    def tolerances(self) -> dict[torch.dtype, tuple[float, float]]:
        """The elementwise tolerances `compare` applies by default.

        Returns:
            dtype -> ``(rtol, atol)``.
        """
        return DEFAULT_TOLERANCES

    def compare(self, actual: Any, expected: Any) -> str | None:
        """Why the candidate's output ``actual`` is not acceptable against eager's ``expected``, or None.

        Elementwise within `tolerances` by default, bfloat16/float16 outputs down to
        `low_precision_sqnr_db` where it is set; a backend that changes numerics on purpose
        overrides this with a measure suited to it.

        Args:
            actual: the candidate's output (for a call with state, with the state after it).
            expected: eager's output for the same call.

        Returns:
            A short reason, or None when ``actual`` is acceptable.
        """
        return mismatch(actual, expected, self.tolerances(), low_precision_sqnr_db=self.low_precision_sqnr_db)

    def options(self) -> dict:
        """Constructor options as JSON, so that a loader can rebuild the same backend.

        Returns:
            Keyword arguments of the constructor that differ from their defaults; `backend_from_json`
            refuses any others.
        """
        return {}

    def inductor_options(self, device: torch.device) -> dict[str, Any]:
        """Inductor settings a compilation on top of this backend (``InductorBackend(base=...)``) needs.

        Args:
            device: the device compiled for.

        Returns:
            Keys of ``torch._inductor.config`` and their values; none by default.
        """
        return {}

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({options})"


class ComposedBackend(Composition, Backend):  # type: ignore[override]  # depends_on etc. become properties
    """A backend that can run on top of another one (``base``) that transforms the module first.

    ``GraphBackend(base=TorchAOBackend(...))`` records the quantized module;
    ``InductorBackend(base=...)`` compiles it. The rule of a composition lives
    here and in `Composition` (its torch-free half, which ``xpupack inspect``
    shares), once: ``label``, ``available``, ``why_unavailable``,
    ``depends_on`` and ``compiled_artifacts`` are the backend's own part and
    the base's together; the base's accuracy measure (``compare``,
    ``tolerances``) is the one used where there is a base (quantization changes
    numerics); the base is built, saved (in a sub-folder named after it) and
    restored first. A subclass states only its own part: `own_depends_on`,
    `own_compiled_artifacts`, `_own_label`, `_own_available`,
    `_own_why_unavailable`, `_own_compare`.
    """

    base: Backend | None = None

    def _set_base(self, base: Backend | dict | None) -> None:
        if not isinstance(base, (Backend, dict, type(None))):
            raise ValueError(
                f"{type(self).__name__}(base={base!r}): give a backend such as xpupack.InductorBackend(), or None"
            )
        self.base = backend_from_json(base["name"], base.get("options", {})) if isinstance(base, dict) else base

    def _base_options(self) -> dict:
        return {"base": {"name": self.base.name, "options": self.base.options()}} if self.base else {}

    def tolerances(self) -> dict[torch.dtype, tuple[float, float]]:
        """The base's tolerances where there is a base, else the defaults.

        Returns:
            dtype -> ``(rtol, atol)``.
        """
        return self.base.tolerances() if self.base else super().tolerances()

    def compare(self, actual: Any, expected: Any) -> str | None:
        """The base's measure where there is a base (quantization changes numerics), else its own
        (`_own_compare`).

        Args:
            actual: the candidate's output.
            expected: eager's output.

        Returns:
            A short reason, or None when ``actual`` is acceptable.
        """
        return self.base.compare(actual, expected) if self.base else self._own_compare(actual, expected)

    def _own_compare(self, actual: Any, expected: Any) -> str | None:
        """This backend's own measure, without a base: `Backend.compare` unless a subclass says otherwise."""
        return Backend.compare(self, actual, expected)

    def save(self, runner: Runner, folder: Path) -> dict:
        """Saves the base's artifacts into ``folder/<base name>/``.

        Args:
            runner: this backend's runner (its ``base_runner`` is the base's).
            folder: ``modules/<path>/<name>/``.

        Returns:
            ``{"base": <the base's config>}``, or ``{}`` without a base.
        """
        if self.base is None:
            return {}
        # a composed backend's runner holds its base's runner whenever the backend has a base
        return {"base": self.base.save(runner.base_runner, folder / self.base.name)}  # type: ignore[arg-type]

    def _build_base(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner | None:
        return self.base.build(target, spec, device) if self.base else None

    def _restore_base(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, use_artifacts: bool
    ) -> Runner | None:
        if self.base is None:
            return None
        return self.base.restore(
            target, spec, config.get("base", {}), folder / self.base.name, device, use_artifacts=use_artifacts
        )


def changes_module(backend: Backend | None) -> bool:
    """Whether ``backend`` or a base under it changes the module in place (TorchAO), after which the
    module's own forward is no longer the original one.

    Args:
        backend: a backend, or None.

    Returns:
        True when one of the chain has ``transforms_module``.
    """
    while backend is not None:
        if backend.transforms_module:
            return True
        backend = getattr(backend, "base", None)
    return False


#: name -> backend class: the registry `register_backend` writes (xpupack's own backends and any a
#: user adds) and `backend_from_json` reads; a manifest resolves only names registered here
BACKENDS: dict[str, type[Backend]] = {}

#: the modules of xpupack's own backends; `import xpupack` no longer imports them (it imports no torch)
_BUILTIN = ("eager", "graph", "inductor", "aoti", "torchao")


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator: makes a backend resolvable by its ``name`` from a manifest.

    A package that names the backend loads only in a process that registered it (imported the
    module defining it) before `xpupack.load`.

    Args:
        cls: the backend class; its ``name`` must be unique (a later registration replaces one of the
            same name).

    Returns:
        ``cls`` itself.

    Examples:
        >>> @register_backend
        ... class MyBackend(Backend):
        ...     name = "mine"
    """
    BACKENDS[cls.name] = cls  # one dict assignment: atomic, no lock needed
    return cls


def known_backends() -> dict[str, type[Backend]]:
    """`BACKENDS`, xpupack's own backends certainly among them (imports them, and torch).

    Returns:
        name -> backend class.
    """
    import importlib

    for name in _BUILTIN:
        importlib.import_module(f"{__package__}.{name}")
    return BACKENDS


def backend_from_json(name: str, options: dict) -> Backend:
    """The backend a manifest names; only registered backends resolve.

    The options must be ones the backend itself would write (`Backend.options`
    round-trips), so a damaged or hostile manifest cannot configure a backend
    in a way no build ever did.

    Args:
        name: the backend's registered ``name``.
        options: its constructor options, as `Backend.options` wrote them.

    Returns:
        A new backend object.

    Raises:
        UnknownConfigError: ``name`` is not registered, or the options are not ones the backend writes.
    """
    known = known_backends()
    try:
        cls = known[name]
    except (KeyError, TypeError):
        raise UnknownConfigError(
            f"unknown backend {name!r}; this xpupack knows {', '.join(sorted(known))} "
            "— upgrade xpupack if the package was built by a newer one"
        ) from None
    try:
        backend = cls(**options)
        canonical = backend.options()
    except UnknownConfigError:
        raise
    except Exception as exc:  # whatever a constructor raises on options it cannot take
        raise UnknownConfigError(
            f"the {name} backend cannot take the options {options!r} ({type(exc).__name__}: {exc}) — "
            "upgrade xpupack if the package was built by a newer one, or rebuild the package"
        ) from None
    if canonical != options:
        raise UnknownConfigError(
            f"the {name} backend does not write the options {options!r} (it would write {canonical!r}) — "
            "the package is damaged or was built by another xpupack; rebuild the package"
        )
    return backend
