"""``xpupack bench``: load a package and time each tuned module against eager."""

from __future__ import annotations

import click

from ._common import (
    build_model,
    byte_size,
    console,
    echo_json,
    fold_table,
    handle_errors,
    import_object,
    json_option,
    printable,
)


@click.command()
@click.argument("package", metavar="PACKAGE")
@click.option(
    "--model",
    "model_factory",
    required=True,
    metavar="MODULE:FACTORY",
    help="Function building the model the package was made from.",
)
@click.option("--device", default=None, help="Device to load onto. Default: the best device here.")
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Timed rounds (a tuned and an eager call) per signature; up to 4x as many while the "
    "timings cannot tell whether tuned is faster.",
)
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit hash).")
@json_option
@handle_errors
def bench(package, model_factory, device, iterations, revision, as_json):
    """Load PACKAGE into MODULE:FACTORY's model and report, per recorded signature, the tuned
    module's latency against eager (device-synchronized; median and p90, in microseconds).

    Tuned and eager calls take turns, so that other work on the machine slows both alike; the speedup
    is the median over rounds with its 95% interval, and "noisy" marks timings that scattered widely.

    PACKAGE is a folder (./out/pkg, /abs/pkg, tiny-pkg) or a Hub repo (org/name, hf://org/name);
    a plain org/name that is also a folder here is refused: write ./org/name or hf://org/name.
    """
    import xpupack
    from xpupack.bench import benchmark
    from xpupack.environment import resolve_device

    device = resolve_device(device)
    model = build_model(import_object(model_factory, "--model", package=package), f"--model {model_factory}")
    # compiled now, not off the caller's path: the rounds time the compiled code, not the original meanwhile
    model = xpupack.load(model, package, device=device, revision=revision, defer_compile=False)
    stats = xpupack.stats(model, totals=True)  # before timing: eager's turn releases the recordings
    memory = {
        "modules": {path: entry["memory_bytes"] for path, entry in stats["modules"].items()},
        "total_bytes": stats["totals"]["memory_bytes"],
        "skipped": {path: entry["skipped"] for path, entry in stats["modules"].items() if entry.get("skipped")},
    }
    rows = benchmark(model, iterations=iterations)
    if as_json:
        echo_json(
            {
                "package": package,
                "device": str(xpupack.tuned.session_of(model).device),
                "results": rows,
                "recording_memory": memory,
            }
        )
        return
    if not rows:
        console().print(
            "nothing to time: every signature of the package carries a KV cache, and only a real call "
            "brings one; time decoding with benchmarks/llm_decode.py"
            if any(entry["signatures"] for entry in stats["modules"].values())
            else "nothing to time: the package recorded no signature"
        )
        return
    rows, memory = printable(rows), printable(memory)  # module paths, signatures and reasons from the package
    table = fold_table(
        "module",
        "signature",
        "backend",
        "tuned median µs",
        "tuned p90 µs",
        "eager median µs",
        "eager p90 µs",
        "speedup",
    )
    for row in rows:
        table.add_row(
            row["module"] or "<model>",
            row["signature"],
            row["backend"] + (" (fell back)" if row["fell_back"] else ""),
            f"{row['tuned']['median_us']:.1f}",
            f"{row['tuned']['p90_us']:.1f}",
            f"{row['eager']['median_us']:.1f}",
            f"{row['eager']['p90_us']:.1f}",
            f"{row['speedup']:.2f}× ({row['speedup_interval'][0]:.2f}-{row['speedup_interval'][1]:.2f})"
            + (" noisy" if row["noisy"] else ""),
        )
    console().print(table)
    console().print(
        f"recording memory: {byte_size(memory['total_bytes'])} in all; "
        + ", ".join(f"{path or '<model>'} {byte_size(n)}" for path, n in memory["modules"].items())
    )
    for path, skipped in memory["skipped"].items():
        for signature, why in skipped.items():
            console().print(f"{path or '<model>'}: skipped {signature}: {why}")
