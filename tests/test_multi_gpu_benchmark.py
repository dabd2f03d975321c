"""benchmarks/multi_gpu.py's code path on a CPU (--device cpu --smoke): both parts run end to end, the
tensor-parallel part through two torchrun ranks over gloo. Its timings mean nothing here; the figures come
from two GPUs (docs/multi-gpu.md)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import multi_gpu  # noqa: E402

pytestmark = pytest.mark.slow  # torchrun ranks, Inductor compiles


def test_smoke_run_reports_both_parts_with_outputs_equal_to_eager(capsys):
    result = multi_gpu.main(["--device", "cpu", "--smoke"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    assert result["smoke"] and result["model"] == "h64x2, seq 32"
    split, tp = result["split"], result["tensor_parallel"]
    # a CPU has no device graphs: the split falls to eager, tensor parallel to Inductor, with the reason
    assert split["backends"] == ["eager"] and split["fallbacks"] == 0 and split["max_abs_diff_vs_eager"] == 0
    assert tp["backends"] == ["inductor"] and tp["fallbacks"] == 0 and tp["max_abs_diff_vs_eager_tp"] < 1e-4
    assert tp["rejected"] == {f"layers.{i}": ["no device graphs on cpu"] for i in range(2)}
    for part, prefix in ((split, "split"), (tp, "tp")):
        for batch in ("batch1", "batch8"):
            row = part[batch]
            assert row[f"{prefix}_tuned_us"] > 0 and row[f"{prefix}_eager_us"] > 0
            ratio = {"split": "split_tuned_speedup_vs_split_eager", "tp": "tp_tuned_speedup_vs_tp_eager"}[prefix]
            assert row[ratio] == pytest.approx(row[f"{prefix}_eager_us"] / row[f"{prefix}_tuned_us"], rel=1e-2)


def test_without_two_devices_it_says_so():
    if multi_gpu.torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two CUDA devices")
    with pytest.raises(SystemExit, match="needs two cuda devices"):
        multi_gpu.main(["--device", "cuda"])
