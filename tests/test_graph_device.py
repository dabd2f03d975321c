"""Real device graphs (CUDAGraph on NVIDIA, XPUGraph on Intel): run on the GPU machine."""

import copy
import gc

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import xpupack
from conftest import GRAPH_DEVICE
from support.models import make_stack
from support.strategies import GRAPH
from xpupack import _device
from xpupack.examples import tiny_transformer

pytestmark = pytest.mark.requires_graph_device


def device_samples(batches=(1, 2)):
    return [torch.randn(b, 8, device=GRAPH_DEVICE) for b in batches]


@pytest.fixture
def tuned():
    model = make_stack().to(GRAPH_DEVICE)
    reference = copy.deepcopy(model)
    xpupack.tune(model, device_samples(), modules=["layers.*.mlp"], strategy=GRAPH)
    return model, reference


def test_replay_equals_eager_with_one_recording_per_batch_size(tuned):
    model, reference = tuned
    stats = xpupack.stats(model)
    assert {s["backend"] for s in stats.values()} == {"graph"}
    assert stats["layers.0.mlp"]["recordings"] == 2
    assert stats["layers.0.mlp"]["memory_bytes"] >= 0
    with torch.inference_mode():
        for batch in (1, 2, 1, 2):
            x = torch.randn(batch, 8, device=GRAPH_DEVICE)
            torch.testing.assert_close(model(x), reference(x))


def test_larger_batch_falls_back(tuned, fallback_calls):
    model, reference = tuned
    x = torch.randn(64, 8, device=GRAPH_DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert {e.path for e in fallback_calls} == {"layers.0.mlp", "layers.1.mlp"}


def test_outputs_are_copies(tuned):
    model, _ = tuned
    mlp = model.layers[0]["mlp"]
    with torch.inference_mode():
        first = mlp(torch.ones(1, 8, device=GRAPH_DEVICE), scale=1.0)
        kept = first.clone()
        mlp(torch.zeros(1, 8, device=GRAPH_DEVICE), scale=1.0)
    assert torch.equal(first, kept)


def test_deactivate_then_activate(tuned):
    model, reference = tuned
    x = torch.randn(2, 8, device=GRAPH_DEVICE)
    xpupack.deactivate(model)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x))
    xpupack.activate(model)
    calls = xpupack.stats(model)["layers.0.mlp"]["calls"]
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x))
    assert xpupack.stats(model)["layers.0.mlp"]["calls"] == calls + 1


def test_moving_the_model_never_replays_stale_memory(tuned):
    model, reference = tuned
    model.to("cpu").to(GRAPH_DEVICE)  # every parameter now lives in new memory
    x = torch.randn(2, 8, device=GRAPH_DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x))
    assert xpupack.stats(model)["layers.0.mlp"]["rerecordings"] == 1


def test_replaced_parameters_are_seen(tuned):
    model, reference = tuned
    weight = torch.randn(16, 8, device=GRAPH_DEVICE)
    model.layers[0]["mlp"].up.weight = nn.Parameter(weight.clone())
    reference.layers[0]["mlp"].up.weight = nn.Parameter(weight.clone())
    x = torch.randn(1, 8, device=GRAPH_DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x))


class HostSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if self.linear(x).sum().item() > 1e9:  # a host sync: cannot be recorded
            return x
        return self.linear(x)


def test_capture_failure_rejects_the_backend_and_moves_on():
    model = nn.Sequential(HostSync()).to(GRAPH_DEVICE).eval()
    xpupack.tune(model, device_samples(), modules=["0"], strategy=GRAPH)
    tuned = xpupack.tuned.session_of(model).modules["0"]
    assert tuned.backend_name == "eager"
    assert tuned.report[0].status == "rejected" and tuned.report[0].reason
    with torch.inference_mode():  # the device is still usable afterwards
        model(torch.randn(1, 8, device=GRAPH_DEVICE))


def test_half_precision_transformer_blocks():
    model = tiny_transformer().to(GRAPH_DEVICE, torch.float16)
    reference = copy.deepcopy(model)
    samples = [torch.randint(0, 256, (b, 16), device=GRAPH_DEVICE) for b in (1, 4)]
    xpupack.tune(model, samples, modules=["layers.?"], strategy=GRAPH)
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"graph"}
    with torch.inference_mode():
        for ids in samples:
            torch.testing.assert_close(model(ids), reference(ids), rtol=2e-2, atol=2e-2)


def test_deploy_after_load_in_a_fresh_process(tuned, tmp_path, run_python):
    model, reference = tuned
    root = xpupack.save(model, tmp_path / "pkg")
    x = torch.randn(2, 8)
    with torch.inference_mode():
        save_file({"x": x, "expected": reference(x.to(GRAPH_DEVICE)).cpu()}, str(tmp_path / "io.safetensors"))
    result = run_python(f"""
        import torch, xpupack
        from safetensors.torch import load_file
        from support.models import make_stack
        io = load_file({str(tmp_path / "io.safetensors")!r})
        model = xpupack.load(make_stack(seed=11), {str(root)!r}, device={GRAPH_DEVICE!r})
        with torch.inference_mode():
            out = model(io["x"].to({GRAPH_DEVICE!r}))
        torch.testing.assert_close(out.cpu(), io["expected"])
        stats = xpupack.stats(model)
        assert stats["layers.0.mlp"]["backend"] == "graph", stats
        assert stats["layers.0.mlp"]["fallbacks"] == 0 and stats["layers.0.mlp"]["recordings"] == 2, stats
        print("ok")
    """)
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(GRAPH_DEVICE is None or getattr(torch, GRAPH_DEVICE).device_count() < 2, reason="needs two devices")
def test_load_onto_another_device_index(tuned, tmp_path):
    model, reference = tuned
    root = xpupack.save(model, tmp_path / "pkg")
    other = f"{GRAPH_DEVICE}:1"
    loaded = xpupack.load(make_stack(), root, device=other)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x.to(other)).cpu(), reference(x.to(GRAPH_DEVICE)).cpu())
    assert xpupack.stats(loaded)["layers.0.mlp"]["recordings"] == 2
    assert xpupack.stats(loaded)["layers.0.mlp"]["fallbacks"] == 0


def test_a_capture_after_every_recording_in_the_shared_pool_was_dropped_succeeds():
    """Regression (H200): a bare graph_pool_handle died with its last graph, and the next capture into it
    failed with "use_count > 0 INTERNAL ASSERT FAILED" (a decode step recorded again over compiled code)."""
    device = torch.device(GRAPH_DEVICE)
    api = _device.graphs_for(device)
    x = torch.ones(16, device=device)
    replay, outputs, _ = api.capture(lambda: x * 2, device=device, pool=api.shared_pool(device))
    replay()
    del replay, outputs
    gc.collect()
    replay, outputs, _ = api.capture(lambda: x * 3, device=device, pool=api.shared_pool(device))
    replay()
    getattr(torch, GRAPH_DEVICE).synchronize()
    assert torch.equal(outputs, x * 3)


def test_a_capture_that_fails_does_not_make_the_next_capture_fail():
    """Regression (H200): torch ends a capture's allocation to its pool only when the capture ends well, so
    after one failed capture every later one into the shared pool failed ("beginAllocateToPool: already
    recording to mempool_id"): a TorchAO decode step's failed capture took every signature down with it."""
    device = torch.device(GRAPH_DEVICE)
    api = _device.graphs_for(device)
    x = torch.ones(16, device=device)
    with pytest.raises(Exception):  # noqa: B017  (the device's own capture error)
        api.capture(lambda: x * int(x.sum().item()), device=device, pool=api.shared_pool(device), warmup=0)
    replay, outputs, _ = api.capture(lambda: x * 3, device=device, pool=api.shared_pool(device))
    replay()
    getattr(torch, GRAPH_DEVICE).synchronize()
    assert torch.equal(outputs, x * 3)


def test_a_process_whose_capture_failed_releases_memory_and_exits_cleanly(run_python):
    """Regression (H200): after one failed capture, which fell back cleanly, the GPU-marked test run aborted
    as the process exited (``captures_underway.empty() INTERNAL ASSERT FAILED``, exit code 134): torch had
    left the capture's allocation to its pool open. ``empty_cache`` met the same assert."""
    run_python(
        f"""
        import torch
        from xpupack import _device
        device = torch.device({GRAPH_DEVICE!r})
        api = _device.graphs_for(device)
        x = torch.ones(16, device=device)
        try:
            api.capture(lambda: x * int(x.sum().item()), device=device, pool=api.shared_pool(device), warmup=0)
        except Exception:
            pass
        getattr(torch, device.type).empty_cache()
        replay, outputs, _ = api.capture(lambda: x * 3, device=device, pool=api.shared_pool(device))
        replay()
        assert torch.equal(outputs, x * 3)
        """
    )


def test_recording_memory_is_measured_and_a_budget_skips_the_smaller_batches(monkeypatch, fallback_calls):
    """Real figures: each recording holds at least its static input, and their sum is the module's. With a
    fresh pool per recording each figure is that recording's own, so a budget of the two largest keeps
    exactly those; every other batch up to 8 is padded up to them and equals eager."""
    api = _device.graphs_for(torch.device(GRAPH_DEVICE))
    monkeypatch.setattr(api, "shared_pool", lambda device: getattr(torch, GRAPH_DEVICE).graph_pool_handle())
    ladder = (8, 4, 2, 1)
    model = make_stack().to(GRAPH_DEVICE)
    reference = copy.deepcopy(model)
    xpupack.tune(model, device_samples(ladder), modules=["layers.0.mlp"], strategy=GRAPH)
    stats = xpupack.stats(model)["layers.0.mlp"]
    memory = stats["recording_memory"]
    assert list(memory) == [f"(f32[{b},8], 1.0)" for b in ladder]  # recorded largest first
    assert all(memory[f"(f32[{b},8], 1.0)"] >= b * 8 * 4 for b in ladder)
    assert stats["memory_bytes"] == sum(memory.values())

    limit = memory["(f32[8,8], 1.0)"] + memory["(f32[4,8], 1.0)"]
    strategy = xpupack.FirstWins([xpupack.GraphBackend(max_memory=limit), xpupack.EagerBackend()], min_speedup=None)
    xpupack.tune(model, device_samples(ladder), modules=["layers.0.mlp"], strategy=strategy)
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["backend"] == "graph" and stats["memory_bytes"] <= limit
    assert list(stats["recording_memory"]) == ["(f32[8,8], 1.0)", "(f32[4,8], 1.0)"]
    assert list(stats["skipped"]) == ["(f32[2,8], 1.0)", "(f32[1,8], 1.0)"]
    with torch.inference_mode():
        for batch in range(1, 9):
            x = torch.randn(batch, 8, device=GRAPH_DEVICE)
            torch.testing.assert_close(model(x), reference(x))
    assert fallback_calls == [] and xpupack.stats(model)["layers.0.mlp"]["padded"] == 6
