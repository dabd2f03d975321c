"""Padding a smaller batch up to a recorded one (issue 11 B), through the emulated graph and Inductor."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import xpupack
from support.models import make_stack
from support.package_tools import rewrite_json
from xpupack.cli import main
from xpupack.errors import PackageFormatError

LADDER = (1, 2, 4, 8)
#: the emulated graph is slower than eager by construction: the speed gate is off for it
GRAPH = xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], min_speedup=None)


def ladder_samples():
    generator = torch.Generator().manual_seed(2)
    return [torch.randn(batch, 8, generator=generator) for batch in LADDER]


def tune_ladder(strategy=GRAPH, model=None, modules=("layers.*.mlp",)):
    model = model or make_stack()
    reference = copy.deepcopy(model)
    xpupack.tune(model, ladder_samples(), modules=list(modules), strategy=strategy)
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


def test_a_batch_whose_recording_failed_is_padded_up_to_the_next(emulated_graphs, tmp_path, fallback_calls):
    model, reference = tune_ladder()
    root = xpupack.save(model, tmp_path / "pkg")
    attempts = iter(range(100))
    emulated_graphs.fail_capture = lambda: next(attempts) == 1  # batch 2 of layers.0 at load
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
    assert padding["mix"].startswith("never padded: rows mix") and padding["mlp"] == \
        "smaller batches padded up to 1, 2, 4, 8"


def test_eager_and_a_module_changing_its_inputs_are_not_padded(emulated_graphs, fallback_calls):
    model, reference = tune_ladder(xpupack.FirstWins([xpupack.EagerBackend()]))
    serve(model, reference, (3,))
    assert xpupack.stats(model)["layers.0.mlp"]["padded"] == 0  # eager runs any batch itself

    class InPlace(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    model = nn.Sequential(InPlace())
    xpupack.tune(model, ladder_samples(), modules=["0"], strategy=xpupack.FirstWins([xpupack.EagerBackend()]))
    assert "changes its input tensors" in spec_of(model, "0").padding_refused


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
    assert out.stdout.strip().splitlines()[-1] == \
        "{'layers.0.mlp': ('graph', 3, 0), 'layers.1.mlp': ('graph', 3, 0)}"


@pytest.mark.parametrize("damage", [
    lambda spec: spec["batch_axes"].pop(),                                            # one per signature
    lambda spec: spec["batch_axes"][0].update(inputs=[5, None]),                      # no such axis
    lambda spec: spec["batch_axes"][0].update(inputs=[None, 0]),                      # a constant
    lambda spec: spec["batch_axes"][0].update(inputs=[None, None]),                   # no batch at all
    lambda spec: spec["signatures"][0]["leaves"][0].update(shape=[0, 8]),               # a batch of no rows
])
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


# -- batch_sizes: a ladder of recorded batches from the samples (issue 11 C) --------------------------

def test_a_ladder_of_batch_sizes_from_one_sample(emulated_graphs, fallback_calls):
    model = make_stack()
    reference = copy.deepcopy(model)
    sample = torch.randn(3, 8)
    xpupack.tune(model, [sample], modules=["layers.*.mlp"], strategy=GRAPH, batch_sizes=[8, 1, 2, 4, 2])
    spec = spec_of(model)
    assert [s.describe() for s in spec.signatures] == [f"(f32[{b},8], 1.0)" for b in (3, 1, 2, 4, 8)]
    assert spec.signature_calls == [1] * 5 and emulated_graphs.captures == 10  # 5 batches x 2 modules
    report = xpupack.tuned.session_of(model).modules["layers.0.mlp"].report
    assert report[-1]["backend"] == "graph" and report[-1]["status"] == "chosen"  # every batch matched eager
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
