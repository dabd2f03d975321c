"""Where a package comes from, as a value: its directory on disk and whether its compiled code may run
(`xpupack.hub.resolve_source` makes one from a local path or a Hub repo id)."""

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
