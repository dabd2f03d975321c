"""The Hugging Face Hub: where a package comes from (a local directory or a repo id and revision), and its download
(README: "Packages"; "Safety and reliability"). Pushing is `xpupack.publish`.

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

from ._version import __version__
from .errors import (HubError, IntegrityError, OfflineNotCachedError, PackageFormatError, RepoNotFoundError,
                     RevisionNotFoundError)
from .manifest import MANIFEST, read_manifest
from .source import Source

log = logging.getLogger("xpupack")

_DOWNLOAD_THREADS = 8
#: a full git commit hash, as the Hub writes them: the only revision that cannot move
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubSettings:
    """Where the Hub is and where its cache lives, as the environment says now."""

    endpoint: str
    cache_dir: Path
    offline: bool

    def repo_cache(self, repo_id: str) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        return self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


def resolve_source(path: str | Path, *, revision: str | None = None, trust_compiled: bool = False,
                   token: str | bool | None = None) -> Source:
    """A local package directory as is (trusted); anything else is looked up on the Hub."""
    local = Path(path).expanduser()
    if local.exists() or revision is None and _looks_local(str(path)):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {path} is a local directory")
        return Source(local, trusted=True, description=str(local), trust_reason="local directory")
    return download(str(path), revision=revision, trust_compiled=trust_compiled, token=token)


def _looks_local(text: str) -> bool:
    """Paths that cannot be ``org/name`` repo ids."""
    return text.startswith((".", "/", "~")) or text.count("/") != 1


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
    hub = hub_settings()
    root = Path(_fetch(hub, repo_id, MANIFEST, revision, token)).parent
    commit = root.name  # the cache keeps each commit's files in snapshots/<commit hash>/: what the Hub resolved
    # pinned means the Hub resolved the revision to that very commit: a branch or tag can be named
    # with 40 hex digits too, and then points wherever its owner moves it
    pinned = revision is not None and COMMIT_HASH.fullmatch(revision) is not None and revision == commit
    manifest = read_manifest(root)  # validates every listed path before any of them is fetched
    with ThreadPoolExecutor(max_workers=_DOWNLOAD_THREADS) as pool:
        list(pool.map(lambda name: _fetch(hub, repo_id, name, commit, token, asked=revision),
                      manifest["files"]))

    if pinned:
        reason = "pinned by commit hash"
    elif trust_compiled:
        reason = "trust_compiled=True"
    elif revision is not None and COMMIT_HASH.fullmatch(revision):
        reason = (f"revision {revision!r} is not pinned by commit hash: it is a branch or tag that the Hub "
                  f"resolved to commit {commit}")
    else:
        reason = f"revision {revision or 'main'!r} (commit {commit}) is not pinned by commit hash"
    described = f"{repo_id}@{commit}" if pinned else f"{repo_id}@{revision or 'main'} (commit {commit[:12]})"
    log.info("%s: package in the Hugging Face cache at %s", described, root)
    return Source(root, trusted=pinned or trust_compiled, links_within=hub.repo_cache(repo_id),
                  description=described, trust_reason=reason, ignore_unlisted=True)


def hub_settings() -> HubSettings:
    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT
    if os.environ.get("HF_HUB_CACHE"):
        cache = os.environ["HF_HUB_CACHE"]
    elif os.environ.get("HF_HOME"):
        cache = os.path.join(os.environ["HF_HOME"], "hub")
    else:
        cache = constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE")
    return HubSettings(endpoint, Path(os.path.expandvars(cache)).expanduser(),
                offline=constants.is_offline_mode() if offline is None else _truthy(offline))


def hub_api(hub: HubSettings, token: str | bool | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.endpoint, token=token, library_name="xpupack", library_version=__version__)


def _truthy(value: str) -> bool:
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _fetch(hub: HubSettings, repo_id: str, filename: str, revision: str | None, token: str | bool | None,
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
        raise HubError(f"the Hub at {hub.endpoint} failed on {filename} of {where}: {first_line(exc)}",
                       repo_id=repo_id, revision=shown) from None


def _diagnose(hub: HubSettings, repo_id: str, revision: str | None, filename: str, token: str | bool | None,
              shown: str | None) -> HubError | PackageFormatError | IntegrityError:
    """What "repository not found" on one file means: no repo, no revision, or no such file.

    Some Hub-compatible servers (mirrors such as olah) answer all three that way;
    two cheap questions tell them apart.
    """
    from huggingface_hub.errors import HfHubHTTPError

    api = hub_api(hub, token)
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


def _revision_not_found(hub: HubSettings, repo_id: str, revision: str | None, token: str | bool | None) -> HubError:
    from huggingface_hub.errors import HfHubHTTPError

    try:
        refs = hub_api(hub, token).list_repo_refs(repo_id)
        available = [ref.name for ref in (*refs.branches, *refs.tags)]
    except HfHubHTTPError:
        available = []
    listing = f" (branches and tags: {', '.join(available)})" if available else ""
    return RevisionNotFoundError(f"{repo_id} has no revision {revision or 'main'!r}{listing}; pass a branch, a tag "
                                 "or a full commit hash", repo_id=repo_id, revision=revision, available=available)


def _missing(hub: HubSettings, repo_id: str, revision: str | None,
             filename: str) -> PackageFormatError | IntegrityError:
    where = f"{repo_id}@{revision or 'main'}"
    if filename == MANIFEST:
        return PackageFormatError(f"{where} on {hub.endpoint} is not an xpupack package: it has no {MANIFEST}; "
                                  f"push one with `xpupack push DIR {repo_id}`", path=MANIFEST)
    return IntegrityError(f"{where} lacks {filename}, which its {MANIFEST} lists; the upload is incomplete — "
                          f"push the package again with `xpupack push DIR {repo_id}`", path=filename)


def _not_cached(hub: HubSettings, repo_id: str, revision: str | None, filename: str) -> OfflineNotCachedError:
    where = f"{repo_id}@{revision or 'main'}"
    if hub.offline:
        message = (f"HF_HUB_OFFLINE is set and {filename} of {where} is not in the Hugging Face cache at "
                   f"{hub.cache_dir}; load it once online with the same HF_HOME, or unset HF_HUB_OFFLINE")
    else:
        message = (f"cannot reach the Hub at {hub.endpoint} and {filename} of {where} is not in the Hugging Face "
                   f"cache at {hub.cache_dir}; check the network and HF_ENDPOINT, or load it once online")
    return OfflineNotCachedError(message, repo_id=repo_id, revision=revision)


def first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
