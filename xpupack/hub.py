"""The Hugging Face Hub: load a package by repo id and revision, and push one (README: "Packages"; "Safety and reliability").

A Hub repo holds a package as it is on disk. Downloads go through
``huggingface_hub``'s cache: the manifest first, then exactly the files it
lists, each pinned to the commit the manifest came from, so a second load of
the same revision downloads nothing and a pinned one sends no request at all.

``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` are read
when a call is made, not when ``huggingface_hub`` was imported, so a process
(or a test) that sets them later is obeyed.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__
from .card import package_card
from .errors import (HubError, IntegrityError, OfflineNotCachedError, PackageFormatError, RepoNotFoundError,
                     RevisionNotFoundError)
from .manifest import MANIFEST, MODEL_CARD, WEIGHTS, check_package, read_manifest
from .source import Source

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

log = logging.getLogger("xpupack")

_DOWNLOAD_THREADS = 8
#: a full git commit hash, as the Hub writes them: the only revision that cannot move
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class _Hub:
    """Where the Hub is and where its cache lives, as the environment says now."""

    endpoint: str
    cache_dir: Path
    offline: bool

    def repo_cache(self, repo_id: str) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        return self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


def download(repo_id: str, *, revision: str | None = None, trust_compiled: bool = False,
             token: str | bool | None = None) -> Source:
    """Fetches the package in Hub repo ``repo_id`` at ``revision`` into the Hugging Face cache.

    Only ``xpupack.json`` and the files it lists are downloaded (not the model
    card or anything else in the repo). Files already in the cache for that
    commit are not downloaded again; with ``HF_HUB_OFFLINE=1`` only the cache
    is used. Other files of the repo that another client put in the same
    snapshot (``hf download``: a LICENSE, the model card) are ignored, never read.

    Args:
        repo_id: ``"org/name"``.
        revision: a branch, a tag or a full commit hash; default ``main``.
        trust_compiled: let the package's compiled artifacts run although the
            revision is not pinned by a full commit hash.
        token: Hugging Face token (default: ``HF_TOKEN`` or the stored login).

    Returns:
        A `Source` on the cached snapshot; ``trusted`` only for a full commit
        hash revision or ``trust_compiled=True`` (README: "Safety and reliability").

    Raises:
        RepoNotFoundError: no such repo, or the token cannot read it.
        RevisionNotFoundError: the repo has no such branch, tag or commit.
        OfflineNotCachedError: offline (or the Hub unreachable) and not in the cache.
        PackageFormatError: the repo at that revision is not an xpupack package.
        IntegrityError: the repo lacks a file its manifest lists.

    Example:
        >>> source = download("org/tiny", revision="3f1c...e9")  # a commit hash: trusted
    """
    hub = _settings()
    root = Path(_fetch(hub, repo_id, MANIFEST, revision, token)).parent
    commit = root.name  # the cache keeps each commit's files in snapshots/<commit hash>/: what the Hub resolved
    # pinned means the Hub resolved the revision to that very commit: a branch or tag can be named
    # with 40 hex digits too, and then points wherever its owner moves it
    pinned = revision is not None and _COMMIT_HASH.fullmatch(revision) is not None and revision == commit
    manifest = read_manifest(root)  # validates every listed path before any of them is fetched
    with ThreadPoolExecutor(max_workers=_DOWNLOAD_THREADS) as pool:
        list(pool.map(lambda name: _fetch(hub, repo_id, name, commit, token, asked=revision),
                      manifest["files"]))

    if pinned:
        reason = "pinned by commit hash"
    elif trust_compiled:
        reason = "trust_compiled=True"
    elif revision is not None and _COMMIT_HASH.fullmatch(revision):
        reason = (f"revision {revision!r} is not pinned by commit hash: it is a branch or tag that the Hub "
                  f"resolved to commit {commit}")
    else:
        reason = f"revision {revision or 'main'!r} (commit {commit}) is not pinned by commit hash"
    described = f"{repo_id}@{commit}" if pinned else f"{repo_id}@{revision or 'main'} (commit {commit[:12]})"
    log.info("%s: package in the Hugging Face cache at %s", described, root)
    return Source(root, trusted=pinned or trust_compiled, links_within=hub.repo_cache(repo_id),
                  description=described, trust_reason=reason, ignore_unlisted=True)


def push(path: str | Path, repo_id: str, *, revision: str | None = None, private: bool | None = None,
         token: str | bool | None = None) -> CommitInfo:
    """Verifies the package at ``path`` and uploads it to Hub repo ``repo_id`` in one commit.

    The repo is created if needed. The commit holds ``xpupack.json``, every file
    it lists and a model card (``README.md``) written for ``repo_id``; files of
    an earlier package in the repo that this one lacks (weights, ``modules/``,
    ``backends/``) are deleted in the same commit (the history keeps them). The
    repo's other files (a ``LICENSE``, docs) stay: loading ignores them.

    Args:
        path: a package directory written by `xpupack.save` or `xpupack build`.
        repo_id: ``"org/name"``.
        revision: the branch to commit to (created from ``main`` if missing);
            default ``main``.
        private: visibility of a repo this call creates (an existing repo keeps its own).
        token: a token with write access (default: ``HF_TOKEN`` or the stored login).

    Returns:
        The commit URL: a ``huggingface_hub.CommitInfo``, which is a ``str``;
        its ``oid`` is the commit hash to pin when loading
        (``xpupack.load(model, repo_id, revision=info.oid)``).

    Raises:
        PackageFormatError, IntegrityError: the package is damaged; nothing is uploaded.
        HubError: the Hub refused (no write access, offline, ...).

    Example:
        >>> url = xpupack.push("tiny-pkg", "org/tiny")
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    root = Path(path)
    manifest = check_package(root)  # a damaged package never reaches the Hub
    if revision is not None and _COMMIT_HASH.fullmatch(revision):
        raise ValueError(f"revision={revision!r} is a commit hash; push commits to a branch — pass a branch "
                         "name or leave revision=None for main")
    hub = _settings()
    if hub.offline:
        raise HubError("HF_HUB_OFFLINE is set: pushing needs the Hub — unset HF_HUB_OFFLINE", repo_id=repo_id,
                       revision=revision)
    card = package_card(root, manifest, repo_id, revision=revision).encode("utf-8")
    listed = [MANIFEST, *manifest["files"]]
    api = _api(hub, token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        stale = [name for name in api.list_repo_files(repo_id, revision=revision)
                 if name not in listed and _package_owned(name)]
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(root / name)) for name in listed]
        operations.append(CommitOperationAdd(path_in_repo=MODEL_CARD, path_or_fileobj=card))
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        info = api.create_commit(repo_id, operations, commit_message=_commit_message(manifest),
                                 revision=revision)
    except OfflineModeIsEnabled:
        raise HubError("huggingface_hub is in offline mode (HF_HUB_OFFLINE was set when it was imported): "
                       "pushing needs the Hub — unset HF_HUB_OFFLINE", repo_id=repo_id) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubError(f"the Hub at {hub.endpoint} refused to write to {repo_id} ({status}): log in with "
                           "`hf auth login` using a token with write access, or pass token=...",
                           repo_id=repo_id, revision=revision) from None
        raise HubError(f"pushing {root} to {repo_id} failed: {_first_line(exc)}", repo_id=repo_id,
                       revision=revision) from None
    log.info("pushed %s to %s (%d files): %s", root, repo_id, len(listed) + 1, info.commit_url)
    return info


def _package_owned(name: str) -> bool:
    """Whether a repo file is where a package keeps its files (so an earlier package's file, not the repo
    owner's LICENSE or docs): the weights, and everything under ``modules/`` and ``backends/``."""
    return name == WEIGHTS or name.split("/", 1)[0] in ("modules", "backends")


def _settings() -> _Hub:
    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT
    if os.environ.get("HF_HUB_CACHE"):
        cache = os.environ["HF_HUB_CACHE"]
    elif os.environ.get("HF_HOME"):
        cache = os.path.join(os.environ["HF_HOME"], "hub")
    else:
        cache = constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE")
    return _Hub(endpoint, Path(os.path.expandvars(cache)).expanduser(),
                offline=constants.is_offline_mode() if offline is None else _truthy(offline))


def _api(hub: _Hub, token: str | bool | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.endpoint, token=token, library_name="xpupack", library_version=__version__)


def _truthy(value: str) -> bool:
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _fetch(hub: _Hub, repo_id: str, filename: str, revision: str | None, token: str | bool | None,
           *, asked: str | None = None) -> str:
    """One file of the repo into the cache; Hub errors become xpupack's, each with its fix.

    ``asked`` is the revision the caller named when ``revision`` is the commit it resolved to.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub import errors as hf

    shown = asked if asked is not None else revision
    where = f"{repo_id}@{shown or 'main'}"
    try:
        return hf_hub_download(repo_id, filename, revision=revision, cache_dir=hub.cache_dir, endpoint=hub.endpoint,
                               token=token, local_files_only=hub.offline, library_name="xpupack",
                               library_version=__version__)
    except hf.GatedRepoError:
        raise RepoNotFoundError(f"{repo_id} is gated: accept its conditions on {hub.endpoint}/{repo_id} and "
                                "log in (`hf auth login`) or pass token=...", repo_id=repo_id,
                                revision=shown) from None
    except hf.RepositoryNotFoundError:
        raise _diagnose(hub, repo_id, revision, filename, token, shown) from None
    except hf.RevisionNotFoundError:
        raise _revision_not_found(hub, repo_id, shown, token) from None
    except (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled):
        raise _not_cached(hub, repo_id, shown, filename) from None
    except hf.EntryNotFoundError:
        raise _missing(hub, repo_id, shown, filename) from None
    except hf.HFValidationError as exc:
        raise RepoNotFoundError(f"{repo_id!r} is neither a local directory nor a valid Hub repo id ({exc}); "
                                "pass a package directory or 'org/name'", repo_id=repo_id) from None
    except hf.HfHubHTTPError as exc:
        raise HubError(f"the Hub at {hub.endpoint} failed on {filename} of {where}: {_first_line(exc)}",
                       repo_id=repo_id, revision=shown) from None


def _diagnose(hub: _Hub, repo_id: str, revision: str | None, filename: str, token: str | bool | None,
              shown: str | None) -> HubError | PackageFormatError | IntegrityError:
    """What "repository not found" on one file means: no repo, no revision, or no such file.

    Some Hub-compatible servers (mirrors such as olah) answer all three that way;
    two cheap questions tell them apart.
    """
    from huggingface_hub.errors import HfHubHTTPError

    api = _api(hub, token)
    try:
        api.list_repo_refs(repo_id)
    except HfHubHTTPError:
        return RepoNotFoundError(
            f"{repo_id} is not a local directory, and the Hub at {hub.endpoint} has no repo {repo_id} that this "
            "token can read; check the name, or for a private repo log in (`hf auth login`) or pass token=...",
            repo_id=repo_id, revision=shown)
    try:
        api.model_info(repo_id, revision=revision or "main")
    except HfHubHTTPError:
        return _revision_not_found(hub, repo_id, shown, token)
    return _missing(hub, repo_id, shown, filename)


def _revision_not_found(hub: _Hub, repo_id: str, revision: str | None, token: str | bool | None) -> HubError:
    from huggingface_hub.errors import HfHubHTTPError

    try:
        refs = _api(hub, token).list_repo_refs(repo_id)
        available = [ref.name for ref in (*refs.branches, *refs.tags)]
    except HfHubHTTPError:
        available = []
    listing = f" (branches and tags: {', '.join(available)})" if available else ""
    return RevisionNotFoundError(f"{repo_id} has no revision {revision or 'main'!r}{listing}; pass a branch, a tag "
                                 "or a full commit hash", repo_id=repo_id, revision=revision, available=available)


def _missing(hub: _Hub, repo_id: str, revision: str | None, filename: str) -> PackageFormatError | IntegrityError:
    where = f"{repo_id}@{revision or 'main'}"
    if filename == MANIFEST:
        return PackageFormatError(f"{where} on {hub.endpoint} is not an xpupack package: it has no {MANIFEST}; "
                                  f"push one with `xpupack push DIR {repo_id}`", path=MANIFEST)
    return IntegrityError(f"{where} lacks {filename}, which its {MANIFEST} lists; the upload is incomplete — "
                          f"push the package again with `xpupack push DIR {repo_id}`", path=filename)


def _not_cached(hub: _Hub, repo_id: str, revision: str | None, filename: str) -> OfflineNotCachedError:
    where = f"{repo_id}@{revision or 'main'}"
    if hub.offline:
        message = (f"HF_HUB_OFFLINE is set and {filename} of {where} is not in the Hugging Face cache at "
                   f"{hub.cache_dir}; load it once online with the same HF_HOME, or unset HF_HUB_OFFLINE")
    else:
        message = (f"cannot reach the Hub at {hub.endpoint} and {filename} of {where} is not in the Hugging Face "
                   f"cache at {hub.cache_dir}; check the network and HF_ENDPOINT, or load it once online")
    return OfflineNotCachedError(message, repo_id=repo_id, revision=revision)


def _commit_message(manifest: dict) -> str:
    env = manifest["environment"]
    backends = ", ".join(sorted({m["backend"]["name"] for m in manifest["modules"]}))
    return (f"xpupack package: {len(manifest['modules'])} module(s) ({backends}), "
            f"torch {env['torch']} on {env['device_type']}")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
