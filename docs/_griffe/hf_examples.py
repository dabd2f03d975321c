"""A griffe extension for the API reference: the Hugging Face docstring style's ``Example:`` section.

The code's docstrings follow the Hugging Face style (STYLE.md), whose examples sit under ``Example:``;
griffe's Google parser knows only ``Examples:`` and would render ``Example:`` as a note of plain
Markdown, where ``x["a"]["b"]`` reads as a link. Renamed here, they render as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class HuggingFaceExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
