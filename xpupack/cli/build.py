"""``xpupack build``: tune a model from a factory and samples, write a package."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import NoCandidateError
from ..source import read_name
from ._common import build_model, console, handle_errors, import_object, printable

if TYPE_CHECKING:
    from rich.console import Console


#: backends that take another as ``base=``: ``graph+torchao:int8-weight-only`` records the quantized
#: module as a device graph, ``inductor+torchao:int8-weight-only`` compiles it
_COMPOSERS = ("graph", "inductor")


def parse_backends(text: str):
    """``"graph,inductor,eager"`` -> backend instances; ``name:argument`` passes one argument
    (``torchao:int8-weight-only``); ``graph+name:argument`` records that backend as a device graph,
    ``inductor+name:argument`` compiles it."""
    from ..backends.base import known_backends

    known = known_backends()

    def one(item: str):
        name, _, argument = item.partition(":")
        if name not in known:
            raise click.BadParameter(
                f"unknown backend {name!r}; choose from {', '.join(sorted(known))}", param_hint="--backends"
            )
        if argument and name == "graph":
            raise click.BadParameter(
                f"{item!r}: graph takes no argument; graph+NAME records another backend "
                "(graph+inductor, graph+torchao:int8-weight-only)",
                param_hint="--backends",
            )
        try:
            return known[name](argument) if argument else known[name]()
        except (ValueError, TypeError) as exc:  # the backend's own refusal of the argument
            raise click.BadParameter(f"{item!r}: {exc}", param_hint="--backends") from None

    backends = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        outer, plus, inner = item.partition("+")
        if plus and outer in _COMPOSERS:
            try:
                backends.append(known[outer](base=one(inner)))
            except ValueError as exc:
                raise click.BadParameter(f"{item!r}: {exc}", param_hint="--backends") from None
        else:
            backends.append(one(item))
    if not backends:
        raise click.BadParameter("name at least one backend", param_hint="--backends")
    return backends


def _ratio(text: str, option: str = "--min-speedup") -> float | None:
    """``--min-speedup`` (above 0) or ``--startup-margin`` (at least 1), checked here so that the error names
    the option rather than the strategy's keyword."""
    if text.strip().lower() == "none":
        return None
    example, low = ("1.0", 0.0) if option == "--min-speedup" else ("1.05", 1.0)
    try:
        value = float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: give a number such as {example}, or none", param_hint=option) from None
    if not (value > low if option == "--min-speedup" else value >= low):  # NaN fails both
        bound = "above 0" if option == "--min-speedup" else "of at least 1"
        raise click.BadParameter(f"{text!r}: give a number {bound} such as {example}, or none", param_hint=option)
    return value


def _in_options(error: NoCandidateError, backends: str | None) -> NoCandidateError:
    """A strategy's `NoCandidateError` said in the command line's terms: one line, the fix named as options."""
    refusals = "; ".join(f"{backend}: {reason}" for backend, reason in error.refusals)
    listed = f"--backends {backends},eager" if backends else "--backends ...,eager"
    fix = f"add eager to --backends ({listed}) to keep such modules untuned"
    if error.too_slow:
        fix += ", or pass --min-speedup none to keep candidates slower than eager"
    return NoCandidateError(
        f"no backend could tune {error.path or '<model>'} — {refusals}; {fix}",
        path=error.path,
        refusals=error.refusals,
        too_slow=error.too_slow,
    )


def _sizes(text: str) -> list[int]:
    from ..padding import MAX_BATCH_SIZE  # build imports torch anyway

    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or not all(1 <= size <= MAX_BATCH_SIZE for size in sizes):
        raise click.BadParameter(
            f"{text!r}: give batch sizes separated by commas, each from 1 to {MAX_BATCH_SIZE}, e.g. 1,2,4,8",
            param_hint="--batch-sizes",
        )
    return sizes


def _quantize(text: str | None, search: str, backends: str | None) -> bool | list[str]:
    """``--quantize``: False, True (``all``) or the config names, checked before minutes of tuning."""
    if search == "thorough" and backends is not None:
        raise click.BadParameter(
            "--backends names the candidates itself; --search thorough tries xpupack's own: pass one or the other",
            param_hint="--search",
        )
    if text is None:
        return False
    if search != "thorough":
        raise click.BadParameter(
            "--quantize adds TorchAO configurations to the thorough search: add --search "
            "thorough, or name torchao backends in --backends (torchao:int8-weight-only)",
            param_hint="--quantize",
        )
    if text.strip().lower() == "all":
        return True
    from ..searches import quantized_backends

    names = [name.strip() for name in text.split(",") if name.strip()]
    try:
        quantized_backends(names or [text])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--quantize") from None
    return names


def outcome_lines(modules: list[dict]) -> list[str]:
    """What each module got and its speed over eager as the build timed it (the candidates of
    `package_report`'s modules), then the tuned modules' speed together: how long their recorded calls
    take eager over how long they take tuned, summed over the modules whose eager time is known."""
    lines = ["chosen, and each module's speed over eager on the samples' calls (timed during this build):"]
    eager_us = tuned_us = 0.0
    for module in modules:
        path, candidates = module["path"] or "<model>", module["candidates"]
        chosen = next((c for c in candidates if c["status"] == "chosen"), {"backend": module["backend"]})
        timed = [c for c in candidates if c.get("speedup") is not None and c.get("median_us") is not None]
        if chosen.get("speedup") is not None and chosen.get("median_us") is not None:
            low, high = chosen["speedup_interval"]
            lines.append(
                f"  {path}: {chosen['backend']}, {chosen['speedup']:.2f}x eager (95% interval {low:.2f}-{high:.2f}x)"
            )
            eager_us += chosen["median_us"] * chosen["speedup"]
            tuned_us += chosen["median_us"]
        elif module["backend"] == "eager" and timed:
            best = max(timed, key=lambda c: c["speedup"])
            faster = f"{best['backend']}, ran at {best['speedup']:.2f}x eager's speed"
            lines.append(f"  {path}: eager (the fastest candidate, {faster})")
            eager_us += best["median_us"] * best["speedup"]
            tuned_us += best["median_us"] * best["speedup"]  # it runs eager: eager's time on both sides
        elif module["backend"] == "eager":
            refused = [f"{c['backend']}: {c['reason']}" for c in candidates if c["status"] == "rejected"]
            lines.append(f"  {path}: eager" + (f" ({'; '.join(refused)})" if refused else ""))
        else:
            lines.append(f"  {path}: {chosen['backend']}, not timed against eager (the speed gate was off)")
    if tuned_us > 0:
        lines.append(f"  together: {eager_us / tuned_us:.2f}x eager's speed")
    return lines


#: a number that ends a progress message: what changes from one to the next while one step counts up
_COUNTER = re.compile(r"\d+$")


@contextlib.contextmanager
def _progress(out: Console, first: str) -> Iterator[Callable[[str], None]]:
    """Shows a build's progress messages: on a terminal as one status line that each message replaces;
    elsewhere (CI, a log) as a line each on stderr, except a message that only counts up from the one
    before it (``recording sample 2`` after ``recording sample 1``)."""
    if out.is_terminal:
        with out.status(first) as status:
            yield status.update
        return
    previous = None

    def line(message: str) -> None:
        nonlocal previous
        step = _COUNTER.sub("", message)
        if step != previous:
            click.echo(message, err=True)
        previous = step

    line(first)
    yield line


@click.command()
@click.argument("model_factory", metavar="MODULE:FACTORY")
@click.option(
    "--samples",
    "samples_factory",
    required=True,
    metavar="MODULE:FN",
    help="Function returning the sample inputs (an iterable; each item a tensor, tuple or dict).",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Package directory to write (an existing package there is replaced atomically).",
)
@click.option(
    "--modules",
    "modules",
    multiple=True,
    metavar="GLOB",
    help="Submodules to tune, as globs over named_modules() object paths (repeatable), e.g. "
    "'layers.*.mlp'. '*' matches one dot-separated segment ('model.layers.*' selects "
    "model.layers.0, not model.layers.0.self_attn), '**' any number of segments, none "
    "included ('**.mlp'). A module and one inside it cannot both be selected. "
    "Default: the whole model as one unit.",
)
@click.option("--device", default=None, help="xpu, cuda, cuda:1 or cpu. Default: the best device here.")
@click.option(
    "--backends",
    "backends",
    default=None,
    help="Candidate backends in order of preference, comma-separated; NAME:ARG passes one "
    "argument (torchao:int8-weight-only), graph+NAME / inductor+NAME record or compile "
    "that backend's module (graph+inductor, graph+torchao:int8-weight-only). "
    "Default: graph+inductor,graph,inductor,eager on a GPU; graph,inductor,eager elsewhere.",
)
@click.option(
    "--strategy",
    type=click.Choice(["first-wins", "fastest"]),
    default="first-wins",
    show_default=True,
    help="first-wins keeps the first backend that matches eager; fastest times all that match and keeps the fastest.",
)
@click.option(
    "--min-speedup",
    "min_speedup",
    default="1.0",
    show_default=True,
    metavar="RATIO|none",
    help="Reject a candidate (other than eager) unless it runs the samples' calls more than RATIO "
    "times as fast as eager; 'none' keeps slower ones (quantizing for size, say).",
)
@click.option(
    "--startup-margin",
    "startup_margin",
    default="1.05",
    show_default=True,
    metavar="RATIO|none",
    help="first-wins: a candidate with compiled code (graph+inductor) is kept only when it runs the "
    "calls RATIO times as fast as the next candidate without it (the plain graph), since its "
    "compiled code costs seconds on a fresh server; 'none': the first to pass wins.",
)
@click.option(
    "--search",
    type=click.Choice(["quick", "thorough"]),
    default="quick",
    show_default=True,
    help="quick: the candidates above, as --strategy says; thorough: every candidate checked and timed, "
    "the fastest kept (with --min-speedup and --startup-margin): Inductor's default settings, "
    "coordinate descent (GPU) and max-autotune, each recorded as a device graph on a GPU, then the "
    "plain graph, Inductor and eager; with --quantize, TorchAO configurations too.",
)
@click.option(
    "--quantize",
    default=None,
    metavar="CONFIG,...|all",
    help="With --search thorough: also try these TorchAO configurations (int8-weight-only,"
    "float8-weight-only,int4-weight-only...), or 'all' for those three, each where the device "
    "has it. Quantization changes numerics: off unless given.",
)
@click.option(
    "--batch-sizes",
    "batch_sizes",
    default=None,
    metavar="N,N,...",
    help="Also record these batch sizes, made from each sample by repeating or cutting its rows "
    "(xpupack.tune's batch_sizes), e.g. 1,2,4,8,16,24,32: smaller batches are padded up to them.",
)
@click.option(
    "--batch-axis",
    "batch_axis",
    type=int,
    default=None,
    metavar="AXIS",
    help="The samples' batch axis for --batch-sizes (default 0); 1 for token ids [batch, length] makes "
    "--batch-sizes sequence-length buckets that shorter sequences are padded up to.",
)
@click.option("--no-weights", is_flag=True, help="Do not store the weights; loaders keep their model's own.")
@click.option(
    "--max-shard-size",
    "max_shard_size",
    default="5GB",
    show_default=True,
    metavar="SIZE",
    help="Weights past this size are written as shards model-0000k-of-0000n.safetensors with "
    "model.safetensors.index.json (the Hugging Face layout): bytes, or e.g. 500MB, 5GB, 2GiB.",
)
@handle_errors
def build(
    model_factory,
    samples_factory,
    out,
    modules,
    device,
    backends,
    strategy,
    min_speedup,
    startup_margin,
    search,
    quantize,
    batch_sizes,
    batch_axis,
    no_weights,
    max_shard_size,
):
    """Tune MODULE:FACTORY's model on its samples and write a package to --out.

    \b
    Example:
      xpupack build xpupack.examples:tiny_decoder \\
          --samples xpupack.examples:tiny_decoder_samples --modules 'layers.*' --out demo-pkg
    """
    from ..manifest import check_destination, destination
    from ..shards import parse_size

    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    sizes = _sizes(batch_sizes) if batch_sizes is not None else None
    configs = _quantize(quantize, search, backends)
    gate, margin = _ratio(min_speedup), _ratio(startup_margin, "--startup-margin")
    check_destination(destination(out))  # before minutes of tuning: save would refuse it after them
    out_console = console()
    started = time.perf_counter()
    if device is not None:
        from ..environment import resolve_device

        resolve_device(device)  # before minutes of tuning
    make_model = import_object(model_factory, "MODULE:FACTORY", package=out)
    make_samples = import_object(samples_factory, "--samples", package=out)
    with _progress(out_console, "importing torch") as progress:
        import xpupack

        from .. import _device
        from ..searches import default_backends, search_strategy

        device = _device.resolve(device)
        if strategy == "fastest" and search != "thorough":
            candidates = parse_backends(backends) if backends is not None else default_backends(device)
            chosen = xpupack.Fastest(candidates, min_speedup=gate)
        elif backends is not None:
            chosen = xpupack.FirstWins(parse_backends(backends), min_speedup=gate, startup_margin=margin)
        else:  # xpupack's own candidates, as tune(search=..., quantize=...) takes them
            chosen = search_strategy(search, device, configs, min_speedup=gate, startup_margin=margin)
        progress("building the model")
        model = build_model(make_model, model_factory)
        samples = make_samples()
        try:
            xpupack.tune(
                model,
                samples,
                modules=list(modules) or None,
                device=device,
                strategy=chosen,
                batch_sizes=sizes,
                batch_axis=batch_axis,
                progress=progress,
            )
        except NoCandidateError as exc:
            if not exc.refusals:  # `Only`'s own reason: nothing the options name
                raise
            raise _in_options(exc, backends) from exc
        progress(f"writing {out}")
        xpupack.save(model, out, weights=not no_weights, max_shard_size=shard_bytes)

    from ..report import package_report
    from .inspect import print_report

    report = package_report(Path(out), device)
    print_report(report, out_console)
    for line in outcome_lines(printable(report["modules"])):  # module paths and reasons, escaped as inspect's
        out_console.print(line)
    out_console.print(
        f"[green]wrote {out}[/green] in {time.perf_counter() - started:.1f} s"
        + (
            ""
            if read_name(out).folder is not None
            else f"; name it './{out}' to load, inspect or push it ('{out}' alone names a Hub repo)"
        )
    )
