"""benchmarks/serving.py's smoke mode, end to end on the emulated graph (its timings mean nothing here)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import serving  # noqa: E402


def test_the_default_ladder_is_vllms_cut_at_the_largest_batch():
    assert serving.default_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert serving.default_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert serving.default_ladder(4) == [1, 2, 4]


def test_smoke_run_replays_or_pads_every_call_of_the_stream(emulated_graphs, capsys):
    result = serving.main(["--smoke", "--device", "cpu", "--backend", "emulated-graph", "--hidden", "32"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    exact, ladder = result["variants"]["exact"], result["variants"]["ladder"]
    assert result["config"]["ladder"] == [1, 2, 4] and result["config"]["distinct_batches"] == 4
    assert (exact["backend"], exact["replayed_exact"], exact["padded"], exact["fallen_back"]) == (
        "graph",
        1.0,
        0.0,
        0.0,
    )
    assert ladder["backend"] == "graph" and ladder["fallen_back"] == 0.0 and 0 < ladder["padded"] < 1
    assert ladder["replayed_exact"] + ladder["padded"] == pytest.approx(1.0)
    assert ladder["signatures"] == 3  # the ladder only: its sample had the largest batch
    assert result["targets"]["replayed_or_padded_at_least_99pct"]
    assert result["ladder_recording"]["memory_bytes"] == ladder["memory_bytes"] > 0
    assert set(result["ratios"]) == {"exact_vs_eager", "ladder_vs_eager", "ladder_vs_exact"}
