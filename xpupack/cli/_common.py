"""What every command shares: error reporting, ``module:attr`` imports, output helpers."""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import traceback
from typing import Any, Callable

import click

from ..errors import XpupackError

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def handle_errors(command: Callable) -> Callable:
    """Maps errors to one line on stderr and exit code 1 (a traceback only with XPUPACK_DEBUG=1)."""

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
            click.echo(f"{label}: {exc}", err=True)
            if not isinstance(exc, XpupackError) and os.environ.get("XPUPACK_DEBUG") != "1":
                click.echo("set XPUPACK_DEBUG=1 for the full traceback", err=True)
            sys.exit(1)

    return wrapper


def import_object(reference: str, what: str) -> Any:
    """Imports ``package.module:attribute`` (the current directory is importable)."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise click.BadParameter(f"{reference!r} is not MODULE:NAME (e.g. xpupack.examples:tiny_transformer)",
                                 param_hint=what)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}", param_hint=what) from None
    try:
        value = module
        for part in attribute.split("."):
            value = getattr(value, part)
    except AttributeError:
        raise click.BadParameter(f"{module_name!r} has no attribute {attribute!r}", param_hint=what) from None
    return value


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def console(stderr: bool = False):
    """A rich console; wide when not on a terminal, so piped output and logs do not wrap mid-word."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(file=stream, width=width, highlight=False)
