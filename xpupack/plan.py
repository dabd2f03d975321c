"""What runs each module of a package here, and whether its compiled artifacts may run
(docs/safety.md).

One decision, made here, that `load` acts on and `verify` and `inspect` report:

1. The package's backend runs if it is available here; otherwise the first of
   its bases that is (``graph+inductor`` on a CPU runs ``inductor``);
   otherwise the original module (unless only the backend holds the weights).
2. If the build environment differs in something the chosen backend depends
   on, ``on_mismatch`` decides: ``"rebuild"`` it here without its artifacts
   (a backend whose artifacts are the only form of what runs, ``rebuildable``
   False, uses them as stored; where only the CPU thread count differs, which
   Inductor keys its own caches on, they are installed and it compiles what
   they miss), ``"fallback"`` to the next of the chain, ``"error"``. A fact the
   package does not record (an older xpupack's) is unknown, not a difference:
   the status says so and the module still counts as running as built.
3. Whatever runs uses compiled artifacts (pickles, native code) only from a
   trusted source. This applies on every path above, and again when a restore
   fails and the module falls back (`Choice.after_failure`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .backends._facts import EAGER, RECOMPILED_ON, BackendFacts
from .environment import differences, unknown
from .errors import IncompatiblePackageError

if TYPE_CHECKING:  # this module imports no torch: `xpupack inspect` and `verify` decide with `BackendFacts`
    import torch

    from .backends.base import Backend

#: what a load may do where a backend cannot run as built (`Context.on_mismatch`)
ON_MISMATCH = ("rebuild", "fallback", "error")


@dataclass(frozen=True)
class Context:
    """Everything besides the module that the decision depends on."""

    device: torch.device
    #: this machine's environment and the package's build environment (`xpupack.environment`)
    here: dict
    built: dict
    trusted: bool
    #: why the source is not trusted (shown to the user), e.g. "revision 'main' ... is not pinned by commit hash"
    untrusted_why: str = ""
    on_mismatch: str = "rebuild"


@dataclass(frozen=True)
class _Step:
    """One way in which what runs differs from the package as built: `load`'s and `verify`'s wording."""

    note: str
    status: str
    #: False for a caveat about a module that still runs as built (a build fact the package lacks)
    degrades: bool = True


@dataclass(frozen=True)
class Choice:
    """What runs one module here."""

    path: str
    #: the package's backend, the start of the chain this choice was made from
    package_backend: Backend
    #: what runs: ``package_backend``, one of its bases, or `EagerBackend` (the original module)
    backend: Backend
    #: how many ``base`` levels below ``package_backend`` the backend is (None for the original module)
    depth: int | None
    use_artifacts: bool
    owned: tuple[str, ...] = ()
    steps: tuple[_Step, ...] = field(default=())

    @property
    def note(self) -> str:
        """Why the module does not run as built (empty when it does, but for caveats), for `load`'s log and report."""
        return "; ".join(step.note for step in self.steps)

    @property
    def compatible(self) -> bool:
        """Whether the module runs as built (caveats aside)."""
        return not any(step.degrades for step in self.steps)

    @property
    def status(self) -> str:
        """``"compatible"``, or what happens instead, for `verify`; caveats follow either."""
        degrading = [step.status for step in self.steps if step.degrades]
        return "; ".join((degrading or ["compatible"]) + [step.status for step in self.steps if not step.degrades])

    def locate(self, config: dict, folder: Path) -> tuple[dict, Path]:
        """The chosen backend's config and folder, given the package's backend's."""
        if self.depth is None:
            return {}, folder
        backend = self.package_backend
        for _ in range(self.depth):
            # depth counts base levels, so each backend passed here is a composed one, with a base
            config, folder, backend = config.get("base", {}), folder / backend.base.name, backend.base  # type: ignore[attr-defined]
        return config, folder

    def without_artifacts(self, why: str) -> Choice:
        """The same backend, built here: its compiled artifacts cannot be used (``why``)."""
        return replace(
            self,
            use_artifacts=False,
            steps=(*self.steps, _Step(f"{self.backend.name} compiled here: {why}", f"compiled on load: {why}")),
        )

    def after_failure(self, why: str, context: Context) -> Choice:
        """What runs when restoring this choice failed (``why``): the next of the chain, same rules.

        Raises `IncompatiblePackageError` when only the failed backend can hold the module's weights.
        """
        if self.depth is None:
            raise ValueError("the original module has nothing to fall back to")
        step = _Step(
            f"{self.backend.name} -> {_next_name(self.package_backend, self.depth)} (restore failed: {why})",
            f"restore failed ({why}): runs {_next_label(self.package_backend, self.depth)}",
        )
        return choose(
            self.path, self.package_backend, context, owned=self.owned, start=self.depth + 1, steps=(*self.steps, step)
        )


def choose(
    path: str,
    backend: Backend,
    context: Context,
    *,
    owned: tuple[str, ...] = (),
    start: int = 0,
    steps: tuple[_Step, ...] = (),
) -> Choice:
    """What runs the module at ``path`` whose package backend is ``backend`` (see the module docstring).

    Args:
        owned: state-dict names only the backend's files hold (quantized weights): the original
            module cannot take over.
        start: skip this many backends of the chain (those that already failed).

    Raises:
        IncompatiblePackageError: with ``on_mismatch="error"``, the backend cannot run as built;
            or nothing but the backend could run a module whose weights only it holds.
    """
    chain = _chain(backend)
    for depth in range(start, len(chain)):
        fit = _fit(path, backend, depth, context)
        steps += fit.steps
        if fit.runs:
            return Choice(path, backend, chain[depth], depth, fit.use_artifacts, owned, steps)
    if owned:
        raise _held_only_by(path, backend, context, owned, steps)
    # a report plans with BackendFacts where a load has Backends: both answer what Choice reads
    return Choice(path, backend, _original_module(backend), None, False, owned, steps)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Fit:
    """Whether one backend of the chain runs here (`_fit`), and why it differs from the package as built."""

    #: False: the next of the chain is tried
    runs: bool
    use_artifacts: bool
    steps: tuple[_Step, ...] = ()


def _fit(path: str, backend: Backend, depth: int, context: Context) -> _Fit:
    """Whether the backend ``depth`` levels below ``backend`` runs here, and with its stored artifacts:
    as built if nothing it depends on changed, otherwise as ``on_mismatch`` says; compiled artifacts only
    from a trusted source."""
    candidate = _chain(backend)[depth]
    changed = differences(context.built, context.here, candidate.depends_on)
    available = candidate.available(context.device)
    if available and not changed:
        fit = _Fit(runs=True, use_artifacts=True, steps=_unknown_steps(candidate, context))
    else:
        fit = _on_mismatch(path, backend, depth, context, changed, available)
    if fit.runs and fit.use_artifacts and candidate.compiled_artifacts and not context.trusted:
        step = _Step(
            f"{candidate.name} compiled here: {context.untrusted_why} (pin the commit, or pass "
            "trust_compiled=True to use its compiled artifacts)",
            f"compiled artifacts not trusted ({context.untrusted_why}): compiled on load",
        )
        return _Fit(runs=True, use_artifacts=False, steps=(*fit.steps, step))
    return fit


def _on_mismatch(path: str, backend: Backend, depth: int, context: Context, changed: dict, available: bool) -> _Fit:
    """What ``on_mismatch`` makes of the backend ``depth`` levels below ``backend`` when it is not
    ``available`` here or its build environment differs (``changed``): an error, the next of the chain,
    or this one rebuilt here (its artifacts used as stored where nothing can rebuild them)."""
    candidate = _chain(backend)[depth]
    what = _changes(changed, ": ") if available else candidate.why_unavailable(context.device)
    fix = _threads_fix(changed) if available else ""
    if context.on_mismatch == "error":
        raise IncompatiblePackageError(
            f"{path or '<model>'}: the {candidate.name} artifacts cannot run here ({what}); {fix and fix + '; or '}"
            "load with on_mismatch='rebuild' or 'fallback', or rebuild the package on this machine",
            differences=changed,
        )
    changes = _changes(changed, " ")
    fix = fix and f" — {fix}"
    if not available or context.on_mismatch == "fallback":
        step = _Step(
            f"{candidate.name} -> {_next_name(backend, depth)} ({what}){fix}",
            f"{what if not available else changes}: runs {_next_label(backend, depth)}{fix}",
        )
        return _Fit(runs=False, use_artifacts=False, steps=(step,))
    if changed.keys() <= set(RECOMPILED_ON):
        # Inductor's own cache keys hold these: what the package carries for them misses by itself, and
        # the rest (the vector-ISA probes) spares the compile its start (the tiny decoder on a 2-core CPU:
        # 7-10 s to first output, against 21 s with nothing installed)
        step = _Step(
            f"{candidate.name} compiles at load: {changes}, so the carried kernels do not apply{fix}",
            f"{changes}: {candidate.name} compiles at load (the carried kernels do not apply){fix}",
        )
        return _Fit(runs=True, use_artifacts=True, steps=(step,))
    if candidate.rebuildable:
        step = _Step(f"{candidate.name} rebuilt here ({what})", "rebuilt on load: " + changes)
        return _Fit(runs=True, use_artifacts=False, steps=(step,))
    # nothing to rebuild from (TorchAO's quantized weights): they are loaded as stored
    step = _Step(
        f"{candidate.name} artifacts used as stored ({what}); they cannot be rebuilt here",
        f"{changes}: stored {candidate.name} artifacts used as they are",
    )
    return _Fit(runs=True, use_artifacts=True, steps=(step,))


def _changes(changed: dict, separator: str) -> str:
    """``torch: built 2.11, here 2.13`` (``separator`` ": ") or ``torch built 2.11, here 2.13`` (" "), one
    per key; the CPU thread count in words: ``built for 2 CPU threads, this process has 1``."""
    return ", ".join(
        f"built for {a} CPU threads, this process has {b}"
        if key == "cpu_threads"
        else f"{key}{separator}built {a}, here {b}"
        for key, (a, b) in changed.items()
    )


def _threads_fix(changed: dict) -> str:
    """How to give this process the thread count the package was built for, where that differs ("" elsewhere)."""
    if "cpu_threads" not in changed:
        return ""
    built = changed["cpu_threads"][0]
    return f"torch.set_num_threads({built}) before xpupack.load, or OMP_NUM_THREADS={built}"


def _unknown_steps(candidate: Backend, context: Context) -> tuple[_Step, ...]:
    """A caveat where ``candidate`` depends on the CPU thread count and the package, an older xpupack's,
    does not record it (`environment.unknown`)."""
    if "cpu_threads" not in unknown(context.built, context.here, candidate.depends_on):
        return ()
    what = (
        "built for an unknown number of CPU threads (an older xpupack did not record it), this process has "
        f"{context.here['cpu_threads']}: unless the build had as many, {candidate.name} compiles at load"
    )
    return (_Step(what, what, degrades=False),)


def _held_only_by(
    path: str, backend: Backend, context: Context, owned: tuple[str, ...], steps: tuple[_Step, ...]
) -> IncompatiblePackageError:
    """The error for a module no backend of the chain can run here, whose weights only the backend holds."""
    why = "; ".join(step.note for step in steps[-1:]) or "it cannot run here"
    return IncompatiblePackageError(
        f"{path or '<model>'}: the {backend.label} backend cannot run here ({why}), and the package holds "
        f"{', '.join(owned[:3])} only in that backend's form, so the original module cannot take "
        "over — load on a device where it runs, or rebuild the package here from the original weights",
        differences=differences(context.built, context.here, backend.depends_on),
    )


def options_here(
    name: str,
    options: dict,
    context: Context,
    *,
    compile_options: dict | None = None,
    record_collectives: bool | None = None,
) -> tuple[dict, tuple[_Step, ...]]:
    """The options a load builds the package's backend ``name`` with (JSON, as the manifest holds them),
    and how they differ from the package's, as steps for `choose` (docs/safety.md).

    Two of a package's options are the loader's to decide: ``compile_options`` (Inductor settings;
    None keeps the package's, a dict replaces them, ``{}`` compiles with Inductor's defaults) and
    ``record_collectives`` (a graph backend recording tensor-parallel modules' collectives, whose
    failed capture can hang every rank; None takes the package's from a trusted source only).
    A base backend's options (``{"base": {"name", "options"}}``) are decided the same way.
    """
    if not isinstance(options, dict):
        return options, ()  # the backend refuses it with its own message
    adjusted, steps = dict(options), tuple[_Step, ...]()
    base = options.get("base")
    if isinstance(base, dict) and isinstance(base.get("options"), dict):
        inner, steps = options_here(
            base.get("name"),
            base["options"],
            context,
            compile_options=compile_options,
            record_collectives=record_collectives,
        )
        if inner != base["options"]:
            adjusted["base"] = {**base, "options": inner}
    if name == "inductor" and compile_options is not None and options.get("compile_options", {}) != compile_options:
        adjusted.pop("compile_options", None)
        if compile_options:
            adjusted["compile_options"] = dict(compile_options)
        steps += (
            _Step(
                f"inductor compiled with the loader's compile_options {compile_options} instead of the "
                f"package's {options.get('compile_options', {})}",
                f"compile_options {compile_options} given to the loader",
            ),
        )
    if name == "graph":
        package = options.get("record_collectives") is True
        honoured = record_collectives if record_collectives is not None else package and context.trusted
        if honoured != package:
            adjusted.pop("record_collectives", None)
            if honoured:
                adjusted["record_collectives"] = True
            why = (
                "the loader passed record_collectives=False"
                if record_collectives is False
                else "the loader passed record_collectives=True"
                if record_collectives
                else f"not taken from an untrusted source: {context.untrusted_why}; pass "
                "record_collectives=True to xpupack.load to take it"
            )
            steps += (_Step(f"graph record_collectives={honoured} ({why})", f"record_collectives={honoured}: {why}"),)
    return adjusted, steps


def _original_module(backend: Backend | BackendFacts) -> Backend | BackendFacts:
    """What runs the original module, of the same kind as ``backend`` (a real backend for `load`)."""
    if isinstance(backend, BackendFacts):
        return EAGER
    from .backends.eager import EagerBackend

    return EagerBackend()


def _chain(backend: Backend) -> list[Backend]:
    """The backend, its base, its base's base..."""
    chain = [backend]
    while getattr(chain[-1], "base", None) is not None:
        chain.append(chain[-1].base)  # type: ignore[attr-defined]
    return chain


def _next_name(backend: Backend, depth: int) -> str:
    chain = _chain(backend)
    return chain[depth + 1].name if depth + 1 < len(chain) else "original module"


def _next_label(backend: Backend, depth: int) -> str:
    chain = _chain(backend)
    return chain[depth + 1].label if depth + 1 < len(chain) else "the original module"
