"""Tensor parallel (DTensor, ``parallelize_module``) over gloo on CPU: tuned per rank, the full weights stored
once, loaded into a sharded model of other weights in fresh processes (docs/multi-gpu.md)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import xpupack
from support.torchrun import run_ranks
from support.tp_worker import make_blocks, shard
from xpupack.manifest import read_manifest

pytestmark = pytest.mark.slow  # fresh processes (and Inductor compiles)

EXPECTED = {"matches_unsharded": True, "matches_eager_tp": True, "fallbacks": 0, "calls": 2}


@pytest.mark.parametrize("backend", ["eager", "inductor", "graph"])
def test_a_tensor_parallel_model_is_tuned_saved_once_and_loaded_into_shards(backend, tmp_path):
    package = tmp_path / "pkg"
    flags = ["--backend", backend, *(["--emulated-graphs"] if backend == "graph" else [])]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    tuned = run_ranks("tp_worker.py", package, "tune", *flags, out=tmp_path / "tune", env=env)
    without_gate = [{k: v for k, v in r.items() if k != "speed_gated"} for r in tuned]
    assert without_gate == [{**EXPECTED, "backends": [backend]}] * 2
    assert all("pass strategy=xpupack.Only(backend)" in r["speed_gated"] for r in tuned)

    # the full, unsharded weights, once: what the model was before parallelize_module
    stored = load_file(str(package / "model.safetensors"))
    reference = make_blocks(seed=0).state_dict()
    assert stored.keys() == reference.keys()
    assert all(torch.equal(stored[name], reference[name]) for name in reference)
    assert not [p for p in package.rglob("*") if "rank" in p.name]
    assert [m["path"] for m in read_manifest(package)["modules"]] == ["layers.0", "layers.1"]

    loaded = run_ranks("tp_worker.py", package, "load", *flags, out=tmp_path / "load", env=env)
    assert loaded == [{**EXPECTED, "backends": [backend]}] * 2


@pytest.fixture
def one_rank_group():
    """A process group of one gloo rank in this process, destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_dtensor_arguments_are_never_recorded(emulated_graphs, fallback_calls):
    """A DTensor input's fit key would be a plain tensor's of its global shape: such calls are not recorded,
    and the module runs the original forward (the answers stay eager's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    block = lambda model, x: model.layers[0](x)  # noqa: E731 (the block takes the DTensor; Blocks would add it to its output)
    samples = [distribute_tensor(torch.randn(2, 8), mesh, [Replicate()])]
    model = xpupack.tune(
        shard(make_blocks(seed=0, depth=1), mesh),
        samples,
        modules=["layers.*"],
        run=block,
        strategy=xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()]),
    )
    stats = xpupack.stats(model)["layers.0"]
    assert stats["backend"] == "eager" and stats["signatures"] == 0
    x = distribute_tensor(torch.randn(2, 8), mesh, [Replicate()])
    with torch.no_grad():
        torch.testing.assert_close(
            torch.as_tensor(block(model, x)), block(make_blocks(seed=0, depth=1), x.full_tensor())
        )
    assert fallback_calls == []  # an eager module runs every call itself: none is a fallback


@pytest.mark.usefixtures("one_rank_group")
def test_moving_a_sharded_module_records_it_again(emulated_graphs, fallback_calls):
    """A DTensor's own storage address is 0, and ``.to()`` swaps its local shard in place: the recordings
    watch the shard, so a moved (here: converted) module is recorded again, never replayed from old memory."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    samples = [torch.randn(2, 8)]
    model = xpupack.tune(
        shard(make_blocks(seed=0, depth=1), mesh),
        samples,
        modules=["layers.*"],
        strategy=xpupack.Only(xpupack.GraphBackend()),
    )
    with torch.no_grad():
        model(samples[0])
    assert xpupack.stats(model)["layers.0"]["rerecordings"] == 0
    model.to(torch.float64)
    with pytest.raises(RuntimeError), torch.no_grad():
        model(samples[0])  # float32 into float64 weights: eager's error, after recording again failed
    assert xpupack.stats(model)["layers.0"]["rerecordings"] == 1


@pytest.fixture
def graphs_without_collectives(emulated_graphs, monkeypatch):
    """Emulated graphs that, like CUDA graphs on torch 2.11 with NCCL, cannot record collectives."""
    monkeypatch.setattr(emulated_graphs, "records_collectives", False, raising=False)
    return emulated_graphs


@pytest.mark.usefixtures("one_rank_group")
def test_a_sharded_module_is_refused_before_any_capture_where_collectives_cannot_be_recorded(
    graphs_without_collectives, tmp_path
):
    """A failed capture of an all-reduce left two H200 ranks hung: the graph backend does not try it, every
    rank refuses alike, and the next backend serves (docs/multi-gpu.md)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    samples = [torch.randn(2, 8)]
    strategy = xpupack.FirstWins([xpupack.GraphBackend(), xpupack.EagerBackend()], min_speedup=None)
    model = xpupack.tune(shard(make_blocks(seed=0, depth=1), mesh), samples, modules=["layers.*"], strategy=strategy)
    assert graphs_without_collectives.captures == 0
    assert xpupack.stats(model)["layers.0"]["backend"] == "eager"
    report = xpupack.tuned.session_of(model).modules["layers.0"].report
    rejected = [entry for entry in report if entry.status == "rejected"]
    assert [entry.backend for entry in rejected] == ["graph"]
    assert "collectives are not recorded" in rejected[0].reason
    assert "record_collectives=True" in rejected[0].reason


@pytest.mark.usefixtures("one_rank_group")
def test_record_collectives_opts_in_and_is_stored_in_the_package(graphs_without_collectives, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    samples = [torch.randn(2, 8)]
    strategy = xpupack.Only(xpupack.GraphBackend(record_collectives=True))
    model = xpupack.tune(shard(make_blocks(seed=0, depth=1), mesh), samples, modules=["layers.*"], strategy=strategy)
    assert xpupack.stats(model)["layers.0"]["backend"] == "graph" and graphs_without_collectives.captures == 1
    root = xpupack.save(model, tmp_path / "pkg")
    assert read_manifest(root)["modules"][0]["backend"]["options"] == {"record_collectives": True}
    loaded = xpupack.load(shard(make_blocks(seed=9, depth=1), mesh), root)
    assert xpupack.stats(loaded)["layers.0"]["backend"] == "graph"
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(loaded(samples[0])), make_blocks(seed=0, depth=1)(samples[0]))


@pytest.mark.usefixtures("one_rank_group")
def test_the_loader_decides_whether_a_package_records_collectives(graphs_without_collectives, tmp_path, monkeypatch):
    """A package's record_collectives is honoured from a trusted source only (an unpinned Hub revision is
    not one), and the loader can refuse it or take it (docs/safety.md)."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    from xpupack.source import Source

    mesh = init_device_mesh("cpu", (1,))
    samples = [torch.randn(2, 8)]
    strategy = xpupack.Only(xpupack.GraphBackend(record_collectives=True))
    model = xpupack.tune(shard(make_blocks(seed=0, depth=1), mesh), samples, modules=["layers.*"], strategy=strategy)
    root = xpupack.save(model, tmp_path / "pkg")
    backend = {}
    for name, load in {"local": {}, "local, refused": {"record_collectives": False}}.items():
        backend[name] = xpupack.stats(xpupack.load(shard(make_blocks(seed=9, depth=1), mesh), root, **load))[
            "layers.0"
        ]["backend"]
    monkeypatch.setattr(
        importlib.import_module("xpupack.loading"),
        "resolve_source",
        lambda *a, **k: Source(root, trusted=False, description="org/name@main"),
    )
    for name, load in {"hub": {}, "hub, taken": {"record_collectives": True}}.items():
        backend[name] = xpupack.stats(xpupack.load(shard(make_blocks(seed=9, depth=1), mesh), "org/name", **load))[
            "layers.0"
        ]["backend"]
    assert backend == {"local": "graph", "local, refused": "eager", "hub": "eager", "hub, taken": "graph"}


def test_record_collectives_takes_only_a_bool():
    with pytest.raises(ValueError, match="record_collectives"):
        xpupack.GraphBackend(record_collectives="yes")


@pytest.mark.usefixtures("one_rank_group")
def test_a_graph_package_of_a_sharded_module_loads_on_a_device_that_cannot_record_its_collectives(
    emulated_graphs, tmp_path, monkeypatch
):
    """Built where collectives record, loaded where they do not: the module is refused before any capture
    and runs the original forward, with the same answers."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    samples = [torch.randn(2, 8)]
    model = xpupack.tune(
        shard(make_blocks(seed=0, depth=1), mesh),
        samples,
        modules=["layers.*"],
        strategy=xpupack.Only(xpupack.GraphBackend()),
    )
    assert xpupack.stats(model)["layers.0"]["backend"] == "graph"
    root = xpupack.save(model, tmp_path / "pkg")
    monkeypatch.setattr(emulated_graphs, "records_collectives", False, raising=False)
    captures = emulated_graphs.captures
    loaded = xpupack.load(shard(make_blocks(seed=9, depth=1), mesh), root)
    assert emulated_graphs.captures == captures
    assert xpupack.stats(loaded)["layers.0"]["backend"] == "eager"  # the original forward
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(loaded(samples[0])), make_blocks(seed=0, depth=1)(samples[0]))
