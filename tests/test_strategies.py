import pytest
import torch

import xpupack
from backends_for_tests import CountingBackend, CpuOnlyNever
from models import make_stack, stack_samples
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


def test_fastest_times_every_passing_candidate_and_keeps_one():
    model = make_stack()
    strategy = xpupack.Fastest([CountingBackend(), xpupack.EagerBackend(), CountingBackend(offset=1.0)],
                               iterations=3)
    xpupack.tune(model, stack_samples(), modules=["layers.0.mlp"], strategy=strategy)
    entries = report(model)
    assert [e["status"] for e in entries].count("chosen") == 1
    assert entries[2]["status"] == "rejected"
    timed = [e for e in entries if e["status"] in ("chosen", "accepted")]
    assert len(timed) == 2 and all(e["median_us"] > 0 for e in timed)
    chosen = next(e for e in entries if e["status"] == "chosen")
    assert chosen["median_us"] == min(e["median_us"] for e in timed)


def test_candidates_are_checked_against_eager_per_dtype():
    from xpupack._compare import mismatch

    x = torch.ones(4, dtype=torch.float16)
    assert mismatch(x + 5e-3, x) is None            # within float16 tolerance
    assert mismatch(x + 0.1, x) is not None
    assert mismatch(torch.ones(4) + 1e-3, torch.ones(4)) is not None  # float32 is tighter
    assert mismatch(torch.tensor([1, 2]), torch.tensor([1, 3])) == "output 0: values differ from eager"
    assert mismatch(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert "structure" in mismatch((x, x), x)
