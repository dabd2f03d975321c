"""Two GPUs: a model split over both (by hand and by accelerate's dispatch), torchrun ranks loading one
package, tensor parallel (whose all-reduce is not recorded) (docs/multi-gpu.md). Skipped with fewer
than two CUDA devices; the CPU counterparts are tests/test_devices.py, test_accelerate.py, test_ranks.py
and test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

import xpupack
from support.models import make_stack, stack_samples
from support.split_models import chain_samples, make_chain
from support.strategies import ONLY_GRAPH
from support.torchrun import run_ranks
from xpupack.manifest import read_manifest
from xpupack.tuned import session_of

pytestmark = [
    pytest.mark.requires_cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TWO = ("cuda:0", "cuda:1")


def _outputs_match(model, reference, x):
    with torch.no_grad():
        torch.testing.assert_close(model(x).cpu(), reference(x).cpu())


def _layer_devices(model):
    return {path: str(device) for path, device in session_of(model).devices.items()}


def test_a_split_model_records_graphs_on_both_devices_and_loads_in_a_fresh_process(tmp_path, run_python):
    model = xpupack.tune(make_chain(devices=TWO), chain_samples("cuda:0"), modules=["layers.*"], strategy=ONLY_GRAPH)
    assert _layer_devices(model) == {
        "layers.0": "cuda:0",
        "layers.1": "cuda:0",
        "layers.2": "cuda:1",
        "layers.3": "cuda:1",
    }
    assert [
        p.device.type + ":" + str(p.device.index) for p in (model.layers[0].up.weight, model.layers[3].up.weight)
    ] == list(TWO)  # nothing moved
    x = chain_samples("cuda:0")[1]
    _outputs_match(model, make_chain(devices=TWO), x)
    stats = xpupack.stats(model)
    assert all(s["backend"] == "graph" and s["recordings"] == 2 and s["fallbacks"] == 0 for s in stats.values())
    root = xpupack.save(model, tmp_path / "pkg")
    manifest = read_manifest(root)
    assert manifest["devices"] == list(TWO) and [m["device_slot"] for m in manifest["modules"]] == [0, 0, 1, 1]

    result = run_python(f"""
        import json, torch, xpupack
        from support.split_models import chain_samples, make_chain
        from xpupack.tuned import session_of
        x = chain_samples("cuda:0")[1]
        out = {{}}
        for name, kwargs in [("default", {{}}), ("swapped", {{"device_map": {{0: "cuda:1", 1: "cuda:0"}}}})]:
            model = xpupack.load(make_chain(seed=9, devices={TWO!r}), {str(root)!r}, **kwargs)
            with torch.no_grad():
                same = torch.allclose(model(x).cpu(), make_chain(devices={TWO!r})(x).cpu(), atol=1e-5)
            stats = xpupack.stats(model)
            out[name] = {{"same": same, "fallbacks": sum(s["fallbacks"] for s in stats.values()),
                         "backends": sorted({{s["backend"] for s in stats.values()}}),
                         "devices": {{p: str(d) for p, d in session_of(model).devices.items()}},
                         "weights": [str(l.up.weight.device) for l in model.layers]}}
        print(json.dumps(out))
    """)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["default"] == {
        "same": True,
        "fallbacks": 0,
        "backends": ["graph"],
        "devices": _layer_devices(model),
        "weights": ["cuda:0", "cuda:0", "cuda:1", "cuda:1"],
    }
    swapped = ["cuda:1", "cuda:1", "cuda:0", "cuda:0"]
    assert out["swapped"] == {
        "same": True,
        "fallbacks": 0,
        "backends": ["graph"],
        "devices": dict(zip(_layer_devices(model), swapped)),
        "weights": swapped,
    }


def test_an_input_on_the_other_device_is_a_counted_fallback_never_a_copy(fallback_calls):
    model = xpupack.tune(make_chain(devices=TWO), chain_samples("cuda:0"), modules=["layers.*"], strategy=ONLY_GRAPH)
    with pytest.raises(RuntimeError, match="device"), torch.no_grad():
        model.layers[3](chain_samples("cuda:0")[0])  # layers.3 is on cuda:1
    assert xpupack.stats(model)["layers.3"]["fallback_reasons"] == {"device": 1}
    assert [e.path for e in fallback_calls] == ["layers.3"]
    assert fallback_calls[0].reason.startswith("an input on cuda:0, but the recordings take cuda:1")


def test_a_model_dispatched_by_accelerate_replays_behind_its_hooks(tmp_path):
    big_modeling = pytest.importorskip("accelerate.big_modeling")
    device_map = {"layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 1}

    def dispatched(seed):
        return big_modeling.dispatch_model(make_chain(seed=seed, move_inputs=False), device_map=device_map)

    model = xpupack.tune(dispatched(0), chain_samples("cuda:0"), modules=["layers.*"], strategy=ONLY_GRAPH)
    x = chain_samples("cuda:0")[1]
    _outputs_match(model, make_chain(devices=TWO), x)
    assert all(s["backend"] == "graph" and s["fallbacks"] == 0 for s in xpupack.stats(model).values())
    loaded = xpupack.load(dispatched(9), xpupack.save(model, tmp_path / "pkg"))
    _outputs_match(loaded, make_chain(devices=TWO), x)
    stats = xpupack.stats(loaded)
    assert all(s["backend"] == "graph" and s["fallbacks"] == 0 and s["calls"] == 1 for s in stats.values())
    assert _layer_devices(loaded) == {
        "layers.0": "cuda:0",
        "layers.1": "cuda:0",
        "layers.2": "cuda:1",
        "layers.3": "cuda:1",
    }


def test_torchrun_ranks_load_one_package_each_on_its_gpu(tmp_path):
    model = xpupack.tune(
        make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], device="cuda:0", strategy=ONLY_GRAPH
    )
    root = xpupack.save(model, tmp_path / "pkg")
    results = run_ranks("rank_loader.py", root, "--device", "cuda", out=tmp_path / "out")
    assert results == [
        {"seeds": [0], "fallbacks": 0, "backends": ["graph"], "devices": [f"cuda:{rank}"]} for rank in range(2)
    ]


def test_tensor_parallel_blocks_are_refused_by_the_graph_backend_and_served_eagerly(tmp_path):
    """Capturing the blocks' NCCL all-reduce failed on torch 2.11 ('CUDA error: invalid argument') and left the
    ranks hung, so the graph backend refuses sharded modules on CUDA before any capture: every rank falls to
    eager alike, with the reason in its report, and the answers match eager TP and the unsharded model, from
    tuning and from a fresh load (docs/multi-gpu.md)."""
    package = tmp_path / "pkg"
    tuned = run_ranks("tp_worker.py", package, "tune", "--backend", "graph", "--device", "cuda", out=tmp_path / "tune")
    loaded = run_ranks("tp_worker.py", package, "load", "--backend", "graph", "--device", "cuda", out=tmp_path / "load")
    expected = {"matches_unsharded": True, "matches_eager_tp": True, "fallbacks": 0, "calls": 2, "backends": ["eager"]}
    for result in tuned:
        rejected = result.pop("rejected")
        assert len(rejected) == 2 and all("collectives are not recorded" in reason for reason in rejected)
    assert [{k: v for k, v in r.items() if k != "speed_gated"} for r in tuned] == [expected] * 2
    assert loaded == [expected] * 2
