import pytest
import torch

import xpupack
from support.backends import CountingBackend, CpuOnlyNever, DelayBackend, ShortcutBackend, TransformingCountingBackend
from support.models import Accumulator, RunningCache, SlowEager, make_stack, stack_samples
from xpupack.errors import NoCandidateError


def report(model, path="layers.0.mlp"):
    return xpupack.tuned.session_of(model).modules[path].report


def test_first_wins_skips_unavailable_wrong_and_broken_candidates():
    model = make_stack()
    strategy = xpupack.FirstWins([CpuOnlyNever(), CountingBackend(offset=1.0),
                                  CountingBackend(build_error="no kernel for this op"), xpupack.EagerBackend()])
    xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"], strategy=strategy)
    entries = report(model)
    assert [e["status"] for e in entries] == ["rejected", "rejected", "rejected", "chosen"]
    assert "never available" in entries[0]["reason"]
    assert "max abs difference" in entries[1]["reason"] and "f32[2,8]" in entries[1]["reason"]
    assert "no kernel for this op" in entries[2]["reason"]
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "eager"


def test_default_order_is_graph_inductor_eager():
    from xpupack.strategies import default_strategy

    strategy = default_strategy()
    assert isinstance(strategy, xpupack.FirstWins)
    assert [b.name for b in strategy.backends] == ["graph", "inductor", "eager"]


def test_first_wins_with_no_passing_candidate_explains_each():
    model = make_stack()
    with pytest.raises(NoCandidateError, match=r"(?s)never.*counting.*EagerBackend"):
        xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"],
                     strategy=xpupack.FirstWins([CpuOnlyNever(), CountingBackend(offset=1.0)]))


def test_only_raises_the_backend_error():
    with pytest.raises(NoCandidateError, match="max abs difference"):
        xpupack.tune(make_stack(), stack_samples(), modules=["layers.0.mlp"],
                     strategy=xpupack.Only(CountingBackend(offset=0.5)))


class _UnregisteredCache:
    """A state object nobody registered: calls that pass one cannot be recorded."""

    def __init__(self):
        self.total = torch.zeros(1, 8)


class _UsesCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.total.add_(self.linear(x))
        return cache.total.clone()


def test_only_raises_when_its_backend_can_take_none_of_the_calls():
    model = _UsesCache().eval()
    cache = _UnregisteredCache()
    with pytest.raises(NoCandidateError, match=r"(?s)<model>.*counting.*none of its 3 calls.*_UnregisteredCache"):
        xpupack.tune(model, [torch.randn(1, 8) for _ in range(3)], run=lambda m, x: m(x, cache),
                     strategy=xpupack.Only(CountingBackend()))


def test_only_eager_keeps_a_module_whose_calls_cannot_be_recorded():
    model = _UsesCache().eval()
    cache = _UnregisteredCache()
    xpupack.tune(model, [torch.randn(1, 8)], run=lambda m, x: m(x, cache), strategy=xpupack.Only(xpupack.EagerBackend()))
    assert xpupack.stats(model)[""]["backend"] == "eager"


def test_fastest_times_every_passing_candidate_and_keeps_one():
    model = make_stack()
    # CountingBackend runs eager's forward: as fast as eager, so the speed gate is off here
    strategy = xpupack.Fastest([CountingBackend(), xpupack.EagerBackend(), CountingBackend(offset=1.0)],
                               iterations=3, min_speedup=None)
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"], strategy=strategy)
    entries = report(model)
    assert [e["status"] for e in entries].count("chosen") == 1
    assert entries[2]["status"] == "rejected"
    timed = [e for e in entries if e["status"] in ("chosen", "accepted")]
    assert len(timed) == 2 and all(e["median_us"] > 0 for e in timed)
    chosen = next(e for e in entries if e["status"] == "chosen")
    assert chosen["median_us"] == min(e["median_us"] for e in timed)


# -- the speed gate: never slower than eager (issue 11) -----------------------------------------------

@pytest.mark.parametrize("kind", [xpupack.FirstWins, xpupack.Fastest])
def test_a_candidate_slower_than_eager_is_rejected_with_its_speedup(kind, tmp_path):
    model = make_stack()
    xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"],
                 strategy=kind([DelayBackend(delay=0.005), xpupack.EagerBackend()], iterations=3))
    slow, eager = report(model)
    assert slow["backend"] == "delay" and slow["status"] == "rejected"
    assert 0 < slow["speedup"] < 1 and f"{slow['speedup']}x eager's speed" in slow["reason"]
    assert "not faster than eager" in slow["reason"] and "min_speedup=1.0" in slow["reason"]
    assert eager["backend"] == "eager" and eager["status"] == "chosen" and "speedup" not in eager
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"eager"}
    # the package keeps the reason and the speedup, and inspect shows them
    from click.testing import CliRunner
    from xpupack.cli import main
    from xpupack.manifest import read_manifest

    root = xpupack.save(model, tmp_path / "pkg")
    assert read_manifest(root)["modules"][0]["candidates"][0]["speedup"] == slow["speedup"]
    shown = CliRunner().invoke(main, ["inspect", str(root)])
    assert shown.exit_code == 0 and "not faster than eager" in shown.output.replace("\n", " ")


def test_a_candidate_faster_than_eager_is_kept_with_its_speedup():
    model = SlowEager(delay=0.005)
    xpupack.tune(model, [torch.randn(2, 8)], strategy=xpupack.FirstWins([ShortcutBackend(), xpupack.EagerBackend()],
                                                                         iterations=3))
    entries = report(model, "")
    assert [(e["backend"], e["status"]) for e in entries] == [("shortcut", "chosen")]
    assert entries[0]["speedup"] > 1 and entries[0]["median_us"] > 0


def test_a_min_speedup_above_the_candidates_rejects_it_and_none_keeps_a_slower_one():
    model = SlowEager(delay=0.005)
    xpupack.tune(model, [torch.randn(2, 8)], strategy=xpupack.FirstWins([ShortcutBackend(), xpupack.EagerBackend()],
                                                                         min_speedup=1e6, iterations=3))
    assert [e["status"] for e in report(model, "")] == ["rejected", "chosen"]
    model = make_stack()
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"],
                 strategy=xpupack.FirstWins([DelayBackend(), xpupack.EagerBackend()], min_speedup=None))
    assert report(model) == [{"backend": "delay", "status": "chosen", "reason": "first to pass"}]


def test_only_is_never_timed_against_eager():
    model = make_stack()
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(DelayBackend()))
    assert report(model) == [{"backend": "delay", "status": "chosen", "reason": "only candidate"}]


def test_the_speed_option_round_trips_in_repr_and_is_checked():
    namespace = {"xpupack": xpupack, "FirstWins": xpupack.FirstWins, "Fastest": xpupack.Fastest,
                 "EagerBackend": xpupack.EagerBackend, "GraphBackend": xpupack.GraphBackend}
    for strategy in (xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()]),
                     xpupack.FirstWins([xpupack.EagerBackend()], min_speedup=None),
                     xpupack.Fastest([xpupack.EagerBackend()], min_speedup=1.25, iterations=5)):
        again = eval(repr(strategy), namespace)
        assert (type(again), again.min_speedup, again.iterations) == \
            (type(strategy), strategy.min_speedup, strategy.iterations)
    assert repr(xpupack.FirstWins([xpupack.EagerBackend()], min_speedup=None)) == \
        "FirstWins([EagerBackend()], min_speedup=None)"
    assert repr(xpupack.FirstWins([xpupack.EagerBackend()])) == "FirstWins([EagerBackend()])"
    for bad in (0, -1.0, True, "fast"):
        with pytest.raises(ValueError, match="min_speedup"):
            xpupack.FirstWins([xpupack.EagerBackend()], min_speedup=bad)


def test_timing_is_weighted_by_how_often_each_signature_was_called(tmp_path):
    import json

    samples = [torch.randn(2, 8), torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8)]
    model = xpupack.tune(make_stack(), samples, modules=["layers.0.mlp"], strategy=xpupack.FirstWins([xpupack.EagerBackend()]))
    spec = xpupack.tuned.session_of(model).modules["layers.0.mlp"].spec
    assert spec.signature_calls == [3, 1]
    root = xpupack.save(model, tmp_path / "pkg")
    assert json.loads((root / "modules/layers.0.mlp/spec.json").read_text())["signature_calls"] == [3, 1]
    assert xpupack.tuned.session_of(xpupack.load(make_stack(), root)).modules["layers.0.mlp"].spec.signature_calls \
        == [3, 1]


def test_a_call_with_state_is_timed_from_the_recorded_state_every_time(emulated_graphs):
    """Timing a decode-like step many times must not let the state run on: eager and the candidate both
    start each timed call from the state the samples saw, and the cache ends as the samples left it."""
    xpupack.register_state(RunningCache, lambda cache: [cache.total, cache.steps])
    torch.manual_seed(0)
    model, cache = Accumulator(), RunningCache()
    reference, expected_cache = Accumulator(), RunningCache()
    reference.load_state_dict(model.state_dict())
    steps = [torch.randn(1, 8) for _ in range(3)]
    with torch.no_grad():
        for x in steps:
            reference(x, expected_cache)
    xpupack.tune(model, steps, run=lambda m, x: m(x, cache),
                 strategy=xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], iterations=5))
    graph = report(model, "")[0]
    assert graph["backend"] == "graph" and graph["speedup"] > 0
    assert torch.equal(cache.total, expected_cache.total) and int(cache.steps) == 3


def test_candidates_are_checked_against_eager_per_dtype():
    from xpupack._compare import mismatch

    x = torch.ones(4, dtype=torch.float16)
    assert mismatch(x + 5e-3, x) is None            # within float16 tolerance
    assert mismatch(x + 0.1, x) is not None
    assert mismatch(torch.ones(4) + 1e-3, torch.ones(4)) is not None  # float32 is tighter
    assert mismatch(torch.tensor([1, 2]), torch.tensor([1, 3])) == "output 0: values differ from eager"
    assert mismatch(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert "structure" in mismatch((x, x), x)


def test_paired_timing_alternates_the_two_functions():
    from xpupack import _timing

    order = []
    first, second = _timing.measure_pair(lambda: order.append("a"), lambda: order.append("b"),
                                         torch.device("cpu"), warmup=2, iterations=5)
    assert order == ["a", "b"] * 7 and first.iterations == second.iterations == 5


@pytest.mark.parametrize("backend, paired", [(CountingBackend(), True),
                                             (TransformingCountingBackend(), False),
                                             (xpupack.GraphBackend(base=TransformingCountingBackend()), False)],
                         ids=["candidate", "transforms-module", "over-a-transforming-base"])
def test_the_speed_gate_times_eager_and_the_candidate_side_by_side(monkeypatch, emulated_graphs, backend, paired):
    """Eager and a candidate timed in separate stretches let a burst of machine load during one of them
    decide the gate (a CPU build once measured Inductor at 8x eager); a candidate that leaves the module
    as it is is timed in alternating calls with eager. One that changes the module in place cannot be
    (eager's forward is gone), and keeps eager's up-front timing."""
    from xpupack import _timing

    pairs = []
    measure_pair = _timing.measure_pair
    monkeypatch.setattr(_timing, "measure_pair", lambda *a, **k: pairs.append(1) or measure_pair(*a, **k))
    model = make_stack()
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"],
                 strategy=xpupack.FirstWins([backend, xpupack.EagerBackend()], min_speedup=0.01))
    entry = report(model)[0]
    assert entry["status"] == "chosen" and entry["speedup"] > 0
    assert bool(pairs) is paired
