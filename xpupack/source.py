"""Where a package comes from: a local directory or a Hub repo, and whether its compiled code may run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Source:
    """A package directory on disk and whether its compiled artifacts may run (README: "Safety and reliability")."""

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
        return self.trust_reason if not self.trusted and self.trust_reason else \
            f"{self.description or self.root} is not pinned by commit hash"


def resolve_source(path: str | Path, *, revision: str | None = None, trust_compiled: bool = False,
                   token: str | bool | None = None) -> Source:
    """A local package directory as is (trusted); anything else is looked up on the Hub."""
    local = Path(path).expanduser()
    if local.exists() or revision is None and _looks_local(str(path)):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {path} is a local directory")
        return Source(local, trusted=True, description=str(local), trust_reason="local directory")
    from .hub import download

    return download(str(path), revision=revision, trust_compiled=trust_compiled, token=token)


def _looks_local(text: str) -> bool:
    """Paths that cannot be ``org/name`` repo ids."""
    return text.startswith((".", "/", "~")) or text.count("/") != 1
