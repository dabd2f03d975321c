"""The README's examples that a user copies into a project run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block_after(heading: str) -> str:
    """The first fenced Python block of the README section that starts with ``heading``."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no Python block after {heading!r}"
    return match.group(1)


@pytest.mark.slow
def test_the_deploy_after_load_example_is_a_real_deploy_test(pytester):
    """The example tunes the demo with Inductor (compiled once, in a module fixture), then loads the
    package and checks that a recorded batch serves without a fallback and an unseen one falls back."""
    pytester.makepyfile(test_deploy=python_block_after("### Deploy-after-load tests"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2)
