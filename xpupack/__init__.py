"""xpupack: build, ship and load tuned PyTorch models for Intel GPUs (XPU), NVIDIA GPUs and CPU.

``import xpupack`` imports no torch: every public name below is resolved on
first use (PEP 562 module ``__getattr__``), so ``xpupack.__version__``, the
errors (``except xpupack.XpupackError``), ``xpupack inspect`` and ``xpupack
verify`` stay light. Using ``xpupack.tune``, ``xpupack.load``, a backend and
so on imports torch then.

Examples:
    >>> import xpupack
    >>> model = xpupack.tune(model, samples, modules=["layers.*.mlp"])
    >>> xpupack.save(model, "pkg/")
    >>> model = xpupack.load(make_model(), "pkg/")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    AmbiguousSourceError,
    BackendError,
    BackendUnavailableError,
    BenchmarkError,
    DestinationExistsError,
    DeviceMapError,
    DeviceUnavailableError,
    HubError,
    IncompatiblePackageError,
    IntegrityError,
    LimitSettingError,
    ModelMismatchError,
    NoCandidateError,
    NotAModelError,
    NotTunedError,
    OfflineNotCachedError,
    OutputMismatchError,
    PackageFormatError,
    PackageLimitError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SampleError,
    SaveError,
    SourceError,
    TuningError,
    UnknownConfigError,
    XpupackError,
)

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    import os

    from huggingface_hub import CommitInfo

    from .backends.aoti import AOTIBackend
    from .backends.eager import EagerBackend
    from .backends.graph import GraphBackend
    from .backends.inductor import InductorBackend
    from .backends.torchao import TorchAOBackend
    from .limits import LoadLimits
    from .loading import load
    from .package import save
    from .state import register_state
    from .strategies import Fastest, FirstWins, Only, Strategy
    from .tuned import activate, deactivate, stats
    from .tuning import tune

#: public name -> the submodule defining it (imported, with torch, on first access)
_LAZY = {
    "EagerBackend": ".backends.eager",
    "GraphBackend": ".backends.graph",
    "InductorBackend": ".backends.inductor",
    "AOTIBackend": ".backends.aoti",
    "TorchAOBackend": ".backends.torchao",
    "LoadLimits": ".limits",
    "load": ".loading",
    "save": ".package",
    "register_state": ".state",
    "Fastest": ".strategies",
    "FirstWins": ".strategies",
    "Only": ".strategies",
    "Strategy": ".strategies",
    "tune": ".tuning",
    "activate": ".tuned",
    "deactivate": ".tuned",
    "stats": ".tuned",
}


def __getattr__(name: str) -> Any:
    """Resolves a public name on first use, importing its submodule (and torch) then (PEP 562)."""
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module 'xpupack' has no attribute {name!r}")
    value = getattr(importlib.import_module(submodule, __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted(set(globals()) | set(_LAZY))


def push(
    path: str | os.PathLike[str],
    repo_id: str,
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
) -> CommitInfo:
    """Verifies the package at ``path`` and uploads it to the Hub repo ``repo_id`` in one commit.

    The repo is created if needed; the commit holds the package and a model card, and deletes files of an
    earlier package that this one lacks (docs/hub.md). ``xpupack push --dry-run`` shows the
    commit without making it. This does not import torch; see `xpupack.publish.push` for the details.

    Args:
        path: a package directory written by `xpupack.save` or ``xpupack build``, named as a folder
            (``"./org/name"`` or a ``Path``; a plain ``"org/name"`` names a Hub repo).
        repo_id: ``"org/name"`` (or ``"hf://org/name"``).
        revision: the branch to commit to (created from ``main`` if missing); default ``main``.
        private: visibility of a repo this call creates (an existing repo keeps its own).
        token: a token with write access (default: ``HF_TOKEN`` or the stored login).

    Returns:
        The commit URL: a ``huggingface_hub.CommitInfo``, which is a ``str``; its ``oid`` is the commit
        hash to pin when loading.

    Raises:
        SourceError: ``path`` names a Hub repo rather than a folder, ``repo_id`` is not ``"org/name"``, or
            ``revision`` is a commit hash.
        PackageFormatError: the package is damaged (bad manifest); nothing is uploaded.
        IntegrityError: a file is missing or changed; nothing is uploaded.
        HubError: the Hub refused (no write access, offline...) or could not be reached.

    Examples:
        >>> info = xpupack.push("./tiny-pkg", "org/tiny")
        >>> model = xpupack.load(make_model(), "org/tiny", revision=info.oid)  # pinned: trusted
    """
    from .publish import push as _push

    return _push(path, repo_id, revision=revision, private=private, token=token)


__all__ = [
    "tune",
    "save",
    "load",
    "LoadLimits",
    "stats",
    "activate",
    "deactivate",
    "push",
    "register_state",
    "FirstWins",
    "Fastest",
    "Only",
    "Strategy",
    "GraphBackend",
    "InductorBackend",
    "AOTIBackend",
    "TorchAOBackend",
    "EagerBackend",
    "XpupackError",
    "PackageFormatError",
    "PackageLimitError",
    "LimitSettingError",
    "IntegrityError",
    "IncompatiblePackageError",
    "ModelMismatchError",
    "BackendError",
    "BackendUnavailableError",
    "OutputMismatchError",
    "NoCandidateError",
    "TuningError",
    "NotTunedError",
    "BenchmarkError",
    "SaveError",
    "DestinationExistsError",
    "DeviceUnavailableError",
    "DeviceMapError",
    "UnknownConfigError",
    "HubError",
    "RepoNotFoundError",
    "RevisionNotFoundError",
    "OfflineNotCachedError",
    "SourceError",
    "AmbiguousSourceError",
    "NotAModelError",
    "SampleError",
    "__version__",
]
