"""The graph backend's logic on CPU, through the emulated graph (tests/support/emulated_graph.py)."""

import copy

import pytest
import torch
from torch import nn

import xpupack
from support.backends import CountingBackend, PaddingCountingBackend
from support.models import make_stack, stack_samples
from support.strategies import GRAPH
from xpupack.manifest import read_manifest


def tune_stack(strategy=GRAPH, samples=None):
    model = make_stack()
    reference = copy.deepcopy(model)
    xpupack.tune(model, samples or stack_samples(), modules=["layers.*.mlp"], strategy=strategy)
    return model, reference


def runner(model, path="layers.0.mlp"):
    return xpupack.tuned.session_of(model).modules[path].runner


def test_unavailable_on_cpu_without_emulation():
    assert not xpupack.GraphBackend().available(torch.device("cpu"))
    model, _ = tune_stack()
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "eager"
    assert "no device graphs on cpu" in xpupack.tuned.session_of(model).modules["layers.0.mlp"].report[0].reason


def test_one_recording_per_batch_size_and_replay_equals_eager(emulated_graphs):
    model, reference = tune_stack()
    assert emulated_graphs.captures == 4  # 2 modules x 2 batch sizes
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["backend"] == "graph" and stats["recordings"] == 2
    replays = emulated_graphs.replays
    with torch.no_grad():
        for batch in (2, 4, 2):
            x = torch.randn(batch, 8)
            assert torch.allclose(model(x), reference(x), atol=1e-6)
    assert emulated_graphs.replays == replays + 6


def test_inputs_are_copied_into_static_buffers(emulated_graphs):
    model, reference = tune_stack()
    recording = runner(model).recordings[0]
    x = torch.randn(2, 8)
    with torch.no_grad():
        model.layers[0]["mlp"](x, scale=1.0)
    assert torch.equal(recording.static_leaves[0], x)
    assert recording.static_leaves[0] is not x


def test_callers_get_copies_by_default(emulated_graphs):
    model, reference = tune_stack()
    mlp = model.layers[0]["mlp"]
    with torch.no_grad():
        first = mlp(torch.ones(2, 8), scale=1.0)
        kept = first.clone()
        second = mlp(torch.zeros(2, 8), scale=1.0)
    assert torch.equal(first, kept)  # the second replay did not overwrite the first result
    assert first.data_ptr() != second.data_ptr()


def test_aliases_when_asked_for(emulated_graphs):
    model, _ = tune_stack(xpupack.Only(xpupack.GraphBackend(copy_outputs=False)))
    mlp = model.layers[0]["mlp"]
    with torch.no_grad():
        first = mlp(torch.ones(2, 8), scale=1.0)
        second = mlp(torch.zeros(2, 8), scale=1.0)
    assert first.data_ptr() == second.data_ptr()  # documented: the next replay overwrites it


@pytest.mark.parametrize("case", ["larger batch", "scale=3.0", "grad enabled", "training mode"])
def test_inputs_the_recording_cannot_take_fall_back(emulated_graphs, fallback_calls, case):
    model, reference = tune_stack()
    mlp, ref = model.layers[0]["mlp"], reference.layers[0]["mlp"]
    x, kwargs = (torch.randn(16, 8), {"scale": 1.0}) if case == "larger batch" else (torch.randn(2, 8), {"scale": 1.0})
    if case == "scale=3.0":
        kwargs = {"scale": 3.0}
    if case == "training mode":
        model.train()
    replays = emulated_graphs.replays
    context = torch.enable_grad() if case == "grad enabled" else torch.no_grad()
    with context:
        assert torch.equal(mlp(x, **kwargs), ref(x, **kwargs))
    assert emulated_graphs.replays == replays
    assert len(fallback_calls) == 1


def test_replaced_parameters_are_rerecorded_never_stale(emulated_graphs):
    model, reference = tune_stack()
    mlp, ref = model.layers[0]["mlp"], reference.layers[0]["mlp"]
    new_weight = torch.randn(16, 8)
    mlp.up.weight = nn.Parameter(new_weight.clone())
    ref.up.weight = nn.Parameter(new_weight.clone())
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(mlp(x, scale=1.0), ref(x, scale=1.0), atol=1e-6)
    assert runner(model).rerecordings == 1


def test_moved_storage_is_rerecorded(emulated_graphs):
    model, reference = tune_stack()
    mlp, ref = model.layers[0]["mlp"], reference.layers[0]["mlp"]
    with torch.no_grad():
        mlp.down.weight.data = torch.randn(8, 16)  # what .to() does to every parameter
        ref.down.weight.data = mlp.down.weight.data.clone()
        x = torch.randn(4, 8)
        assert torch.allclose(mlp(x, scale=1.0), ref(x, scale=1.0), atol=1e-6)
    assert runner(model).rerecordings == 1


def test_in_place_weight_updates_are_seen_without_rerecording(emulated_graphs):
    model, _ = tune_stack()
    other = make_stack(seed=42)
    model.load_state_dict(other.state_dict())
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), other(x), atol=1e-6)
    assert runner(model).rerecordings == 0


def test_dtype_change_never_replays_stale_memory(emulated_graphs, fallback_calls):
    model, reference = tune_stack()
    model.double()
    reference.double()
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # another dtype: falls back
        with pytest.raises(RuntimeError) as expected:
            reference(torch.randn(2, 8))
        with pytest.raises(RuntimeError) as got:
            model(torch.randn(2, 8))  # the recorded dtype, but the weights changed: eager's own error
    assert str(got.value) == str(expected.value)


def test_capture_failure_rejects_the_backend_with_its_reason(emulated_graphs):
    emulated_graphs.fail_capture = lambda: True
    model, _ = tune_stack()
    entry = xpupack.tuned.session_of(model).modules["layers.0.mlp"].report[0]
    assert entry.status == "rejected" and "emulated capture failure" in entry.reason
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "eager"


def test_recording_cap_keeps_the_largest_and_the_rest_are_padded_up(emulated_graphs, fallback_calls):
    samples = [torch.randn(b, 8) for b in (1, 2, 3)]
    model, reference = tune_stack(xpupack.Only(xpupack.GraphBackend(max_recordings=2)), samples)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["recordings"] == 2 and stats["not_recorded"] == {
        "(f32[1,8], 1.0)": "over the cap of 2 recordings per module"
    }
    with torch.no_grad():
        assert torch.allclose(model(samples[0]), reference(samples[0]), atol=1e-6)
    assert fallback_calls == [] and xpupack.stats(model)["layers.0.mlp"]["padded"] == 1


def test_package_stores_signatures_only_and_load_records_again(emulated_graphs, tmp_path):
    model, reference = tune_stack()
    root = xpupack.save(model, tmp_path / "pkg")
    manifest = read_manifest(root)
    assert all(
        m["backend"]
        == {
            "name": "graph",
            "options": {},
            "config": {
                "recorded": {
                    "memory_bytes": (4 + 2) * 8 * 4 * 2,  # a static input and output, f32[b,8], of batches 4 and 2
                    "recording_memory": {"(f32[4,8], 1.0)": 256, "(f32[2,8], 1.0)": 128},
                }
            },
        }
        for m in manifest["modules"]
    )
    assert not any(p.is_file() for p in (root / "modules/layers.0.mlp").rglob("*") if p.name != "spec.json")
    captures = emulated_graphs.captures
    loaded = xpupack.load(make_stack(seed=3), root)
    assert emulated_graphs.captures == captures + 4
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.allclose(loaded(x), reference(x), atol=1e-6)


def test_a_signature_that_fails_to_record_at_load_falls_back_alone(emulated_graphs, tmp_path, fallback_calls):
    model, reference = tune_stack()
    root = xpupack.save(model, tmp_path / "pkg")
    attempts = iter(range(100))
    # the first recording at load (batch 4 of layers.0, recorded largest first) fails: the largest
    # batch, so no call of it can be padded up to another recording
    emulated_graphs.fail_capture = lambda: next(attempts) == 0
    loaded = xpupack.load(make_stack(), root)
    stats = xpupack.stats(loaded)["layers.0.mlp"]
    assert stats["recordings"] == 1 and "emulated capture failure" in str(stats["not_recorded"])
    with torch.no_grad():
        for batch in (2, 4):
            x = torch.randn(batch, 8)
            assert torch.allclose(loaded(x), reference(x), atol=1e-6)
    assert [e.path for e in fallback_calls] == ["layers.0.mlp"]  # batch 4 of layers.0 only


def test_graph_records_another_backends_runner(emulated_graphs, tmp_path):
    strategy = xpupack.Only(xpupack.GraphBackend(base=CountingBackend()))
    model, reference = tune_stack(strategy)
    base = runner(model).base_runner
    runs = base.runs
    with torch.no_grad():
        x = torch.randn(2, 8)
        assert torch.allclose(model(x), reference(x), atol=1e-6)
    assert base.runs > runs  # the emulated replay re-runs the recorded base runner
    root = xpupack.save(model, tmp_path / "pkg")
    entry = read_manifest(root)["modules"][0]["backend"]
    assert entry["options"] == {"base": {"name": "counting", "options": {"offset": 0.0, "fail": False}}}
    loaded = xpupack.load(make_stack(), root)
    assert runner(loaded).base_runner is not None


def test_deactivate_releases_recordings_and_activate_records_again(emulated_graphs):
    model, reference = tune_stack()
    xpupack.deactivate(model)
    assert runner(model).recordings == {}
    xpupack.activate(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-6)
    assert runner(model).rerecordings == 1 and len(runner(model).recordings) == 2


def test_storage_watch_sees_replaced_submodules(emulated_graphs):
    model, reference = tune_stack()
    mlp = model.layers[0]["mlp"]
    mlp.up = nn.Linear(8, 16)
    reference.layers[0]["mlp"].up = copy.deepcopy(mlp.up)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), atol=1e-6)
    assert runner(model).rerecordings == 1


@pytest.mark.parametrize(
    "options", [{"max_recordings": 0}, {"max_recordings": "all"}, {"max_recordings": True}, {"copy_outputs": "yes"}]
)
def test_bad_options_are_refused_when_the_backend_is_made(options):
    with pytest.raises(ValueError, match="GraphBackend"):
        xpupack.GraphBackend(**options)


def test_bad_options_in_a_manifest_name_the_backend():
    from xpupack.backends.base import backend_from_json
    from xpupack.errors import UnknownConfigError

    with pytest.raises(UnknownConfigError, match="graph"):
        backend_from_json("graph", {"max_recordings": "all"})


class AddsInPlace(nn.Module):
    """Changes its input in place, as some fused residual blocks do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x.add_(1.0)
        return self.linear(x)


def test_modules_that_change_their_inputs_are_never_recorded(emulated_graphs, tmp_path):
    model = nn.Sequential(AddsInPlace()).eval()
    reference = copy.deepcopy(model)
    xpupack.tune(model, [torch.zeros(2, 8)], modules=["0"], strategy=GRAPH)
    tuned = xpupack.tuned.session_of(model).modules["0"]
    assert tuned.backend_name == "eager" and "in place" in tuned.report[0].reason
    x, y = torch.zeros(2, 8), torch.zeros(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(y))
    assert torch.equal(x, y)  # the caller sees the in-place change, as with eager


def test_a_package_claiming_graph_for_such_a_module_falls_back_at_load(emulated_graphs, tmp_path, caplog):
    import json

    model = nn.Sequential(AddsInPlace()).eval()
    xpupack.tune(model, [torch.zeros(2, 8)], modules=["0"], strategy=xpupack.FirstWins([xpupack.EagerBackend()]))
    root = xpupack.save(model, tmp_path / "pkg")
    manifest = json.loads((root / "xpupack.json").read_text())
    manifest["modules"][0]["backend"] = {"name": "graph", "options": {}, "config": {}}
    (root / "xpupack.json").write_text(json.dumps(manifest))
    loaded = xpupack.load(nn.Sequential(AddsInPlace()), root)
    assert xpupack.stats(loaded)["0"]["backend"] == "eager"
    assert "in place" in caplog.text


class WritesInto(nn.Module):
    """Writes its result into a tensor the caller passes (``out``), as kernels with an output argument do
    (``writes=False``: the same weights and result, ``out`` left alone)."""

    def __init__(self, writes=True):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.writes = writes

    def forward(self, x, out):
        y = self.linear(x)
        if self.writes:
            out.copy_(y)
        return y


class WritesIntoModel(nn.Module):
    def __init__(self, writes=True):
        super().__init__()
        self.inner = WritesInto(writes)

    def forward(self, x, out):
        return self.inner(x, out)


@pytest.mark.parametrize("strategy", [GRAPH, xpupack.Only(PaddingCountingBackend())], ids=["graph", "padded-copy"])
def test_a_package_saying_its_module_leaves_its_inputs_alone_is_checked_at_load(
    emulated_graphs, tmp_path, fallback_calls, backend_downgrades, strategy
):
    """Regression: ``mutates_inputs: false`` was the package's word. For a module that writes into an input,
    a replay (or a padded copy of the call) wrote into a copy, and the caller's tensor stayed as it was while
    the outputs matched. The loader now sees the write on its own check run: no recording, no padding."""
    torch.manual_seed(0)
    samples = [(torch.randn(batch, 8), torch.zeros(batch, 8)) for batch in (1, 2, 4, 8)]
    model = WritesIntoModel(writes=False)
    xpupack.tune(model, samples, modules=["inner"], strategy=strategy)
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(WritesIntoModel(), root)
    assert xpupack.tuned.session_of(loaded).modules["inner"].spec.mutates_inputs
    graph = strategy is GRAPH  # no recording: the original module runs; a padding backend runs, but never pads
    for batch in (4, 3):  # a recorded batch (a replay), and one that would be padded up to 4
        x, out = torch.randn(batch, 8), torch.zeros(batch, 8)
        with torch.no_grad():
            y = loaded(x, out)
            assert torch.allclose(out, loaded.inner.linear(x)) and torch.allclose(y, out)
    assert xpupack.stats(loaded)["inner"]["padded"] == 0
    assert [(event.running, "in place" in event.reason) for event in backend_downgrades] == (
        [("eager", True)] if graph else []
    )
    # the batch of 3, which no recording takes; a module downgraded to eager runs every call itself
    assert len(fallback_calls) == (0 if graph else 1)
