"""The Hugging Face Hub: where a package comes from (a local directory or a repo id and revision), and its download
(docs/packages.md; docs/safety.md). Pushing is `xpupack.publish`.

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

from ._fsutil import moved_aside
from ._version import __version__
from .errors import (
    AmbiguousSourceError,
    HubError,
    IntegrityError,
    OfflineNotCachedError,
    PackageFormatError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceError,
    error_line,
    first_line,
)
from .manifest import MANIFEST, read_manifest
from .source import Source, is_repo_id, read_name

log = logging.getLogger("xpupack")

_DOWNLOAD_THREADS = 8
#: a full git commit hash, as the Hub writes them: the only revision that cannot move
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubSettings:
    """Where the Hub is and where its cache lives, as the environment says now.

    Args:
        endpoint: the Hub's URL (``HF_ENDPOINT``, else huggingface_hub's default).
        cache_dir: the Hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default).
        offline: ``HF_HUB_OFFLINE``.
    """

    endpoint: str
    cache_dir: Path
    offline: bool

    def repo_cache(self, repo_id: str) -> Path:
        """The folder of the cache that holds ``repo_id``'s files.

        Args:
            repo_id: ``"org/name"``.

        Returns:
            ``<cache_dir>/models--org--name``.
        """
        from huggingface_hub.file_download import repo_folder_name

        return self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


def resolve_source(
    path: str | os.PathLike,
    *,
    revision: str | None = None,
    trust_compiled: bool = False,
    token: str | bool | None = None,
) -> Source:
    """The package that ``path`` names, by the naming rule (`xpupack.source`; docs/hub.md, "Naming a package").

    A folder is trusted (its compiled artifacts may run); a Hub repo is downloaded
    (`download`) and trusted only when pinned or with ``trust_compiled=True``.

    Args:
        path: a folder (a ``Path``, an absolute path, ``"./org/name"``...) or a Hub repo id
            (``"org/name"``, ``"hf://org/name"``).
        revision: a Hub revision (branch, tag or commit hash); not for a folder.
        trust_compiled: trust a Hub revision that is not pinned by commit hash.
        token: Hugging Face token (default: ``HF_TOKEN`` or the stored login).

    Returns:
        The `Source`: its folder on disk, and whether its compiled artifacts may run.

    Raises:
        AmbiguousSourceError: a plain ``"org/name"`` that is also a folder (or file) here.
        SourceError: a folder that does not exist, or ``revision`` given for a folder.
        HubError: the repo's download failed (see `download`).
    """
    name = read_name(path)
    if name.folder is None:
        if name.plain and os.path.lexists(name.repo_id):
            raise AmbiguousSourceError(
                f"{name.given!r} names the Hub repo {name.repo_id}, and a folder {Path(name.repo_id).absolute()} "
                "exists here too; xpupack does not guess between them (a folder's compiled artifacts run, a "
                f"Hub repo's only when pinned): name the folder './{name.given}' (or pathlib.Path("
                f"{name.given!r})), or the Hub repo 'hf://{name.repo_id}'",
                source=name.given,
                folder=name.given,
                repo_id=name.repo_id,
            )
        return download(name.repo_id, revision=revision, trust_compiled=trust_compiled, token=token, plain=name.plain)
    folder = name.folder
    if revision is not None:
        raise SourceError(
            f"revision={revision!r} selects a version of a Hub repo, but {name.given!r} names the "
            f"folder {folder}; drop revision=, or name the Hub repo as 'org/name' or "
            "'hf://org/name'",
            source=name.given,
            folder=str(folder),
        )
    if not folder.exists() and not moved_aside(folder):  # `read_manifest` explains an interrupted save
        raise SourceError(
            f"there is no folder {folder.absolute()}{_hub_hint(name.given)}", source=name.given, folder=str(folder)
        )
    return Source(folder, trusted=True, description=str(folder), trust_reason="local directory")


def _hub_hint(given: str) -> str:
    """For a folder that does not exist: how the name would read as a Hub repo, where it could be one."""
    bare = given[2:] if given.startswith("./") else given
    if "/" in bare and is_repo_id(bare):
        return f"; to load the Hub repo {bare}, name it '{bare}' or 'hf://{bare}'"
    if is_repo_id(bare):
        return f"; a Hub repo is named 'org/name' ('hf://{bare}' for one without an organisation)"
    return ""


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    trust_compiled: bool = False,
    token: str | bool | None = None,
    plain: bool = False,
) -> Source:
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
        plain: the repo was named by a plain ``"org/name"``, which could have been a mistyped folder:
            an error that it cannot be found or reached says that no such folder exists either, and
            an unreachable Hub is reported at once instead of after huggingface_hub's retries.

    Returns:
        A `Source` on the cached snapshot; ``trusted`` only for a full commit
        hash revision or ``trust_compiled=True`` (docs/safety.md).

    Raises:
        RepoNotFoundError: no such repo, or the token cannot read it.
        RevisionNotFoundError: the repo has no such branch, tag or commit.
        OfflineNotCachedError: offline (or the Hub unreachable) and not in the cache.
        PackageFormatError: the repo at that revision is not an xpupack package.
        IntegrityError: the repo lacks a file its manifest lists.

    Examples:
        >>> source = download("org/tiny", revision="3f1c...e9")  # a commit hash: trusted
    """
    hub = hub_settings()
    if plain:
        _check_reachable(hub, repo_id, revision, token)
    root = Path(_fetch(hub, repo_id, MANIFEST, revision, token, plain=plain)).parent
    commit = root.name  # the cache keeps each commit's files in snapshots/<commit hash>/: what the Hub resolved
    # pinned means the Hub resolved the revision to that very commit: a branch or tag can be named
    # with 40 hex digits too, and then points wherever its owner moves it
    pinned = revision is not None and COMMIT_HASH.fullmatch(revision) is not None and revision == commit
    manifest = read_manifest(root)  # validates every listed path before any of them is fetched
    with ThreadPoolExecutor(max_workers=_DOWNLOAD_THREADS) as pool:
        list(pool.map(lambda name: _fetch(hub, repo_id, name, commit, token, asked=revision), manifest["files"]))

    if pinned:
        reason = "pinned by commit hash"
    elif trust_compiled:
        reason = "trust_compiled=True"
    elif revision is not None and COMMIT_HASH.fullmatch(revision):
        reason = (
            f"revision {revision!r} is not pinned by commit hash: it is a branch or tag that the Hub "
            f"resolved to commit {commit}"
        )
    else:
        reason = f"revision {revision or 'main'!r} (commit {commit}) is not pinned by commit hash"
    described = f"{repo_id}@{commit}" if pinned else f"{repo_id}@{revision or 'main'} (commit {commit[:12]})"
    log.info("%s: package in the Hugging Face cache at %s", described, root)
    return Source(
        root,
        trusted=pinned or trust_compiled,
        links_within=hub.repo_cache(repo_id),
        description=described,
        trust_reason=reason,
        ignore_unlisted=True,
    )


def hub_settings() -> HubSettings:
    """The Hub settings the environment gives now (read at each call, not at import).

    Returns:
        Endpoint, cache folder and offline mode.
    """
    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT
    if os.environ.get("HF_HUB_CACHE"):
        cache = os.environ["HF_HUB_CACHE"]
    elif os.environ.get("HF_HOME"):
        cache = os.path.join(os.environ["HF_HOME"], "hub")
    else:
        cache = constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE")
    return HubSettings(
        endpoint,
        Path(os.path.expandvars(cache)).expanduser(),
        offline=constants.is_offline_mode() if offline is None else _truthy(offline),
    )


def hub_api(hub: HubSettings, token: str | bool | None):
    """A ``huggingface_hub.HfApi`` on ``hub``'s endpoint that names xpupack as its library.

    Args:
        hub: where the Hub is.
        token: Hugging Face token (None: ``HF_TOKEN`` or the stored login).

    Returns:
        (huggingface_hub.HfApi): the client.
    """
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.endpoint, token=token, library_name="xpupack", library_version=__version__)


def _truthy(value: str) -> bool:
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _fetch(
    hub: HubSettings,
    repo_id: str,
    filename: str,
    revision: str | None,
    token: str | bool | None,
    *,
    asked: str | None = None,
    plain: bool = False,
) -> str:
    """One file of the repo into the cache; Hub errors become xpupack's, each with its fix.

    ``asked`` is the revision the caller named when ``revision`` is the commit it resolved to;
    ``plain``: see `download`.
    """
    from huggingface_hub import errors as hf
    from huggingface_hub import hf_hub_download

    shown = asked if asked is not None else revision
    where = f"{repo_id}@{shown or 'main'}"
    try:
        return hf_hub_download(
            repo_id,
            filename,
            revision=revision,
            cache_dir=hub.cache_dir,
            endpoint=hub.endpoint,
            token=token,
            local_files_only=hub.offline,
            library_name="xpupack",
            library_version=__version__,
        )
    except hf.GatedRepoError:
        raise RepoNotFoundError(
            f"{repo_id} is gated: accept its conditions on {hub.endpoint}/{repo_id} and "
            "log in (`hf auth login`) or pass token=...",
            repo_id=repo_id,
            revision=shown,
        ) from None
    except hf.RepositoryNotFoundError:
        raise _diagnose(hub, repo_id, revision, filename, token, shown, plain) from None
    except hf.RevisionNotFoundError:
        raise _revision_not_found(hub, repo_id, shown, token) from None
    except (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled):
        raise _not_cached(hub, repo_id, shown, filename, plain) from None
    except hf.EntryNotFoundError:
        raise _missing(hub, repo_id, shown, filename) from None
    except hf.HFValidationError as exc:
        raise RepoNotFoundError(
            f"{repo_id!r} is not a valid Hub repo id ({exc}); name a Hub repo 'org/name', a folder './name'",
            repo_id=repo_id,
        ) from None
    except hf.HfHubHTTPError as exc:
        raise HubError(
            f"the Hub at {hub.endpoint} failed on {filename} of {where}: {first_line(exc)}",
            repo_id=repo_id,
            revision=shown,
        ) from None


def _diagnose(
    hub: HubSettings,
    repo_id: str,
    revision: str | None,
    filename: str,
    token: str | bool | None,
    shown: str | None,
    plain: bool = False,
) -> HubError | PackageFormatError | IntegrityError:
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
            f"{_no_folder(repo_id) if plain else ''}the Hub at {hub.endpoint} has no repo {repo_id} that this "
            "token can read; check the name, or for a private repo log in (`hf auth login`) or pass token=...",
            repo_id=repo_id,
            revision=shown,
        )
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
    return RevisionNotFoundError(
        f"{repo_id} has no revision {revision or 'main'!r}{listing}; pass a branch, a tag or a full commit hash",
        repo_id=repo_id,
        revision=revision,
        available=available,
    )


def _missing(
    hub: HubSettings, repo_id: str, revision: str | None, filename: str
) -> PackageFormatError | IntegrityError:
    where = f"{repo_id}@{revision or 'main'}"
    if filename == MANIFEST:
        return PackageFormatError(
            f"{where} on {hub.endpoint} is not an xpupack package: it has no {MANIFEST}; "
            f"push one with `xpupack push DIR {repo_id}`",
            path=MANIFEST,
        )
    return IntegrityError(
        f"{where} lacks {filename}, which its {MANIFEST} lists; the upload is incomplete — "
        f"push the package again with `xpupack push DIR {repo_id}`",
        path=filename,
    )


def _not_cached(
    hub: HubSettings, repo_id: str, revision: str | None, filename: str, plain: bool = False, why: str = ""
) -> OfflineNotCachedError:
    where = f"{repo_id}@{revision or 'main'}"
    if hub.offline:
        message = (
            f"HF_HUB_OFFLINE is set and {filename} of {where} is not in the Hugging Face cache at "
            f"{hub.cache_dir}; load it once online with the same HF_HOME, or unset HF_HUB_OFFLINE"
        )
    else:
        message = (
            f"cannot reach the Hub at {hub.endpoint}{f' ({why})' if why else ''} and {filename} of {where} "
            f"is not in the Hugging Face cache at {hub.cache_dir}; check the network and HF_ENDPOINT, or "
            "load it once online"
        )
    return OfflineNotCachedError((_no_folder(repo_id) if plain else "") + message, repo_id=repo_id, revision=revision)


def _no_folder(repo_id: str) -> str:
    """The start of a message about a plain ``"org/name"``: it named no folder either."""
    return (
        f"{repo_id!r} names a Hub repo (no folder {Path(repo_id).absolute()} exists here either; a folder "
        f"is named './{repo_id}'): "
    )


def _check_reachable(hub: HubSettings, repo_id: str, revision: str | None, token: str | bool | None) -> None:
    """Raises `OfflineNotCachedError` at once when the Hub cannot be reached and the manifest is not cached.

    huggingface_hub retries an unreachable Hub for about 20 s before it gives up, which is right for a
    server that starts before its network, and wrong for a mistyped folder: a plain ``"org/name"`` asks
    once (``hf://org/name`` keeps the retries). Any answer from the Hub, or a cached manifest that
    huggingface_hub falls back to, leaves the download to `_fetch`.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if hub.offline or isinstance(
        try_to_load_from_cache(repo_id, MANIFEST, cache_dir=hub.cache_dir, revision=revision), str
    ):
        return
    url = hf_hub_url(repo_id, MANIFEST, revision=revision, endpoint=hub.endpoint)
    try:
        get_hf_file_metadata(
            url,
            token=token,
            endpoint=hub.endpoint,
            retry_on_errors=False,
            library_name="xpupack",
            library_version=__version__,
        )
    except HfHubHTTPError:
        return  # the Hub answered: `_fetch` says what the answer means
    except Exception as exc:  # no answer at all: refused, unresolvable, timed out
        raise _not_cached(hub, repo_id, revision, MANIFEST, plain=True, why=error_line(exc)) from None
