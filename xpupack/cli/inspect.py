"""``xpupack inspect`` and ``xpupack verify``: look at a package without loading a model."""

from __future__ import annotations

import sys

import click

from ..candidate import Candidate
from ._common import byte_size, console, echo_json, fold_table, handle_errors, json_option, printable

_revision = click.option("--revision", default=None, help="Hub revision (branch, tag or commit hash).")
_on_mismatch = click.option(
    "--on-mismatch",
    "on_mismatch",
    type=click.Choice(["rebuild", "fallback", "error"]),
    default="rebuild",
    show_default=True,
    help="Report what xpupack.load(..., on_mismatch=...) does with this setting.",
)


def _source(package: str, revision: str | None):
    from ..hub import resolve_source

    return resolve_source(package, revision=revision)


def print_report(report: dict, out) -> None:
    """Renders `package_report` as tables, every string in it escaped (`printable`): it comes from the package."""
    report = printable(report)
    env = report["environment"]
    out.print(
        f"[bold]{report['package']}[/bold]  format {report['format_version']}, "
        f"xpupack {report['xpupack_version']}, built {report['created']} on {report['device']}"
    )
    out.print(
        f"environment: torch {env['torch']}, torchao {env.get('torchao')}, triton {env.get('triton')}, "
        f"python {env['python']}, {env['device_type']} {env['device_name']}"
        + (f" ({env['architecture']})" if env.get("architecture") else "")
        + _threads(env)
    )
    out.print(
        f"model: {report['model']['class']}, {report['model']['tensors']} tensors, "
        f"{_weights(report['model'])}; package {byte_size(report['total_bytes'])}"
        + (
            f"; recordings at build {byte_size(report['recording_memory_bytes'])}"
            if report["recording_memory_bytes"]
            else ""
        )
    )
    if len(report["devices"]) > 1:
        out.print(
            "device slots (xpupack.load(..., device_map={slot: device})): "
            + ", ".join(f"{slot}: built on {device}" for slot, device in enumerate(report["devices"]))
        )
    if report.get("inductor_artifacts"):
        out.print(_inductor_line(report["inductor_artifacts"]))
    out.print(_trust_line(report))
    compiled = _compiled_code_line(report)
    if compiled:
        out.print(compiled)
    quantized = _quantization_line(report)
    if quantized:
        out.print(quantized)
    table = fold_table("module", "backend", "signatures", "candidates", "on load here", "size")
    for module in report["modules"]:
        candidates = "\n".join(Candidate.from_json(entry).summary() for entry in module["candidates"])
        signatures = "\n".join(module["signatures"]) or "—"
        if module.get("padding"):
            signatures += "\n" + module["padding"]
        recorded = module.get("recorded")
        if recorded:
            signatures += f"\nrecordings: {byte_size(recorded['memory_bytes'])}" + (
                f" (max_memory {byte_size(recorded['max_memory'])})" if "max_memory" in recorded else ""
            )
            signatures += "".join(f"\nskipped {sig}: {why}" for sig, why in recorded.get("skipped", {}).items())
        if module["unrecordable"]:
            signatures += "\n" + "\n".join(f"{n}× {why}" for why, n in module["unrecordable"].items())
        name = module["path"] or "<model>"
        if len(report["devices"]) > 1:
            name += f"\nslot {module['device_slot']}"
        backend = "\n".join([module.get("label") or module["backend"], *module.get("settings", [])])
        table.add_row(name, backend, signatures, candidates, module["on_load"], byte_size(module["size_bytes"]))
    out.print(table)


def _threads(env: dict) -> str:
    """``, 2 CPU threads`` for a package built on a CPU (``, CPU threads unknown`` where an older xpupack
    recorded none); nothing for a GPU's."""
    if env["device_type"] != "cpu":
        return ""
    return f", {env['cpu_threads']} CPU threads" if "cpu_threads" in env else ", CPU threads unknown"


def _weights(model: dict) -> str:
    """``weights in model.safetensors (12.0 MiB)``, ``weights in 4 shards (15.0 GiB)`` or ``weights not stored``."""
    if not model["weights"]:
        return "weights not stored"
    files = model["weights_files"]
    where = "model.safetensors" if files == 1 else f"{files} shards"
    return f"weights in {where} ({byte_size(model['weights_bytes'])})"


def _inductor_line(carried: dict) -> str:
    """``inductor artifacts: 2 graphs, 0 tuning results, 10 kernel sources, 654.7 KiB (mega-cache: inductor 2,
    aot_autograd 2)``: `report.inductor_artifacts` in a line."""
    rest = f"{carried['kernel_sources']} kernel sources, {byte_size(carried['bytes'])}"
    if carried["artifacts"] is None:
        return f"inductor artifacts: {rest}; mega-cache not read: {carried['unreadable']}"
    by_type = ", ".join(f"{name} {n}" for name, n in carried["artifacts"].items())
    return f"inductor artifacts: {carried['graphs']} graphs, {carried['tuning_results']} tuning results, {rest}" + (
        f" (mega-cache: {by_type})" if by_type else ""
    )


def _quantization_line(report: dict) -> str | None:
    """``quantized (TorchAO, stored as such, not quantized again at load): layers.0.mlp int8-weight-only``;
    None where every module keeps the model's own weights."""
    quantized = [f"{m['path'] or '<model>'} {m['quantization']}" for m in report["modules"] if m.get("quantization")]
    if not quantized:
        return None
    return "quantized (TorchAO, stored as such, not quantized again at load): " + ", ".join(quantized)


def _compiled_code_line(report: dict) -> str | None:
    """How the compiled code that runs here comes alive at load: AOTInductor libraries are mapped in (no
    compile), Inductor compiles from its carried caches, or without the kernels they carry where the module
    does not run as built (another thread count, versions, an untrusted source: "on load here" says which);
    None where no module runs compiled code."""
    paths: dict[str, list[str]] = {"aoti": [], "inductor": [], "inductor anew": []}
    for module in report["modules"]:
        parts = str(module.get("runs_here") or "").replace(":", "+").split("+")
        kind: str | None = next((kind for kind in ("aoti", "inductor") if kind in parts), None)
        if kind == "inductor" and not (module["compatible_here"] and module["artifacts_here"]):
            kind = "inductor anew"
        if kind is not None:
            paths[kind].append(module["path"] or "<model>")
    lines = []
    if paths["aoti"]:
        lines.append(f"{', '.join(paths['aoti'])}: AOTInductor libraries mapped in, no compile")
    where = "on the caller's path (load(..., defer_compile=True): in the background)"
    if paths["inductor"]:
        lines.append(f"{', '.join(paths['inductor'])}: Inductor compiles from the carried caches {where}")
    if paths["inductor anew"]:
        lines.append(
            f"{', '.join(paths['inductor anew'])}: Inductor compiles without the carried kernels {where}, "
            "as 'on load here' says"
        )
    if lines and report.get("samples_mode"):
        lines.append(
            f"tuned under {report['samples_mode']}: serve there (compiled code guards on the mode of a call "
            "with state); load(warmup=...) called outside any mode warms up there"
        )
    return "compiled code at load: " + "; ".join(lines) if lines else None


def _trust_line(report: dict) -> str:
    """Whether the package's compiled artifacts may run here (docs/safety.md)."""
    compiled = ", ".join(
        f"{m['path'] or '<model>'} ({m['runs_here']})" for m in report["modules"] if m["compiled_here"]
    )
    if report["trusted"]:
        return f"trust: {report['trust_reason']} — " + (
            f"compiled artifacts of {compiled} are trusted" if compiled else "no compiled artifacts"
        )
    if not compiled:
        what = (
            "the package has no compiled artifacts"
            if not any(m["compiled_artifacts"] for m in report["modules"])
            else "no module runs the package's compiled artifacts here"
        )
        return f"trust: {report['trust_reason']}; {what}, so nothing is rebuilt"
    return (
        f"[yellow]trust: compiled artifacts of {compiled} will be rebuilt on load: {report['trust_reason']} — "
        "pin that commit (--revision, or revision= in xpupack.load) or pass trust_compiled=True to "
        "xpupack.load to run them[/yellow]"
    )


@click.command()
@click.argument("package", metavar="PACKAGE")
@_revision
@_on_mismatch
@json_option
@handle_errors
def inspect(package, revision, on_mismatch, as_json):
    """Show a package's modules, chosen backends, rejected candidates and why, recorded signatures,
    build environment, file sizes, the Inductor graphs and tuning results it carries, and whether its
    compiled artifacts are trusted.

    PACKAGE is a folder (./out/pkg, /abs/pkg, tiny-pkg) or a Hub repo (org/name, hf://org/name);
    a plain org/name that is also a folder here is refused: write ./org/name or hf://org/name.
    """
    from ..report import package_report

    report = package_report(_source(package, revision), on_mismatch=on_mismatch)
    if as_json:
        echo_json(report)
    else:
        print_report(report, console())


#: `verify`'s exit status when it could not check the package at all (not "damaged" 1, not "degraded" 2)
CANNOT_CHECK = 3


class _VerifyCommand(click.Command):
    """Usage errors exit with `CANNOT_CHECK`: click's own status for them, 2, means "degraded" here."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            exc.exit_code = CANNOT_CHECK
            raise


@click.command(cls=_VerifyCommand)
@click.argument("package", metavar="PACKAGE")
@_revision
@click.option("--device", default=None, help="Device to check compatibility against. Default: the best here.")
@_on_mismatch
@json_option
@handle_errors(exit_code=CANNOT_CHECK)
def verify(package, revision, device, on_mismatch, as_json):
    """Check a package: schema, every file's sha256, and compatibility with this machine.

    PACKAGE is a folder (./out/pkg, /abs/pkg, tiny-pkg) or a Hub repo (org/name, hf://org/name);
    a plain org/name that is also a folder here is refused: write ./org/name or hf://org/name.

    \b
    Exit status: 0 when the package is intact and everything in it runs here as built;
    1 when it is damaged (nothing is loaded from such a package);
    2 when it is intact but some modules would be rebuilt or run the original module here;
    3 when it could not be checked (a device not here, the Hub unreachable, no such repo, a bad option).
    """
    from ..report import verify_package

    result = verify_package(_source(package, revision), device=device, on_mismatch=on_mismatch)
    degraded = any(not entry["compatible"] for entry in result["compatibility"].values())
    if as_json:
        echo_json(result)
    else:
        out = console()
        result = printable(result)  # problems and statuses quote the package
        for problem in result["problems"]:
            out.print(f"[red]problem:[/red] {problem}")
        for path, entry in result["compatibility"].items():
            colour = "green" if entry["compatible"] else "yellow"
            settings = f", {', '.join(entry['settings'])}" if entry.get("settings") else ""
            out.print(f"[{colour}]{path}[/{colour}] ({entry['backend']}{settings}): {entry['status']}")
        if "load_work" in result:
            work = result["load_work"]
            out.print(
                f"load work: {work['signatures']} signatures, {work['compiles']} compiles, "
                f"{work['recordings']} graph recordings, {work['input_bytes']} bytes of inputs synthesised"
            )
        if result["ok"]:
            out.print(
                "[green]intact[/green]: schema and every file's sha256 check out"
                + ("" if not degraded else "; some modules will not run as built here")
            )
    sys.exit(1 if not result["ok"] else 2 if degraded else 0)
