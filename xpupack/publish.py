"""Publishing a package on the Hugging Face Hub: verify it, write its model card, upload it in one commit
(docs/packages.md)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .card import package_card
from .errors import HubError, SourceError, first_line
from .hub import COMMIT_HASH, hub_api, hub_settings
from .manifest import MANIFEST, MODEL_CARD, check_package
from .shards import WEIGHTS_INDEX, is_weights_file
from .source import HUB_PREFIX, is_repo_id, local_folder

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

log = logging.getLogger("xpupack")


@dataclass(frozen=True)
class PushPlan:
    """What `push` would commit, worked out without contacting the Hub (``xpupack push --dry-run``).

    ``files`` pairs each path in the repo with its size in bytes: ``xpupack.json``,
    every file it lists, then the model card (``README.md``). Files of an earlier
    package in the repo that this one lacks are deleted in the same commit; which
    ones only the Hub can say.

    Args:
        root: the package folder.
        repo_id: ``"org/name"``.
        revision: the branch, or None for ``main``.
        endpoint: the Hub it would go to.
        files: ``(path in the repo, size in bytes)`` of each file uploaded.
        card: the model card's bytes.
        commit_message: the commit's message.
    """

    root: Path
    repo_id: str
    revision: str | None
    endpoint: str
    files: tuple[tuple[str, int], ...]
    card: bytes
    commit_message: str


def plan_push(path: str | os.PathLike[str], repo_id: str, *, revision: str | None = None) -> PushPlan:
    """Verifies the package at ``path`` and works out the commit `push` would make; contacts nothing.

    Args:
        path: the package folder (named as a folder, docs/hub.md, "Naming a package").
        repo_id: ``"org/name"`` (or ``"hf://org/name"``).
        revision: the branch to commit to; None for ``main``.

    Returns:
        The files, sizes, model card and commit message of the commit.

    Raises:
        SourceError: ``path`` names a Hub repo rather than a folder, ``repo_id`` is not ``"org/name"``,
            or ``revision`` is a commit hash (push commits to a branch) or not a name git takes for a
            branch (empty, ``..``, a leading ``/``, whitespace or control characters...).
        PackageFormatError, IntegrityError: the package is damaged.

    Examples:
        >>> plan = plan_push("./tiny-pkg", "org/tiny")
        >>> sum(size for _, size in plan.files)
        123456
    """
    root = local_folder(path)
    repo_id = _repo_id(repo_id)
    manifest = check_package(root)  # a damaged package never reaches the Hub
    if revision is not None:
        _check_branch(revision)
    card = package_card(root, manifest, repo_id, revision=revision).encode("utf-8")
    files = tuple((name, (root / name).stat().st_size) for name in [MANIFEST, *manifest["files"]])
    return PushPlan(
        root,
        repo_id,
        revision,
        hub_settings().endpoint,
        files + ((MODEL_CARD, len(card)),),
        card,
        _commit_message(manifest),
    )


def push(
    path: str | os.PathLike[str],
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
) -> CommitInfo:
    """Verifies the package at ``path`` and uploads it to Hub repo ``repo_id`` in one commit.

    The repo is created if needed. The commit holds ``xpupack.json``, every file
    it lists and a model card (``README.md``) written for ``repo_id``; files of
    an earlier package in the repo that this one lacks (weights, ``modules/``,
    ``backends/``) are deleted in the same commit (the history keeps them). The
    repo's other files (a ``LICENSE``, docs) stay: loading ignores them.
    `plan_push` shows the same commit without uploading it.

    Args:
        path: a package directory written by `xpupack.save` or `xpupack build`, named as a folder
            (docs/hub.md, "Naming a package": ``"./org/name"``, not ``"org/name"``, which names a Hub repo).
        repo_id: ``"org/name"`` (or ``"hf://org/name"``).
        revision: the branch to commit to (created from ``main`` if missing);
            default ``main``.
        private: visibility of a repo this call creates (an existing repo keeps its own).
        token: a token with write access (default: ``HF_TOKEN`` or the stored login).

    Returns:
        The commit URL: a ``huggingface_hub.CommitInfo``, which is a ``str``;
        its ``oid`` is the commit hash to pin when loading
        (``xpupack.load(model, repo_id, revision=info.oid)``).

    Raises:
        SourceError: ``path`` names a Hub repo rather than a folder, or ``repo_id`` is not ``"org/name"``.
        PackageFormatError, IntegrityError: the package is damaged; nothing is uploaded.
        HubError: the Hub refused (no write access, offline, ...) or could not be reached (the
            message names the endpoint tried).

    Examples:
        >>> url = xpupack.push("tiny-pkg", "org/tiny")
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    plan = plan_push(path, repo_id, revision=revision)
    root, repo_id = plan.root, plan.repo_id  # the repo as "org/name", also when named "hf://org/name"
    hub = hub_settings()
    if hub.offline:
        raise HubError(
            "HF_HUB_OFFLINE is set: pushing needs the Hub — unset HF_HUB_OFFLINE", repo_id=repo_id, revision=revision
        )
    listed = [name for name, _size in plan.files if name != MODEL_CARD]
    api = hub_api(hub, token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        stale = [
            name
            for name in api.list_repo_files(repo_id, revision=revision)
            if name not in listed and _package_owned(name)
        ]
        operations: list[CommitOperationAdd | CommitOperationDelete] = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(root / name)) for name in listed
        ]
        operations.append(CommitOperationAdd(path_in_repo=MODEL_CARD, path_or_fileobj=plan.card))
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        info = api.create_commit(repo_id, operations, commit_message=plan.commit_message, revision=revision)
    except OfflineModeIsEnabled:
        raise HubError(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE was set when it was imported): "
            "pushing needs the Hub — unset HF_HUB_OFFLINE",
            repo_id=repo_id,
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubError(
                f"the Hub at {hub.endpoint} refused to write to {repo_id} ({status}): log in with "
                "`hf auth login` using a token with write access, or pass token=...",
                repo_id=repo_id,
                revision=revision,
            ) from None
        raise HubError(
            f"pushing {root} to {repo_id} failed: {first_line(exc)}", repo_id=repo_id, revision=revision
        ) from None
    except Exception as exc:
        if not _unreachable(exc):
            raise
        raise HubError(
            f"cannot reach the Hub at {hub.endpoint} to push {root} to {repo_id} ({first_line(exc)}): "
            "check the network, and HF_ENDPOINT if that is not the Hub you meant",
            repo_id=repo_id,
            revision=revision,
        ) from None
    log.info("pushed %s to %s (%d files): %s", root, repo_id, len(plan.files), info.commit_url)
    return info


#: (module, class) of the errors that mean no answer came (refused, unresolvable, timed out), whichever HTTP
#: client huggingface_hub uses: httpx and httpx2 (huggingface_hub 1 and 2), requests (before), or the socket's own
_NO_ANSWER = {
    ("httpx", "TransportError"),
    ("httpx2", "TransportError"),
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
    ("builtins", "ConnectionError"),
    ("builtins", "TimeoutError"),
}


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server gave no answer at all (not an HTTP error status, not a local file's)."""
    return any((cls.__module__.split("._")[0], cls.__name__) in _NO_ANSWER for cls in type(exc).__mro__)


def _repo_id(repo_id: str) -> str:
    """``org/name`` from ``org/name`` or ``hf://org/name``: a repo the model card's ``xpupack.load(model,
    "org/name")`` names (a bare ``name`` would be created under the token's user, and load as a folder)."""
    text = repo_id[len(HUB_PREFIX) :] if isinstance(repo_id, str) and repo_id.startswith(HUB_PREFIX) else repo_id
    if not isinstance(text, str) or text.count("/") != 1 or not is_repo_id(text):
        raise SourceError(
            f"push needs a Hub repo named 'org/name' (letters, digits, '-', '_', '.'), not {repo_id!r}",
            source=str(repo_id),
        )
    return text


#: what git refuses in a branch name (``git check-ref-format``): a component starting with ``.`` or ending in
#: ``.lock``, ``..``, ``//``, ``@{``, a space or control character, ``~^:?*[\``, a leading or trailing ``/``,
#: a trailing ``.``, or ``@`` alone
_NOT_A_BRANCH = re.compile(r"(^|/)\.|\.lock(/|$)|\.\.|//|@\{|[\x00-\x20\x7f~^:?*\[\\]|^/|/$|\.$|^@$")


def _check_branch(revision: str) -> None:
    """Raises `SourceError` unless ``revision`` is a branch push can commit to: a name git takes for one
    (a revision ``../main`` or ``""`` would otherwise reach the Hub, or pass a dry run), not a commit hash."""
    if COMMIT_HASH.fullmatch(revision):
        why = "is a commit hash; push commits to a branch"
    elif not revision or _NOT_A_BRANCH.search(revision) or not revision.isprintable() or revision != revision.strip():
        why = (
            "is not a branch name git takes (one is not empty and has no '..', '//', leading or trailing '/', "
            "whitespace, control character, any of ~^:?*[\\ or part starting with '.')"
        )
    else:
        return
    raise SourceError(
        f"revision={revision!r} {why} — pass a branch name such as 'candidate' or 'release/v2', or leave "
        "revision=None (no --revision) for main",
        source=revision,
    )


def _package_owned(name: str) -> bool:
    """Whether a repo file is where a package keeps its files (so an earlier package's file, not the repo
    owner's LICENSE or docs): the weights (one file, or shards and their index), and everything under
    ``modules/`` and ``backends/``."""
    return is_weights_file(name) or name == WEIGHTS_INDEX or name.split("/", 1)[0] in ("modules", "backends")


def _commit_message(manifest: dict) -> str:
    env = manifest["environment"]
    backends = ", ".join(sorted({m["backend"]["name"] for m in manifest["modules"]}))
    return (
        f"xpupack package: {len(manifest['modules'])} module(s) ({backends}), "
        f"torch {env['torch']} on {env['device_type']}"
    )
