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


def test_ci_runs_the_language_model_tests_on_the_oldest_transformers_the_test_extra_allows():
    """`.ci/run` runs the language-model tests a second time on the oldest transformers supported: the
    version it installs is the test extra's lower bound, so raising one without the other fails here."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (bound,) = [
        re.fullmatch(r"transformers>=([\d.]+)", requirement)[1]
        for requirement in extra
        if requirement.startswith("transformers")
    ]
    pinned = re.search(r"^oldest_transformers=([\d.]+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert pinned is not None
    assert tuple(map(int, pinned[1].split("."))) == tuple(map(int, (bound + ".0").split(".")[:3]))
