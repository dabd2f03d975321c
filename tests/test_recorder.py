import pytest
import torch
from torch import nn

from models import make_stack
from xpupack.errors import TuningError
from xpupack.recorder import SAMPLES_PER_SIGNATURE, record, select_modules


def test_globs_select_siblings_by_full_object_path():
    model = make_stack()
    selected = select_modules(model, ["layers.*.mlp"])
    assert list(selected) == ["layers.0.mlp", "layers.1.mlp"]
    assert selected["layers.0.mlp"] is not selected["layers.1.mlp"]


def test_none_selects_the_whole_model():
    model = make_stack()
    assert select_modules(model, None) == {"": model}


def test_no_match_lists_existing_paths():
    with pytest.raises(TuningError, match="layers.0.mlp"):
        select_modules(make_stack(), ["blocks.*"])


def test_nested_selection_is_refused():
    with pytest.raises(TuningError, match="both"):
        select_modules(make_stack(), ["layers.*", "layers.*.mlp"])


def test_recording_keeps_each_signature_and_a_few_samples():
    model = make_stack()
    modules = select_modules(model, ["layers.*.mlp"])
    samples = [torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), torch.randn(3, 8)]
    specs = record(model, modules, samples, run=None)
    spec = specs["layers.1.mlp"]
    assert spec.calls == 4
    assert [s.describe() for s in spec.signatures] == ["(f32[2,8], 1.0)", "(f32[3,8], 1.0)"]
    assert len(spec.samples[0]) == SAMPLES_PER_SIGNATURE
    # hooks are removed afterwards
    assert not model.layers[0]["mlp"]._forward_pre_hooks


def test_recorded_samples_are_snapshots():
    model = make_stack()
    x = torch.randn(2, 8)
    specs = record(model, select_modules(model, ["layers.0.mlp"]), [x], run=None)
    x.add_(100)
    (recorded,), _ = specs["layers.0.mlp"].samples[0][0]
    assert recorded.max() < 50


class Cache:
    """Stands in for a transformers DynamicCache: an object that is no tensor and no constant."""


class WithCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        return self.inner(x)


def test_calls_with_objects_are_counted_not_recorded():
    model = nn.Sequential(WithCache())
    modules = select_modules(model, ["0"])
    specs = record(model, modules, [{"x": torch.randn(1, 4)}, torch.randn(1, 4)],
                   run=lambda m, s: m[0](**s) if isinstance(s, dict) else m[0](s, cache=Cache()))
    spec = specs["0"]
    assert spec.calls == 2
    assert len(spec.signatures) == 1
    assert sum(spec.unrecordable.values()) == 1
    assert "Cache" in next(iter(spec.unrecordable))


def test_empty_samples_raise():
    model = make_stack()
    with pytest.raises(TuningError, match="empty"):
        record(model, select_modules(model, None), [], run=None)


def test_snapshots_keep_named_tuples():
    from collections import namedtuple

    from xpupack.recorder import snapshot

    Pair = namedtuple("Pair", "x y")
    original = Pair(torch.ones(2), [torch.zeros(1), None])
    copy = snapshot(original)
    assert type(copy) is Pair and copy.y[1] is None
    assert torch.equal(copy.x, original.x) and copy.x is not original.x
