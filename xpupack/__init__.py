"""xpupack: build, ship and load tuned PyTorch models for Intel GPUs (XPU), NVIDIA GPUs and CPU.

Example:
    >>> import xpupack
    >>> model = xpupack.tune(model, samples, modules=["layers.*.mlp"])
    >>> xpupack.save(model, "pkg/")
    >>> model = xpupack.load(make_model(), "pkg/")
"""

from .backends.eager import EagerBackend
from .backends.graph import GraphBackend
from .backends.inductor import InductorBackend
from .backends.torchao import TorchAOBackend
from .environment import __version__
from .errors import (BackendError, BackendUnavailableError, DestinationExistsError, DeviceUnavailableError, HubError,
                     IncompatiblePackageError, IntegrityError, ModelMismatchError, NoCandidateError, NotTunedError,
                     OfflineNotCachedError, OutputMismatchError, PackageFormatError, RepoNotFoundError,
                     RevisionNotFoundError, SaveError, TuningError, UnknownConfigError, XpupackError)
from .load import load
from .package import save
from .state import register_state
from .strategies import Fastest, FirstWins, Only, Strategy
from .tune import tune
from .tuned import activate, deactivate, stats


def push(path, repo_id, revision=None, private=None, token=None):
    """Verifies the package at ``path`` and uploads it to the Hub repo ``repo_id`` in one commit.

    Returns the commit URL; see `xpupack.hub.push` for the details.
    """
    from .hub import push as _push

    return _push(path, repo_id, revision=revision, private=private, token=token)


__all__ = [
    "tune", "save", "load", "stats", "activate", "deactivate", "push", "register_state",
    "FirstWins", "Fastest", "Only", "Strategy",
    "GraphBackend", "InductorBackend", "TorchAOBackend", "EagerBackend",
    "XpupackError", "PackageFormatError", "IntegrityError", "IncompatiblePackageError",
    "ModelMismatchError", "BackendError", "BackendUnavailableError", "OutputMismatchError",
    "NoCandidateError", "TuningError", "NotTunedError", "SaveError", "DestinationExistsError",
    "DeviceUnavailableError", "UnknownConfigError", "HubError",
    "RepoNotFoundError", "RevisionNotFoundError", "OfflineNotCachedError",
    "__version__",
]
