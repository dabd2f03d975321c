"""The public API documents itself: the API reference of the docs is generated from these docstrings
(Google style, the "Args:" section names each parameter)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import xpupack

#: the extension points a backend or strategy of one's own implements (docs/tuning.md; `xpupack.backends`)
EXTENSION_POINTS = [
    "backends.base.Runner.run",
    "backends.base.Backend.build",
    "backends.base.Backend.save",
    "backends.base.Backend.restore",
    "backends.base.Backend.save_shared",
    "backends.base.Backend.restore_shared",
    "strategies.Strategy.choose",
]


def documented_parameters(docstring: str) -> set[str]:
    """The names the "Args:" section of a Google-style docstring documents (``name:`` or ``name (type):``
    at the section's first indentation; ``*args``/``**kwargs`` without their stars)."""
    lines = inspect.cleandoc(docstring).splitlines()
    names: set[str] = set()
    for start, line in enumerate(lines):
        if line.strip() != "Args:":
            continue
        indent = None
        for entry in lines[start + 1 :]:
            if not entry.strip():
                continue
            width = len(entry) - len(entry.lstrip())
            if width <= len(line) - len(line.lstrip()):
                break  # the next section
            indent = width if indent is None else indent
            match = re.match(r"\*{0,2}(\w+)\s*(\([^)]*\))?:", entry.strip())
            if width == indent and match:
                names.add(match.group(1))
    return names


def undocumented_parameters(obj) -> list[str]:
    """The parameters of a function (or of a class's constructor) that its docstring does not name; a
    class may document them in its own docstring, its ``__init__``'s, or those of the class that
    defines the ``__init__`` it inherits."""
    if not inspect.isclass(obj):
        function, docstrings = obj, [inspect.getdoc(obj)]
    else:
        function = obj.__init__
        owner = next(cls for cls in obj.__mro__ if "__init__" in vars(cls))
        if owner.__module__ == "builtins":
            return []  # object's or Exception's constructor: nothing of xpupack's to document
        docstrings = [inspect.getdoc(obj), owner.__doc__, function.__doc__]
    named = documented_parameters("\n".join(inspect.cleandoc(text) for text in docstrings if text))
    return [
        name for name in inspect.signature(function).parameters if name not in ("self", "cls") and name not in named
    ]


def public_objects():
    for name in xpupack.__all__:
        if name != "__version__":
            yield name, getattr(xpupack, name)


def extension_point(dotted: str):
    """``"strategies.Strategy.choose"`` -> the function ``xpupack.strategies.Strategy.choose``."""
    *modules, cls, method = dotted.split(".")
    return getattr(getattr(importlib.import_module(".".join(["xpupack", *modules])), cls), method)


@pytest.mark.parametrize("name", [name for name in xpupack.__all__ if name != "__version__"])
def test_every_public_name_has_a_docstring_with_a_summary_line(name):
    docstring = inspect.getdoc(getattr(xpupack, name))
    assert docstring, f"xpupack.{name} has no docstring"
    summary = docstring.split("\n\n")[0]  # the first paragraph: what the reference lists under the name
    assert summary.strip().endswith("."), f"xpupack.{name}: the docstring opens with no summary sentence: {summary!r}"


def test_every_public_callable_documents_each_of_its_parameters():
    missing = {
        f"xpupack.{name}": gaps
        for name, obj in public_objects()
        if callable(obj) and (gaps := undocumented_parameters(obj))
    }
    assert not missing, f"parameters missing from the Args: section: {missing}"


@pytest.mark.parametrize("dotted", EXTENSION_POINTS)
def test_each_extension_point_documents_its_parameters_and_what_it_returns(dotted):
    method = extension_point(dotted)
    docstring = inspect.getdoc(method) or ""
    assert not undocumented_parameters(method), f"{dotted}: {undocumented_parameters(method)} undocumented"
    if inspect.signature(method).return_annotation not in ("None", None):
        assert "Returns:" in docstring, f"{dotted} does not say what it returns"


def test_the_parameter_check_finds_a_parameter_the_docstring_leaves_out():
    def documented(model, *, device=None, **options):
        """Does something.

        Args:
            model: the model.
            **options: more.
                device: not at the section's indentation, so not a parameter entry.
        """

    assert undocumented_parameters(documented) == ["device"]


def test_no_docstring_puts_doctest_lines_under_an_example_admonition():
    """griffe reads "Example:" as an admonition of Markdown, where ``>>>`` becomes nested block quotes (and
    ``x["a"]["b"]`` a broken reference under ``mkdocs build --strict``); "Examples:" renders them as code."""
    package = Path(xpupack.__file__).parent
    offenders = [
        f"{path.relative_to(package.parent)}:{text[: match.start()].count(chr(10)) + 1}"
        for path in sorted(package.rglob("*.py"))
        for text in [path.read_text(encoding="utf-8")]
        for match in re.finditer(r"^[ \t]*Example:[ \t]*\n[ \t]*>>>", text, re.M)
    ]
    assert not offenders, f"title these sections Examples: {offenders}"


ROOT = Path(__file__).resolve().parents[1]


def test_every_documentation_reference_in_the_code_names_a_page_or_section_that_exists():
    """The README once held the guide; references to its old sections (the README's section "Cold start")
    went stale when the guide moved to docs/ (issue 31). Code and tests name a docs page
    (``docs/cold-start.md``), with a quoted heading or bold paragraph lead of that page where they point
    into one, or a section the README still has (a quoted "docs/x.md" is a file name, not a reference)."""
    readme_sections = set(re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M))
    problems = []
    for path in sorted(path for folder in ("xpupack", "benchmarks", "tests") for path in (ROOT / folder).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        for name in re.findall(r'README\W{0,3}"([^"]+)"', text):
            if " ".join(name.split()) not in readme_sections:
                problems.append(f'{where}: README has no section "{name}"')
        for page, heading in re.findall(r'(?<!["\'])(docs/[\w-]+\.md)(?:, "([^"]+)")?', text):
            if not (ROOT / page).is_file():
                problems.append(f"{where}: no page {page}")
            elif heading and not re.search(  # a heading, or a paragraph's bold lead ("**Remembered verifications.**")
                rf"^#+ {re.escape(heading)}$|\*\*{re.escape(heading)}[.:*]", (ROOT / page).read_text(), re.M
            ):
                problems.append(f'{where}: {page} has no heading "{heading}"')
    assert not problems, "\n".join(problems)
