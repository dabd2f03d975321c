"""Padding a shorter sequence up to a recorded length (issue 31, docs/serving-shapes.md).

An encoder tuned on a few sequence lengths serves the lengths between them from the next longer recording:
its token ids and mask padded with zeros (a mask of 0 keeps those positions out of the real ones), the
outputs along the sequence cut back, those without one (a pooled output) returned whole.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import xpupack
from support.strategies import GRAPH
from support.zoo import ENCODERS, VOCAB
from xpupack.cli import main

LENGTHS = (8, 16)


def token_batch(length: int, seed: int = 0, batch: int = 2) -> dict:
    """``batch`` sequences of ``length`` tokens, the last one padded after three quarters of it."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[-1, length * 3 // 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tuned_bert(strategy=GRAPH, lengths=LENGTHS, batches=(2,)):
    make, _ = ENCODERS["bert"]
    model = make()
    reference = copy.deepcopy(model)
    samples = [
        token_batch(length, seed, batch)
        for seed, (length, batch) in enumerate((length, batch) for length in lengths for batch in batches)
    ]
    with torch.inference_mode():
        xpupack.tune(model, samples, run=lambda m, inputs: m(**inputs), strategy=strategy)
    return model, reference


def answers(model, inputs):
    with torch.inference_mode():
        out = model(**inputs)
    return out.last_hidden_state, out.pooler_output


def assert_serves_like_eager(model, reference, inputs):
    for got, expected in zip(answers(model, inputs), answers(reference, inputs)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def spec_of(model, path=""):
    return xpupack.tuned.session_of(model).modules[path].spec


def test_a_length_between_recorded_ones_is_padded_up_with_its_mask_and_equals_eager(emulated_graphs, fallback_calls):
    model, reference = tuned_bert()
    spec = spec_of(model)
    assert spec.batch_axes == {} and sorted(spec.length_axes) == [0, 1]
    axes = spec.length_axes[0]
    assert axes.inputs == (1, 1) and axes.outputs == (1, None)  # the pooled output is returned whole
    for length in (5, 12, 16):
        assert_serves_like_eager(model, reference, token_batch(length, seed=40 + length))
    assert fallback_calls == []
    stats = xpupack.stats(model)[""]
    assert (stats["padded"], stats["fallbacks"]) == (2, 0)  # 16 is recorded: an exact fit
    assert_serves_like_eager(model, reference, token_batch(20, seed=3))  # longer than any recording
    assert [event.reason.split(" (")[0] for event in fallback_calls] == ["no recorded signature fits"]


def test_without_a_mask_positions_mix_and_lengths_are_never_padded(emulated_graphs, tmp_path, fallback_calls):
    make, _ = ENCODERS["bert"]
    model = make()
    samples = [{"input_ids": token_batch(length)["input_ids"]} for length in LENGTHS]  # every position attended
    with torch.inference_mode():
        xpupack.tune(model, samples, run=lambda m, inputs: m(**inputs), strategy=GRAPH)
    spec = spec_of(model)
    assert spec.length_axes == {} and spec.padding_refused.startswith("positions mix: 4 real position(s)")
    root = xpupack.save(model, tmp_path / "pkg")
    shown = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(root)]).output)
    assert shown["modules"][0]["padding"].startswith("never padded: positions mix")


def test_causal_attention_pads_lengths_without_a_mask(emulated_graphs, fallback_calls):
    """A causal decoder's real positions never see later ones: zeros after them change nothing."""
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layer = nn.Embedding(VOCAB, 32), layer

        def forward(self, ids):
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
            return self.layer(self.embed(ids), src_mask=mask, is_causal=True)

    torch.manual_seed(0)
    model = Causal().eval()
    reference = copy.deepcopy(model)
    xpupack.tune(model, [token_batch(length)["input_ids"] for length in LENGTHS], strategy=GRAPH)
    assert sorted(spec_of(model).length_axes) == [0, 1]
    ids = token_batch(11, seed=5)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-4, atol=1e-4)
    assert xpupack.stats(model)[""]["padded"] == 1 and fallback_calls == []


def test_a_ladder_of_batches_at_two_lengths_pads_either_one(emulated_graphs, fallback_calls):
    """Batches 1 and 4 at lengths 8 and 16: a batch of 3 pads up to 4 at a recorded length, a length of 12
    up to 16 at a recorded batch; a call that would need both falls back."""
    model, reference = tuned_bert(batches=(1, 4))
    spec = spec_of(model)
    assert len(spec.batch_axes) == 4 and len(spec.length_axes) == 4
    assert_serves_like_eager(model, reference, token_batch(8, seed=9, batch=3))
    assert_serves_like_eager(model, reference, token_batch(12, seed=9, batch=4))
    assert xpupack.stats(model)[""]["padded"] == 2 and fallback_calls == []
    assert_serves_like_eager(model, reference, token_batch(12, seed=9, batch=3))
    assert len(fallback_calls) == 1


def test_length_padding_survives_a_load_checks_its_first_call_and_inspect_shows_the_lengths(
    emulated_graphs, tmp_path, fallback_calls
):
    model, _ = tuned_bert()
    root = xpupack.save(model, tmp_path / "pkg")
    shown = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(root)]).output)
    assert shown["modules"][0]["padding"] == "shorter sequences padded up to lengths 8, 16"
    make, _ = ENCODERS["bert"]
    reference = make()
    loaded = xpupack.load(make(), root)
    assert_serves_like_eager(loaded, reference, token_batch(12, seed=1))
    assert_serves_like_eager(loaded, reference, token_batch(10, seed=2))
    stats = xpupack.stats(loaded)[""]
    assert (stats["padded"], stats["padding_checks"], stats["fallbacks"]) == (2, 1, 0)  # the first one checked
    assert fallback_calls == []


@pytest.mark.parametrize("trusted", [True, False])
def test_length_axes_are_kept_only_from_a_trusted_source(emulated_graphs, trusted):
    """No synthesised input stands for token ids and a mask (a mask of zeros hides every position): a
    package's length axes count only where its compiled code would."""
    model, _ = tuned_bert()
    tuned = spec_of(model)
    xpupack.deactivate(model)
    spec = xpupack.padding.check_loaded(copy.deepcopy(tuned), model.forward, trusted=trusted)
    assert bool(spec.length_axes) == trusted
    assert trusted or spec.lengths_refused.startswith("the loader cannot check sequence padding")


def compiles() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_inductor_serves_a_length_between_recorded_ones_without_a_compile_also_after_load(tmp_path, fallback_calls):
    """The bar of issue 31: a BERT tuned on two lengths serves a third, padded up, with no compile on the
    caller's path (tuned here, and loaded with its compiled code)."""
    model, reference = tuned_bert(strategy=xpupack.Only(xpupack.InductorBackend()))
    before = compiles()
    assert_serves_like_eager(model, reference, token_batch(12, seed=4))
    assert compiles() == before and xpupack.stats(model)[""]["padded"] == 1
    root = xpupack.save(model, tmp_path / "pkg")
    make, _ = ENCODERS["bert"]
    loaded = xpupack.load(make(), root)
    before = compiles()
    assert_serves_like_eager(loaded, reference, token_batch(11, seed=5))
    assert compiles() == before and xpupack.stats(loaded)[""]["padded"] == 1
    assert fallback_calls == []


def test_buckets_made_from_one_sample_along_its_sequence_axis(emulated_graphs, fallback_calls):
    """``batch_sizes`` with ``batch_axis=1`` repeats or cuts one sample's tokens to each length."""
    make, _ = ENCODERS["bert"]
    model = make()
    reference = copy.deepcopy(model)
    with torch.inference_mode():
        xpupack.tune(
            model,
            [token_batch(12)],
            run=lambda m, inputs: m(**inputs),
            strategy=GRAPH,
            batch_sizes=list(LENGTHS),
            batch_axis=1,
        )
    assert sorted(spec_of(model).length_axes) == [0, 1, 2]  # the sample's own 12, then 8 and 16
    assert_serves_like_eager(model, reference, token_batch(14, seed=6))
    assert xpupack.stats(model)[""]["padded"] == 1 and fallback_calls == []


class AttendsEverywhere(nn.Module):
    """Token ids in, every position attending to every other (no mask), one output along the sequence."""

    def __init__(self):
        super().__init__()
        self.embed, self.attention = nn.Embedding(VOCAB, 16), nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, ids):
        x = self.embed(ids)
        return self.attention(x, x, x, need_weights=False)[0]


def test_a_sequence_whose_positions_mix_is_refused_by_the_length_check(emulated_graphs):
    """Its outputs all follow the length, so the batch check runs first and fails too; the reason given is
    the length check's, the one that matters for a sequence."""
    torch.manual_seed(0)
    model = AttendsEverywhere().eval()
    xpupack.tune(model, [token_batch(length)["input_ids"] for length in LENGTHS], strategy=GRAPH)
    spec = spec_of(model)
    assert spec.length_axes == {} and spec.batch_axes == {}
    assert spec.padding_refused.startswith("positions mix: 4 real position(s) of (i64[2,8]) padded with zeros")
