import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from xpupack.cli import main

DEMO = ["xpupack.examples:tiny_transformer", "--samples", "xpupack.examples:tiny_transformer_samples"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "pkg"
    result = CliRunner().invoke(
        main, ["build", *DEMO, "--modules", "layers.*.mlp", "--out", str(out), "--backends", "graph,eager"]
    )
    assert result.exit_code == 0, result.output
    return out, result.output, result.stderr


def test_build_reports_modules_and_rejections(built):
    out, output, _ = built
    assert (out / "xpupack.json").is_file()
    assert "layers.0.mlp" in output and "layers.1.mlp" in output
    assert "no device graphs on cpu" in output


def test_build_ends_with_what_each_module_got(built):
    _, output, _ = built
    assert output.splitlines()[-3:-1] == [
        "  layers.0.mlp: eager (graph: no device graphs on cpu)",
        "  layers.1.mlp: eager (graph: no device graphs on cpu)",
    ]


def _candidate(backend, status, speedup=None, median_us=None, reason=""):
    entry = {"backend": backend, "status": status, "reason": reason}
    if speedup is not None:
        entry.update(speedup=speedup, speedup_interval=[speedup * 0.9, speedup * 1.1], median_us=median_us)
    return entry


def test_the_build_summary_says_each_module_s_speed_over_eager_and_theirs_together():
    from xpupack.cli.build import outcome_lines

    modules = [
        {"path": "a", "backend": "inductor", "candidates": [_candidate("inductor", "chosen", 2.0, 50.0)]},
        {
            "path": "b",
            "backend": "eager",
            "candidates": [
                _candidate("graph", "rejected", reason="no device graphs on cpu"),
                _candidate("inductor", "rejected", 0.8, 125.0, "not faster than eager: ..."),
                _candidate("eager", "chosen", reason="first to pass"),
            ],
        },
        {"path": "c", "backend": "graph", "candidates": [_candidate("graph", "chosen", reason="first to pass")]},
        {"path": "", "backend": "eager", "candidates": [_candidate("graph", "rejected", reason="no device graphs")]},
    ]
    assert outcome_lines(modules) == [
        "chosen, and each module's speed over eager on the samples' calls (timed during this build):",
        "  a: inductor, 2.00x eager (95% interval 1.80-2.20x)",
        "  b: eager (the fastest candidate, inductor, ran at 0.80x eager's speed)",
        "  c: graph, not timed against eager (the speed gate was off)",
        "  <model>: eager (graph: no device graphs)",
        "  together: 1.33x eager's speed",  # a: 100 µs eager, 50 tuned; b: 100 µs either way (200 over 150)
    ]


def test_inspect_json(built):
    out, _, _ = built
    result = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    module = report["modules"][0]
    assert module["path"] == "layers.0.mlp" and module["backend"] == "eager"
    assert module["signatures"] == ["(f32[1,16,64])", "(f32[2,16,64])"]
    assert module["candidates"][0] == {"backend": "graph", "status": "rejected", "reason": "no device graphs on cpu"}
    assert report["environment"]["device_type"] == "cpu" and report["files"]["model.safetensors"] > 0


def test_inspect_table(built):
    result = CliRunner().invoke(main, ["inspect", str(built[0])])
    assert result.exit_code == 0 and "first to pass" in result.output


def test_build_outside_a_terminal_prints_a_line_per_step_and_module(built):
    """In CI or a log there is no spinner to update: each step and each module gets its own line, once."""
    lines = built[2].splitlines()
    assert "importing torch" in lines and "building the model" in lines
    assert [line for line in lines if line.startswith("tuning ")] == [
        "tuning layers.0.mlp (1/2, 2 signature(s))",
        "tuning layers.1.mlp (2/2, 2 signature(s))",
    ]
    assert [line for line in lines if line.startswith("recording sample")] == ["recording sample 1"]  # no count-up
    assert any(line.startswith("writing ") for line in lines)


def test_inspect_at_80_columns_wraps_signatures_instead_of_cutting_them(built):
    from rich.console import Console

    from xpupack.cli.inspect import print_report
    from xpupack.report import package_report

    report = package_report(built[0])
    long = "(f32[1,16,64], " + ", ".join(["StaticCache[6 state tensors]", "bool[1,1,1,1300000]"] * 2) + ")"
    report["modules"][0]["signatures"] = [long]
    console = Console(width=80, record=True, highlight=False)
    print_report(report, console)
    text = console.export_text()
    assert "…" not in text
    assert long.replace(" ", "") in _column_text(text, 2, columns=6).replace(" ", "")


def _column_text(table: str, index: int, columns: int) -> str:
    """The text of a rich table's column ``index`` (0-based) read down its rows, where a cell too wide for the
    terminal wraps onto more lines: each line's piece stripped, joined."""
    rows = [line.split("│") for line in table.splitlines() if line.count("│") == columns + 1]
    return "".join(row[index + 1].strip() for row in rows)


def test_verify_intact_then_damaged(built, tmp_path):
    import shutil

    out = tmp_path / "pkg"
    shutil.copytree(built[0], out)
    result = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ok"]
    spec = out / "modules/layers.1.mlp/spec.json"
    spec.write_text(spec.read_text().replace("16", "17"))
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1
    assert "spec.json" in result.output and "sha256" in result.output


def test_verify_reports_parts_that_will_not_run_as_built(built, tmp_path):
    import shutil

    out = tmp_path / "pkg"
    shutil.copytree(built[0], out)
    manifest = json.loads((out / "xpupack.json").read_text())
    for module in manifest["modules"]:
        module["backend"] = {"name": "graph", "options": {}, "config": {}}
    (out / "xpupack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 2
    assert "no device graphs on cpu" in result.output


def test_bench_json(built):
    result = CliRunner().invoke(
        main, ["bench", str(built[0]), "--model", "xpupack.examples:tiny_transformer", "--iterations", "3", "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert len(rows) == 4
    assert all(r["tuned"]["median_us"] > 0 and r["eager"]["p90_us"] > 0 and not r["fell_back"] for r in rows)
    # the speedup is a median over rounds of tuned and eager calls taken in turns, with its interval
    assert all(
        r["speedup_interval"][0] <= r["speedup"] <= r["speedup_interval"][1]
        and r["rounds"] >= 3
        and isinstance(r["noisy"], bool)
        for r in rows
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["build", "nosuchmodule:factory", "--samples", "x:y", "--out", "o"], "cannot import 'nosuchmodule'"),
        (["build", "xpupack.examples", "--samples", "x:y", "--out", "o"], "is not MODULE:NAME"),
        (["build", *DEMO, "--out", "o", "--backends", "warp"], "unknown backend 'warp'"),
        (["build", *DEMO, "--out", "o", "--modules", "nothing.*"], "error: no submodule matches"),
        (["inspect", "no/such/dir"], "there is no folder"),
        (["build", *DEMO, "--out", "o", "--min-speedup", "fast"], "'fast': give a number such as 1.0, or none"),
        (["build", *DEMO, "--out", "o", "--min-speedup", "0"], "'0': give a number above 0 such as 1.0, or none"),
        (["build", *DEMO, "--out", "o", "--startup-margin", "0.5"], "'0.5': give a number of at least 1 such as 1.05"),
        (["build", *DEMO, "--out", "o", "--startup-margin", "x"], "'x': give a number such as 1.05, or none"),
        (
            ["bench", "pkg", "--model", "xpupack.examples:tiny_transformer", "--iterations", "0"],
            "0 is not in the range x>=1",
        ),
        (
            ["build", *DEMO, "--out", "o", "--batch-sizes", "1,100000000000000000000000000000"],
            "give batch sizes separated by commas, each from 1 to 2147483647",
        ),
        (["build", *DEMO, "--out", "o", "--batch-sizes", "0"], "each from 1 to"),
        (["build", *DEMO, "--out", "o", "--backends", "graph:5"], "'graph:5': graph takes no argument; graph+NAME"),
        (["build", *DEMO, "--out", "o", "--backends", "eager:5"], "'eager:5': "),
        (["build", *DEMO, "--out", "o", "--backends", "graph+graph"], "'graph+graph': GraphBackend(base=GraphBackend"),
        (
            ["build", *DEMO, "--out", "o", "--modules", "layers.*.mlp", "--modules", "layers.*.mpl"],
            "error: the module pattern 'layers.*.mpl' matches no submodule (the others match 2); close object paths: "
            "layers.1.mlp, layers.0.mlp",
        ),
    ],
)
def test_errors_are_one_line_without_traceback(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_a_build_whose_candidates_are_all_refused_names_the_command_line_s_options(tmp_path):
    """The speed gate's refusal says what to pass to build, not to the Python API (issue 31)."""
    import support.backends  # noqa: F401  (registers "delay": eager's outputs, 5 ms late)

    result = CliRunner().invoke(
        main, ["build", *DEMO, "--modules", "layers.*.mlp", "--backends", "delay", "--out", str(tmp_path / "pkg")]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert line.startswith("error: no backend could tune layers.0.mlp — delay: not faster than eager: ")
    assert "the speed gate asks for more than 1.0x" in line
    assert line.endswith(
        "; add eager to --backends (--backends delay,eager) to keep such modules untuned, "
        "or pass --min-speedup none to keep candidates slower than eager"
    )
    assert "EagerBackend" not in line and "min_speedup" not in line and "\\n" not in line


@pytest.mark.parametrize("case", ["other files", "a file", "under a file"])
def test_build_refuses_an_out_it_may_not_replace_before_tuning(case, tmp_path, monkeypatch):
    import xpupack

    def never(*args, **kwargs):
        raise AssertionError("tuned before the destination was checked")

    monkeypatch.setattr(xpupack, "tune", never)
    out = tmp_path / "pkg"
    if case == "other files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "a file":
        out.write_text("mine")
    else:
        out.with_name("parent").write_text("mine")
        out = out.with_name("parent") / "pkg"
    result = CliRunner().invoke(main, ["build", *DEMO, "--out", str(out)])
    assert result.exit_code in (1, 2) and "tuned before" not in result.output, result.output  # 2: click's own
    assert out.name in result.output and "Traceback" not in result.output
    if case == "other files":
        assert "refusing to replace it" in result.output and (out / "notes.txt").read_text() == "mine"


def test_help_shows_the_demo():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "xpupack build xpupack.examples:tiny_decoder" in result.output
    for command in ("build", "inspect", "verify", "bench"):
        assert CliRunner().invoke(main, [command, "--help"]).exit_code == 0


# -- options and files a user can get wrong (docs/cli.md) -----------------------------------


def _lacking(device):
    from xpupack.environment import devices_here

    if device in ("cuda", "xpu") and any(d.startswith(device) for d in devices_here()):
        pytest.skip(f"this machine has {device}")


@pytest.mark.parametrize("device", ["cuda", "xpu", "cuda:99", "warp", "mps", "cpu:1"])
def test_verify_on_a_device_this_machine_lacks_could_not_check(built, device):
    """Exit 1 means damaged and 2 degraded: a device that is not here is neither (exit 3)."""
    _lacking(device)
    result = CliRunner().invoke(main, ["verify", str(built[0]), "--device", device])
    assert result.exit_code == 3, result.output
    assert result.stderr.startswith(f"error: device {device!r} is not available here")
    assert "Traceback" not in result.output and "AssertionError" not in result.output


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "PKG", "--model", "xpupack.examples:tiny_transformer", "--device", "cuda:99"],
        ["build", *DEMO, "--out", "out", "--device", "cuda:99"],
    ],
)
def test_other_commands_refuse_a_missing_device_in_one_line(built, command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [str(built[0]) if part == "PKG" else part for part in command])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: device 'cuda:99' is not available here")
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_verify_exit_status_3_when_it_cannot_check(tmp_path):
    """A usage error is not 'degraded' either (click's own exit status for it is 2)."""
    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--no-such-option"])
    assert result.exit_code == 3


PLANTED = "open({marker!r}, 'w').write('imported')\n"


@pytest.mark.parametrize("how", ["main()", pytest.param("python -m xpupack", marks=pytest.mark.slow)])  # a process
def test_bench_inside_a_package_imports_nothing_from_it(built, tmp_path, how):
    """`xpupack bench .` in a package directory: the directory is not put on sys.path, so a planted
    module there never runs (docs/safety.md); the unlisted file is then refused."""
    package = shutil.copytree(built[0], tmp_path / "pkg")
    marker = tmp_path / "imported"
    for name in ("jsonschema.py", "rich.py"):  # modules that bench and load import only when they need them
        (package / name).write_text(PLANTED.format(marker=str(marker)))
    args = ["bench", ".", "--model", "xpupack.examples:tiny_transformer", "--iterations", "1"]
    if how == "main()":  # as the `xpupack` console script runs it: from a script outside the package
        script = tmp_path / "xpupack_script.py"
        script.write_text(f"from xpupack.cli import main\nmain({args!r})\n")
        command = [sys.executable, str(script)]
    else:  # Python puts the current directory first on sys.path for -m
        command = [sys.executable, "-m", "xpupack", *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, cwd=package, capture_output=True, text=True, env=env, timeout=600)
    assert not marker.exists(), result.stderr
    assert result.returncode == 1 and "is not listed in the manifest" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "name",
    ["jsonschema.py", "torch.pth", "click.cpython-311-x86_64-linux-gnu.so", "safetensors/__init__.py", "rich.pyc"],
)
def test_a_package_with_importable_files_at_its_root_is_refused(built, tmp_path, name):
    """Listed and digest-checked is not enough: at a package's root such a file could shadow a module
    whenever the package directory is the current one."""
    from support.package_tools import redigest

    package = shutil.copytree(built[0], tmp_path / "pkg")
    (package / name).parent.mkdir(exist_ok=True)
    (package / name).write_text("x = 1\n")
    redigest(package)
    result = CliRunner().invoke(main, ["verify", str(package)])
    assert result.exit_code == 1
    assert name in result.output and "importable" in result.output


def test_inspect_and_verify_show_every_option_that_changes_what_runs(built, tmp_path):
    """A package's record_collectives (whose capture hung two NCCL ranks) and its Inductor settings are
    on view before anything loads, in the table and in --json."""
    out = tmp_path / "pkg"
    shutil.copytree(built[0], out)
    manifest = json.loads((out / "xpupack.json").read_text())
    first, second = manifest["modules"]
    first["backend"] = {"name": "graph", "options": {"record_collectives": True, "max_recordings": 4}, "config": {}}
    second["backend"] = {
        "name": "graph",
        "options": {"base": {"name": "inductor", "options": {"compile_options": {"coordinate_descent_tuning": True}}}},
        "config": {},
    }
    (out / "xpupack.json").write_text(json.dumps(manifest))
    report = json.loads(CliRunner().invoke(main, ["inspect", str(out), "--json"]).output)
    assert report["modules"][0]["settings"] == ["max_recordings=4", "record_collectives=True"]
    assert report["modules"][1]["settings"] == ["inductor: compile_options.coordinate_descent_tuning=True"]
    rows = [line.split("│") for line in CliRunner().invoke(main, ["inspect", str(out)]).output.splitlines()]
    table = "".join(row[2].strip() for row in rows if len(row) == 8)  # the backend column: folded, never cut
    assert "record_collectives=True" in table and "compile_options.coordinate_descent_tuning=True" in table
    result = re.sub(r"\s", "", CliRunner().invoke(main, ["verify", str(out)]).output)
    assert "record_collectives=True" in result and "compile_options.coordinate_descent_tuning=True" in result
    verified = json.loads(CliRunner().invoke(main, ["verify", str(out), "--json"]).output)
    assert verified["compatibility"]["layers.0.mlp"]["settings"] == ["max_recordings=4", "record_collectives=True"]


def test_verify_says_an_untrusted_package_does_not_get_its_record_collectives(built, tmp_path):
    from xpupack.report import verify_package
    from xpupack.source import Source

    out = tmp_path / "pkg"
    shutil.copytree(built[0], out)
    manifest = json.loads((out / "xpupack.json").read_text())
    manifest["modules"][0]["backend"] = {"name": "graph", "options": {"record_collectives": True}, "config": {}}
    (out / "xpupack.json").write_text(json.dumps(manifest))
    trusted = verify_package(out)["compatibility"]["layers.0.mlp"]["status"]
    assert "record_collectives" not in trusted
    untrusted = verify_package(
        Source(
            out,
            trusted=False,
            description="org/name@main",
            trust_reason="revision 'main' of org/name is not pinned by commit hash",
        )
    )
    status = untrusted["compatibility"]["layers.0.mlp"]["status"]
    assert "record_collectives=False: not taken from an untrusted source" in status
    assert not untrusted["compatibility"]["layers.0.mlp"]["compatible"]


def _inspect_json(package) -> dict:
    result = CliRunner().invoke(main, ["inspect", str(package), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.slow
def test_inspect_counts_the_inductor_artifacts_a_package_carries(inductor_package):
    """Graphs and tuning results as PyTorch's own reader counts them (a CPU compile runs no Triton kernel,
    so nothing was tuned), the C++ kernel sources and the bytes, in --json and in the table."""
    from torch.compiler._cache import CacheArtifactManager

    root = inductor_package[1]
    folder = root / "backends" / "inductor"
    carried = _inspect_json(root)["inductor_artifacts"]
    by_torch = CacheArtifactManager.deserialize((folder / "cache.bin").read_bytes())
    assert carried["artifacts"] == {kind: len(artifacts) for kind, artifacts in by_torch.items()}
    assert carried["graphs"] == len(by_torch["inductor"]) >= 1 and carried["tuning_results"] == 0
    sources = list((folder / "kernels").rglob("*.cpp"))
    assert carried["kernel_sources"] == len(sources) > 0
    assert carried["bytes"] == sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    table = CliRunner().invoke(main, ["inspect", str(root)]).output
    assert f"inductor artifacts: {carried['graphs']} graphs, 0 tuning results, {len(sources)} kernel sources" in table


def _with_mega_cache(package, destination, blob: bytes):
    """``package`` carrying ``blob`` as its Inductor mega-cache, digests updated."""
    from support.package_tools import redigest

    shutil.copytree(package, destination)
    (destination / "backends" / "inductor").mkdir(parents=True)
    (destination / "backends" / "inductor" / "cache.bin").write_bytes(blob)
    manifest = json.loads((destination / "xpupack.json").read_text())
    manifest["backends"]["inductor"] = {"folder": "backends/inductor", "config": {"cache": "cache.bin", "kernels": []}}
    (destination / "xpupack.json").write_text(json.dumps(manifest))
    redigest(destination)
    return destination


def test_inspect_counts_the_tuning_results_pytorch_wrote_into_the_mega_cache(built, tmp_path):
    import torch
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager._ensure_cache_artifacts_registered()
        for n in range(3):  # what coordinate descent records for a Triton kernel
            CacheArtifactManager.record_artifact("autotune", f"ab/k{n}.best_config", {"XBLOCK": 64, "num_warps": 4})
        CacheArtifactManager.record_artifact("inductor", "fgraph", b"a graph")
        blob = torch.compiler.save_cache_artifacts()[0]
    carried = _inspect_json(_with_mega_cache(built[0], tmp_path / "pkg", blob))["inductor_artifacts"]
    assert carried == {
        "graphs": 1,
        "tuning_results": 3,
        "artifacts": {"autotune": 3, "inductor": 1},
        "kernel_sources": 0,
        "bytes": len(blob),
    }


class _Planted:
    """Touches a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_inspect_never_unpickles_a_mega_cache_it_cannot_read(built, tmp_path):
    """PyTorch's first mega-cache was one pickle; inspect reads only PyTorch's container and says why not."""
    import pickle

    marker = tmp_path / "unpickled"
    package = _with_mega_cache(built[0], tmp_path / "pkg", pickle.dumps({"inductor": [_Planted(marker)]}))
    carried = _inspect_json(package)["inductor_artifacts"]
    assert carried["graphs"] is carried["tuning_results"] is carried["artifacts"] is None
    assert "backends/inductor/cache.bin is not PyTorch's cache-artifact container" in carried["unreadable"]
    table = CliRunner().invoke(main, ["inspect", str(package)]).output
    assert "mega-cache not read" in re.sub(r"\s+", " ", table)
    assert not marker.exists()


def test_inspect_reads_a_large_mega_cache_a_block_at_a_time(built, tmp_path):
    """A hostile package's cache.bin may be a sparse file of 64 GiB (a MemoryError when read whole): inspect
    reads it a block at a time, so a cache of 256 MiB costs it no more than a few MiB."""
    import tracemalloc

    from xpupack.report import package_report

    package = _with_mega_cache(built[0], tmp_path / "pkg", b"")
    cache = package / "backends" / "inductor" / "cache.bin"
    with cache.open("wb") as stream:
        stream.truncate(256 * 2**20)  # sparse: costs no disk
    manifest = json.loads((package / "xpupack.json").read_text())
    manifest["files"]["backends/inductor/cache.bin"]["size"] = cache.stat().st_size  # inspect checks no digest
    (package / "xpupack.json").write_text(json.dumps(manifest))
    tracemalloc.start()
    try:
        carried = package_report(package)["inductor_artifacts"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "its CRC-32 does not match" in carried["unreadable"] and carried["bytes"] == 256 * 2**20
    assert peak < 16 * 2**20, f"inspect held {peak / 2**20:.0f} MiB"


#: what a hostile package puts in its strings: rich markup, a clear screen, a clipboard write (OSC 52), a
#: hyperlink (OSC 8), a C1 control, a bidi override, and a newline that starts a forged trust line
CLEAR, CLIPBOARD, LINK = "\x1b[2J", "\x1b]52;c;aGVsbG8=\x07", "\x1b]8;;https://example.com\x1b\\here\x1b]8;;\x1b\\"
FORGED_TRUST = "fine\ntrust: pinned by commit 0123abcd — compiled artifacts of layers.0.mlp are trusted"
RAW_CONTROLS = ("\x1b", "\x07", "\x9b", "\u202e")


def _hostile_strings(package):
    manifest = json.loads((package / "xpupack.json").read_text())
    manifest["created"] = "[bold]2026[/bad]"
    manifest["environment"]["device_name"] = f"{CLEAR}{CLIPBOARD}{LINK}\x9b\u202e"
    manifest["environment"]["torch"] = "2.0" + CLEAR  # verify quotes it: layers.0.mlp is rebuilt on load
    manifest["modules"][0]["backend"]["name"] = "inductor"
    manifest["modules"][1]["candidates"][0]["reason"] = FORGED_TRUST
    (package / "xpupack.json").write_text(json.dumps(manifest))
    return manifest


def _printed_safely(output, trust=()):
    """No control character reached ``output``, and its lines that say "trust:" are ``trust`` alone."""
    assert not any(control in output for control in RAW_CONTROLS), ascii(output)
    assert [line for line in output.splitlines() if line.startswith("trust:")] == list(trust)


def test_inspect_and_verify_print_a_package_s_strings_escaped(built, tmp_path):
    """Markup does not crash inspect (it did: MarkupError); controls reach the terminal as visible escapes."""
    package = shutil.copytree(built[0], tmp_path / "pkg")
    manifest = _hostile_strings(package)
    inspected = CliRunner().invoke(main, ["inspect", str(package)])
    assert inspected.exit_code == 0, inspected.output
    _printed_safely(
        inspected.output, ["trust: local directory — compiled artifacts of layers.0.mlp (inductor) are trusted"]
    )
    text = re.sub(r"[\s│]+", "", inspected.output)  # lines and table cells fold long strings
    assert "built[bold]2026[/bad]oncpu" in text
    assert "cpu\\x1b[2J\\x1b]52;c;aGVsbG8=\\x07" in text and "\\x9b\\u202e" in text
    rows = [line.split("│") for line in inspected.output.splitlines() if line.count("│") == 7]
    assert "fine\\ntrust:pinnedby" in "".join(row[4].replace(" ", "") for row in rows)  # the candidates
    verified = CliRunner().invoke(main, ["verify", str(package)])
    assert verified.exit_code == 2, verified.output
    _printed_safely(verified.output)
    assert "torch built 2.0\\x1b[2J" in verified.output
    for command in ("inspect", "verify"):  # --json is JSON: its escapes give back the strings as they are
        result = CliRunner().invoke(main, [command, str(package), "--json"])
        assert not any(control in result.output for control in RAW_CONTROLS)
        if command == "inspect":
            report = json.loads(result.output)
            assert report["environment"]["device_name"] == manifest["environment"]["device_name"]
            assert report["created"] == manifest["created"]
        else:
            json.loads(result.output)


def test_an_error_quoting_a_package_stays_one_line_without_controls(built, tmp_path):
    package = shutil.copytree(built[0], tmp_path / "pkg")
    manifest = json.loads((package / "xpupack.json").read_text())
    manifest["files"]["notes" + CLIPBOARD] = {}  # the schema error names the field: the package's own key
    (package / "xpupack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["inspect", str(package)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "files/notes\\x1b]52;c;aGVsbG8=\\x07: 'sha256' is a required property" in result.stderr
    _printed_safely(result.stderr)


def test_bench_prints_the_package_s_strings_escaped(built, monkeypatch):
    import xpupack.bench

    real = xpupack.bench.benchmark

    def hostile(model, **kwargs):
        rows = real(model, **kwargs)
        rows[0] = {**rows[0], "signature": "[bold](f32)[/bad]" + CLEAR, "backend": "eager\n" + FORGED_TRUST}
        return rows

    monkeypatch.setattr(xpupack.bench, "benchmark", hostile)
    result = CliRunner().invoke(
        main, ["bench", str(built[0]), "--model", "xpupack.examples:tiny_transformer", "--iterations", "1"]
    )
    assert result.exit_code == 0, result.output
    _printed_safely(result.output)
    # read down the columns: a busy machine's timings ("noisy") can widen the table so that these cells wrap
    assert "[bold](f32)[/bad]\\x1b[2J" in _column_text(result.output, 1, columns=8)
    assert "eager\\nfine\\ntrust:" in _column_text(result.output, 2, columns=8)


def test_bench_wraps_a_long_signature_instead_of_cutting_it(built, monkeypatch):
    import xpupack.bench

    real = xpupack.bench.benchmark
    long = "(" + ",".join(["f32[1,1300000]"] * 16) + ")"  # wider than the 160 columns of piped output

    def with_a_long_signature(model, **kwargs):
        rows = real(model, **kwargs)
        rows[0] = {**rows[0], "signature": long}
        return rows

    monkeypatch.setattr(xpupack.bench, "benchmark", with_a_long_signature)
    result = CliRunner().invoke(
        main, ["bench", str(built[0]), "--model", "xpupack.examples:tiny_transformer", "--iterations", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and long in _column_text(result.output, 1, columns=8)


def test_push_dry_run_prints_the_package_s_strings_escaped(built, tmp_path):
    package = shutil.copytree(built[0], tmp_path / "pkg")
    manifest = json.loads((package / "xpupack.json").read_text())
    manifest["environment"]["torch"] = "2.0" + CLIPBOARD  # the commit message quotes it
    (package / "xpupack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["push", str(package), "org/tiny", "--dry-run"])
    assert result.exit_code == 0, result.output
    _printed_safely(result.output)
    assert "torch 2.0\\x1b]52;c;aGVsbG8=\\x07 on cpu" in result.output


@pytest.mark.parametrize("linked", ["xpupack.json", "modules/layers.0.mlp/spec.json", "modules"])
def test_inspect_refuses_a_symbolic_link_as_verify_does(built, tmp_path, linked):
    """A link may point anywhere (another package, a huge or a private file): inspect never reads through
    one, and says which it is, in verify's words."""
    package = shutil.copytree(built[0], tmp_path / "pkg")
    outside = tmp_path / "outside"
    (package / linked).rename(outside)
    (package / linked).symlink_to(outside, target_is_directory=outside.is_dir())
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(main, [command, str(package)])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        message = re.sub(r"\s+", " ", result.output)
        assert f"{package / linked} is a symbolic link" in message, message
        assert "refuses to follow it" in message


def test_inspect_does_not_read_a_mega_cache_through_a_symbolic_link(built, tmp_path):
    package = _with_mega_cache(built[0], tmp_path / "pkg", b"")
    cache = package / "backends" / "inductor" / "cache.bin"
    cache.unlink()
    cache.symlink_to(tmp_path / "elsewhere.bin")
    (tmp_path / "elsewhere.bin").write_bytes(b"\0" * 64)
    carried = _inspect_json(package)["inductor_artifacts"]
    assert carried["artifacts"] is None and f"{cache} is a symbolic link" in carried["unreadable"]


@pytest.mark.parametrize(
    "change, number",
    [
        (
            lambda m: m["files"]["model.safetensors"].update(size=10**400),
            "the integer 1" + "0" * 23 + "… is out of range",
        ),
        (lambda m: m["model"]["tensors"]["embed.weight"].update(shape=[2**63, 64]), "the integer 9223372036854775808"),
        (lambda m: m["modules"][0]["candidates"][0].update(median_us=float("nan")), "NaN is not a JSON number"),
        (lambda m: m["modules"][0]["candidates"][0].update(speedup=float("inf")), "Infinity is not a JSON number"),
    ],
)
def test_numbers_out_of_range_are_a_format_error_not_an_overflow(built, tmp_path, change, number):
    """10**400 as a file's size ended inspect in an OverflowError; NaN made its --json output invalid JSON."""
    import xpupack
    from xpupack.errors import PackageFormatError

    package = shutil.copytree(built[0], tmp_path / "pkg")
    manifest = json.loads((package / "xpupack.json").read_text())
    change(manifest)
    (package / "xpupack.json").write_text(json.dumps(manifest))
    for command in (["inspect"], ["inspect", "--json"], ["verify"]):
        result = CliRunner().invoke(main, [*command, str(package)])
        assert result.exit_code == 1 and "error (" not in result.output and "NaN," not in result.output
        # the console wraps lines at a space or inside a long path: compare without any whitespace
        unwrapped = "".join(result.output.split())
        assert "".join(f"xpupack.json is not valid JSON ({number}".split()) in unwrapped, result.output
    with pytest.raises(PackageFormatError, match="is out of range|is not a JSON number"):
        xpupack.load(xpupack.examples.tiny_transformer(), package)


@pytest.mark.parametrize(
    "factory, words",
    [
        ("os:system", "os:system cannot be called without arguments (missing a required argument: 'command')"),
        ("os:getcwd", "os:getcwd returned a str, not a torch.nn.Module"),
        ("os:sep", "os:sep is not a function"),
    ],
)
@pytest.mark.parametrize("command", ["bench", "build"])
def test_a_model_factory_that_gives_no_model_is_refused_in_one_line(
    built, tmp_path, monkeypatch, command, factory, words
):
    """``bench --model os:system`` printed a raw TypeError."""
    monkeypatch.chdir(tmp_path)
    args = (
        ["bench", str(built[0]), "--model", factory]
        if command == "bench"
        else ["build", factory, "--samples", "xpupack.examples:tiny_transformer_samples", "--out", "out"]
    )
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    *progress, line = result.stderr.splitlines()  # build says what it is doing first
    assert line.startswith("error: ") and words in line and "such as xpupack.examples:tiny_transformer" in line
    assert not any(other.startswith("error") for other in progress) and "TypeError" not in result.output
