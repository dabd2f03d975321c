"""Bad inputs at call time: a tuned module gives eager's result or eager's error, never another answer.

Each case calls a tuned MLP and an untouched copy with the same inputs and
compares: the same values (bit for bit, signs of zeros included), dtype,
shape and autograd state, or the same exception type and message. The
recorded signatures are ``mlp(x, scale=1.0)`` with ``x`` float32 of shape
``[2, 8]`` and ``[4, 8]`` (and ``scale=0.0`` for the signed-zero cases).
"""

from __future__ import annotations

import copy

import pytest
import torch

import xpupack
from support.backends import CountingBackend
from support.compare_calls import assert_same_outcome, outcome
from support.models import make_stack, stack_samples


def _tuned(backend, samples=None):
    model = make_stack()
    reference = copy.deepcopy(model)
    samples = samples or stack_samples() + [(x, 0.0) for x in stack_samples()]
    xpupack.tune(model, samples, modules=["layers.*.mlp"], strategy=xpupack.Only(backend))
    return model.layers[0]["mlp"], reference.layers[0]["mlp"]


# inductor loads the session's compiled package (an Inductor compile per xdist worker): slow
@pytest.fixture(params=["counting", "graph", pytest.param("inductor", marks=pytest.mark.slow)])
def tuned_mlp(request):
    """``(tuned mlp, eager copy)`` for a backend that keeps autograd (counting), one that does not
    (graph, emulated), and a compiler (inductor, loaded from the session's package)."""
    if request.param == "counting":
        return _tuned(CountingBackend())
    if request.param == "graph":
        request.getfixturevalue("emulated_graphs")
        return _tuned(xpupack.GraphBackend())
    root = request.getfixturevalue("inductor_package")[1]
    model = xpupack.load(make_stack(seed=9), root)
    return model.layers[0]["mlp"], make_stack().layers[0]["mlp"]


def x(batch=2):
    return r(batch, 8)


def r(*shape):
    """Seeded: each case makes the same inputs for the tuned module and for eager."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


CASES = {
    # (inputs, grad mode); every call passes through both modules
    "fits": lambda: ((x(),), {"scale": 1.0}),
    "other batch size": lambda: ((x(3),), {"scale": 1.0}),
    "empty batch": lambda: ((x(0),), {"scale": 1.0}),
    "one sample without batch axis": lambda: ((r(8),), {"scale": 1.0}),
    "extra axis": lambda: ((r(2, 1, 8),), {"scale": 1.0}),
    "wrong feature size": lambda: ((r(2, 7),), {"scale": 1.0}),
    "float64": lambda: ((x().double(),), {"scale": 1.0}),
    "float16": lambda: ((x().half(),), {"scale": 1.0}),
    "bfloat16": lambda: ((x().bfloat16(),), {"scale": 1.0}),
    "int64": lambda: ((x().long(),), {"scale": 1.0}),
    "meta device": lambda: ((x().to("meta"),), {"scale": 1.0}),
    "transposed (non-contiguous)": lambda: ((r(8, 2).t(),), {"scale": 1.0}),
    "every other row (non-contiguous)": lambda: ((x(4)[::2],), {"scale": 1.0}),
    "broadcast row (stride 0)": lambda: ((r(1, 8).expand(2, 8),), {"scale": 1.0}),
    "NaN and inf values": lambda: ((torch.tensor([[float("nan"), float("inf")] * 4] * 2),), {"scale": 1.0}),
    "missing keyword": lambda: ((x(),), {}),
    "positional instead of keyword": lambda: ((x(), 1.0), {}),
    "extra keyword": lambda: ((x(),), {"scale": 1.0, "temperature": 0.5}),
    "extra positional": lambda: ((x(), 1.0, None, 3), {}),
    "no input": lambda: ((), {"scale": 1.0}),
    "int instead of float": lambda: ((x(),), {"scale": 1}),
    "bool instead of float": lambda: ((x(),), {"scale": True}),
    "tensor instead of float": lambda: ((x(),), {"scale": torch.tensor(1.0)}),
    "other constant": lambda: ((x(),), {"scale": 2.5}),
    "NaN constant": lambda: ((x(),), {"scale": float("nan")}),
    "negative zero (0.0 was recorded)": lambda: ((x(),), {"scale": -0.0}),
    "positive zero (recorded)": lambda: ((x(),), {"scale": 0.0}),
    "tensor for None": lambda: ((x(),), {"scale": 1.0, "bias": torch.ones(8)}),
    "list instead of tensor": lambda: ((x().tolist(),), {"scale": 1.0}),
    "a Parameter as input": lambda: ((torch.nn.Parameter(x(), requires_grad=False),), {"scale": 1.0}),
}


def _run(module, case, grad, autocast):
    args, kwargs = CASES[case]()
    grad_mode = torch.enable_grad() if grad else torch.no_grad()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)

    def call():
        with grad_mode, cast:
            return module(*args, **kwargs)

    return outcome(call)


def _assert_eager_result(tuned, reference, case, grad=False, autocast=False):
    expected = _run(reference, case, grad, autocast)
    got = _run(tuned, case, grad, autocast)
    assert_same_outcome(got, expected)


@pytest.mark.parametrize("case", CASES)
def test_bad_inputs_give_eager_results_or_eager_errors(tuned_mlp, case, fallback_calls, request):
    tuned, reference = tuned_mlp
    _assert_eager_result(tuned, reference, case)


@pytest.mark.parametrize("case", ["fits", "other batch size", "transposed (non-contiguous)"])
def test_requires_grad_inputs_keep_autograd_like_eager(tuned_mlp, case, fallback_calls):
    tuned, reference = tuned_mlp
    args, kwargs = CASES[case]()
    inputs = [args[0].detach().clone().requires_grad_(), args[0].detach().clone().requires_grad_()]
    outputs = []
    for module, leaf in zip((tuned, reference), inputs):
        with torch.enable_grad():
            out = module(leaf, **kwargs)
        out.square().sum().backward()
        outputs.append(out)
    assert outputs[0].requires_grad and outputs[0].grad_fn is not None
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)
    assert torch.allclose(inputs[0].grad, inputs[1].grad, atol=1e-6)


def test_requires_grad_inputs_under_no_grad_fit(fallback_calls, emulated_graphs):
    tuned, reference = _tuned(xpupack.GraphBackend())
    leaf = x().requires_grad_()
    replays = emulated_graphs.replays
    with torch.no_grad():
        out, expected = tuned(leaf, scale=1.0), reference(leaf, scale=1.0)
    assert emulated_graphs.replays == replays + 1 and not fallback_calls
    assert torch.equal(out, expected) and not out.requires_grad


@pytest.mark.parametrize("case", ["fits", "float64"])
def test_autocast_gives_what_eager_gives(tuned_mlp, case, fallback_calls):
    """A device graph replays the precision it recorded; under autocast eager computes in bfloat16."""
    tuned, reference = tuned_mlp
    _assert_eager_result(tuned, reference, case, autocast=True)


def test_after_a_bad_call_the_next_good_call_runs_the_backend(emulated_graphs, fallback_calls):
    tuned, reference = _tuned(xpupack.GraphBackend())
    for case in ("wrong feature size", "extra keyword", "float64", "fits"):
        _assert_eager_result(tuned, reference, case)
    replays = emulated_graphs.replays
    _assert_eager_result(tuned, reference, "fits")
    assert emulated_graphs.replays == replays + 1
