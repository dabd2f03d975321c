import pytest
import torch
from torch import nn

from support.models import make_stack
from xpupack.errors import TuningError
from xpupack.recorder import SAMPLES_PER_SIGNATURE, path_matches, record, select_modules


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


@pytest.mark.parametrize(
    "pattern, path, matches",
    [
        ("model.layers.*", "model.layers.0", True),
        ("model.layers.*", "model.layers.0.self_attn", False),  # `*` is one segment: it never crosses a dot
        ("model.layers.*", "model.layers", False),
        ("layers.*.mlp", "layers.10.mlp", True),
        ("layers.*.mlp", "layers.0.block.mlp", False),
        ("layers.**.mlp", "layers.0.block.mlp", True),
        ("layers.**.mlp", "layers.mlp", True),  # `**` may match no segment at all
        ("**.mlp", "mlp", True),
        ("**.mlp", "layers.0.mlp", True),
        ("**.mlp", "layers.0.mlp.fc", False),
        ("**", "a.b.c", True),
        ("model.**.**.proj", "model.proj", True),
        ("layers.1?", "layers.12", True),
        ("layers.1?", "layers.1", False),
        ("layers.[01].mlp", "layers.1.mlp", True),
        ("layers.[01].mlp", "layers.2.mlp", False),
        ("lay*", "layers.0", False),
        ("layers.0.mlp", "layers.0.mlp", True),
        ("layers.0", "layers.0.mlp", False),
    ],
)
def test_globs_match_by_path_segment(pattern, path, matches):
    assert path_matches(path, pattern) is matches


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.o_proj = nn.Linear(4, 4)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU())


class _Llama(nn.Module):
    """The module tree of a transformers Llama: model.layers.N.{self_attn,mlp}, and lm_head."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = nn.Linear(4, 4)


def test_one_segment_star_selects_the_decoder_layers_of_a_llama():
    """fnmatch's `*` crossed dots: `model.layers.*` used to select each layer and its submodules (refused)."""
    model = _Llama()
    assert list(select_modules(model, ["model.layers.*"])) == ["model.layers.0", "model.layers.1"]
    assert list(select_modules(model, "**.mlp")) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert list(select_modules(model, ["model.layers.*.self_attn.*_proj"])) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    with pytest.raises(TuningError, match="both 'model.layers.0' and its submodule 'model.layers.0.mlp'"):
        select_modules(model, ["model.layers.*", "**.mlp"])


def test_recording_keeps_each_signature_and_a_few_samples():
    model = make_stack()
    modules = select_modules(model, ["layers.*.mlp"])
    samples = [torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), torch.randn(3, 8)]
    specs = record(model, modules, samples, run=None)
    spec = specs["layers.1.mlp"]
    assert spec.calls == 4
    assert [s.describe() for s in spec.signatures] == ["(f32[2,8], 1.0)", "(f32[3,8], 1.0)"]
    assert spec.samples.count(0) == SAMPLES_PER_SIGNATURE
    # hooks are removed afterwards
    assert not model.layers[0]["mlp"]._forward_pre_hooks


def test_recorded_samples_are_snapshots():
    model = make_stack()
    x = torch.randn(2, 8)
    specs = record(model, select_modules(model, ["layers.0.mlp"]), [x], run=None)
    x.add_(100)
    (recorded,), _ = specs["layers.0.mlp"].samples.inputs[0][0]
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
    specs = record(
        model,
        modules,
        [{"x": torch.randn(1, 4)}, torch.randn(1, 4)],
        run=lambda m, s: m[0](**s) if isinstance(s, dict) else m[0](s, cache=Cache()),
    )
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


@pytest.mark.parametrize(
    "given, says",
    [
        (make_stack, "the function make_stack — call it: xpupack.tune(make_stack()"),
        (nn.Linear, "the class Linear — build it: xpupack.tune(Linear(...)"),
        ([1, 2], "a list"),
    ],
)
def test_tune_given_something_else_than_a_model_says_so(given, says):
    import xpupack
    from xpupack.errors import NotAModelError

    with pytest.raises(NotAModelError, match="xpupack.tune needs the model") as caught:
        xpupack.tune(given, [torch.randn(2, 8)])
    assert says in str(caught.value) and isinstance(caught.value, TypeError)
    with torch.inference_mode(), pytest.raises(NotAModelError):  # also where tune looks at the model first
        xpupack.tune(given, [torch.randn(2, 8)])


@pytest.mark.parametrize("run", [None, lambda model, sample: model(sample["x"])], ids=["samples", "run"])
def test_a_sample_that_fails_in_the_model_is_named(run):
    import xpupack

    good, bad = torch.randn(2, 8), torch.randn(2, 7)
    samples = [good, bad, good] if run is None else [{"x": good}, {"x": bad}]
    with pytest.raises(TuningError, match="sample 1 ") as caught:
        xpupack.tune(make_stack(), samples, run=run)
    message = str(caught.value)
    assert ("a Tensor of shape [2, 7]" if run is None else "a dict {'x': [2, 7]}") in message
    assert "RuntimeError" in message and isinstance(caught.value.__cause__, RuntimeError)
    assert caught.value.index == 1
