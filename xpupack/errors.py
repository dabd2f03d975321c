"""Every error xpupack raises on purpose.

One base class, one subclass per failure a user can act on. Each message says
what went wrong, where, and what to do next.
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
    """Base class of every error xpupack raises on purpose."""


class PackageFormatError(XpupackError, ValueError):
    """A package's manifest or spec is not valid JSON, fails its schema, or names a bad path."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class IntegrityError(XpupackError):
    """A file of the package is missing, changed, truncated, or not listed in the manifest."""

    def __init__(self, message: str, *, path: str | None = None, expected: str | None = None,
                 actual: str | None = None):
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class IncompatiblePackageError(XpupackError):
    """The package was built in an environment whose artifacts cannot run here."""

    def __init__(self, message: str, *, differences: dict | None = None):
        super().__init__(message)
        self.differences = differences or {}


class DeviceUnavailableError(XpupackError, ValueError):
    """A device was asked for (``device=``, ``--device``) that this machine or this PyTorch build lacks."""

    def __init__(self, message: str, *, device: str | None = None, available: list[str] | None = None):
        super().__init__(message)
        self.device = device
        self.available = available or []


class DeviceMapError(XpupackError, ValueError):
    """``device_map=`` cannot place the package's modules: a slot the package lacks (``unknown``), a slot its
    modules use that the map lacks (``missing``), or ``device=`` given too. ``slots``: the slots the modules use."""

    def __init__(self, message: str, *, slots: list[int] | None = None, unknown: list | None = None,
                 missing: list[int] | None = None):
        super().__init__(message)
        self.slots = slots or []
        self.unknown = unknown or []
        self.missing = missing or []


class ModelMismatchError(XpupackError, ValueError):
    """The model given to `load` has another architecture than the one the package was built from."""

    def __init__(self, message: str, *, expected=None, actual=None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class BackendError(XpupackError):
    """A backend could not build, save or restore a module (the reason says why)."""


class BackendUnavailableError(BackendError):
    """A backend cannot run on the requested device at all."""


class OutputMismatchError(BackendError):
    """A candidate backend's outputs differ from eager beyond the tolerance."""


class NoCandidateError(XpupackError):
    """No backend of the strategy could tune a module; the message lists each refusal."""


class TuningError(XpupackError, ValueError):
    """`tune` was called with arguments it cannot use (no samples, no matching module...)."""


class BenchmarkError(XpupackError, ValueError):
    """`xpupack.bench.benchmark` (``xpupack bench``) was called with arguments it cannot use."""


class SampleError(TuningError):
    """A sample failed in the model while `tune` ran the samples; ``index`` is its place among them, and the
    model's own exception is the ``__cause__``."""

    def __init__(self, message: str, *, index: int):
        super().__init__(message)
        self.index = index


class NotAModelError(XpupackError, TypeError):
    """`tune` or `load` was given something else than the model, e.g. the function that builds it;
    ``actual`` names what it was given."""

    def __init__(self, message: str, *, actual: str):
        super().__init__(message)
        self.actual = actual


class NotTunedError(XpupackError, ValueError):
    """The model has no tuned modules (call `xpupack.tune` or `xpupack.load` first)."""


class SaveError(XpupackError):
    """Writing the package failed; any previous package at the destination is untouched."""


class DestinationExistsError(SaveError):
    """`save` was pointed at a directory that is not a package xpupack wrote; nothing was changed.

    ``unexpected`` lists what the directory holds that a package would not (or why its
    ``xpupack.json`` is not a package manifest).
    """

    def __init__(self, message: str, *, path: str | None = None, unexpected: list[str] | None = None):
        super().__init__(message)
        self.path = path
        self.unexpected = unexpected or []


class PackageLimitError(XpupackError, ValueError):
    """A package asks the loader for more than its limits allow (`xpupack.LoadLimits`): ``field`` names
    the limit, ``limit`` its value, ``actual`` what the package asks for."""

    def __init__(self, message: str, *, field: str, limit: int, actual: int):
        super().__init__(message)
        self.field = field
        self.limit = limit
        self.actual = actual


class UnknownConfigError(XpupackError, ValueError):
    """A backend config names a type xpupack does not know (the message lists the known ones)."""


class SourceError(XpupackError, ValueError):
    """A package was named in a way xpupack will not read: a folder that does not exist, ``revision=`` for a
    folder, a name that is neither a folder nor a Hub repo id (README: "Hugging Face Hub", naming rule).

    ``source`` is the name as given; ``folder`` and ``repo_id`` what it could name (None where it cannot).
    """

    def __init__(self, message: str, *, source: str | None = None, folder: str | None = None,
                 repo_id: str | None = None):
        super().__init__(message)
        self.source = source
        self.folder = folder
        self.repo_id = repo_id


class AmbiguousSourceError(SourceError):
    """A plain ``"org/name"`` names a Hub repo, and a folder of that name exists here too: xpupack does not
    guess (a folder is trusted to run its compiled code, a Hub repo only when pinned). Name the folder
    ``"./org/name"`` or ``pathlib.Path("org/name")``, or the repo ``"hf://org/name"``."""


class HubError(XpupackError):
    """A Hugging Face Hub operation failed; the subclasses below name the failures a user can fix."""

    def __init__(self, message: str, *, repo_id: str | None = None, revision: str | None = None):
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision


class RepoNotFoundError(HubError):
    """No Hub repo of that id exists, or it is private or gated and the token cannot read it."""


class RevisionNotFoundError(HubError):
    """The Hub repo exists but has no such branch, tag or commit."""

    def __init__(self, message: str, *, repo_id: str | None = None, revision: str | None = None,
                 available: list[str] | None = None):
        super().__init__(message, repo_id=repo_id, revision=revision)
        self.available = available or []


class OfflineNotCachedError(HubError):
    """The Hub cannot be reached (``HF_HUB_OFFLINE`` or no network) and the package is not in the local cache."""
