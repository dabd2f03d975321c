"""What every command shares: error reporting, ``module:attr`` imports, output helpers."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import NotAModelError, XpupackError

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def handle_errors(command: Callable | None = None, *, exit_code: int = 1) -> Callable:
    """Maps errors to one line on stderr and exit status ``exit_code`` (a traceback only with XPUPACK_DEBUG=1).

    ``@handle_errors`` or ``@handle_errors(exit_code=3)``.
    """
    if command is None:
        return functools.partial(handle_errors, exit_code=exit_code)

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get("XPUPACK_DEBUG") == "1":
                traceback.print_exc()
            label = "error" if isinstance(exc, XpupackError) else f"error ({type(exc).__name__})"
            click.echo(f"{label}: {printable(str(exc), markup=False)}", err=True)  # it may quote a package
            if not isinstance(exc, XpupackError) and os.environ.get("XPUPACK_DEBUG") != "1":
                click.echo("set XPUPACK_DEBUG=1 for the full traceback", err=True)
            sys.exit(exit_code)

    return wrapper


def import_object(reference: str, what: str, *, package: str | Path | None = None) -> Any:
    """Imports ``package.module:attribute``; the current directory is importable, unless it is
    (inside) the package directory ``package``: nothing is ever imported from a package."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise click.BadParameter(
            f"{reference!r} is not MODULE:NAME (e.g. xpupack.examples:tiny_transformer)", param_hint=what
        )
    cwd = Path.cwd().resolve()
    root = Path(package).resolve() if package is not None and Path(package).is_dir() else None
    hint = ""
    if root is not None and cwd.is_relative_to(root):
        # a package's files are data: keep its directory off the path (`python -m` put it first)
        sys.path[:] = [entry for entry in sys.path if not Path(entry or ".").resolve().is_relative_to(root)]
        hint = (
            f" (the current directory is inside the package {package}, which xpupack never imports from: "
            "run from your project directory, or install the module)"
        )
    elif str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}{hint}", param_hint=what) from None
    try:
        value = module
        for part in attribute.split("."):
            value = getattr(value, part)
    except AttributeError:
        raise click.BadParameter(f"{module_name!r} has no attribute {attribute!r}", param_hint=what) from None
    return value


def build_model(factory: Any, reference: str) -> Any:
    """The model that ``factory`` (imported from ``reference``, ``module:function``) builds, called with no
    arguments; `NotAModelError` in one line where it is not a function of none or gives no
    ``torch.nn.Module`` (``os:system`` ended ``bench`` in a raw ``TypeError``)."""
    from torch import nn

    fix = "give a function that takes no arguments and returns the model, such as xpupack.examples:tiny_transformer"
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:  # not callable, or arguments it requires
        why = f"cannot be called without arguments ({exc})" if callable(factory) else "is not a function"
        raise NotAModelError(f"{reference} {why}; {fix}", actual=type(factory).__name__) from None
    except ValueError:  # a builtin without a signature: its call says
        pass
    model = factory()
    if not isinstance(model, nn.Module):
        raise NotAModelError(
            f"{reference} returned a {type(model).__name__}, not a torch.nn.Module; {fix}", actual=type(model).__name__
        )
    return model


def byte_size(n: float) -> str:
    """``1.5 MiB``: a byte count for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def printable(value: Any, *, markup: bool = True) -> Any:
    """Text from a package (which may be hostile), made safe to print: every character Python does not
    call printable (controls such as newline, ESC and the C1 range, format characters such as bidi
    overrides, separators but the space) becomes a visible escape (``\\n``, ``\\x1b``, ``\\u202e``), so a
    package cannot clear the screen, write the clipboard, make links or start a line of its own; with
    ``markup``, rich markup is escaped too, for printing with `console`.

    A dict or list gets the same for every string in it, keys included; other values stay as they are.
    """
    if isinstance(value, dict):
        return {printable(key, markup=markup): printable(item, markup=markup) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable(item, markup=markup) for item in value]
    if not isinstance(value, str):
        return value
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)
    if markup:
        from rich.markup import escape

        text = escape(text)
    return text


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def console(stderr: bool = False):
    """A rich console; wide when not on a terminal, so piped output and logs do not wrap mid-word."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(file=stream, width=width, highlight=False, emoji=False)  # a package's ":name:" stays text


def fold_table(*headers: str):
    """A rich table whose cells fold onto more lines when the terminal is too narrow: a package's names and
    signatures are never cut at "…"."""
    from rich.table import Table

    made = Table(*headers)
    for column in made.columns:
        column.overflow = "fold"
    return made
