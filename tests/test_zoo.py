"""The zoo (issue 31): a tiny random model of every family the docs name, tuned through its usual call.

Decoders are tuned through a greedy ``generate()`` with a static cache, encoders through ``model(**inputs)``,
each as one unit with the graph backend alone (over eager, on a CPU's emulated device graphs: no compile, so
the whole zoo tunes in seconds). Each then serves every call with eager's tokens or outputs, is saved,
passes ``xpupack inspect`` and ``xpupack verify``, and is loaded in one fresh process with the others.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import xpupack
from support.emulated_graph import EmulatedGraphs
from support.language_models import NEW_TOKENS, generate, prompt, whole
from support.strategies import ONLY_GRAPH
from support.zoo import DECODERS, ENCODERS
from xpupack import _device
from xpupack.cli import main

#: one worker holds the module's packages, which the fresh process loads together; the sweep of every family is
#: slow (the quick loop has the Llama of tests/test_llm.py), and CI runs it again on the oldest transformers
pytestmark = [pytest.mark.xdist_group("zoo"), pytest.mark.slow]

#: the prompt every served generate() decodes: the tuned prompt's length, other tokens
SERVED_PROMPT_SEED = 7
#: the decoders whose caches have sliding-window layers (Mistral's default window is 4096)
SLIDING_WINDOWS = frozenset({"mistral", "gemma2", "gemma3"})
#: the inputs every served encoder call takes: the tuned call's shapes, other values
SERVED_INPUTS_SEED = 2


@dataclass
class Built:
    """A tuned member of the zoo: the model (tuned here), its package and what eager answered."""

    model: torch.nn.Module
    root: Path
    expected: torch.Tensor  # a decoder's tokens, an encoder's last hidden state


class Zoo:
    """Builds each member's package once, when a test first asks for it (tests of one family run alone)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.built: dict[str, Built] = {}

    def decoder(self, family: str) -> Built:
        if family not in self.built:
            model = DECODERS[family]()
            reference = copy.deepcopy(model)
            xpupack.tune(model, [prompt()], run=lambda m, ids: generate(m, ids, NEW_TOKENS), strategy=ONLY_GRAPH)
            expected = generate(reference, prompt(seed=SERVED_PROMPT_SEED), NEW_TOKENS)
            self.built[family] = Built(model, xpupack.save(model, self.folder / family), expected)
        return self.built[family]

    def encoder(self, family: str) -> Built:
        if family not in self.built:
            make, inputs = ENCODERS[family]
            model = make()
            reference = copy.deepcopy(model)
            xpupack.tune(model, [inputs(1)], strategy=ONLY_GRAPH)
            with torch.no_grad():
                expected = reference(**inputs(SERVED_INPUTS_SEED)).last_hidden_state
            self.built[family] = Built(model, xpupack.save(model, self.folder / family), expected)
        return self.built[family]

    def build(self, family: str) -> Built:
        return self.decoder(family) if family in DECODERS else self.encoder(family)


@pytest.fixture(scope="module")
def graphs():
    """The module's emulated device graphs: its packages are tuned, served and verified with them."""
    with pytest.MonkeyPatch.context() as patch:
        api = EmulatedGraphs()
        patch.setitem(_device.GRAPH_APIS, "cpu", api)
        yield api


@pytest.fixture(scope="module")
def zoo(graphs, tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("family", DECODERS)
def test_a_decoder_tuned_through_generate_serves_every_call_with_eager_tokens(zoo, family, fallback_calls):
    built = zoo.decoder(family)
    before = dict(whole(built.model))
    assert before["backend"] == "graph"
    assert torch.equal(generate(built.model, prompt(seed=SERVED_PROMPT_SEED), NEW_TOKENS), built.expected)
    stats = whole(built.model)
    assert stats["calls"] - before["calls"] == NEW_TOKENS  # the prefill, then one call per decode step
    assert stats["fallbacks"] - before["fallbacks"] == 0 and fallback_calls == []


@pytest.mark.parametrize("family", ENCODERS)
def test_an_encoder_tuned_through_its_usual_call_serves_it_with_eager_outputs(zoo, family, fallback_calls):
    built = zoo.encoder(family)
    _, inputs = ENCODERS[family]
    before = dict(whole(built.model))
    assert before["backend"] == "graph"
    with torch.no_grad():
        torch.testing.assert_close(built.model(**inputs(SERVED_INPUTS_SEED)).last_hidden_state, built.expected)
    stats = whole(built.model)
    assert stats["calls"] - before["calls"] == 1 and stats["fallbacks"] - before["fallbacks"] == 0
    assert fallback_calls == []


@pytest.mark.parametrize("family", [*DECODERS, *ENCODERS])
def test_inspect_and_verify_accept_the_package(zoo, family):
    root = zoo.build(family).root
    for command in (["inspect", str(root)], ["verify", str(root)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output


#: the fresh process: loads every package (argv: their folder, the served prompt's and inputs' seeds) and
#: prints what each served as JSON
LOAD_THE_ZOO = """
import json, sys, torch, xpupack
from xpupack import _device
from support.emulated_graph import EmulatedGraphs
from support.language_models import NEW_TOKENS, generate, prompt
from support.zoo import DECODERS, ENCODERS

api = EmulatedGraphs()
_device.GRAPH_APIS["cpu"] = api
folder, prompt_seed, inputs_seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
served = {}
for family, make in DECODERS.items():
    model = xpupack.load(make(seed=5), f"{folder}/{family}")
    replays = api.replays
    tokens = generate(model, prompt(seed=prompt_seed), NEW_TOKENS)
    equal = torch.equal(tokens, torch.load(f"{folder}/{family}.expected.pt"))
    served[family] = {**xpupack.stats(model)[""], "equal": equal, "replays": api.replays - replays}
for family, (make, inputs) in ENCODERS.items():
    model = xpupack.load(make(seed=5), f"{folder}/{family}")
    replays = api.replays
    with torch.no_grad():
        output = model(**inputs(inputs_seed)).last_hidden_state
    expected = torch.load(f"{folder}/{family}.expected.pt")
    equal = torch.allclose(output, expected, rtol=1.3e-6, atol=1e-5)  # assert_close's float32 tolerances
    served[family] = {**xpupack.stats(model)[""], "equal": equal, "replays": api.replays - replays}
print(json.dumps(served))
"""


def test_every_package_loads_in_one_fresh_process_and_serves_eager_answers(zoo, run_python):
    """One process loads the whole zoo into models of other weights: each serves every call again."""
    for family in [*DECODERS, *ENCODERS]:
        torch.save(zoo.build(family).expected, zoo.folder / f"{family}.expected.pt")
    arguments = [str(zoo.folder), str(SERVED_PROMPT_SEED), str(SERVED_INPUTS_SEED)]
    result = run_python(f"import sys; sys.argv[1:] = {arguments!r}\n" + LOAD_THE_ZOO)
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served.keys() == {*DECODERS, *ENCODERS}
    for family, stats in served.items():
        calls = NEW_TOKENS if family in DECODERS else 1
        assert stats["backend"] == "graph" and stats["equal"], (family, stats)
        assert stats["calls"] == calls and stats["fallbacks"] == 0, (family, stats)
    # a new cache: its prefill and first decode step run for real, the second step records, the rest replay
    # (what a sliding window's step adds to its count was learnt in the load's warm-up generate())
    replays = dict.fromkeys(DECODERS, NEW_TOKENS - 3)
    assert {family: served[family]["replays"] for family in DECODERS} == replays
