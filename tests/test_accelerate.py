"""Modules behind accelerate's hooks (`xpupack._hooks`): recorded, tuned and activated behind the hook, which
moves the inputs first. On a CPU the hook here changes the dtype instead of the device (the same place in the
call, something a recording must see); the two-GPU run with ``dispatch_model`` is in tests/test_multi_gpu.py.
Skipped where accelerate is not installed (it is no dependency of xpupack)."""

from __future__ import annotations

import pytest
import torch

import xpupack
from support.models import make_stack

hooks = pytest.importorskip("accelerate.hooks")


class ToFloat32(hooks.ModelHook):
    """Casts the inputs as accelerate's ``AlignDevicesHook`` moves them, and counts its calls."""

    calls = 0

    def pre_forward(self, module, *args, **kwargs):
        type(self).calls += 1
        cast = lambda x: x.float() if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _hooked_stack(seed: int = 0):
    model = make_stack(seed=seed)
    for layer in model.layers:
        hooks.add_hook_to_module(layer["mlp"], ToFloat32())
    return model


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 8, generator=generator, dtype=torch.float64)]


def _call(model, x):
    """The stack's layers, each MLP called with a float64 input, as a model placed over devices calls
    a module with an input on the previous module's device."""
    with torch.no_grad():
        return [layer["mlp"](x, scale=1.0) for layer in model.layers]


@pytest.mark.parametrize("how", ["tune", "load"])
def test_hooked_modules_are_tuned_behind_the_hook(how, emulated_graphs, tmp_path):
    strategy = xpupack.Only(xpupack.GraphBackend())
    model = xpupack.tune(_hooked_stack(), _samples(), modules=["layers.*.mlp"], strategy=strategy)
    if how == "load":
        root = xpupack.save(model, tmp_path / "pkg")
        model = xpupack.load(_hooked_stack(seed=9), root)
    signatures = {path: s["signatures"] for path, s in xpupack.stats(model).items()}
    assert signatures == {"layers.0.mlp": 1, "layers.1.mlp": 1}
    mlp = model.layers[0]["mlp"]
    assert isinstance(mlp.__dict__["forward"], __import__("functools").partial)  # accelerate's wrapper stays
    assert isinstance(mlp._old_forward, xpupack.tuned.TunedModule)
    x = torch.randn(2, 8, dtype=torch.float64)
    before, replays = ToFloat32.calls, emulated_graphs.replays
    outputs = _call(model, x)
    reference = make_stack(seed=0)
    expected = _call(reference, x.float())
    assert ToFloat32.calls == before + 2 and emulated_graphs.replays == replays + 2
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want)
    assert all(s["fallbacks"] == 0 for s in xpupack.stats(model).values())


def test_deactivating_gives_the_hook_its_forward_back(emulated_graphs):
    model = xpupack.tune(
        _hooked_stack(), _samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.GraphBackend())
    )
    mlp = model.layers[0]["mlp"]
    xpupack.deactivate(model)
    assert not isinstance(mlp._old_forward, xpupack.tuned.TunedModule)
    before = ToFloat32.calls
    torch.testing.assert_close(
        _call(model, torch.ones(2, 8, dtype=torch.float64))[0], _call(make_stack(seed=0), torch.ones(2, 8))[0]
    )
    assert ToFloat32.calls == before + 2  # the hook still runs
    hooks.remove_hook_from_module(mlp)
    assert "forward" in mlp.__dict__ and "_old_forward" not in mlp.__dict__
    xpupack.activate(model)  # the hook is gone now: the tuned forward goes on the module itself
    assert isinstance(mlp.__dict__["forward"], xpupack.tuned.TunedModule)
