"""A griffe extension for the API reference: the Hugging Face docstring style's ``Example:`` section.

The code's docstrings follow the Hugging Face style (STYLE.md), whose examples sit under ``Example:``;
griffe's Google parser knows only ``Examples:`` and would render ``Example:`` as a note of plain
Markdown, where ``x["a"]["b"]`` reads as a link. Renamed here, ``>>>`` examples render as code; an
example written as plain code (a test function, say) is fenced as Python so that it does too.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_TITLE = re.compile(r"^(?P<indent>[ \t]*)Examples?:[ \t]*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def hugging_face_examples(text: str) -> str:
    """``text`` with each ``Example:`` section titled ``Examples:`` and its plain code fenced as Python."""
    lines, out, index = text.splitlines(), [], 0
    while index < len(lines):
        match = _TITLE.match(lines[index])
        if match is None:
            out.append(lines[index])
            index += 1
            continue
        indent = len(match["indent"])
        end = index + 1
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        body = lines[index + 1 : end]
        while body and not body[-1].strip():
            body.pop()
        out.append(f"{match['indent']}Examples:")
        first = next((line for line in body if line.strip()), "")
        if body and not first.lstrip().startswith(">>>"):
            inner = " " * _indent(first)
            body = [f"{inner}```python", *body, f"{inner}```"]
        out.extend(body)
        if end < len(lines):
            out.append("")  # the blank line that ended the section
        index = end
    return "\n".join(out)


class HuggingFaceExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = hugging_face_examples(obj.docstring.value)
