"""`xpupack.load`: verify a package, restore weights and backends, activate
(docs/packages.md; docs/safety.md).

Everything that can be checked is checked before the model is touched. For
the changes that follow (weights, device, backends, activation) a `ModelEdit`
(`xpupack._model_edit`) puts every tensor, module entry and flag back if anything fails, so a
failed load leaves the model exactly as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _background, _device, _hooks, _inference, device_slots, distributed, padding
from ._model_edit import ModelEdit, edits_model, named_tensors
from ._weights_io import stored_tensors
from .backends.base import Backend, backend_from_json, check_against_original
from .candidate import Candidate
from .digests import Digests
from .environment import environment
from .errors import (
    BackendError,
    IncompatiblePackageError,
    IntegrityError,
    ModelMismatchError,
    PackageFormatError,
    UnknownConfigError,
    XpupackError,
)
from .hub import resolve_source
from .limits import LoadLimits, check_limits, early_check
from .manifest import listed_files, module_slot, open_package, reading_once
from .module_spec import ModuleSpec, Target
from .plan import ON_MISMATCH, Choice, Context, choose, options_here
from .recorder import BufferWatch, observe_calls
from .shards import read_weight_map
from .signature import dtype_name
from .source import Source
from .spec import read_module_spec
from .tuned import (
    DowngradeEvent,
    Session,
    TunedModule,
    attach,
    check_model,
    check_verify_padding,
    describe_architecture,
    detach,
    find_session,
)
from .warmup import check_warmup, warm_up

log = logging.getLogger("xpupack")


@dataclass
class _ModuleLoad:
    """One module's share of a load: the module, its spec, and what restores it."""

    module: nn.Module
    spec: ModuleSpec
    #: what runs (`xpupack.plan`), and the package's config and folder of the package's backend
    choice: Choice
    package_config: dict
    package_folder: Path
    #: the load's context with this module's device (`xpupack.device_slots`)
    context: Context

    @property
    def path(self) -> str:
        return self.choice.path

    @property
    def backend(self) -> Backend:
        return self.choice.backend

    @property
    def config(self) -> dict:
        return self.choice.locate(self.package_config, self.package_folder)[0]

    @property
    def folder(self) -> Path:
        return self.choice.locate(self.package_config, self.package_folder)[1]


@edits_model
@_inference.outside_inference_mode  # the weights and recordings it makes serve in any mode
def load(
    model: nn.Module,
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    device_map: dict[int, str | torch.device] | list[str | torch.device] | None = None,
    revision: str | None = None,
    on_mismatch: str = "rebuild",
    trust_compiled: bool = False,
    token: str | bool | None = None,
    progress: Callable[[str], None] | None = None,
    compile_options: dict | None = None,
    record_collectives: bool | None = None,
    limits: LoadLimits | None = None,
    defer_compile: bool = False,
    verify_padding: str = "first",
    warmup: Callable[[nn.Module], Any] | str | None = "auto",
) -> nn.Module:
    """Loads the package at ``path`` (a folder or a Hub repo) into ``model`` and activates it.

    The manifest is validated against its schema, every file's sha256 is
    checked, and the model's architecture (state-dict names, shapes, dtypes) is
    compared with the package's before anything changes. Then the package's
    weights replace the model's (in the same Parameter objects), every backend
    is rebuilt on its module's device (device graphs are recorded again there) and run
    once per recorded signature beside the original module (a backend that
    answers differently is not used), and the tuned modules are activated.
    The model is put in eval mode. If anything fails, the model is put back
    exactly as it was.

    Args:
        model: a freshly built model of the architecture the package was built from.
        path: a folder (a ``pathlib.Path``, an absolute path, ``"./org/name"``, ``"tiny-pkg"``), or a repo on
            the Hugging Face Hub (``"org/name"``, ``"hf://org/name"``); docs/hub.md, "Naming a package". A plain
            ``"org/name"`` that is also a folder here is refused (`AmbiguousSourceError`).
        device: run everything on this one device (the model moves there). Default: each tuned
            module runs where its parameters are (a model split over devices stays split).
        device_map: the device of each device slot of the package (``{0: "cuda:0", 1: "cuda:1"}``,
            or a list by slot; `xpupack inspect` shows the slots): each tuned module moves to its
            slot's device, the rest of the model stays where it is. Not together with ``device``.
        revision: Hub revision (branch, tag or commit hash).
        on_mismatch: when the build environment differs in a way that invalidates
            an artifact: ``"rebuild"`` it here, ``"fallback"`` to the original
            module, or ``"error"`` (raise `IncompatiblePackageError`).
        trust_compiled: run compiled artifacts from a Hub revision that is not
            pinned by commit hash (local packages are always trusted).
        token: Hugging Face token for private repos.
        progress: called with short status messages.
        compile_options: Inductor settings for every module this load compiles, instead of the
            package's (``{}``: Inductor's defaults); the same settings `InductorBackend` takes, those
            that only change speed. None: the package's, checked the same way.
        record_collectives: whether graph backends record tensor-parallel modules, collectives
            included (``GraphBackend(record_collectives=...)``). None: as the package says where its
            source is trusted (local, pinned by commit hash, or ``trust_compiled=True``), never from
            another source. A refused capture runs the module with the next backend.
        limits: the most the package may make this load allocate or do (`LoadLimits`). None:
            the defaults, or the ``XPUPACK_MAX_*`` environment variables where set.
        defer_compile: False (the default): the load returns once everything it can reach is compiled
            and recorded, and nothing of it runs on afterwards (no thread, no compiler in the background).
            A call with a KV cache is compiled and recorded at its first call, on the caller's path: only
            a real call brings the cache (docs/cold-start.md).
            True (opt-in, for Inductor packages whose compile at load takes seconds): a device graph over
            Inductor's compiled code (``graph+inductor``) records the original module now and serves
            those recordings while a background thread loads the compiled code; each signature's next
            call after that records it again over the compiled code (docs/cold-start.md); a plain
            Inductor module runs the original meanwhile. ``stats()`` counts the calls served meanwhile
            as ``compiling``. Ignored with ``on_mismatch="error"``, which must raise what fails.
            AOTInductor packages (``aoti``, the GPU default) need neither: their compiled code is live
            when the load returns.
        verify_padding: ``"first"`` (default): the first padded call into each recording is run by the
            original module too and compared; ``"always"``: every padded call is — one more eager run per
            padded call, for a module whose rows may mix only for some inputs (docs/serving-shapes.md).
            A call that disagrees gets the original's answer, and its recording is no longer padded into.
        warmup: calls made inside the load, once it is active, so that what only a real call can compile
            (a language model's prefill and decode steps, which need its KV cache) is compiled and recorded
            before ``load`` returns rather than at the caller's first call: a function of the model (e.g.
            ``lambda m: m.generate(ids, max_new_tokens=128, cache_implementation="static")``), or
            ``"auto"`` (the default): a greedy ``generate()`` with a static cache of each batch, prompt length
            and cache length the package's ``generate()`` prefills were tuned on (a model tuned as a whole that
            has ``generate``; nothing for others; nothing with ``defer_compile=True``, whose compiles run while
            the first calls are served). None: no warm-up (those calls then compile at the caller's first
            call, which is slower than the ones after it). It runs in the mode ``load`` is called in
            (`torch.inference_mode()` or `torch.no_grad()`), or called in neither, in the mode the package was
            tuned in (compiled code guards on the mode of a call with state: load in the mode you serve in,
            or tune in it). Its calls are not counted in
            `xpupack.stats`; one that raises is logged as a warning and the load stands (docs/cold-start.md).

    Returns:
        The same model object, tuned modules active.

    Raises:
        ValueError: ``on_mismatch`` is not one of ``"rebuild"``, ``"fallback"``, ``"error"``, or
            ``verify_padding`` not ``"first"`` or ``"always"``.
        SourceError: no such folder, or ``revision`` for a folder (`AmbiguousSourceError`: see ``path``).
        PackageFormatError: not a package, bad JSON, schema violation, unsafe path.
        IntegrityError: a file is missing, changed or unlisted.
        ModelMismatchError: the model's architecture or weight tying differs from the package's.
        DeviceUnavailableError: ``device`` (or a device of ``device_map``) is not a device of this machine.
        DeviceMapError: ``device_map`` names a slot the package lacks or lacks one it uses, or
            ``device`` is given too.
        PackageLimitError: the package asks for more than ``limits`` allow (the field and the limit named).
        UnknownConfigError: a backend or backend option this xpupack does not know, or one a package
            may not set (an Inductor setting that does more than change speed).
        IncompatiblePackageError: with ``on_mismatch="error"``, what differs.
        BackendError: with ``on_mismatch="error"``, a backend that failed to restore
            (`OutputMismatchError`: one that answers differently from the original module).

    Examples:
        >>> model = xpupack.load(MyModel(), "pkg/", device="xpu")
    """
    check_model(model, "load")
    _check_options(on_mismatch, compile_options, record_collectives)
    check_verify_padding(verify_padding)
    check_warmup(warmup)
    limits = limits if limits is not None else LoadLimits.from_environment()
    clock = _Phases()
    verified = _verify(
        model,
        resolve_source(path, revision=revision, trust_compiled=trust_compiled, token=token),
        limits,
        device=device,
        device_map=device_map,
        on_mismatch=on_mismatch,
        overrides={"compile_options": compile_options, "record_collectives": record_collectives},
    )
    clock.lap("verify")
    previous = _install(
        model,
        verified,
        clock,
        progress=progress,
        defer=defer_compile and on_mismatch != "error",
        verify_padding=verify_padding,
    )
    if previous is not None:
        previous.deactivate()  # its modules now run the new session: this only frees its recordings
    session = find_session(model)
    if defer_compile and warmup == "auto":
        warmup = None  # the opt-in background mode returns at once; its compiles run while the first calls serve
    if session is not None and warm_up(model, session, warmup, progress):
        clock.lap("warmup")
    _log_loaded(verified.source, clock)
    return model


@dataclass
class _Verified:
    """What a load has read and checked before it touches the model (`_verify`)."""

    source: Source
    manifest: dict
    placement: device_slots.Placement
    #: the load's context: its first device, both environments, trust and ``on_mismatch``
    context: Context
    jobs: list[_ModuleLoad]
    #: the weights files in the order they are read, empty for a package without weights
    weights: list[str]
    #: the weights files' digests, checked while they are read (`manifest.open_package`)
    digests: Digests


def _verify(
    model: nn.Module,
    source: Source,
    limits: LoadLimits,
    *,
    device: str | torch.device | None,
    device_map: dict[int, str | torch.device] | list[str | torch.device] | None,
    on_mismatch: str,
    overrides: dict,
) -> _Verified:
    """Everything that can be checked before the model is touched: the package, its limits, the model's
    architecture, where each module goes and what runs it here. The weights' digests are still being checked
    when it returns (`manifest.open_package`); an error raised meanwhile gives way to a failed digest."""
    # the checks `xpupack verify` makes, so that the two never disagree on a damaged package; each spec is
    # read once (`reading_once`), refused before its schema check where it has too many signatures or leaves
    with reading_once():
        return _verify_once(
            model, source, limits, device=device, device_map=device_map, on_mismatch=on_mismatch, overrides=overrides
        )


def _verify_once(
    model: nn.Module,
    source: Source,
    limits: LoadLimits,
    *,
    device: str | torch.device | None,
    device_map: dict[int, str | torch.device] | list[str | torch.device] | None,
    on_mismatch: str,
    overrides: dict,
) -> _Verified:
    manifest, digests = open_package(
        source.root,
        links_within=source.links_within,
        ignore_unlisted=source.ignore_unlisted,
        before_schema=early_check(limits),
    )
    with digests.reported_first():
        check_limits(source.root, manifest, limits)  # before a signature is parsed or an input synthesised
        check_architecture(model, manifest, source.root)
        placement = device_slots.resolve_placement(
            model, manifest, device=device, device_map=device_map, default=_device.model_device(model)
        )
        here = environment(placement.first)
        build_devices = device_slots.manifest_devices(manifest, source.root)
        context = Context(
            placement.first, here, manifest["environment"], source.trusted, untrusted_why(source), on_mismatch
        )
        jobs = [
            _module_load(model, module, source, build_devices, placement, context, overrides)
            for module in manifest["modules"]
        ]
        weights = list(read_weight_map(source.root, manifest))
    return _Verified(source, manifest, placement, context, jobs, weights, digests)


def _install(
    model: nn.Module,
    verified: _Verified,
    clock: _Phases,
    *,
    progress: Callable[[str], None] | None,
    defer: bool,
    verify_padding: str,
) -> Session | None:
    """Puts the verified package into the model and activates it; returns the session it replaced, if any.

    Every change goes through a `ModelEdit`: if anything fails, the model, and an earlier tuning of it
    (active or not), are put back exactly as they were before the error is raised again.
    """
    edit = ModelEdit(model)
    previous = find_session(model)
    was_active = previous is not None and previous.active
    try:
        if previous is not None:  # loading again replaces the earlier tuning
            _set_aside(model, previous, edit)
        with verified.digests.reported_first():
            _place_tensors(edit, model, verified)
            verified.digests.wait()  # nothing runs on the weights before their digests are in
        edit.set_eval(model)
        clock.lap("weights")
        modules = _restore_modules(verified, edit, clock, progress=progress, defer=defer)
        for module in modules.values():
            module.verify_padding(verify_padding)
        _activate(model, verified, modules, clock)
    except BaseException:
        edit.rollback()
        detach(model)
        if previous is not None:
            attach(model, previous)
            if was_active:
                previous.activate()
        raise
    return previous


def _set_aside(model: nn.Module, previous: Session, edit: ModelEdit) -> None:
    """Takes an earlier tuning off the model, its runners' changes undone through ``edit`` (so a failed load
    puts them back)."""
    _unhook(previous)
    detach(model)
    for tuned in previous.modules.values():
        edit.undo_runner(tuned.runner)


def _restore_modules(
    verified: _Verified, edit: ModelEdit, clock: _Phases, *, progress: Callable[[str], None] | None, defer: bool
) -> dict[str, TunedModule]:
    """Each module's backend restored on its own device, the shared artifacts first."""
    source, manifest, jobs = verified.source, verified.manifest, verified.jobs
    # backends read no file the manifest does not list; with defer_compile, compiled code is restored
    # off the caller's path while recordings of the original modules serve
    with listed_files(source.root, manifest), _background.deferring(defer):
        _restore_shared(manifest, source, jobs, verified.context)
        clock.lap("shared_artifacts")
        modules = {}
        for number, job in enumerate(jobs, 1):
            if progress:
                progress(f"restoring {job.path or '<model>'} ({number}/{len(jobs)}, {job.backend.name})")
            # the load's own runs of the module (checks, recordings) leave its buffers as the package has them
            with _device.on_device(job.context.device), BufferWatch(job.module).kept():
                modules[job.path] = _restore(job, job.context)
            modules[job.path].load_s = clock.lap("modules")
            edit.keep_runner(modules[job.path].runner)
    return modules


def _activate(model: nn.Module, verified: _Verified, modules: dict[str, TunedModule], clock: _Phases) -> None:
    """Attaches a new session of the restored modules to the model and activates it."""
    session = Session(
        modules,
        verified.context.device,
        environment=verified.context.here,
        strategy=verified.manifest.get("strategy", ""),
        architecture=verified.manifest["model"]["tensors"],
        devices=verified.placement.modules,
        samples_mode=verified.manifest.get("samples_mode", ""),
    )
    attach(model, session)
    session.activate()
    clock.lap("activate")
    session.load_seconds = clock.seconds


def _log_loaded(source: Source, clock: _Phases) -> None:
    log.info(
        "loaded %s in %.2f s (%s)",
        source.description,
        sum(clock.seconds.values()),
        ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in clock.seconds.items()),
    )


class _Phases:
    """Where a load's time goes (`Session.load_seconds`): seconds per phase, laps adding up."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
        return elapsed


def _unhook(session: Session) -> None:
    """Takes an earlier tuning's forwards off its modules while a load restores the new ones.

    Unlike `Session.deactivate` this keeps its recordings and flags, so that a
    failed load gives the tuning back exactly as it was, counters included.
    """
    for tuned in session.modules.values():
        _hooks.uninstall(tuned.target.module, tuned, tuned.target.forward)


def check_architecture(model: nn.Module, manifest: dict, root: Path) -> None:
    """Raises `ModelMismatchError` unless the model's state dict has the package's names, shapes and dtypes."""
    expected = manifest["model"]["tensors"]
    actual = describe_architecture(model)
    missing = [name for name in expected if name not in actual]
    unexpected = [name for name in actual if name not in expected]
    changed = [
        f"{name}: package {expected[name]['dtype']}{expected[name]['shape']}, "
        f"model {actual[name]['dtype']}{actual[name]['shape']}"
        for name in expected
        if name in actual and expected[name] != actual[name]
    ]
    paths = dict(model.named_modules())
    absent = [m["path"] for m in manifest["modules"] if m["path"] not in paths]
    if missing or unexpected or changed or absent:
        problems = (
            [f"missing {name}" for name in missing[:5]]
            + [f"unexpected {name}" for name in unexpected[:5]]
            + changed[:5]
            + [f"no submodule {path!r}" for path in absent[:5]]
        )
        raise ModelMismatchError(
            f"{type(model).__name__} does not match the package at {root} (built from "
            f"{manifest['model']['class']}): "
            + "; ".join(problems)
            + " — build the model with the same architecture and dtype as the package",
            expected=manifest["model"]["class"],
            actual=f"{type(model).__module__}.{type(model).__qualname__}",
        )


def _check_options(on_mismatch: str, compile_options: dict | None, record_collectives: bool | None) -> None:
    """The loader's own options, checked before anything is read."""
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch={on_mismatch!r}; choose one of {', '.join(ON_MISMATCH)}")
    if record_collectives is not None and not isinstance(record_collectives, bool):
        raise ValueError(f"record_collectives={record_collectives!r}; give True, False or None")
    if compile_options is not None:
        from .backends.inductor import InductorBackend

        InductorBackend(compile_options=compile_options)  # raises ValueError naming a setting it refuses


def _module_load(
    model: nn.Module,
    entry: dict,
    source: Source,
    build_devices: list[torch.device],
    placement: device_slots.Placement,
    context: Context,
    overrides: dict,
) -> _ModuleLoad:
    spec = read_module_spec(source.root, entry)
    mapping = placement.spec_map(build_devices, entry["path"], module_slot(entry))
    spec = replace(spec, signatures=tuple(signature.on_device(mapping) for signature in spec.signatures))
    context = replace(context, device=placement.modules[entry["path"]])
    name = entry["backend"]["name"]
    backend = backend_from_json(name, entry["backend"]["options"])  # the package's own, checked even if overridden
    options, steps = options_here(name, entry["backend"]["options"], context, **overrides)
    if steps:
        backend = backend_from_json(name, options)
    choice = choose(entry["path"], backend, context, owned=tuple(entry.get("owned_tensors", ())), steps=steps)
    if choice.note:
        level = logging.WARNING if not choice.compatible else logging.INFO  # a caveat: it runs as built
        log.log(level, "%s: %s", choice.path or "<model>", choice.note)
    return _ModuleLoad(
        model.get_submodule(entry["path"]),
        spec,
        choice,
        entry["backend"]["config"],
        source.root / entry["folder"] / backend.name,
        context,
    )


def untrusted_why(source: Source) -> str:
    """Why ``source``'s compiled artifacts may not run, for messages."""
    return source.untrusted_why


def _restore_shared(manifest: dict, source: Source, jobs: list[_ModuleLoad], context: Context) -> None:
    """Artifacts that a backend saved once for all its modules (Inductor's cache), for what runs them now.

    The entry named ``name`` was written by the package's backend ``name``; it is restored by the
    backend that runs those modules here (the package's, or the base it fell back to), with the
    artifacts only if every one of them may use them.
    """
    for name, shared in manifest["backends"].items():
        # the modules that run a backend of the package's chain (not the original module)
        users = [job for job in jobs if job.choice.package_backend.name == name and job.choice.depth is not None]
        if not users:
            continue
        folder = source.root / shared["folder"]
        use_artifacts = all(job.choice.use_artifacts for job in users)
        try:
            users[0].backend.restore_shared(shared["config"], folder, use_artifacts=use_artifacts)
        except XpupackError:
            raise
        except Exception as exc:  # PyTorch's loader on a damaged or foreign cache: any exception at all
            why = f"the shared {name} artifacts in {folder} cannot be loaded ({type(exc).__name__}: {str(exc)[:200]})"
            if context.on_mismatch == "error":
                raise BackendError(
                    f"{why}; rebuild the package on this machine, or load with "
                    "on_mismatch='rebuild' to compile here instead"
                ) from exc
            log.warning("%s; compiling those modules here", why)
            for job in users:
                job.choice = job.choice.without_artifacts(why)


def _restore(job: _ModuleLoad, context: Context) -> TunedModule:
    target = Target(job.path, job.module, _hooks.original_forward(job.module))
    report = [Candidate(job.backend.name, "chosen", job.choice.note or "from package")]
    try:
        if job.backend.pads_calls:
            job = replace(job, spec=_check_claims(target, job.spec, context))
        runner = job.backend.restore(
            target, job.spec, job.config, job.folder, context.device, use_artifacts=job.choice.use_artifacts
        )
    except Exception as exc:  # a failed restore has undone its own changes to the module
        return _restore_failed(job, context, exc)
    try:
        # eager, and a backend that transforms the module in place (TorchAO), run the module's own
        # forward: there is no other original to compare with
        if job.backend.name != "eager" and not job.backend.transforms_module and not runner.checked_where_compiled:
            # both runs of each check start from the same buffers (running statistics...)
            check_against_original(target, job.spec, job.backend, runner, reset=BufferWatch(target.module).restore)
    except Exception as exc:
        runner.undo()
        return _restore_failed(job, context, exc)
    promised, running = job.choice.package_backend.label, job.backend.label
    downgrade = DowngradeEvent(job.path, promised, running, job.choice.note) if running != promised else None
    return TunedModule(target, job.spec, job.backend, runner, report, downgrade=downgrade)


def _check_claims(target: Target, spec: ModuleSpec, context: Context) -> ModuleSpec:
    """What a package says about its module's calls is its author's word; for a backend that records or
    pads calls, the loader sees for itself whether the module writes its inputs in place or its own
    buffers (`xpupack.recorder.observe_calls`), and checks the batch axes it would pad by
    (`xpupack.padding.check_loaded`). Returns the spec with what it found (docs/calls-and-fallback.md)."""
    claimed = bool(spec.batch_axes), bool(spec.length_axes)
    spec = observe_calls(target.forward, target.module, spec)
    spec = padding.check_loaded(spec, target.forward, trusted=context.trusted)
    for was_claimed, axes, what, why in (
        (claimed[0], spec.batch_axes, "batch axes are not used, calls of other batch sizes", spec.padding_refused),
        (claimed[1], spec.length_axes, "length axes are not used, shorter sequences", spec.lengths_refused),
    ):
        if was_claimed and not axes:
            log.warning("%s: the package's %s run the original module: %s", target.path or "<model>", what, why)
    return spec


def _restore_failed(job: _ModuleLoad, context: Context, exc: Exception) -> TunedModule:
    """What runs a module whose backend failed to restore or answers differently from the original module.

    A damaged package (a file or config that is not what the manifest promises) is refused, never served.
    """
    if (
        context.on_mismatch == "error"
        or job.choice.depth is None
        or isinstance(exc, (PackageFormatError, IntegrityError, UnknownConfigError))
    ):
        if isinstance(exc, XpupackError):
            raise exc
        raise BackendError(
            f"{job.path or '<model>'}: restoring the {job.backend.name} backend failed "
            f"({type(exc).__name__}: {exc}); load with on_mismatch='fallback' to run the "
            "original module instead, or rebuild the package on this machine"
        ) from exc
    # serving beats crashing: the original module still gives eager's answers
    try:
        fallback = job.choice.after_failure(str(exc), context)
    except IncompatiblePackageError:
        raise exc from None  # nothing can run this module without the backend: its own error says why
    log.warning(
        "%s: restoring %s failed (%s: %s); %s",
        job.path or "<model>",
        job.backend.name,
        type(exc).__name__,
        exc,
        fallback.note,
    )
    tuned = _restore(replace(job, choice=fallback), context)
    tuned.report.insert(0, Candidate(job.backend.name, "rejected", f"restore failed: {exc}"))
    return tuned


def _place_tensors(edit: ModelEdit, model: nn.Module, verified: _Verified) -> None:
    """Installs the package's weights, streamed from its files a tensor at a time, and puts each of the model's
    tensors on the device the placement gives it (`xpupack.device_slots`): with ``device=`` everything moves
    there; with ``device_map=`` each tuned module's tensors move to its slot's device; otherwise every tensor
    stays where it is. A DTensor gets its shard of the full weight.

    Device memory: a tensor that stays on its accelerator is written in place (`ModelEdit.copy_into`, its old
    values kept in host memory for a rollback), one that moves or lives in host memory is replaced by a copy
    on its device (`ModelEdit.replace_tensor`): past the model's own, a load allocates nothing on a device.
    """
    manifest, placement = verified.manifest, verified.placement
    tensors: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for module, state_name, name, tensor in named_tensors(model):
        tensors[state_name] = (module, name, tensor)
    takers: dict[str, list[str]] = {}  # stored name -> the model's names that take its value
    for alias, stored in manifest["model"]["aliases"].items():
        takers.setdefault(stored, []).append(alias)
    installed = _Installed(edit, placement, manifest, verified.source.root, type(model).__name__)
    # closed at once on an error: its hashing threads end and its memory maps close before the rollback
    with closing(stored_tensors(verified.source.root, verified.weights, verified.digests)) as stream:
        for stored, value in stream:
            for state_name in [stored, *takers.get(stored, ())]:
                installed.put(state_name, *tensors[state_name], value, stored)
    for state_name, (module, name, tensor) in tensors.items():
        installed.move(state_name, module, name, tensor)


class _Installed:
    """The tensors of the model a load has installed or moved so far: a tensor that two names share (tied
    weights, in one Parameter object) is written once, and must get one value from the package."""

    def __init__(self, edit: ModelEdit, placement: device_slots.Placement, manifest: dict, root: Path, model: str):
        self.edit, self.placement, self.manifest, self.root, self.model = edit, placement, manifest, root, model
        #: the model's names whose tensors a module's backend stores and puts in itself
        self.owned = {
            f"{entry['path']}.{name}" if entry["path"] else name
            for entry in manifest["modules"]
            for name in entry.get("owned_tensors", ())
        }
        #: id of a tensor of the model -> (the stored name it took, the tensor that holds its value now)
        self.done: dict[int, tuple[str | None, torch.Tensor]] = {}

    def put(
        self, state_name: str, module: nn.Module, name: str, tensor: torch.Tensor, value: torch.Tensor, stored: str
    ) -> None:
        """``value`` (a CPU tensor over the file) into the model's ``state_name``, on the device it goes to."""
        self._check(state_name, value, stored)
        if id(tensor) in self.done:
            self._check_tie(state_name, tensor, value, stored)
            return
        if distributed.is_dtensor(tensor):
            self.edit.copy_into(tensor.to_local(), distributed.local_shard(tensor, value))  # type: ignore[attr-defined]
            self.done[id(tensor)] = (stored, tensor)
            return
        device = self.placement.tensor_device(state_name, tensor.device)
        if device == tensor.device and device.type != "cpu":
            self.edit.copy_into(tensor, value)  # stays on its accelerator: in place, the old values to the host
            self.done[id(tensor)] = (stored, tensor)
        else:  # moves, or lives on the host: a copy (never the file's memory map) takes its place
            new = value.to(device, copy=True)
            self.edit.replace_tensor(module, name, tensor, new)
            self.done[id(tensor)] = (stored, new)

    def move(self, state_name: str, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Every tensor of the model once the weights are in: one the package does not store (a backend owns it, or
        there are no weights) moves to its device if it goes elsewhere; a buffer that another module's entry
        shares, and that was replaced, is replaced by the same tensor here too."""
        if id(tensor) in self.done:
            new = self.done[id(tensor)][1]
            if name in module._buffers and module._buffers[name] is not new:  # a buffer another module shares
                self.edit.replace_tensor(module, name, tensor, new)
            return
        device = self.placement.tensor_device(state_name, tensor.device)
        if distributed.is_dtensor(tensor) or device == tensor.device:
            return
        if tensor.is_meta:  # an empty model's: only its package can give it a value
            if state_name in self.owned:
                return  # the module's backend puts its own tensor there (TorchAO's quantized weights)
            stored = "stores no weights" if self.manifest["model"]["weights"] is None else "does not store it"
            raise ModelMismatchError(
                f"{self.model}'s {state_name} is on the meta device (an empty model) and the package at "
                f"{self.root} {stored}; build the model with its weights (e.g. from_pretrained), or load a "
                "package saved with them",
                expected="a tensor with data",
                actual="meta",
            )
        new = tensor.to(device)
        self.edit.replace_tensor(module, name, tensor, new)
        self.done[id(tensor)] = (None, new)

    def _check(self, state_name: str, value: torch.Tensor, stored: str) -> None:
        """The stored tensor has the manifest's shape and dtype (`shards.check_weights` read the header; a dtype
        safetensors' codes leave open is checked here, and a file changed since is caught before any copy)."""
        expected = self.manifest["model"]["tensors"][state_name]
        if dtype_name(value.dtype) != expected["dtype"] or list(value.shape) != expected["shape"]:
            raise PackageFormatError(
                f"{self.root}: the stored tensor {stored!r} is a {dtype_name(value.dtype)}{list(value.shape)}, the "
                f"manifest says {expected['dtype']}{expected['shape']} for {state_name}; rebuild the package",
                path=self.manifest["model"]["weights"],
            )

    def _check_tie(self, state_name: str, tensor: torch.Tensor, value: torch.Tensor, stored: str) -> None:
        """Names that share one tensor in the model (tied weights) must get one value from the package.

        Otherwise installing the weights would keep whichever came first, and the model would compute
        something the packaged model never did.
        """
        first, holder = self.done[id(tensor)]
        if first == stored:  # an alias: the package stores the two once
            return
        current = holder.to_local() if distributed.is_dtensor(holder) else holder  # type: ignore[attr-defined]
        if distributed.is_dtensor(tensor):
            value = distributed.local_shard(tensor, value)
        if not torch.equal(current, value.to(current.device)):
            one, other = sorted((first, state_name))
            raise ModelMismatchError(
                f"{self.model} ties {one} and {other} (one tensor), but the package at {self.root} stores "
                f"different values for them (built from {self.manifest['model']['class']}, which does not tie them) "
                "— build the model with the same weight tying as the package",
                expected="untied",
                actual="tied",
            )
