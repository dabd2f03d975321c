"""Padding a smaller batch up to a recorded one (docs/calls-and-fallback.md), through the emulated graph
and Inductor."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import xpupack
from support.backends import PaddingCountingBackend
from support.models import make_stack
from support.package_tools import rewrite_json
from support.strategies import GRAPH
from xpupack.cli import main
from xpupack.errors import PackageFormatError

LADDER = (1, 2, 4, 8)


def ladder_samples():
    generator = torch.Generator().manual_seed(2)
    return [torch.randn(batch, 8, generator=generator) for batch in LADDER]


def tune_ladder(strategy=GRAPH, model=None, modules=("layers.*.mlp",), **options):
    model = model or make_stack()
    reference = copy.deepcopy(model)
    xpupack.tune(model, ladder_samples(), modules=list(modules), strategy=strategy, **options)
    return model, reference


def serve(model, reference, batches):
    with torch.no_grad():
        for batch in batches:
            x = torch.randn(batch, 8)
            assert torch.allclose(model(x), reference(x), atol=1e-5), batch


def spec_of(model, path="layers.0.mlp"):
    return xpupack.tuned.session_of(model).modules[path].spec


def test_batches_between_recorded_ones_are_padded_up_and_equal_eager(emulated_graphs, fallback_calls):
    model, reference = tune_ladder()
    axes = spec_of(model).batch_axes
    assert sorted(axes) == [0, 1, 2, 3] and axes[0].inputs == (0, None) and axes[0].outputs == (0,)
    replays = emulated_graphs.replays
    serve(model, reference, (3, 5, 7))
    assert emulated_graphs.replays == replays + 6  # each padded call replays a recording: 3 calls x 2 modules
    assert fallback_calls == []
    serve(model, reference, (9,))  # above the largest recorded batch: nothing to pad up to
    assert [event.path for event in fallback_calls] == ["layers.0.mlp", "layers.1.mlp"]
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert (stats["calls"], stats["padded"], stats["fallbacks"]) == (4, 3, 1)


def test_a_padded_call_gets_rows_of_its_own_size_and_the_fit_rules_still_hold(emulated_graphs, fallback_calls):
    model, reference = tune_ladder()
    mlp, ref_mlp = model.layers[0]["mlp"], reference.layers[0]["mlp"]
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = mlp(x, scale=1.0)
        assert out.shape == (3, 8) and torch.allclose(out, ref_mlp(x, scale=1.0), atol=1e-5)
        mlp(x, scale=2.0)  # another constant: no recording of any batch fits
    mlp(x, scale=1.0)  # gradients needed: a recording cannot give them, padded or not
    assert [event.reason for event in fallback_calls][0].startswith("no recorded signature fits")
    assert fallback_calls[1].reason == "autograd needed"
    assert xpupack.stats(model)["layers.0.mlp"]["padded"] == 1


@pytest.mark.parametrize("copies", [True, False])
def test_a_padded_graph_call_gets_its_own_rows_copied_or_as_views_of_the_recording(emulated_graphs, copies):
    strategy = xpupack.FirstWins([xpupack.GraphBackend(copy_outputs=copies)], min_speedup=None)
    model, reference = tune_ladder(strategy, modules=("layers.0.mlp",))
    mlp, ref_mlp = model.layers[0]["mlp"], reference.layers[0]["mlp"]
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        first = mlp(x, scale=1.0)
        kept = first.clone()
        assert first.shape == (3, 8) and torch.allclose(first, ref_mlp(x, scale=1.0), atol=1e-5)
        # padded into the batch-4 recording's own buffers: a copy holds 3 rows, a view sees the next replay
        assert (first.untyped_storage().nbytes() == 3 * 8 * 4) == copies
        second = mlp(y, scale=1.0)
        assert torch.allclose(second, ref_mlp(y, scale=1.0), atol=1e-5)
        assert torch.equal(first, kept) == copies
        mlp(torch.randn(4, 8), scale=1.0)  # the batch-4 recording itself: all four rows filled
        mlp(x, scale=1.0)
    runner = xpupack.tuned.session_of(model).modules["layers.0.mlp"].runner
    buffer = next(r for r in runner.recordings.values() if r.static_leaves[0].shape[0] == 4).static_leaves[0]
    assert torch.equal(buffer[:3], x) and torch.equal(buffer[3], torch.zeros(8))  # the filler the check verified
    assert xpupack.stats(model)["layers.0.mlp"]["padded"] == 3


def test_a_batch_whose_recording_failed_is_padded_up_to_the_next(emulated_graphs, tmp_path, fallback_calls):
    model, reference = tune_ladder()
    root = xpupack.save(model, tmp_path / "pkg")
    attempts = iter(range(100))
    emulated_graphs.fail_capture = lambda: next(attempts) == 2  # batch 2 of layers.0 at load (8, 4, 2, 1)
    loaded = xpupack.load(make_stack(), root)
    serve(loaded, reference, (2,))
    assert fallback_calls == [] and xpupack.stats(loaded)["layers.0.mlp"]["padded"] == 1


class RowMixing(nn.Module):
    """Subtracts the batch mean: every row depends on every other."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y - y.mean(dim=0, keepdim=True)


class MixingStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = RowMixing()
        self.mlp = make_stack().layers[0]["mlp"]

    def forward(self, x):
        return self.mlp(self.mix(x))


def test_a_module_whose_rows_mix_is_never_padded_and_inspect_says_why(emulated_graphs, tmp_path, fallback_calls):
    torch.manual_seed(0)
    model, reference = tune_ladder(model=MixingStack(), modules=("mix", "mlp"))
    assert spec_of(model, "mix").batch_axes == {} and "rows mix" in spec_of(model, "mix").padding_refused
    assert spec_of(model, "mlp").batch_axes and spec_of(model, "mlp").padding_refused is None
    serve(model, reference, (3,))
    assert [event.path for event in fallback_calls] == ["mix"]
    assert xpupack.stats(model)["mlp"]["padded"] == 1 and xpupack.stats(model)["mix"]["padded"] == 0
    root = xpupack.save(model, tmp_path / "pkg")
    shown = CliRunner().invoke(main, ["inspect", "--json", str(root)])
    padding = {m["path"]: m["padding"] for m in json.loads(shown.output)["modules"]}
    assert (
        padding["mix"].startswith("never padded: rows mix")
        and padding["mlp"] == "smaller batches padded up to 1, 2, 4, 8"
    )


def test_eager_and_a_module_changing_its_inputs_are_not_padded(emulated_graphs, tmp_path, fallback_calls):
    model, reference = tune_ladder(xpupack.FirstWins([xpupack.EagerBackend()]))
    serve(model, reference, (3, 16))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["padded"] == 0 and stats["fallbacks"] == 0  # eager runs any batch itself: nothing falls back
    assert fallback_calls == []
    root = xpupack.save(model, tmp_path / "pkg")
    shown = CliRunner().invoke(main, ["inspect", "--json", str(root)])
    assert [m["padding"] for m in json.loads(shown.output)["modules"]] == [None, None]
    assert "padded up to" not in CliRunner().invoke(main, ["inspect", str(root)]).output

    class InPlace(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    model = nn.Sequential(InPlace())
    xpupack.tune(model, ladder_samples(), modules=["0"], strategy=xpupack.FirstWins([xpupack.EagerBackend()]))
    assert "changes its input tensors" in spec_of(model, "0").padding_refused


class NeedsTwoRows(nn.Module):
    """Runs the batches it is given, refuses a single row (as a module with a batch-only code path may)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] < 2:
            raise ValueError("this module needs at least two rows")
        return self.linear(x)


def test_a_module_the_padding_check_makes_raise_is_tuned_unpadded_and_says_why(emulated_graphs, fallback_calls):
    """The check cuts a recorded call of 2 rows to 1: the module's error means "not paddable", not a failed tune."""
    torch.manual_seed(0)
    model = nn.Sequential(NeedsTwoRows()).eval()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    xpupack.tune(model, [torch.randn(batch, 8, generator=generator) for batch in (2, 4)], modules=["0"], strategy=GRAPH)
    spec = spec_of(model, "0")
    assert spec.batch_axes == {}
    assert spec.padding_refused == (
        "the padding check's call of (f32[2,8]) cut to 1 row(s) failed to run "
        "(ValueError: this module needs at least two rows)"
    )
    assert xpupack.stats(model)["0"]["backend"] == "graph"
    serve(model, reference, (3,))  # not padded up to 4: the original module runs it
    assert [event.path for event in fallback_calls] == ["0"] and xpupack.stats(model)["0"]["padded"] == 0


def test_padding_survives_a_fresh_process_load(emulated_graphs, tmp_path, run_python):
    model, _ = tune_ladder()
    root = xpupack.save(model, tmp_path / "pkg")
    spec = json.loads((root / "modules/layers.0.mlp/spec.json").read_text())
    assert spec["batch_axes"] == [{"inputs": [0, None], "outputs": [0]}] * 4
    out = run_python(f"""
        import torch, xpupack
        from xpupack import _device
        from support.emulated_graph import EmulatedGraphs
        from support.models import make_stack
        _device.GRAPH_APIS["cpu"] = EmulatedGraphs()
        reference = make_stack()
        model = xpupack.load(make_stack(seed=9), {str(root)!r})
        with torch.no_grad():
            for batch in (3, 5, 7):
                x = torch.randn(batch, 8)
                assert torch.allclose(model(x), reference(x), atol=1e-5), batch
        print({{path: (s["backend"], s["padded"], s["fallbacks"]) for path, s in xpupack.stats(model).items()}})
    """)
    assert out.stdout.strip().splitlines()[-1] == "{'layers.0.mlp': ('graph', 3, 0), 'layers.1.mlp': ('graph', 3, 0)}"


@pytest.mark.parametrize(
    "damage",
    [
        lambda spec: spec["batch_axes"].pop(),  # one per signature
        lambda spec: spec["batch_axes"][0].update(inputs=[5, None]),  # no such axis
        lambda spec: spec["batch_axes"][0].update(inputs=[None, 0]),  # a constant
        lambda spec: spec["batch_axes"][0].update(inputs=[None, None]),  # no batch at all
        lambda spec: spec["signatures"][0]["leaves"][0].update(shape=[0, 8]),  # a batch of no rows
    ],
)
def test_damaged_batch_axes_are_refused_at_load(emulated_graphs, tmp_path, damage):
    model, _ = tune_ladder()
    root = xpupack.save(model, tmp_path / "pkg")
    rewrite_json(root, "modules/layers.0.mlp/spec.json", damage)
    with pytest.raises(PackageFormatError, match="batch[ _]axes"):
        xpupack.load(make_stack(), root)


@pytest.mark.slow
def test_batches_between_recorded_ones_are_padded_up_through_inductor(fallback_calls):
    model, reference = tune_ladder(xpupack.Only(xpupack.InductorBackend()), modules=("layers.0.mlp",))
    serve(model, reference, (3, 5, 7))
    assert fallback_calls == []
    serve(model, reference, (9,))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert (stats["backend"], stats["padded"], stats["fallbacks"]) == ("inductor", 3, 1)


# -- batch_sizes: a ladder of recorded batches from the samples (docs/tuning.md) -------------------


def test_a_ladder_of_batch_sizes_from_one_sample(emulated_graphs, fallback_calls):
    model = make_stack()
    reference = copy.deepcopy(model)
    sample = torch.randn(3, 8)
    xpupack.tune(model, [sample], modules=["layers.*.mlp"], strategy=GRAPH, batch_sizes=[8, 1, 2, 4, 2])
    spec = spec_of(model)
    assert [s.describe() for s in spec.signatures] == [f"(f32[{b},8], 1.0)" for b in (3, 1, 2, 4, 8)]
    assert spec.signature_calls == (1,) * 5 and emulated_graphs.captures == 10  # 5 batches x 2 modules
    report = xpupack.tuned.session_of(model).modules["layers.0.mlp"].report
    assert report[-1].backend == "graph" and report[-1].status == "chosen"  # every batch matched eager
    serve(model, reference, (1, 2, 3, 4, 8))
    serve(model, reference, (5, 6, 7))
    assert fallback_calls == []
    serve(model, reference, (9,))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert (stats["calls"], stats["padded"], stats["fallbacks"]) == (9, 3, 1)


def test_a_ladder_repeats_or_cuts_rows_of_each_batched_tensor():
    from xpupack.padding import batch_ladder

    x, mask, table = torch.arange(6).reshape(3, 2), torch.tensor([True, False, True]), torch.ones(5, 5)
    ladder = batch_ladder([(x, {"mask": mask, "table": table, "scale": 2.0})], [1, 3, 5])
    assert len(ladder) == 3  # the sample itself, then batches 1 and 5
    (small, small_kwargs), (big, big_kwargs) = ladder[1], ladder[2]
    assert torch.equal(small, x[:1]) and torch.equal(small_kwargs["mask"], mask[:1])
    assert torch.equal(big, x[[0, 1, 2, 0, 1]]) and torch.equal(big_kwargs["mask"], mask[[0, 1, 2, 0, 1]])
    assert big_kwargs["table"] is table and big_kwargs["scale"] == 2.0  # not batched: left as it was


@pytest.mark.parametrize("sizes", [[], [0, 2], [1.5], "12", [True]])
def test_batch_sizes_must_be_positive_integers(sizes):
    with pytest.raises(xpupack.TuningError, match="batch_sizes"):
        xpupack.tune(make_stack(), [torch.randn(2, 8)], modules=["layers.0.mlp"], batch_sizes=sizes)


# -- recording memory and GraphBackend(max_memory=...) (docs/device-graphs.md) ---------------------
# The emulated graph's capture reports the bytes of its static outputs, the runner adds its static
# inputs: a recording of f32[b,8] -> f32[b,8] takes 64 * b bytes, exactly.


def budget(max_memory):
    return xpupack.FirstWins([xpupack.GraphBackend(max_memory=max_memory), xpupack.EagerBackend()], min_speedup=None)


def test_recordings_report_their_memory_largest_first(emulated_graphs, fallback_calls):
    model, reference = tune_ladder()
    serve(model, reference, (3, 9))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["recording_memory"] == {
        "(f32[8,8], 1.0)": 512,
        "(f32[4,8], 1.0)": 256,
        "(f32[2,8], 1.0)": 128,
        "(f32[1,8], 1.0)": 64,
    }
    assert list(stats["recording_memory"]) == [
        "(f32[8,8], 1.0)",
        "(f32[4,8], 1.0)",
        "(f32[2,8], 1.0)",
        "(f32[1,8], 1.0)",
    ]  # the order they were recorded in
    assert stats["memory_bytes"] == 960 and "skipped" not in stats and "max_memory" not in stats
    summed = xpupack.stats(model, totals=True)
    assert summed["modules"] == xpupack.stats(model)
    assert summed["totals"] == {"calls": 4, "fallbacks": 2, "padded": 2, "memory_bytes": 2 * 960}
    assert len(fallback_calls) == 2  # batch 9, in each module


def test_a_memory_budget_skips_the_smaller_batches_and_pads_their_calls_up(emulated_graphs, fallback_calls):
    model, reference = tune_ladder(budget(512 + 256))  # room for batches 8 and 4 only
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["recording_memory"] == {"(f32[8,8], 1.0)": 512, "(f32[4,8], 1.0)": 256}
    assert stats["memory_bytes"] == 768 and stats["max_memory"] == 768 and stats["recordings"] == 2
    assert stats["skipped"] == {
        "(f32[2,8], 1.0)": "over the memory budget (max_memory=768 bytes): it took 128 bytes with 768 spent",
        "(f32[1,8], 1.0)": "over the memory budget (max_memory=768 bytes): recordings of more benefit took it",
    }
    serve(model, reference, range(1, 9))
    assert fallback_calls == [] and xpupack.stats(model)["layers.0.mlp"]["padded"] == 6  # 1, 2, 3, 5, 6, 7


def test_the_budget_keeps_the_most_called_signatures_and_the_rest_fall_back(emulated_graphs, fallback_calls):
    model = make_stack()
    reference = copy.deepcopy(model)
    samples = [torch.randn(8, 8)] + [torch.randn(batch, 8) for batch in (4, 2) for _ in range(3)]
    xpupack.tune(model, samples, modules=["layers.0.mlp"], strategy=budget(256 + 128))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert list(stats["recording_memory"]) == ["(f32[4,8], 1.0)", "(f32[2,8], 1.0)"]  # 3 calls each, then 1
    assert list(stats["skipped"]) == ["(f32[8,8], 1.0)"]
    serve(model, reference, (3, 8, 5))  # 3 padded up to 4; nothing larger is recorded for 8 and 5
    assert [event.path for event in fallback_calls] == ["layers.0.mlp"] * 2
    assert xpupack.stats(model)["layers.0.mlp"]["padded"] == 1


def test_a_budget_no_recording_fits_rejects_the_graph_backend_with_the_reason(emulated_graphs):
    model, _ = tune_ladder(budget(63), modules=("layers.0.mlp",))
    entry = xpupack.tuned.session_of(model).modules["layers.0.mlp"].report[0]
    assert entry.status == "rejected" and "no recording fits the memory budget" in entry.reason
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "eager"


def test_the_budget_survives_save_and_load_and_applies_when_recording_again(emulated_graphs, tmp_path, fallback_calls):
    model, reference = tune_ladder(budget(768))
    root = xpupack.save(model, tmp_path / "pkg")
    entry = json.loads((root / "xpupack.json").read_text())["modules"][0]
    assert entry["backend"]["options"] == {"max_memory": 768}
    captures = emulated_graphs.captures
    loaded = xpupack.load(make_stack(), root)
    assert emulated_graphs.captures == captures + 2 * 3  # batches 8, 4, and 2 (taken, then dropped)
    stats = xpupack.stats(loaded)["layers.0.mlp"]
    assert list(stats["recording_memory"]) == ["(f32[8,8], 1.0)", "(f32[4,8], 1.0)"]
    assert list(stats["skipped"]) == ["(f32[2,8], 1.0)", "(f32[1,8], 1.0)"]
    xpupack.deactivate(loaded)  # releases the recordings; the next call records again, within the budget
    xpupack.activate(loaded)
    serve(loaded, reference, (1, 2, 3))
    stats = xpupack.stats(loaded)["layers.0.mlp"]
    assert (stats["rerecordings"], stats["memory_bytes"], stats["padded"]) == (1, 768, 3)
    assert list(stats["skipped"]) == ["(f32[2,8], 1.0)", "(f32[1,8], 1.0)"] and fallback_calls == []

    shown = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(root)]).output)
    recorded = {m["path"]: m["recorded"] for m in shown["modules"]}
    assert recorded["layers.0.mlp"]["memory_bytes"] == 768 and recorded["layers.0.mlp"]["max_memory"] == 768
    assert recorded["layers.0.mlp"]["skipped"] == stats["skipped"] and shown["recording_memory_bytes"] == 2 * 768
    text = CliRunner().invoke(main, ["inspect", str(root)]).output
    assert "recordings: 768 B (max_memory 768 B)" in text and "skipped (f32[1,8], 1.0)" in text

    benched = CliRunner().invoke(
        main,
        ["bench", str(root), "--model", "support.models:make_stack", "--device", "cpu", "--iterations", "1", "--json"],
    )
    assert benched.exit_code == 0, benched.output
    assert json.loads(benched.output)["recording_memory"] == {
        "modules": {"layers.0.mlp": 768, "layers.1.mlp": 768},
        "total_bytes": 1536,
        "skipped": {path: stats["skipped"] for path in ("layers.0.mlp", "layers.1.mlp")},
    }


@pytest.mark.parametrize(
    "recorded",
    [
        {"memory_bytes": 768, "skipped": ["(f32[1,8], 1.0)"]},
        {"memory_bytes": 768, "max_memory": "768"},
        {"memory_bytes": 768, "recording_memory": {"(f32[8,8], 1.0)": None}},
        {"memory_bytes": True},
    ],
)
def test_inspect_shows_no_recordings_for_an_entry_of_another_shape(emulated_graphs, tmp_path, recorded):
    """The recordings' memory is for people only, so a package's entry of any other shape is not shown,
    rather than failing `inspect` with a TypeError."""
    model, _ = tune_ladder(budget(768))
    root = xpupack.save(model, tmp_path / "pkg")
    rewrite_json(
        root, "xpupack.json", lambda manifest: manifest["modules"][0]["backend"]["config"].update(recorded=recorded)
    )
    shown = CliRunner().invoke(main, ["inspect", "--json", str(root)])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["modules"][0]["recorded"] is None
    text = CliRunner().invoke(main, ["inspect", str(root)])
    assert text.exit_code == 0, text.output


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2GiB"])
def test_max_memory_must_be_a_positive_number_of_bytes(value):
    with pytest.raises(xpupack.TuningError, match=r"max_memory=.*positive number of bytes"):
        xpupack.GraphBackend(max_memory=value)


# -- batch_axis: the samples' batch axis when it is not the first -------------------------------------


class SequenceFirst(nn.Module):
    """Takes ``[sequence, batch, 8]``: adds the sequence's mean (positions mix), rows of the batch stay apart."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y + y.mean(dim=0, keepdim=True)


def sequence_first_model():
    torch.manual_seed(0)
    return nn.Sequential(SequenceFirst()).eval()


def test_a_declared_batch_axis_builds_the_ladder_along_it_and_pads_there(emulated_graphs, fallback_calls):
    model = sequence_first_model()
    reference = copy.deepcopy(model)
    xpupack.tune(model, [torch.randn(4, 3, 8)], modules=["0"], strategy=GRAPH, batch_sizes=LADDER, batch_axis=1)
    spec = spec_of(model, "0")
    assert [s.describe() for s in spec.signatures] == [f"(f32[4,{b},8])" for b in (3, 1, 2, 4, 8)]
    assert spec.padding_refused is None and {axes.inputs for axes in spec.batch_axes.values()} == {(1,)}
    with torch.no_grad():
        for batch in (5, 6, 7):
            x = torch.randn(4, batch, 8)
            assert torch.allclose(model(x), reference(x), atol=1e-5), batch
    assert fallback_calls == [] and xpupack.stats(model)["0"]["padded"] == 3


def test_without_the_declaration_the_ladder_resizes_axis_0_and_padding_there_is_refused(emulated_graphs):
    model = sequence_first_model()
    xpupack.tune(model, [torch.randn(4, 3, 8)], modules=["0"], strategy=GRAPH, batch_sizes=LADDER)
    spec = spec_of(model, "0")
    assert [s.describe() for s in spec.signatures][:2] == ["(f32[4,3,8])", "(f32[1,3,8])"]
    assert spec.batch_axes == {} and spec.padding_refused.startswith("rows mix")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_axis": 1}, "pass batch_sizes too"),
        ({"batch_sizes": [1, 2], "batch_axis": -1}, "non-negative integer"),
        ({"batch_sizes": [1, 2], "batch_axis": True}, "non-negative integer"),
        ({"batch_sizes": [1, 2], "batch_axis": 3}, r"a batch axis 3, not tensors of shapes \[\[4, 3, 8\]\]"),
    ],
)
def test_batch_axis_errors_say_what_to_pass(kwargs, message):
    with pytest.raises(xpupack.TuningError, match=message):
        xpupack.tune(sequence_first_model(), [torch.randn(4, 3, 8)], modules=["0"], **kwargs)


def test_build_records_a_ladder_from_the_command_line(tmp_path):
    out = tmp_path / "pkg"
    result = CliRunner().invoke(
        main,
        [
            "build",
            "support.models:make_stack",
            "--samples",
            "support.models:stack_samples",
            "--modules",
            "layers.0.mlp",
            "--backends",
            "eager",
            "--batch-sizes",
            "1,8",
            "--batch-axis",
            "0",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    spec = json.loads((out / "modules/layers.0.mlp/spec.json").read_text())
    assert [s["leaves"][0]["shape"][0] for s in spec["signatures"]] == [2, 4, 1, 8]
    assert spec["signature_calls"] == [1, 1, 2, 2]  # batches 1 and 8 made from each of the two samples
    assert spec["batch_axes"] == [{"inputs": [0, None], "outputs": [0]}] * 4
    bad = CliRunner().invoke(
        main,
        [
            "build",
            "support.models:make_stack",
            "--samples",
            "support.models:stack_samples",
            "--batch-sizes",
            "1,x",
            "--out",
            str(tmp_path / "other"),
        ],
    )
    assert bad.exit_code != 0 and "give batch sizes separated by commas" in bad.output


def test_half_precision_rows_that_mix_are_still_refused(emulated_graphs):
    torch.manual_seed(0)
    model = MixingStack().to(torch.bfloat16)
    samples = [sample.to(torch.bfloat16) for sample in ladder_samples()]
    xpupack.tune(model, samples, modules=["mix", "mlp"], strategy=GRAPH)
    assert "rows mix" in spec_of(model, "mix").padding_refused and "SQNR" in spec_of(model, "mix").padding_refused
    assert spec_of(model, "mlp").batch_axes and spec_of(model, "mlp").padding_refused is None


# -- a package's batch axes are a claim: checked before a loaded model pads with them ---------------


def _wrong_output_axes(spec):
    for axes in spec["batch_axes"]:
        axes["outputs"] = [1]  # the columns: of the same size as the rows only for the batch of 8


@pytest.mark.parametrize("strategy", [GRAPH, xpupack.Only(PaddingCountingBackend())], ids=["graph", "padded-copy"])
@pytest.mark.parametrize("checked_at_load", [True, False], ids=["at-load", "first-call"])
def test_output_batch_axes_that_name_the_wrong_rows_never_cut_an_answer(
    emulated_graphs, tmp_path, fallback_calls, monkeypatch, strategy, checked_at_load
):
    """Regression (found by tests/test_fuzz.py): a spec rewritten with its digest to cut the outputs along
    the wrong axis gave padded calls outputs of the wrong shape, or, where the shapes happen to agree
    (8 x 8), the wrong values. Axes that do not fit the outputs are refused; the load checks the axes on
    inputs of its own, and the first padded call into each recording of a loaded package is checked
    against the original module too (here alone, the load's check switched off)."""
    model, reference = tune_ladder(strategy)
    root = xpupack.save(model, tmp_path / "pkg")
    rewrite_json(root, "modules/layers.0.mlp/spec.json", _wrong_output_axes)
    if not checked_at_load:
        monkeypatch.setattr(xpupack.padding, "check_loaded", lambda spec, *args, **kwargs: spec)
    loaded = xpupack.load(make_stack(), root)
    assert ("checked at load" in (spec_of(loaded).padding_refused or "")) == checked_at_load
    serve(loaded, reference, (3, 5, 7, 5))
    stats = xpupack.stats(loaded)
    assert stats["layers.0.mlp"]["padded"] == 0 and stats["layers.0.mlp"]["fallbacks"] == 4
    assert ("padding check" in stats["layers.0.mlp"]["fallback_reasons"]) != checked_at_load
    assert (stats["layers.1.mlp"]["padded"], stats["layers.1.mlp"]["fallbacks"]) == (4, 0)  # untouched: checked once


def test_a_loaded_package_checks_its_first_padded_call_per_recording_only(
    emulated_graphs, tmp_path, fallback_calls, monkeypatch
):
    model, reference = tune_ladder()
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(make_stack(), root)
    tuned = xpupack.tuned.session_of(loaded).modules["layers.0.mlp"]
    originals = []
    forward = tuned.target.forward
    monkeypatch.setattr(tuned.target, "forward", lambda *a, **k: originals.append(1) or forward(*a, **k))
    serve(loaded, reference, (3, 3, 5, 7, 7))  # 3 -> 4, 5 and 7 -> 8
    assert len(originals) == 2 and fallback_calls == []
    assert xpupack.stats(loaded)["layers.0.mlp"]["padded"] == 5
    # a freshly tuned model was checked on its samples while tuning: no call runs the original
    tuned_now = xpupack.tuned.session_of(model).modules["layers.0.mlp"]
    forward_now = tuned_now.target.forward
    monkeypatch.setattr(tuned_now.target, "forward", lambda *a, **k: originals.append(2) or forward_now(*a, **k))
    serve(model, reference, (3, 5))
    assert 2 not in originals


def test_the_first_padded_call_check_allows_half_precision_rounding_as_tuning_does():
    """A larger batch runs other matrix kernels: in bfloat16 the rows may miss the elementwise tolerance by
    rounding, so the check takes an SQNR floor there; float32 and wrong rows still fail."""
    from xpupack._compare import mismatch
    from xpupack.padding import padded_rows_differ

    backend = xpupack.GraphBackend()
    expected = 10 * torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    rounded = expected * (1 + 0.04 * torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).sign())
    assert mismatch(rounded.bfloat16(), expected.bfloat16()) is not None  # beyond the elementwise tolerance
    assert padded_rows_differ(backend, rounded.bfloat16(), expected.bfloat16()) is None  # about 28 dB
    assert padded_rows_differ(backend, rounded, expected) is not None  # float32: elementwise, as tuned
    assert padded_rows_differ(backend, expected.flip(0).bfloat16(), expected.bfloat16()) is not None  # other rows


# -- what a loaded package says about its module is established from the module itself ---------------


class MaxMixing(nn.Module):
    """Adds each column's maximum over the batch: zero rows padded in change it only where every real row
    is below zero, so a padded call can agree with the module on one input and not on the next."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) + x.amax(dim=0, keepdim=True)


def _claim_batch_axes(spec):
    spec["batch_axes"] = [{"inputs": [0], "outputs": [0]}] * len(spec["signatures"])
    spec.pop("padding_refused", None)


def test_batch_axes_a_package_claims_for_a_module_whose_rows_mix_are_refused_at_load(
    emulated_graphs, tmp_path, fallback_calls
):
    """Regression: the axes were checked on the first padded call only; a call of positive rows passed,
    and a later one of negative rows came back wrong. The loader now checks the rows the way tuning does,
    on inputs of its own, before any call is padded."""
    torch.manual_seed(0)
    model, reference = tune_ladder(model=nn.Sequential(MaxMixing()), modules=("0",))
    assert "rows mix" in spec_of(model, "0").padding_refused  # honest tuning refuses
    root = xpupack.save(model, tmp_path / "pkg")
    rewrite_json(root, "modules/0/spec.json", _claim_batch_axes)
    loaded = xpupack.load(nn.Sequential(MaxMixing()), root)
    assert spec_of(loaded, "0").batch_axes == {} and "rows mix" in spec_of(loaded, "0").padding_refused
    positive = torch.rand(3, 8) + 0.5
    with torch.no_grad():
        for x in (positive, -positive):
            assert torch.allclose(loaded(x), reference(x), atol=1e-5)
    assert xpupack.stats(loaded)["0"]["padded"] == 0 and len(fallback_calls) == 2


class RowCounter(nn.Module):
    """Counts the rows it has seen in a buffer, as running statistics do (``counting=False``: the same
    weights and buffers, never written)."""

    def __init__(self, counting=True):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.int64))
        self.counting = counting

    def forward(self, x):
        if self.counting:
            self.rows_seen += x.shape[0]
        return self.linear(x)


def test_a_module_that_writes_its_own_buffers_is_never_padded_and_tuning_leaves_them_as_the_samples_did(
    emulated_graphs, fallback_calls
):
    """Padding would feed its zero rows into the buffers (a row counter counts them)."""
    model, reference = tune_ladder(model=nn.Sequential(RowCounter()), modules=("0",))
    assert spec_of(model, "0").batch_axes == {} and "buffer" in spec_of(model, "0").padding_refused
    assert model[0].rows_seen.item() == sum(LADDER)  # the samples' own run, not tuning's checks and timing
    with torch.no_grad():
        x = torch.randn(3, 8)
        assert torch.allclose(model(x), reference[0].linear(x), atol=1e-6)
    assert model[0].rows_seen.item() == sum(LADDER) + 3 and len(fallback_calls) == 1


def test_a_loaded_module_that_writes_its_own_buffers_is_not_padded_and_loading_leaves_them_alone(
    emulated_graphs, tmp_path, fallback_calls
):
    """Regression: a package made from a module that does not count (its axes honest there) loaded into
    one that does: loading left the counter at what its recordings and checks counted, and the first
    padded call counted its rows twice (7 for a call of 3)."""
    model, _ = tune_ladder(model=nn.Sequential(RowCounter(counting=False)), modules=("0",))
    assert spec_of(model, "0").batch_axes
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(nn.Sequential(RowCounter()), root)
    assert loaded[0].rows_seen.item() == 0  # as the package holds it
    assert spec_of(loaded, "0").batch_axes == {} and "buffer" in spec_of(loaded, "0").padding_refused
    with torch.no_grad():
        loaded(torch.randn(3, 8))
    assert loaded[0].rows_seen.item() == 3 and len(fallback_calls) == 1


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(16, 8)

    def forward(self, ids):
        return self.embedding(ids)


def test_batch_axes_over_integer_inputs_alone_are_kept_only_from_a_trusted_source(emulated_graphs):
    """The loader's check fills integer inputs with zeros (the only index valid for any table): rows that
    differ only in token ids give it nothing to vary, so such a package's word counts only where its
    compiled code would (a local folder, a pinned Hub commit, trust_compiled=True)."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(Embed())
    xpupack.tune(
        model,
        [torch.randint(0, 16, (batch, 4), generator=generator) for batch in LADDER],
        modules=["0"],
        strategy=GRAPH,
    )
    tuned = spec_of(model, "0")
    assert tuned.batch_axes
    xpupack.deactivate(model)  # the checks run the original forward
    for trusted in (True, False):
        spec = xpupack.padding.check_loaded(copy.deepcopy(tuned), model[0].forward, trusted=trusted)
        assert bool(spec.batch_axes) == trusted
        assert trusted or "not trusted" in spec.padding_refused


# -- verify_padding="always": every padded call checked (issue 32, item 13) ---------------------------------------


class MixesWhenLarge(nn.Module):
    """Rows mix only for large inputs (a data-dependent branch): every padding check on ordinary values
    passes, and a padded call of large values comes back wrong."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y + y.mean(dim=0, keepdim=True) if x.abs().amax() > 100 else y


@pytest.mark.parametrize("how", ["tune", "load"])
def test_verify_padding_always_checks_every_padded_call_against_the_original(
    emulated_graphs, tmp_path, fallback_calls, how
):
    torch.manual_seed(0)
    model, reference = tune_ladder(model=nn.Sequential(MixesWhenLarge()), modules=("0",))
    assert spec_of(model, "0").batch_axes  # its rows passed every check
    large = torch.randn(3, 8) * 1000
    with torch.no_grad():
        assert not torch.allclose(model(large), reference(large), atol=1e-3)  # documented: wrong when padded
    root = xpupack.save(model, tmp_path / "pkg")
    if how == "tune":
        torch.manual_seed(0)
        checked, _ = tune_ladder(model=nn.Sequential(MixesWhenLarge()), modules=("0",), verify_padding="always")
    else:
        checked = xpupack.load(nn.Sequential(MixesWhenLarge()), root, verify_padding="always")
        checked.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for x in (torch.randn(3, 8), torch.randn(3, 8), large, torch.randn(3, 8)):
            assert torch.allclose(checked(x), reference(x), atol=1e-4)
    stats = xpupack.stats(checked)["0"]
    # each padded call ran the original too; the third disagreed, so 3 rows are now padded up to 8, not 4
    assert stats["padding_checks"] == 4
    assert (stats["padded"], stats["fallback_reasons"].get("padding check")) == (3, 1)


@pytest.mark.parametrize("value", ["sometimes", True, None])
def test_verify_padding_is_first_or_always(value):
    with pytest.raises(ValueError, match="verify_padding=.*give 'first' .* or 'always'"):
        xpupack.tune(make_stack(), ladder_samples(), modules=["layers.*.mlp"], verify_padding=value)
