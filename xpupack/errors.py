"""Every error xpupack raises on purpose.

One base class, one subclass per failure a user can act on. Each message says
what went wrong, where, and what to do next. Several subclass a builtin as well
(``ValueError``, ``TypeError``), so callers that catch those keep working. The
command line prints an error's message on one line (a traceback only with
``XPUPACK_DEBUG=1``).

Every class is importable from ``xpupack`` without importing torch.

Examples:
    >>> try:
    ...     xpupack.load(model, "org/name")
    ... except xpupack.IntegrityError as exc:
    ...     print(exc.path, exc.expected, exc.actual)
"""

from __future__ import annotations

#: the most of a wrapped error's message that a one-line message quotes
_QUOTED_CHARACTERS = 300


def first_line(exc: BaseException) -> str:
    """What a one-line message quotes of an error it reports: the first line of ``exc``'s message (at most 300
    characters; torch's can run to pages), or the error type's name where the message is empty."""
    lines = str(exc).strip().splitlines()
    return lines[0][:_QUOTED_CHARACTERS] if lines else type(exc).__name__


def error_line(exc: BaseException) -> str:
    """``exc`` as ``"TypeName: first line of its message"`` (`first_line`), or ``"TypeName"`` alone."""
    line = first_line(exc)
    return line if line == type(exc).__name__ else f"{type(exc).__name__}: {line}"


class XpupackError(Exception):
    """Base class of every error xpupack raises on purpose.

    Catch it to handle any failure xpupack reports with a message meant for a user; other exceptions
    (a bug, or the model's own error as the ``__cause__`` of a `SampleError`) are not of this class.
    """


class PackageFormatError(XpupackError, ValueError):
    """A package's manifest or spec is not valid JSON, fails its schema, or names a bad path.

    Raised by `xpupack.load`, ``xpupack inspect``/``verify`` and `xpupack.push` when a folder is not an
    xpupack package, its ``format_version`` is newer than this xpupack reads, or a file it names is
    absolute or escapes the package (docs/safety.md).

    Args:
        message: what is wrong, where, and the fix.
        path: the file at fault, where one is.
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class IntegrityError(XpupackError):
    """A file of the package is missing, changed, truncated, or not listed in the manifest.

    Raised by `xpupack.load`, ``xpupack verify`` and `xpupack.push` when a file's sha256 or size differs
    from the manifest's, and by a Hub download that lacks a listed file.

    Args:
        message: what is wrong, where, and the fix.
        path: the file at fault.
        expected: what the manifest says (a sha256 or a size).
        actual: what the file holds.
    """

    def __init__(
        self, message: str, *, path: str | None = None, expected: str | None = None, actual: str | None = None
    ):
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class IncompatiblePackageError(XpupackError):
    """The package was built in an environment whose artifacts cannot run here.

    Raised by `xpupack.load` with ``on_mismatch="error"`` when a module's backend cannot run here at all
    or the build environment differs from this one in a way that invalidates its artifacts (torch,
    triton, device architecture...), and with any ``on_mismatch`` when the module's weights exist only in
    that backend's form (TorchAO), so the original module cannot take over (docs/safety.md).

    Args:
        message: what differs, and the choices (``on_mismatch="rebuild"`` or ``"fallback"``, rebuilding).
        differences: environment key -> ``(built with, here)``.
    """

    def __init__(self, message: str, *, differences: dict | None = None):
        super().__init__(message)
        self.differences = differences or {}


class DeviceUnavailableError(XpupackError, ValueError):
    """A device was asked for (``device=``, ``--device``) that this machine or this PyTorch build lacks.

    Raised by `xpupack.tune`, `xpupack.load` and the command line while resolving a device.

    Args:
        message: the device, what is here instead, and the fix.
        device: the device as given.
        available: the devices this machine offers.
    """

    def __init__(self, message: str, *, device: str | None = None, available: list[str] | None = None):
        super().__init__(message)
        self.device = device
        self.available = available or []


class DeviceMapError(XpupackError, ValueError):
    """``device_map=`` cannot place the package's modules.

    Raised by `xpupack.load` for a slot the package lacks (``unknown``), a slot its modules use that the
    map lacks (``missing``), or ``device=`` given too.

    Args:
        message: what does not fit, and the fix.
        slots: the device slots the package's modules use (``xpupack inspect`` lists them).
        unknown: slots of the map that the package lacks.
        missing: slots the package uses that the map lacks.
    """

    def __init__(
        self,
        message: str,
        *,
        slots: list[int] | None = None,
        unknown: list | None = None,
        missing: list[int] | None = None,
    ):
        super().__init__(message)
        self.slots = slots or []
        self.unknown = unknown or []
        self.missing = missing or []


class ModelMismatchError(XpupackError, ValueError):
    """The model given to `load` has another architecture than the one the package was built from.

    Raised by `xpupack.load` before the model changes: state-dict names, shapes, dtypes or weight tying
    differ from the package's.

    Args:
        message: what differs, and where.
        expected (object): what the package says.
        actual (object): what the model has.
    """

    def __init__(self, message: str, *, expected=None, actual=None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class BackendError(XpupackError):
    """A backend could not build, save or restore a module (the reason says why).

    Raised by `xpupack.load` with ``on_mismatch="error"`` for a backend that failed to restore, and by
    backends themselves (a TorchAO config that quantized nothing). While tuning, a strategy records
    such failures as refusals instead (see `NoCandidateError`).
    """


class BackendUnavailableError(BackendError):
    """A backend cannot run on the requested device at all.

    Raised, for example, when `TorchAOBackend` is used without torchao installed.
    """


class OutputMismatchError(BackendError):
    """A candidate backend's outputs differ from eager beyond the tolerance.

    Raised when a restored backend answers differently from the original module on inputs synthesised
    from its signatures (`xpupack.load` checks every restored backend); with ``on_mismatch="error"`` it
    reaches the caller, otherwise the module falls back to the original.
    """


class NoCandidateError(XpupackError):
    """No backend of the strategy could tune a module; the message lists each refusal.

    Raised by `xpupack.tune` (from `Strategy.choose`) when every candidate failed to build, differed
    from eager or was not faster than eager; add ``EagerBackend()`` to the strategy to keep such modules
    untuned. `Only` raises it with its backend's own reason.

    Args:
        message: the refusals and the fix.
        path: the module's object path ("" for the whole model), where a strategy tried candidates.
        refusals: ``(backend, reason)`` for each candidate refused, in the order tried (empty from `Only`).
        too_slow: whether the speed gate refused one of them (a lower threshold would keep it).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        refusals: tuple[tuple[str, str], ...] = (),
        too_slow: bool = False,
    ):
        super().__init__(message)
        self.path = path
        self.refusals = tuple(refusals)
        self.too_slow = too_slow


class TuningError(XpupackError, ValueError):
    """`tune` was called with arguments it cannot use (no samples, no matching module...).

    Also raised for backend options out of range (``GraphBackend(max_memory=...)``) and for
    ``batch_sizes``/``batch_axis`` that the samples cannot give.
    """


class BenchmarkError(XpupackError, ValueError):
    """`xpupack.bench.benchmark` (``xpupack bench``) was called with arguments it cannot use.

    For example, fewer than one timed iteration.
    """


class SampleError(TuningError):
    """A sample failed in the model while `tune` ran the samples.

    The model's own exception is the ``__cause__``; nothing was tuned.

    Args:
        message: which sample failed, and the model's error.
        index: the sample's place among the samples (from 0).
    """

    def __init__(self, message: str, *, index: int):
        super().__init__(message)
        self.index = index


class NotAModelError(XpupackError, TypeError):
    """`tune` or `load` was given something else than the model, e.g. the function that builds it.

    Args:
        message: what was given, and the call to make instead.
        actual: the type name of what was given.
    """

    def __init__(self, message: str, *, actual: str):
        super().__init__(message)
        self.actual = actual


class NotTunedError(XpupackError, ValueError):
    """The model has no tuned modules (call `xpupack.tune` or `xpupack.load` first).

    Raised by `xpupack.save`, `xpupack.stats`, `xpupack.activate` and `xpupack.deactivate`.
    """


class SaveError(XpupackError):
    """Writing the package failed; any previous package at the destination is untouched.

    Raised by `xpupack.save` when the destination's parent is not a writable directory, or writing
    failed midway (the partial package is removed).
    """


class DestinationExistsError(SaveError):
    """`save` was pointed at a directory that is not a package xpupack wrote; nothing was changed.

    Args:
        message: the directory, what it holds, and the fix.
        path: the destination.
        unexpected: what the directory holds that a package would not (or why its
            ``xpupack.json`` is not a package manifest).
    """

    def __init__(self, message: str, *, path: str | None = None, unexpected: list[str] | None = None):
        super().__init__(message)
        self.path = path
        self.unexpected = unexpected or []


class PackageLimitError(XpupackError, ValueError):
    """A package asks the loader for more than its limits allow (`xpupack.LoadLimits`).

    Raised by `xpupack.load` and ``xpupack verify`` before anything is allocated.

    Args:
        message: the limit, what the package asks for, and how to raise the limit.
        field: the name of the limit (``"max_input_bytes"``...).
        limit: its value.
        actual: what the package asks for.
    """

    def __init__(self, message: str, *, field: str, limit: int, actual: int):
        super().__init__(message)
        self.field = field
        self.limit = limit
        self.actual = actual


class LimitSettingError(XpupackError, ValueError):
    """A limit of `xpupack.LoadLimits`, or the ``XPUPACK_MAX_*`` environment variable it is read from, is not
    a positive whole number.

    Raised by ``LoadLimits(...)``, and by `xpupack.load` and ``xpupack verify`` while reading the
    environment variables.

    Args:
        message: the limit or the variable, its value, and the fix.
        field: the limit (``"max_signatures"``...).
        value: the value given (a variable's text as it is set).
        variable: the environment variable it came from, or None for ``LoadLimits(...)``.
    """

    def __init__(self, message: str, *, field: str, value: object, variable: str | None = None):
        super().__init__(message)
        self.field = field
        self.value = value
        self.variable = variable


class UnknownConfigError(XpupackError, ValueError):
    """A backend config names a type xpupack does not know (the message lists the known ones).

    Raised while reading a manifest (an unknown backend name or option, a TorchAO class off the
    allow-list) and by ``TorchAOBackend(config=...)`` for an unknown config name.
    """


class SourceError(XpupackError, ValueError):
    """A package was named in a way xpupack will not read.

    Raised by `xpupack.load`, `xpupack.push` and the command line for a folder that does not exist,
    ``revision=`` for a folder, or a name that is neither a folder nor a Hub repo id (docs/hub.md, "Naming a package").

    Args:
        message: the name, what it could mean, and how to spell what was meant.
        source: the name as given.
        folder: the folder it could name, or None.
        repo_id: the Hub repo it could name, or None.
    """

    def __init__(
        self, message: str, *, source: str | None = None, folder: str | None = None, repo_id: str | None = None
    ):
        super().__init__(message)
        self.source = source
        self.folder = folder
        self.repo_id = repo_id


class AmbiguousSourceError(SourceError):
    """A plain ``"org/name"`` names a Hub repo, and a folder of that name exists here too: xpupack does not
    guess (a folder is trusted to run its compiled code, a Hub repo only when pinned). Name the folder
    ``"./org/name"`` or ``pathlib.Path("org/name")``, or the repo ``"hf://org/name"``."""


class HubError(XpupackError):
    """A Hugging Face Hub operation failed; the subclasses below name the failures a user can fix.

    Raised by `xpupack.load` (download) and `xpupack.push` (upload) with the endpoint tried.

    Args:
        message: what failed, the endpoint, and the fix.
        repo_id: the repo.
        revision: the revision asked for, or None for ``main``.
    """

    def __init__(self, message: str, *, repo_id: str | None = None, revision: str | None = None):
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision


class RepoNotFoundError(HubError):
    """No Hub repo of that id exists, or it is private or gated and the token cannot read it."""


class RevisionNotFoundError(HubError):
    """The Hub repo exists but has no such branch, tag or commit.

    Args:
        message: the revision, and the ones that exist.
        repo_id: the repo.
        revision: the revision asked for.
        available: branches and tags the repo has.
    """

    def __init__(
        self,
        message: str,
        *,
        repo_id: str | None = None,
        revision: str | None = None,
        available: list[str] | None = None,
    ):
        super().__init__(message, repo_id=repo_id, revision=revision)
        self.available = available or []


class OfflineNotCachedError(HubError):
    """The Hub cannot be reached (``HF_HUB_OFFLINE`` or no network) and the package is not in the local cache."""
