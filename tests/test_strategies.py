import pytest
import torch

import xpupack
from support.backends import (
    ArtifactBackend,
    CountingBackend,
    CpuOnlyNever,
    DelayBackend,
    FastArtifactBackend,
    ShortcutBackend,
)
from support.models import Accumulator, RunningCache, SlowEager, make_stack, stack_samples
from xpupack.errors import NoCandidateError


def report(model, path="layers.0.mlp"):
    """The module's candidates as the package stores them."""
    return [entry.to_json() for entry in xpupack.tuned.session_of(model).modules[path].report]


def test_first_wins_skips_unavailable_wrong_and_broken_candidates():
    model = make_stack()
    strategy = xpupack.FirstWins(
        [
            CpuOnlyNever(),
            CountingBackend(offset=1.0),
            CountingBackend(build_error="no kernel for this op"),
            xpupack.EagerBackend(),
        ]
    )
    xpupack.tune(model, stack_samples(), modules=["layers.*.mlp"], strategy=strategy)
    entries = report(model)
    assert [e["status"] for e in entries] == ["rejected", "rejected", "rejected", "chosen"]
    assert "never available" in entries[0]["reason"]
    assert "max abs difference" in entries[1]["reason"] and "f32[2,8]" in entries[1]["reason"]
    assert "no kernel for this op" in entries[2]["reason"]
    assert xpupack.stats(model)["layers.0.mlp"]["backend"] == "eager"


def test_default_order_is_graph_inductor_eager():
    from xpupack.searches import default_strategy

    strategy = default_strategy()
    assert isinstance(strategy, xpupack.FirstWins)
    assert [b.name for b in strategy.backends] == ["graph", "inductor", "eager"]


def test_on_a_gpu_the_default_weighs_graph_over_inductor_against_the_plain_graph():
    from xpupack.searches import DEFAULT_STARTUP_MARGIN, default_strategy

    strategy = default_strategy(torch.device("cuda"))
    assert [b.label for b in strategy.backends] == ["graph+inductor", "graph", "inductor", "eager"]
    assert strategy.startup_margin == DEFAULT_STARTUP_MARGIN == 1.05
    assert "startup_margin=1.05" in repr(strategy)


def test_aoti_refuses_a_gpu_with_the_reason():
    """Regression: on an H100 (torch 2.11.0+cu130) AOTInductor's package loader crashed the tuning process
    (SIGSEGV) when the GPU default tried graph+aoti first; a crash cannot be caught, so it runs on a CPU only."""
    from xpupack.backends import _facts

    backend = xpupack.AOTIBackend()
    assert backend.available(torch.device("cpu"))
    for device in (torch.device("cuda"), torch.device("xpu")):
        assert not backend.available(device)
        assert "crashed the process (SIGSEGV)" in backend.why_unavailable(device)
    assert not _facts.AOTI.available(torch.device("cuda"))  # what plan, verify and inspect read without torch


def test_compiled_code_no_faster_than_a_lighter_candidate_gives_way_to_it():
    model = SlowEager(delay=0.005)
    # the compiled candidate runs the slow forward, the lighter one the shortcut
    strategy = xpupack.FirstWins(
        [ArtifactBackend(), ShortcutBackend(), xpupack.EagerBackend()],
        min_speedup=None,
        iterations=3,
        startup_margin=1.05,
    )
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy)
    entries = {e["backend"]: e for e in report(model, "")}
    assert entries["artifact"]["status"] == "rejected" and entries["shortcut"]["status"] == "chosen"
    assert "not clearly above the start-up margin 1.05x" in entries["artifact"]["reason"]
    assert entries["artifact"]["startup_ratio"] == entries["shortcut"]["startup_ratio"] < 1.05
    low, high = entries["artifact"]["startup_ratio_interval"]
    assert low <= entries["artifact"]["startup_ratio"] <= high
    assert xpupack.stats(model)[""]["backend"] == "shortcut"


def test_compiled_code_clearly_faster_than_the_lighter_candidate_is_kept():
    model = SlowEager(delay=0.005)
    strategy = xpupack.FirstWins(
        [FastArtifactBackend(), CpuOnlyNever(), DelayBackend(), xpupack.EagerBackend()],
        min_speedup=None,
        iterations=3,
        startup_margin=1.05,
    )
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy)
    entries = report(model, "")
    assert [(e["backend"], e["status"]) for e in entries] == [("fast-artifact", "chosen"), ("delay", "rejected")]
    assert entries[0]["startup_ratio"] > 1.05
    assert "at least the start-up margin" in entries[1]["reason"]


def test_without_a_startup_margin_the_first_compiled_candidate_wins_untimed_against_later_ones():
    model = SlowEager(delay=0.005)
    xpupack.tune(
        model, [torch.randn(2, 8)], strategy=xpupack.FirstWins([ArtifactBackend(), ShortcutBackend()], min_speedup=None)
    )
    assert report(model, "") == [{"backend": "artifact", "status": "chosen", "reason": "first to pass"}]


@pytest.mark.parametrize("margin", [0.9, True, "1.05"])
def test_a_startup_margin_below_one_or_not_a_number_is_refused(margin):
    with pytest.raises(ValueError, match="startup_margin"):
        xpupack.FirstWins([xpupack.EagerBackend()], startup_margin=margin)


def test_first_wins_with_no_passing_candidate_explains_each():
    model = make_stack()
    with pytest.raises(NoCandidateError, match=r"(?s)never.*counting.*EagerBackend"):
        xpupack.tune(
            model,
            stack_samples(),
            modules=["layers.0.mlp"],
            strategy=xpupack.FirstWins([CpuOnlyNever(), CountingBackend(offset=1.0)]),
        )


def test_only_raises_the_backend_error():
    with pytest.raises(NoCandidateError, match="max abs difference"):
        xpupack.tune(
            make_stack(), stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(CountingBackend(offset=0.5))
        )


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
        xpupack.tune(
            model,
            [torch.randn(1, 8) for _ in range(3)],
            run=lambda m, x: m(x, cache),
            strategy=xpupack.Only(CountingBackend()),
        )


def test_only_eager_keeps_a_module_whose_calls_cannot_be_recorded():
    model = _UsesCache().eval()
    cache = _UnregisteredCache()
    xpupack.tune(
        model, [torch.randn(1, 8)], run=lambda m, x: m(x, cache), strategy=xpupack.Only(xpupack.EagerBackend())
    )
    assert xpupack.stats(model)[""]["backend"] == "eager"


def test_fastest_times_every_passing_candidate_and_keeps_one():
    model = make_stack()
    # CountingBackend runs eager's forward: as fast as eager, so the speed gate is off here
    strategy = xpupack.Fastest(
        [CountingBackend(), xpupack.EagerBackend(), CountingBackend(offset=1.0)], iterations=3, min_speedup=None
    )
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"], strategy=strategy)
    entries = report(model)
    assert [e["status"] for e in entries].count("chosen") == 1
    assert entries[2]["status"] == "rejected"
    timed = [e for e in entries if e["status"] in ("chosen", "accepted")]
    assert len(timed) == 2 and all(e["median_us"] > 0 for e in timed)
    chosen = next(e for e in entries if e["status"] == "chosen")
    # the highest speedup over eager timed alongside it wins; eager itself counts 1.0
    assert chosen.get("speedup", 1.0) == max(e.get("speedup", 1.0) for e in timed)


# -- the speed gate: never slower than eager (docs/tuning.md) --------------------------------------


@pytest.mark.parametrize("kind", [xpupack.FirstWins, xpupack.Fastest])
def test_a_candidate_slower_than_eager_is_rejected_with_its_speedup(kind, tmp_path):
    model = make_stack()
    xpupack.tune(
        model,
        stack_samples(),
        modules=["layers.*.mlp"],
        strategy=kind([DelayBackend(delay=0.005), xpupack.EagerBackend()], iterations=3),
    )
    slow, eager = report(model)
    assert slow["backend"] == "delay" and slow["status"] == "rejected"
    assert 0 < slow["speedup"] < 1 and f"{slow['speedup']}x eager's speed" in slow["reason"]
    assert "not faster than eager" in slow["reason"] and "the speed gate asks for more than 1.0x" in slow["reason"]
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
    xpupack.tune(
        model,
        [torch.randn(2, 8)],
        strategy=xpupack.FirstWins([ShortcutBackend(), xpupack.EagerBackend()], iterations=3),
    )
    entries = report(model, "")
    assert [(e["backend"], e["status"]) for e in entries] == [("shortcut", "chosen")]
    assert entries[0]["speedup"] > 1 and entries[0]["median_us"] > 0


def test_a_min_speedup_above_the_candidates_rejects_it_and_none_keeps_a_slower_one():
    model = SlowEager(delay=0.005)
    xpupack.tune(
        model,
        [torch.randn(2, 8)],
        strategy=xpupack.FirstWins([ShortcutBackend(), xpupack.EagerBackend()], min_speedup=1e6, iterations=3),
    )
    assert [e["status"] for e in report(model, "")] == ["rejected", "chosen"]
    model = make_stack()
    xpupack.tune(
        model,
        stack_samples(),
        modules=["layers.0.mlp"],
        strategy=xpupack.FirstWins([DelayBackend(), xpupack.EagerBackend()], min_speedup=None),
    )
    assert report(model) == [{"backend": "delay", "status": "chosen", "reason": "first to pass"}]


def test_only_is_never_timed_against_eager():
    model = make_stack()
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(DelayBackend()))
    assert report(model) == [{"backend": "delay", "status": "chosen", "reason": "only candidate"}]


def test_the_speed_option_round_trips_in_repr_and_is_checked():
    namespace = {
        "xpupack": xpupack,
        "FirstWins": xpupack.FirstWins,
        "Fastest": xpupack.Fastest,
        "EagerBackend": xpupack.EagerBackend,
        "GraphBackend": xpupack.GraphBackend,
    }
    for strategy in (
        xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()]),
        xpupack.FirstWins([xpupack.EagerBackend()], min_speedup=None),
        xpupack.Fastest([xpupack.EagerBackend()], min_speedup=1.25, iterations=5),
    ):
        again = eval(repr(strategy), namespace)
        assert (type(again), again.min_speedup, again.iterations) == (
            type(strategy),
            strategy.min_speedup,
            strategy.iterations,
        )
    assert (
        repr(xpupack.FirstWins([xpupack.EagerBackend()], min_speedup=None))
        == "FirstWins([EagerBackend()], min_speedup=None)"
    )
    assert repr(xpupack.FirstWins([xpupack.EagerBackend()])) == "FirstWins([EagerBackend()])"
    for bad in (0, -1.0, True, "fast"):
        with pytest.raises(ValueError, match="min_speedup"):
            xpupack.FirstWins([xpupack.EagerBackend()], min_speedup=bad)


def test_timing_is_weighted_by_how_often_each_signature_was_called(tmp_path):
    import json

    samples = [torch.randn(2, 8), torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8)]
    model = xpupack.tune(
        make_stack(), samples, modules=["layers.0.mlp"], strategy=xpupack.FirstWins([xpupack.EagerBackend()])
    )
    spec = xpupack.tuned.session_of(model).modules["layers.0.mlp"].spec
    assert spec.signature_calls == (3, 1)
    root = xpupack.save(model, tmp_path / "pkg")
    assert json.loads((root / "modules/layers.0.mlp/spec.json").read_text())["signature_calls"] == [3, 1]
    assert xpupack.tuned.session_of(xpupack.load(make_stack(), root)).modules["layers.0.mlp"].spec.signature_calls == (
        3,
        1,
    )


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
    xpupack.tune(
        model,
        steps,
        run=lambda m, x: m(x, cache),
        strategy=xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], iterations=5),
    )
    graph = report(model, "")[0]
    assert graph["backend"] == "graph" and graph["speedup"] > 0
    assert torch.equal(cache.total, expected_cache.total) and int(cache.steps) == 3


def test_candidates_are_checked_against_eager_per_dtype():
    from xpupack._compare import mismatch

    x = torch.ones(4, dtype=torch.float16)
    assert mismatch(x + 5e-3, x) is None  # within float16 tolerance
    assert mismatch(x + 0.1, x) is not None
    assert mismatch(torch.ones(4) + 1e-3, torch.ones(4)) is not None  # float32 is tighter
    assert mismatch(torch.tensor([1, 2]), torch.tensor([1, 3])) == "output 0: values differ from eager"
    assert mismatch(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert "structure" in mismatch((x, x), x)


# -- timing on a shared machine: rounds, an interval, and "could not tell" -----------------------------


def metered_tune(monkeypatch, clock, eager_us, fast_us, *, strategy=xpupack.FirstWins, **options):
    """Tunes a `Metered` model with `MeteredBackend` against eager, timed on ``clock``; returns its report."""
    import functools

    from support.backends import MeteredBackend
    from support.models import Metered
    from xpupack import _timing

    monkeypatch.setattr(_timing, "compare", functools.partial(_timing.compare, clock=clock))
    model = Metered(clock, eager_us, fast_us)
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy([MeteredBackend(), xpupack.EagerBackend()], **options))
    return model, report(model, "")


def test_compare_takes_turns_each_round_and_switches_sides_through_the_hooks():
    """Each round times both sides, which goes first alternating; a side's hook runs when the turn passes
    to it (a module changed in place is changed back for eager's turn), and the candidate's side is
    current again at the end."""
    from support.clock import FakeClock
    from xpupack import _timing

    clock = FakeClock()
    events = []
    result = _timing.compare(
        [lambda: events.append("C")],
        [lambda: events.append("E")],
        torch.device("cpu"),
        rounds=3,
        warmup=1,
        to_eager=lambda: events.append("undo"),
        to_candidate=lambda: events.append("redo"),
        clock=clock,
    )
    assert "".join(e[0] for e in events) == "uErC" + "uErC" + "CuE" + "ErC"
    assert result.rounds == 3 and result.candidate.iterations == result.eager.iterations == 3


def test_a_candidate_signature_that_falls_back_costs_eager_s_time_of_the_same_round():
    from support.clock import FakeClock
    from xpupack import _timing

    clock = FakeClock()
    result = _timing.compare(
        [lambda: clock.spend("candidate", 10), None],
        [lambda: clock.spend("eager", 40), lambda: clock.spend("eager", 100)],
        torch.device("cpu"),
        weights=[3, 1],
        clock=clock,
    )
    # per recorded call: eager (3*40 + 100) / 4 = 55, the candidate (3*10 + 100) / 4 = 32.5
    assert result.speedup == result.low == pytest.approx(55 / 32.5) and result.high == pytest.approx(55 / 32.5)
    assert result.eager.median_us == pytest.approx(55) and not result.noisy


def test_timings_that_cannot_tell_get_more_rounds_but_a_bounded_number():
    from support.clock import FakeClock, scattered
    from xpupack import _timing

    clock = FakeClock(scattered(seed=1, spread=3.0))
    calls = ([lambda: clock.spend("candidate", 100)], [lambda: clock.spend("eager", 100)])
    unsure = _timing.compare(*calls, torch.device("cpu"), threshold=1.0, rounds=10, clock=clock)
    assert unsure.verdict(1.0) == "unsure" and unsure.noisy and unsure.rounds == 40  # 4x rounds at most
    assert _timing.compare(*calls, torch.device("cpu"), rounds=10, clock=clock).rounds == 10  # no threshold
    # slow calls stop at the time budget (a few rounds first, no more after twice the budget)
    clock = FakeClock(scattered(seed=0, spread=3.0))
    slow = ([lambda: clock.spend("candidate", 1e6)], [lambda: clock.spend("eager", 1e6)])
    assert (
        _timing.compare(*slow, torch.device("cpu"), threshold=1.0, budget_s=4.0, clock=clock).rounds
        == _timing.MIN_ROUNDS
    )


def test_the_median_s_interval_comes_from_order_statistics():
    from xpupack._timing import _median_interval

    values = [float(v) for v in range(1, 21)]
    assert _median_interval(values) == (6.0, 15.0)  # n = 20: the 6th smallest and the 6th largest
    assert _median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)  # too few for 95%: the range
    assert _median_interval([2.0]) == (2.0, 2.0)


def test_a_burst_of_load_cannot_make_a_candidate_that_changes_the_module_look_faster(monkeypatch):
    """A candidate that changes the module in place (TorchAO) was compared with eager timed before it was
    built: a burst of load during eager's timing made it look 8x faster. Timed alongside eager (the
    change taken back for eager's turns), 120 µs against eager's 100 µs stays slower, burst or not."""
    from support.clock import FakeClock, burst

    clock = FakeClock(burst(calls=30, factor=10.0))
    model, (metered, eager) = metered_tune(monkeypatch, clock, eager_us=100, fast_us=120)
    assert metered["status"] == "rejected" and "not faster than eager" in metered["reason"]
    assert metered["speedup"] == pytest.approx(100 / 120, abs=1e-3) and not metered["noisy"]
    assert eager["status"] == "chosen" and model.switched is False
    # the sides took turns: no side ran more than twice in a row (eager, candidate, candidate, eager...)
    runs = "".join(side[0] for side in clock.log)
    assert "ccc" not in runs and "eee" not in runs


def test_a_clean_comparison_keeps_a_faster_candidate_with_its_interval(monkeypatch):
    from support.clock import FakeClock

    model, entries = metered_tune(monkeypatch, FakeClock(), eager_us=100, fast_us=50, iterations=10)
    assert [(e["backend"], e["status"], e["reason"]) for e in entries] == [("metered", "chosen", "first to pass")]
    assert entries[0]["speedup"] == 2.0 and entries[0]["speedup_interval"] == [2.0, 2.0]
    assert entries[0]["rounds"] == 10 and entries[0]["noisy"] is False and model.switched is True


def test_timings_that_cannot_tell_keep_eager_and_say_they_were_noisy(monkeypatch, tmp_path):
    """On a busy machine a candidate about as fast as eager can measure anywhere from 0.3x to 3x: after
    the extra rounds the interval still holds min_speedup, so the candidate is kept out (a tuned module
    must never be slower than eager), and its reason, the package and `inspect` say the timings were noisy."""
    from click.testing import CliRunner

    from support.clock import FakeClock, scattered
    from xpupack.cli import main

    model, (metered, eager) = metered_tune(
        monkeypatch, FakeClock(scattered(seed=1, spread=3.0)), eager_us=100, fast_us=95, iterations=10
    )
    assert metered["status"] == "rejected" and metered["noisy"] is True and metered["rounds"] == 40
    low, high = metered["speedup_interval"]
    assert low <= 1.0 < high
    assert "could not tell whether it is faster than eager, timings too noisy" in metered["reason"]
    assert f"95% interval {low:.3g}-{high:.3g}x over 40 rounds" in metered["reason"]
    assert eager["status"] == "chosen" and model.switched is False
    root = xpupack.save(model, tmp_path / "pkg")
    shown = CliRunner().invoke(main, ["inspect", str(root)])
    assert shown.exit_code == 0 and "timings too noisy" in shown.output.replace("\n", " ")


@pytest.mark.parametrize("kind, reason", [(xpupack.FirstWins, "first to pass"), (xpupack.Fastest, "fastest")])
def test_a_candidate_clearly_faster_on_noisy_timings_is_kept_and_marked_noisy(monkeypatch, kind, reason):
    from support.clock import FakeClock, scattered

    model, entries = metered_tune(
        monkeypatch, FakeClock(scattered(seed=2, spread=1.5)), eager_us=300, fast_us=100, strategy=kind
    )
    metered = entries[0]
    low, high = metered["speedup_interval"]
    assert metered["status"] == "chosen" and metered["noisy"] is True and 1.0 < low < high
    assert (
        metered["reason"] == f"{reason}; noisy timings: 95% interval {low}-{high}x eager's speed over "
        f"{metered['rounds']} rounds"
    )


def test_fastest_keeps_the_highest_speedup_over_eager_timed_alongside_it(monkeypatch):
    """Candidates timed minutes apart cannot be ranked by their own times on a busy machine; their ratios
    to eager, each timed alongside eager, can. Eager counts 1.0."""
    from support.clock import FakeClock

    _, entries = metered_tune(
        monkeypatch, FakeClock(), eager_us=100, fast_us=150, strategy=xpupack.Fastest, min_speedup=None
    )
    assert [(e["backend"], e["status"]) for e in entries] == [("metered", "accepted"), ("eager", "chosen")]
    assert entries[0]["speedup"] == pytest.approx(100 / 150, abs=1e-3) and "speedup" not in entries[1]


# -- progress: a module's search can take minutes (a language model's: 50-130 s on a CPU) -------------------


def test_tune_reports_each_candidate_it_builds_and_times():
    messages: list[str] = []
    strategy = xpupack.FirstWins([CpuOnlyNever(), DelayBackend(), xpupack.EagerBackend()], iterations=3)
    xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=strategy, progress=messages.append)
    head = "tuning layers.0.mlp (1/2, 2 signature(s))"
    assert messages[messages.index(head) :][:3] == [
        head,
        f"{head}: building delay and checking it against eager",  # CpuOnlyNever is refused before it builds
        f"{head}: timing delay against eager",
    ]
    assert "tuning layers.1.mlp (2/2, 2 signature(s)): timing delay against eager" in messages
    assert not any("checking eager" in message for message in messages)  # eager is the reference


def test_without_a_progress_function_tune_logs_its_progress(caplog):
    with caplog.at_level("INFO", logger="xpupack"):
        xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(CountingBackend()))
    assert "tuning layers.0.mlp (1/2, 2 signature(s)): building counting and checking it against eager" in [
        record.getMessage() for record in caplog.records
    ]
