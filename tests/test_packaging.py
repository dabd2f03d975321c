"""The project's own metadata: what CI installs (`.ci/run`: ``pip install -e '.[test]'``) must run every test."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_package_a_test_skips_without_is_in_the_test_extra():
    """A test that ``pytest.importorskip``s a package is skipped silently in CI unless the extra installs it."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    installed = {re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower().replace("_", "-") for requirement in extra}
    skipped_without = {
        match.split(".")[0].replace("_", "-")
        for path in (ROOT / "tests").rglob("*.py")
        for match in re.findall(r"importorskip\(\s*[\"']([A-Za-z0-9_.]+)", path.read_text())
    }
    assert skipped_without and skipped_without <= installed, sorted(skipped_without - installed)
