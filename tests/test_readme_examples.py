"""The README's first two commands, which CI and the docs rely on: they stay first, unchanged, and work.

The README's and docs/' other examples run as tests of their own (sybil, ``conftest.py`` at the root).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from xpupack.cli import main

ROOT = Path(__file__).resolve().parent.parent
INSTALL_AND_BUILD = "\n".join(
    [
        "python -m venv .venv && . .venv/bin/activate",
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "pip install -e '.[test]'",
        "xpupack build xpupack.examples:tiny_decoder --samples xpupack.examples:tiny_decoder_samples "
        "--modules 'layers.*' --out demo-pkg",
    ]
)
TEST = "python -m pytest -q"


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of a Markdown file, in order."""
    return re.findall(r"^```(\S*)[^\n]*\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def test_the_readme_starts_with_the_install_and_build_command_then_the_test_command():
    assert fenced_blocks(ROOT / "README.md")[:2] == [("bash", INSTALL_AND_BUILD + "\n"), ("bash", TEST + "\n")]


def test_getting_started_starts_with_the_same_two_commands():
    assert fenced_blocks(ROOT / "docs" / "getting-started.md")[:2] == [
        ("bash", INSTALL_AND_BUILD + "\n"),
        ("bash", TEST + "\n"),
    ]


def test_ci_runs_the_readmes_test_command_and_builds_the_docs_strictly():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert TEST in ci
    assert "mkdocs build --strict" in ci


def test_the_readme_stays_a_front_door_of_at_most_200_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_the_readmes_links_into_docs_name_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert links and [link for link in links if not (ROOT / link).is_file()] == []


@pytest.mark.slow
def test_the_readmes_build_command_builds_the_demo_package_and_says_what_each_block_got(tmp_path, monkeypatch):
    """The ``xpupack build`` of the first command, as written (its default strategy compiles with Inductor).

    It ends with each block's backend and its speed over eager as timed: which backend wins is the
    machine's to say (no timing threshold here), but Inductor must have built, matched eager and been
    timed for both blocks (benchmarks/ measure the speed-up itself)."""
    monkeypatch.chdir(tmp_path)
    build = shlex.split(INSTALL_AND_BUILD.splitlines()[-1])
    assert build[0] == "xpupack"
    result = CliRunner().invoke(main, build[1:])
    assert result.exit_code == 0, result.output
    figure = r"\d+\.\d\dx"
    lines = result.stdout.splitlines()
    assert lines[-5] == "chosen, and each module's speed over eager on the samples' calls (timed during this build):"
    for block, line in zip(("layers.0", "layers.1"), lines[-4:-2], strict=True):
        assert re.fullmatch(
            rf"  {block}: (inductor, {figure} eager \(95% interval .*\)"
            rf"|eager \(the fastest candidate, inductor, ran at {figure} eager's speed\))",
            line,
        ), line
    assert re.fullmatch(rf"  together: {figure} eager's speed", lines[-2]) and lines[-1].startswith("wrote demo-pkg")
    verified = CliRunner().invoke(main, ["verify", "demo-pkg"])
    assert verified.exit_code == 0, verified.output
