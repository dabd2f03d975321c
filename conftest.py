"""Runs the code examples of README.md and docs/*.md as tests (sybil), on the CPU.

What runs, block by block, in the order of the page (the blocks of one page share one namespace and
one working directory, a fresh temporary folder):

- ```` ```python ```` blocks run as written (``>>>`` blocks as doctests);
- ```` ```python title="test_NAME.py" ```` blocks are pytest files: each is written into a folder of
  its own and run by pytest in a fresh process, which must pass (the deploy-after-load examples);
- ```` ```console ```` blocks: every ``$ xpupack ...`` line runs through click's ``CliRunner`` and must
  exit 0; the other lines are what it prints, shown, not compared;
- everything else (``text``, ``bash``, ``pycon``, ``json``, ...) is not run: listings, fragments,
  commands for a shell.

A block that cannot run here (a GPU, a Hub, two ranks) follows ``<!-- skip: next "why" -->`` and is
reported as skipped with that reason. A block that compiles with Inductor or starts a process
follows ``<!-- slow -->``: it gets pytest's ``slow`` mark (and still runs in CI), and so do the blocks
after it on its page, which may use what it made. docs/pending/ holds
notes for the maintainers, not pages: it is not run.
"""

from __future__ import annotations

import atexit
import doctest
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sybil import Example, Region, Sybil
from sybil.integration.pytest import SybilItem
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent
#: environment variables a page's examples get, each pointing into the page's own folder
_ISOLATED = ("HF_HOME", "XPUPACK_CACHE")


#: what xpupack's tests set for the whole run (`pytest_configure`), inherited by pytest-xdist's workers
COMPILER_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def pytest_configure(config):
    """One Inductor and one Triton cache for the whole run, never the user's: a graph that one test, one
    xdist worker or one fresh process compiled is a cache hit for the others. The first process (xdist's
    controller, or the only one) makes them before the workers start, and they inherit them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    folder = tempfile.mkdtemp(prefix="xpupack-tests-compiler-caches-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    _memoize_the_cxx_compiler(folder)


def _memoize_the_cxx_compiler(folder: str) -> None:
    """``CXX`` becomes tests/support/cxx_memo.py's shim: a C++ kernel g++ built for one test (one worker, one fresh
    process with an empty Inductor cache) is not built again for the next. ``XPUPACK_TEST_CXX_MEMO=off`` turns
    it off; set to a folder, the memo lasts between runs (a developer's quick loop)."""
    memo = os.environ.get("XPUPACK_TEST_CXX_MEMO") or os.path.join(folder, "cxx-memo")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if memo == "off" or compiler is None or sys.platform != "linux":
        return
    import torch

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    cpu = Path("/proc/cpuinfo").read_text(errors="replace").partition("flags")[2].partition("\n")[0]
    shim = Path(folder) / "bin" / "g++"  # named so: Inductor picks gcc's flags by the compiler's name
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests/support/cxx_memo.py"}" "$@"\n')
    shim.chmod(0o755)
    os.environ.update(
        CXX=str(shim),
        XPUPACK_TEST_CXX=compiler,
        XPUPACK_TEST_CXX_MEMO=memo,
        XPUPACK_TEST_CXX_SALT=hashlib.sha256(
            "\n".join((version, torch.__version__, torch.__file__, cpu)).encode()
        ).hexdigest(),
        XPUPACK_TEST_CXX_STABLE=os.pathsep.join(
            {os.path.realpath(path) for path in (sys.prefix, sys.base_prefix, os.path.dirname(torch.__file__))}
        ),
    )
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:  # read CXX when it was imported
        inductor_config.cpp.cxx = (None, str(shim))


def _setup(namespace: dict) -> None:
    folder = Path(tempfile.mkdtemp(prefix="xpupack-docs-"))
    namespace["__docs_restore__"] = (
        folder,
        os.getcwd(),
        {name: os.environ.get(name) for name in (*_ISOLATED, "HF_HUB_OFFLINE", *COMPILER_CACHES)},
    )
    for name in _ISOLATED:
        os.environ[name] = str(folder / name.lower())
    os.environ["HF_HUB_OFFLINE"] = "1"  # an example that would reach the Hub fails instead of waiting on it
    os.chdir(folder)


def _teardown(namespace: dict) -> None:
    background = sys.modules.get("xpupack._background")
    if background is not None and background._worker is not None:
        background.wait(600)  # a load's compile off the caller's path reads the package folder
    folder, cwd, environment = namespace.pop("__docs_restore__")
    os.chdir(cwd)
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(folder, ignore_errors=True)


#: the pytest files that passed in this run (README.md and docs/testing.md show the same one)
_PASSED: set[tuple[str, str]] = set()


def _pytest_file(example: Example) -> str | None:
    """Runs a ``python title="test_NAME.py"`` block with pytest in a fresh process; returns why it failed."""
    name, source = example.parsed
    if (name, source) in _PASSED:
        return None
    folder = Path(tempfile.mkdtemp(prefix="xpupack-docs-pytest-", dir=os.getcwd()))
    (folder / name).write_text(source, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        return f"pytest {name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    _PASSED.add((name, source))
    return None


class PytestFileParser:
    """```` ```python title="test_NAME.py" ````: a file for pytest, not a snippet."""

    def __init__(self) -> None:
        self.lexer = FencedCodeBlockLexer(
            r'python title="(?P<file>test_\w+\.py)"', mapping={"file": "file", "source": "source"}
        )

    def __call__(self, document):
        for region in self.lexer(document):
            yield Region(
                region.start, region.end, (region.lexemes["file"], str(region.lexemes["source"])), _pytest_file
            )


def _console(example: Example) -> str | None:
    """Runs every ``$ xpupack ...`` line of a ``console`` block; returns why one failed."""
    from click.testing import CliRunner

    from xpupack.cli import main

    for line in example.parsed.splitlines():
        if not line.startswith("$ "):
            continue  # what the command prints: shown, not compared (timings, paths and sizes vary)
        argv = shlex.split(line[2:], comments=True)
        if argv[:1] != ["xpupack"]:
            return f"only xpupack commands run in a console block (fence other shell commands as bash): {line}"
        result = CliRunner().invoke(main, argv[1:])
        if result.exit_code != 0:
            return f"{line}\nexited {result.exit_code}:\n{result.output}"
    return None


class ConsoleParser:
    def __init__(self) -> None:
        self.lexer = FencedCodeBlockLexer("console", mapping={"source": "source"})

    def __call__(self, document):
        for region in self.lexer(document):
            yield Region(region.start, region.end, str(region.lexemes["source"]), _console)


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS),
        PytestFileParser(),
        ConsoleParser(),
        SkipParser(),
    ],
    patterns=["README.md", "docs/*.md", "docs/**/*.md"],
    excludes=["docs/pending/*", "docs/pending/**/*"],
    setup=_setup,
    teardown=_teardown,
).pytest()


def _comments_before(text: str, start: int) -> list[str]:
    """The HTML comments right above a block (only blank lines between them and it), nearest first."""
    comments, head = [], text[:start].rstrip()
    while head.endswith("-->") and (opening := head.rfind("<!--")) != -1:
        comments.append(head[opening + 4 : -3].strip())
        head = head[:opening].rstrip()
    return comments


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """``<!-- slow -->`` above a block gives its test pytest's ``slow`` mark, and the page's later blocks too:
    they share its namespace and folder (a package it saved), so they cannot run without it. For the same
    reason a page's blocks are one ``xdist_group``: one pytest-xdist worker runs them all, in order."""
    slow_pages = set()
    for item in items:
        if isinstance(item, SybilItem):
            example = item.example
            item.add_marker(pytest.mark.xdist_group(str(Path(example.document.path).relative_to(ROOT))))
            if any(
                comment.split(":")[0].strip() == "slow"
                for comment in _comments_before(example.document.text, example.region.start)
            ):
                slow_pages.add(example.document.path)
            if example.document.path in slow_pages:
                item.add_marker(pytest.mark.slow)
