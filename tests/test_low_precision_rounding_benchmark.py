"""benchmarks/low_precision_rounding.py's CPU smoke run: the figures behind the SQNR floor, measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "low_precision_rounding.py"
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab", "256"]


@pytest.mark.slow
def test_a_tiny_run_reports_each_pairs_sqnr_against_the_floor(tmp_path):
    command = [sys.executable, str(BENCHMARK), *TINY, "--heads", "4", "--kv-heads", "2", "--prompt", "8"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["floor_db"] == 20.0 and report["layers"] == 2 and report["device_name"] == "cpu"
    sqnr = report["sqnr_db"]
    assert set(sqnr) == {"inductor_vs_eager", "eager_vs_float32", "inductor_vs_float32"}  # no graph on a CPU
    # two bf16 layers round far less than 32: every pair above the floor; bf16 is never float32
    assert all(value > 20.0 for value in sqnr.values())
    assert sqnr["eager_vs_float32"] < 200 and sqnr["inductor_vs_float32"] < 200
    assert 0.0 <= report["inductor_argmax_agreement"] <= 1.0
