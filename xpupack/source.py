"""Where a package comes from, as a value: its directory on disk and whether its compiled code may run
(`xpupack.hub.resolve_source` makes one), and the rule that reads a name given for a package as a local
folder or a Hub repo id (docs/hub.md, "Naming a package").

The rule, in full (`read_name`):

- a ``pathlib.Path`` (any ``os.PathLike``) is a folder;
- ``"hf://org/name"`` (or ``"hf://name"``) is a Hub repo;
- a string that is absolute, starts with ``./``, ``../`` or ``~``, is ``.`` or ``..``, or ends with ``/``
  is a folder;
- a plain ``"org/name"``, two segments that can be a Hub repo id, is a Hub repo; a folder of that name
  here does not change that: the loader refuses such a name (`AmbiguousSourceError`) rather than guess;
- anything else (``"tiny-pkg"``, ``"out/x/pkg"``, a name no repo id can have) is a folder.

A folder is trusted to run its compiled artifacts and a Hub repo only when pinned, so a name the user
gave as a repo id must never end up reading a folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import SourceError

#: the explicit form of a Hub repo: ``hf://org/name`` (huggingface_hub's file-system paths start so too)
HUB_PREFIX = "hf://"

#: a Hub repo id as huggingface_hub validates one: ``name`` or ``org/name``, letters, digits, ``-_.``
_REPO_ID = re.compile(r"[\w.-]{1,96}(?:/[\w.-]{1,96})?")


@dataclass
class Source:
    """A package directory on disk and whether its compiled artifacts may run (docs/safety.md)."""

    root: Path
    trusted: bool
    links_within: Path | None = None
    description: str = ""
    #: why the compiled artifacts may (or may not) run, shown by `inspect`
    trust_reason: str = ""
    #: files the manifest does not list are ignored rather than refused (a Hub snapshot may hold
    #: the repo's other files: a LICENSE, its model card); they are never read
    ignore_unlisted: bool = False

    @property
    def untrusted_why(self) -> str:
        """Why the compiled artifacts may not run, for messages."""
        return (
            self.trust_reason
            if not self.trusted and self.trust_reason
            else f"{self.description or self.root} is not pinned by commit hash"
        )


@dataclass(frozen=True)
class SourceName:
    """What a name given for a package names: a local ``folder`` or a Hub ``repo_id`` (one of the two)."""

    given: str
    folder: Path | None = None
    repo_id: str | None = None
    #: a Hub repo named by a plain ``"org/name"``, which reads as a relative folder too: the loader
    #: refuses it when that folder exists, and its errors say that no such folder exists here
    plain: bool = False


def is_repo_id(text: str) -> bool:
    """Whether ``text`` can be a Hub repo id (``name`` or ``org/name``), as huggingface_hub validates one."""
    return (
        _REPO_ID.fullmatch(text) is not None
        and "--" not in text
        and ".." not in text
        and not text.endswith(".git")
        and len(text) <= 96
        and not any(part.startswith((".", "-")) or part.endswith((".", "-")) for part in text.split("/"))
    )


def read_name(path: str | os.PathLike) -> SourceName:
    """Reads a package name by the rule in this module's docstring.

    Raises:
        SourceError: not a string or path, empty, or ``hf://`` followed by no valid repo id.
    """
    if isinstance(path, os.PathLike):
        return SourceName(os.fspath(path), folder=Path(path).expanduser())
    if not isinstance(path, str):
        raise SourceError(
            f"a package is named by a str or a pathlib.Path, not {type(path).__name__} {path!r}", source=repr(path)
        )
    if not path:
        raise SourceError("the package name is empty; give a folder ('./pkg') or a Hub repo ('org/name')", source=path)
    if path.startswith(HUB_PREFIX):
        repo_id = path[len(HUB_PREFIX) :]
        if not is_repo_id(repo_id):
            raise SourceError(
                f"{path!r} names no Hub repo: a repo id is 'org/name' (letters, digits, '-', '_', "
                "'.'), as in 'hf://org/name'",
                source=path,
            )
        return SourceName(path, repo_id=repo_id)
    if (
        path in (".", "..")
        or path.startswith(("./", "../", "~"))
        or path.endswith("/")
        or os.path.isabs(path)
        or (os.sep != "/" and (path.startswith((f".{os.sep}", f"..{os.sep}")) or path.endswith(os.sep)))
    ):
        return SourceName(path, folder=Path(path).expanduser())
    if path.count("/") == 1 and is_repo_id(path):
        return SourceName(path, repo_id=path, plain=True)
    return SourceName(path, folder=Path(path))


def local_folder(path: str | os.PathLike, *, what: str = "the package folder") -> Path:
    """The folder ``path`` names, for a command that reads only folders (`xpupack.push`'s package).

    Raises:
        SourceError: ``path`` names a Hub repo (a plain ``"org/name"`` or ``"hf://..."``).
    """
    name = read_name(path)
    if name.folder is None:
        fix = f"'./{name.repo_id}' or pathlib.Path({name.repo_id!r})" if name.plain else "a folder"
        raise SourceError(
            f"{what} {name.given!r} names the Hub repo {name.repo_id}, not a folder; name the folder as {fix}",
            source=name.given,
            repo_id=name.repo_id,
        )
    return name.folder
