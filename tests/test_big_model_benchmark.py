"""benchmarks/big_model.py on a CPU: when full speed starts, what a stopped process leaves, the budget, and
(slow) a tiny end-to-end run whose JSON has every field. Its timings mean nothing here: the Llama-3-8B
figures come from a GPU run (docs/benchmarks.md)."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import big_model

TINY = [
    "--device",
    "cpu",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--vocab",
    "256",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--new-tokens",
    "8",
    "--prompt",
    "8",
]
#: figures that are positive whenever their phase ran
POSITIVE = [
    "tune_s",
    "save_s",
    "save_gb_s",
    "package_gb",
    "load_s",
    "load_gb_s",
    "load_to_first_token_s",
    "slowest_generate_tokens_s",
    "steady_tokens_s",
    "decode_tokens_s",
    "hand_decode_tokens_s",
    "decode_vs_hand",
    "ttft_s",
    "hand_ttft_s",
    "ttft_vs_hand",
]


def test_full_speed_starts_with_the_last_run_of_generates_at_nine_tenths_of_steady_or_never():
    starts = [1.0, 2.0, 3.0, 4.0]
    assert big_model.full_speed_at(starts, [10, 95, 100, 100], steady=100) == 2.0
    assert big_model.full_speed_at(starts, [95, 50, 100, 100], steady=100) == 3.0  # a slow one after a fast one
    assert big_model.full_speed_at(starts, [90, 95, 100, 100], steady=100) == 1.0  # 0.9× counts as full speed
    assert big_model.full_speed_at(starts, [100, 100, 100, 50], steady=100) is None


def test_a_stopped_process_names_the_phase_it_was_in_and_skips_the_rest():
    found = {"phases": {"prepare": "ok", "load": "ok"}, "load_s": 1.0}
    big_model.unfinished(found, "serve", "stopped by the --budget while it ran")
    assert found["errors"] == {"series": "stopped by the --budget while it ran"}
    after = big_model.PHASES["serve"][3:]
    assert found["skipped"] == dict.fromkeys(after, "series did not finish")
    assert list(found["phases"]) == big_model.PHASES["serve"] and found["load_s"] == 1.0


def test_the_processes_get_the_runs_settings():
    args = big_model.parser().parse_args([*TINY, "--batch", "2", "--seconds", "5"])
    again = big_model.parser().parse_args(big_model.child_arguments(args))
    assert big_model.Shape.of(again) == big_model.Shape.of(args) and again.seconds == 5
    assert again.quantize is None
    args = big_model.parser().parse_args([*TINY, "--quantize", "int8-weight-only"])
    assert big_model.parser().parse_args(big_model.child_arguments(args)).quantize == "int8-weight-only"
    assert big_model.report_head(args)["settings"]["quantize"] == "int8-weight-only"
    args = big_model.parser().parse_args([*TINY, "--quantize", "int4-weight-only", "--min-sqnr-db", "8"])
    assert big_model.parser().parse_args(big_model.child_arguments(args)).min_sqnr_db == 8
    assert big_model.report_head(args)["settings"]["min_sqnr_db"] == 8
    args = big_model.parser().parse_args([*TINY, "--backends", "graph+aoti,eager"])
    assert big_model.parser().parse_args(big_model.child_arguments(args)).backends == "graph+aoti,eager"
    assert big_model.report_head(args)["settings"]["backends"] == "graph+aoti,eager"
    assert big_model.parser().parse_args(big_model.child_arguments(args)).empty_model is False
    args = big_model.parser().parse_args([*TINY, "--empty-model"])
    assert big_model.parser().parse_args(big_model.child_arguments(args)).empty_model is True
    assert big_model.report_head(args)["settings"]["empty_model"] is True


def test_an_empty_model_has_its_parameters_on_the_meta_device_and_its_buffers_real():
    shape = big_model.Shape.of(big_model.parser().parse_args(TINY))
    model = big_model.build(shape, seed=1, empty=True)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # the rotary frequencies a load cannot give


def test_backends_tunes_the_candidates_named_and_not_with_quantize(tmp_path, capsys):
    shape = big_model.Shape.of(big_model.parser().parse_args(TINY))
    tuned = big_model.tune(shape, {}, tmp_path / "pkg", backend_list="eager")
    assert set(tuned["tuned_backends"].values()) == {"eager"}
    with pytest.raises(SystemExit):
        big_model.main([*TINY, "--backends", "eager", "--quantize", "int8-weight-only"])
    assert "give --quantize or --backends, not both" in capsys.readouterr().err


def test_quantize_tunes_the_one_quantized_chain_with_the_int8_floor():
    pytest.importorskip("torchao")
    chain = big_model.quantized_chain("cpu", "int8-weight-only")
    assert chain.label == "inductor+torchao:int8-weight-only" and chain.base.min_sqnr_db == 20
    # on a GPU as the thorough search tries it: with coordinate descent, without which Inductor's int8 weight-only
    # products ran at 0.46x bf16 on Llama-3-8B's shapes (H100)
    label = big_model.quantized_chain("cuda", "int4-weight-only").label
    assert label.startswith("graph+inductor[coordinate_descent_tuning") and label.endswith("]+torchao:int4-weight-only")
    assert big_model.quantized_chain("cpu", "int8-weight-only", floor=8).base.min_sqnr_db == 8
    with pytest.raises(SystemExit):
        big_model.parser().parse_args([*TINY, "--quantize", "int3"])


def test_the_hand_compiled_step_compiles_as_the_package_did():
    pytest.importorskip("torchao")
    assert big_model.hand_compile_settings("cuda", None) == {}  # bf16: the default strategy's defaults
    options = big_model.hand_compile_settings("cuda", "int8-weight-only")["options"]
    assert options["coordinate_descent_tuning"] is True and options["pattern_matcher"] is False
    assert big_model.hand_compile_settings("cpu", "int8-weight-only") == {"mode": None}


def test_a_quantized_weight_without_dequantize_is_read_through_the_layers_own_product():
    layer = torch.nn.Linear(2500, 300, bias=False)  # wider than one block of the identity
    assert torch.equal(big_model.stored_weight(layer, torch.float32), layer.weight)

    class Packed(torch.nn.Module):  # int4's tile-packed layout: a product, no dequantize()
        in_features = 2500

        def __init__(self):
            super().__init__()
            self.weight = types.SimpleNamespace(device=layer.weight.device, dequantize=self.refuse)

        def refuse(self):
            raise NotImplementedError("aten.dequantize")

        def forward(self, x):
            return layer(x)

    with torch.no_grad():
        assert torch.equal(big_model.stored_weight(Packed(), torch.float32), layer.weight)


def test_random_weights_rounded_to_the_grid_lose_less_to_quantization():
    """A quantized package of random weights is checked against weights rounded to what TorchAO stores: every
    linear layer's weight, and only those, loses less to quantizing it again (bf16 cannot hold every int8 grid
    point times its scale, so not nothing: 43-44 dB before, 48 after on this model)."""
    pytest.importorskip("torchao")
    import torch
    from torchao.quantization import quantize_

    import xpupack

    def quantization_loss_db(weight: torch.Tensor) -> float:
        probe = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        probe.weight.data.copy_(weight)
        quantize_(probe, xpupack.TorchAOBackend("int8-weight-only").config)
        noise = (probe.weight.dequantize().float() - weight.float()).pow(2).mean()
        return float(10 * torch.log10(weight.float().pow(2).mean() / noise))

    model = big_model.build(big_model.Shape.of(big_model.parser().parse_args(TINY)), seed=0)
    embedding = model.model.embed_tokens.weight.clone()
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    before = [quantization_loss_db(module.weight.detach()) for module in linears]
    assert big_model.round_to_grid(model, "int8-weight-only") == len(linears) == 2 * 7 + 1
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    after = [quantization_loss_db(module.weight.detach()) for module in linears]
    assert all(rounded > raw + 3 for raw, rounded in zip(before, after)), (before, after)


@pytest.mark.slow  # a fresh process, stopped by the budget
def test_a_spent_budget_stops_the_build_and_still_prints_every_field(tmp_path, capsys):
    report = big_model.main([*TINY, "--budget", "1", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert json.loads(capsys.readouterr().out) == report == json.loads((tmp_path / "r.json").read_text())
    assert set(big_model.FIELDS) <= set(report) and report["tune_s"] is None
    # on a slow machine the process is stopped on its way out, after skipping what the deadline left no time for
    assert report["phases"]["tune"] in ("error", "skipped") and report["phases"]["save"] == "skipped"
    assert "stopped by the --budget while it ran" in report["errors"].values()
    assert report["skipped"]["serve"] == "no package: the build did not finish"


@pytest.mark.slow  # two fresh processes: a tune and a load on empty compiler caches, with Inductor
def test_a_tiny_run_tunes_saves_loads_and_serves_with_every_field(tmp_path, capsys):
    report = big_model.main([*TINY, "--seconds", "2", "--workdir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out) == report
    assert report["errors"] == {} and report["skipped"] == {}, report
    assert set(report["phases"]) == {name for names in big_model.PHASES.values() for name in names}
    assert set(report["phases"].values()) == {"ok"} and report["settings"]["warmup"] == "auto"
    for field in POSITIVE:
        assert isinstance(report[field], (int, float)) and report[field] > 0, field
    assert report["extra_device_memory_gb"] >= 0
    assert {"verify", "weights", "modules", "warmup"} <= set(report["load_phases"])  # where the load's time went
    assert sum(report["load_phases"].values()) <= report["load_s"]
    # the warm-up's compiles hit the graphs the package carried (what still costs time is named); timed against
    # eager on a busy machine, the compiled candidate may lose, and an eager package compiles nothing
    assert report["load_compiler_counters"]["fxgraph_cache_miss"] == 0, report["load_compile_s"]
    compiled = "inductor" in report["tuned_backends"]["<model>"]
    assert (report["load_compiler_counters"]["fxgraph_cache_hit"] > 0) == compiled, report["tuned_candidates"]
    series = report["time_series"]
    assert series and all(tokens_s > 0 for _, tokens_s in series)
    assert [t for t, _ in series] == sorted(t for t, _ in series) and series[-1][0] >= 2
    assert report["load_to_first_token_s"] < series[0][0]
    full_speed = report["time_to_full_speed_s"]
    assert full_speed is None or 0 < full_speed <= series[-1][0]
    # no compiler thread after load() returns (its warm-up compiled on the caller's path)
    assert all(isinstance(name, str) for name in report["threads_alive_after_load"])
    assert not [name for name in report["threads_alive_after_load"] if name.startswith("xpupack")], report
    stats = report["stats"]
    assert stats["calls"] > 0 and set(stats["backends"]) == set(report["tuned_backends"]) == set(
        report["tuned_candidates"]
    ) == {"<model>"}
    # the warm-up left the cache generate() was tuned with: its prefills fit (they fell back after a warm-up
    # at the decode loop's cache length, and the decode step compiled again)
    assert report["prefill_fallbacks"] == 0 == stats["fallbacks"], stats
    # against eager's tokens in the build process (a quantized package has no bf16 weights to rerun)
    reference = json.loads((tmp_path / "reference_tokens.json").read_text())
    assert len(reference) == 1 and len(reference[0]) == 8
    assert isinstance(report["tokens_equal"], bool)
    assert (report["first_differing_position"] is None) == report["tokens_equal"]
    assert report["hand"] == "the torch.compile'd step (no graphs on a CPU)" and report["device_name"] == "cpu"
    assert isinstance(report["torch"], str) and isinstance(report["transformers"], str)


def test_serving_alone_needs_the_package_an_earlier_build_left(tmp_path):
    with pytest.raises(SystemExit, match="no package in .*run --only build with this --workdir first"):
        big_model.main([*TINY, "--only", "serve", "--workdir", str(tmp_path)])


def test_a_baseline_run_builds_and_serves_the_unquantized_package_first_and_reports_the_ratios(
    tmp_path, capsys, monkeypatch
):
    ran = []

    def fake_step(step, args, workdir, deadline):
        ran.append((step, args.quantize, args.backends, args.empty_model, workdir.name))
        if step == "build":
            return {"package_gb": 2.0 if args.quantize else 5.0, "phases": {"tune": "ok", "save": "ok"}}
        return {"decode_tokens_s": 900.0 if args.quantize else 450.0, "load_s": 20.0, "ttft_s": None}

    monkeypatch.setattr(big_model, "run_step", fake_step)
    argv = [*TINY, "--quantize", "int4-weight-only", "--baseline", "graph+inductor", "--empty-model"]
    report = big_model.main([*argv, "--workdir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out) == report
    assert ran == [
        ("build", None, "graph+inductor", False, "baseline"),  # the baseline first, full precision, a model of its own
        ("serve", None, "graph+inductor", False, "baseline"),
        ("build", "int4-weight-only", None, True, "quantized"),
        ("serve", "int4-weight-only", None, True, "quantized"),
    ]
    assert report["baseline"]["decode_tokens_s"] == 450.0 and report["decode_tokens_s"] == 900.0
    assert report["vs_baseline"]["decode_tokens_s"] == 2.0 and report["vs_baseline"]["package_gb"] == 0.4
    assert report["vs_baseline"]["load_s"] == 1.0 and report["vs_baseline"]["ttft_s"] is None  # not measured
    assert report["settings"]["baseline"] == "graph+inductor"
    args = big_model.parser().parse_args(argv)
    assert big_model.parser().parse_args(big_model.child_arguments(args)).baseline is None  # a process runs one
    ran.clear()
    big_model.main([*TINY, "--quantize", "int8-weight-only", "--baseline", "--workdir", str(tmp_path / "d")])
    assert ran[0][:3] == ("build", None, None)  # the default strategy


def test_a_baseline_needs_a_quantized_package_to_measure(capsys):
    with pytest.raises(SystemExit):
        big_model.main([*TINY, "--baseline"])
    assert "--baseline is the unquantized package a --quantize run is measured against" in capsys.readouterr().err


def test_a_baseline_serve_checks_both_packages_before_serving_either(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(big_model, "run_step", lambda step, args, workdir, deadline: ran.append(step) or {})
    (tmp_path / "baseline" / "pkg").mkdir(parents=True)  # the quantized build never finished
    argv = [*TINY, "--quantize", "int8-weight-only", "--baseline", "--only", "serve", "--workdir", str(tmp_path)]
    with pytest.raises(SystemExit, match="no package in .*quantized"):
        big_model.main(argv)
    assert ran == []  # the baseline's serve did not spend the budget first
