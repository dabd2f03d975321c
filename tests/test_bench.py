import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import xpupack
from support.backends import ShortcutBackend
from support.clock import FakeClock, scattered
from support.models import Metered
from xpupack import _timing
from xpupack.bench import benchmark


def metered_bench(monkeypatch, clock, eager_us, fast_us, **options):
    """Tunes a `Metered` model with `ShortcutBackend` (no timing), then benchmarks it on ``clock``."""
    model = Metered(clock, eager_us, fast_us)
    xpupack.tune(model, [torch.randn(2, 8)], strategy=xpupack.FirstWins([ShortcutBackend()], min_speedup=None))
    monkeypatch.setattr(_timing, "compare", functools.partial(_timing.compare, clock=clock))
    clock.log.clear()
    return model, benchmark(model, **options)


def test_bench_takes_turns_between_tuned_and_eager_calls(monkeypatch):
    """All tuned calls first, then all eager ones, let other work on the machine decide the ratio (modules
    eager in both measured 0.01x to 1.8x); tuned and eager calls take turns instead."""
    clock = FakeClock()
    model, (row,) = metered_bench(monkeypatch, clock, eager_us=100, fast_us=50, iterations=5, warmup=1)
    assert "".join(side[0] for side in clock.log) == "ec" + "ec" + "ce" + "ec" + "ce" + "ec"
    assert row["speedup"] == 2.0 and row["speedup_interval"] == [2.0, 2.0] and row["rounds"] == 5
    assert row["noisy"] is False and row["tuned"]["median_us"] == 50 and row["eager"]["median_us"] == 100


def test_bench_says_when_its_timings_were_noisy(monkeypatch):
    clock = FakeClock(scattered(seed=1, spread=3.0))
    _, (row,) = metered_bench(monkeypatch, clock, eager_us=100, fast_us=100, iterations=10, warmup=1)
    low, high = row["speedup_interval"]
    assert row["noisy"] is True and low < 1.0 < high and row["rounds"] == 40  # more rounds could not tell


@pytest.mark.parametrize("active", [True, False])
def test_bench_leaves_the_tuned_modules_as_it_found_them(monkeypatch, active):
    clock = FakeClock()
    model = Metered(clock, 100, 50)
    xpupack.tune(model, [torch.randn(2, 8)], strategy=xpupack.FirstWins([ShortcutBackend()], min_speedup=None))
    if not active:
        xpupack.deactivate(model)
    benchmark(model, iterations=3, warmup=1)
    assert xpupack.tuned.session_of(model).active is active
    clock.log.clear()
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert clock.log == ["candidate" if active else "eager"]


# -- the command line ------------------------------------------------------------------------------


def _bench_cli(package, factory: str, *extra: str) -> subprocess.CompletedProcess:
    """``python -m xpupack bench`` in a fresh process (its exit is part of what is checked)."""
    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "xpupack", "bench", str(package), "--model", factory, "--iterations", "3"]
    return subprocess.run([*command, *extra], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_bench_times_a_package_s_compiled_code_not_the_original_while_it_compiles(inductor_package):
    """A load compiles Inductor modules off the caller's path by default; bench timed the original
    module meanwhile (speedups near 1x) and, exiting, called the compile still queued failed."""
    result = _bench_cli(inductor_package[1], "support.models:make_stack", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["results"]
    assert len(rows) == 4 and not any(row["fell_back"] for row in rows), rows
    assert "compiling off the caller's path failed" not in result.stderr


@pytest.mark.slow
def test_bench_of_a_language_model_package_says_what_it_cannot_time(tmp_path):
    from support.language_models import tune_llm

    model, _ = tune_llm(xpupack.Only(xpupack.InductorBackend()))
    root = xpupack.save(model, tmp_path / "llm-pkg")
    result = _bench_cli(root, "support.language_models:tiny_llama")
    assert result.returncode == 0, result.stderr
    assert "failed: cancelled" not in result.stdout + result.stderr
    assert "nothing to time: every signature of the package carries a KV cache" in result.stdout
