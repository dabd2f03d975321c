import json

import pytest
from click.testing import CliRunner

from xpupack.cli import main

DEMO = ["xpupack.examples:tiny_transformer", "--samples", "xpupack.examples:tiny_transformer_samples"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "pkg"
    result = CliRunner().invoke(main, ["build", *DEMO, "--modules", "layers.*.mlp", "--out", str(out),
                                       "--backends", "graph,eager"])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_build_reports_modules_and_rejections(built):
    out, output = built
    assert (out / "xpupack.json").is_file()
    assert "layers.0.mlp" in output and "layers.1.mlp" in output
    assert "no device graphs on cpu" in output


def test_inspect_json(built):
    out, _ = built
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
    result = CliRunner().invoke(main, ["bench", str(built[0]), "--model", "xpupack.examples:tiny_transformer",
                                       "--iterations", "3", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert len(rows) == 4
    assert all(r["tuned"]["median_us"] > 0 and r["eager"]["p90_us"] > 0 and not r["fell_back"] for r in rows)


@pytest.mark.parametrize("args, message", [
    (["build", "nosuchmodule:factory", "--samples", "x:y", "--out", "o"], "cannot import 'nosuchmodule'"),
    (["build", "xpupack.examples", "--samples", "x:y", "--out", "o"], "is not MODULE:NAME"),
    (["build", *DEMO, "--out", "o", "--backends", "warp"], "unknown backend 'warp'"),
    (["build", *DEMO, "--out", "o", "--modules", "nothing.*"], "error: no submodule matches"),
    (["inspect", "no/such/dir"], "not a directory"),
])
def test_errors_are_one_line_without_traceback(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_help_shows_the_demo():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "xpupack build xpupack.examples:tiny_transformer" in result.output
    for command in ("build", "inspect", "verify", "bench"):
        assert CliRunner().invoke(main, [command, "--help"]).exit_code == 0
