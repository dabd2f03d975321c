"""Weights in shards, streamed at save and at load, their digests checked once (docs/packages.md;
docs/format.md, "Weights"; docs/safety.md, "Remembered verifications")."""

from __future__ import annotations

import importlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import xpupack
from support.package_tools import assert_unchanged, redigest, rewrite_json, rewrite_manifest, snapshot
from support.strategies import EAGER
from xpupack import digests
from xpupack.errors import IntegrityError, ModelMismatchError, PackageFormatError
from xpupack.manifest import read_manifest
from xpupack.shards import WEIGHTS, WEIGHTS_INDEX, parse_size, plan_shards

#: a 32x32 float32 weight and its bias fit one shard, two weights do not: the MLP below needs four shards
SHARD = 4096 + 256


class TiedMLP(nn.Module):
    """An embedding, three linear layers and an output layer tied to the embedding (one Parameter)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, 32, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("steps", torch.arange(4))

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def make(seed: int = 0, width: int = 32) -> TiedMLP:
    torch.manual_seed(seed)
    return TiedMLP(width).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))


def tuned(seed: int = 0) -> TiedMLP:
    return xpupack.tune(make(seed), [tokens()], modules=["layers.*"], strategy=EAGER)


@pytest.fixture
def sharded(tmp_path):
    return xpupack.save(tuned(), tmp_path / "pkg", max_shard_size=SHARD)


@pytest.fixture(params=["from the copied bytes", "ahead"])
def hashing(request, monkeypatch):
    """How a load hashes its weights files: from the bytes it copies (a machine of few cores, as CI's), or
    ahead, each in a thread of its own from the start (`xpupack.digests.hash_ahead`: cores to spare)."""
    monkeypatch.setattr(digests, "HASH_AHEAD_CORES", 1 if request.param == "ahead" else 10**6)
    return request.param


def shards_of(root):
    return sorted(path.name for path in root.glob("model-*.safetensors"))


def flip_a_data_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's data: same size, another sha256, a header that still parses
    path.write_bytes(bytes(data))


# -- saving: the Hugging Face layout past one shard --


def test_weights_past_one_shard_are_written_as_shards_with_an_index(sharded):
    shards = shards_of(sharded)
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (sharded / WEIGHTS).exists()
    manifest = read_manifest(sharded)
    assert manifest["model"]["weights"] == WEIGHTS_INDEX
    assert set(shards) | {WEIGHTS_INDEX} <= set(manifest["files"])  # listed and digested like every file
    for shard in shards:
        assert (sharded / shard).stat().st_size <= SHARD + 1024  # the data, and a header


def test_the_index_and_shards_read_as_safetensors_and_transformers_read_them(sharded):
    index = json.loads((sharded / WEIGHTS_INDEX).read_text())
    assert set(index) == {"metadata", "weight_map"}
    held = {}
    for shard in shards_of(sharded):
        with safe_open(str(sharded / shard), framework="pt") as stored:
            assert stored.metadata() == {"format": "pt"}
            for name in stored.keys():  # noqa: SIM118 (a safe_open has no __iter__)
                held[name] = shard
                assert index["weight_map"][name] == shard
    assert held == index["weight_map"]
    model = tuned()
    state = model.state_dict()
    assert index["metadata"]["total_size"] == sum(state[name].nbytes for name in held)
    from transformers.trainer_utils import load_sharded_checkpoint

    other = make(seed=3)
    result = load_sharded_checkpoint(other, str(sharded), strict=False)
    assert result.missing_keys == ["out.weight"]  # the tied name, stored once under embed.weight
    assert all(torch.equal(other.state_dict()[name], state[name]) for name in state)


def test_tied_weights_are_stored_once_across_shards(sharded):
    manifest = read_manifest(sharded)
    assert manifest["model"]["aliases"] == {"out.weight": "embed.weight"}
    weight_map = json.loads((sharded / WEIGHTS_INDEX).read_text())["weight_map"]
    assert "embed.weight" in weight_map and "out.weight" not in weight_map
    model = make(seed=5)
    xpupack.load(model, sharded)
    assert model.out.weight is model.embed.weight


def test_a_sharded_package_loads_into_the_models_own_parameters(sharded):
    model = make(seed=5)
    before = [id(p) for p in model.parameters()]
    xpupack.load(model, sharded)
    expected = tuned().state_dict()
    assert all(torch.equal(model.state_dict()[name], expected[name]) for name in expected)
    assert [id(p) for p in model.parameters()] == before
    with torch.no_grad():
        assert torch.equal(model(tokens()), tuned()(tokens()))


def test_weights_that_fit_one_shard_stay_one_model_safetensors(tmp_path):
    root = xpupack.save(tuned(), tmp_path / "pkg")  # 5 GB by default
    assert (root / WEIGHTS).is_file() and not (root / WEIGHTS_INDEX).exists() and not shards_of(root)
    assert read_manifest(root)["model"]["weights"] == WEIGHTS
    stored = load_file(str(root / WEIGHTS))  # safetensors' own reader
    state = tuned().state_dict()
    assert set(stored) == set(state) - {"out.weight"}
    assert all(torch.equal(stored[name], state[name]) for name in stored)


def test_a_package_whose_weights_safetensors_wrote_still_loads(tmp_path):
    """Packages of earlier xpupacks: ``model.safetensors`` written by safetensors' ``save_file``."""
    root = xpupack.save(tuned(), tmp_path / "pkg")
    stored = load_file(str(root / WEIGHTS))
    save_file(stored, str(root / WEIGHTS), metadata={"format": "pt"})
    redigest(root)
    model = make(seed=5)
    xpupack.load(model, root)
    assert torch.equal(model.layers[2].weight, tuned().layers[2].weight)


def test_a_loaded_model_does_not_depend_on_the_package_file(tmp_path):
    """Every tensor is copied out of safetensors' memory map: writing the file in place later (same inode)
    changes nothing in the model (it once did, its parameters were the file's pages)."""
    root = xpupack.save(tuned(), tmp_path / "pkg")
    model = make(seed=5)
    xpupack.load(model, root)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    data = bytearray((root / WEIGHTS).read_bytes())
    data[-8192:] = bytes(8192)
    with (root / WEIGHTS).open("r+b") as stream:
        stream.write(data)
    assert all(torch.equal(model.state_dict()[name], before[name]) for name in before)


@pytest.mark.parametrize(
    "text, size",
    [(4096, 4096), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5 kb", 1500), ("7", 7)],
)
def test_max_shard_size_takes_bytes_or_a_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", [0, -1, "", "5 parsecs", "GB", True, 1.5, None])
def test_a_bad_max_shard_size_is_refused_before_anything_is_written(bad, tmp_path):
    with pytest.raises(ValueError, match="max_shard_size"):
        xpupack.save(tuned(), tmp_path / "pkg", max_shard_size=bad)
    assert not (tmp_path / "pkg").exists()


def test_a_tensor_larger_than_a_shard_gets_a_shard_of_its_own():
    assert plan_shards({"a": 10, "b": 50, "c": 10, "d": 10}, 25) == [["a"], ["b"], ["c", "d"]]
    assert plan_shards({}, 25) == []


# -- loading: refused before anything runs on them, and the model as it was --


def test_a_tampered_shard_is_refused_and_the_model_is_unchanged(sharded, hashing):
    flip_a_data_byte(sharded / shards_of(sharded)[1])
    model = make(seed=5).train()
    before = snapshot(model)
    with pytest.raises(IntegrityError, match=r"model-00002-of-\d+\.safetensors does not match its sha256"):
        xpupack.load(model, sharded)
    assert_unchanged(model, before)


def test_a_shard_damaged_in_its_header_is_reported_as_changed(sharded, hashing):
    """Its header no longer parses, but what is wrong is that the file changed: the digest says so first."""
    shard = sharded / shards_of(sharded)[0]
    data = bytearray(shard.read_bytes())
    data[10] = ord("[")
    shard.write_bytes(bytes(data))
    model = make(seed=5)
    before = snapshot(model)
    with pytest.raises(IntegrityError, match="does not match its sha256"):
        xpupack.load(model, sharded)
    assert_unchanged(model, before)


def test_a_failure_after_the_weights_are_installed_puts_them_back(sharded, monkeypatch):
    monkeypatch.setattr(
        importlib.import_module("xpupack.loading"), "attach", lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    model = make(seed=5).train()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        xpupack.load(model, sharded)
    assert_unchanged(model, before)
    assert model.out.weight is model.embed.weight


@pytest.mark.parametrize(
    "shard, words",
    [
        ("../outside.safetensors", "not one of"),
        ("/etc/passwd", "not one of"),
        ("other.safetensors", "not one of"),
        ("model-00001-of-00099.safetensors", "not one of"),
    ],
)
def test_an_index_naming_another_file_is_refused(sharded, tmp_path, shard, words):
    shutil.copyfile(sharded / shards_of(sharded)[0], tmp_path / "outside.safetensors")
    rewrite_json(sharded, WEIGHTS_INDEX, lambda index: index["weight_map"].update({"embed.weight": shard}))
    model = make(seed=5)
    before = snapshot(model)
    with pytest.raises(PackageFormatError, match=words):
        xpupack.load(model, sharded)
    assert_unchanged(model, before)
    from xpupack.report import verify_package

    result = verify_package(sharded)
    assert not result["ok"] and words in result["problems"][0]


def test_an_index_that_moves_a_name_to_another_shard_is_refused(sharded):
    index = json.loads((sharded / WEIGHTS_INDEX).read_text())
    shared = [shard for shard in shards_of(sharded) if list(index["weight_map"].values()).count(shard) > 1]
    name = next(name for name, shard in index["weight_map"].items() if shard == shared[0])
    other = next(shard for shard in shards_of(sharded) if shard != shared[0])
    rewrite_json(sharded, WEIGHTS_INDEX, lambda index: index["weight_map"].update({name: other}))
    with pytest.raises(PackageFormatError, match=f"holds the tensor '{name}'"):
        xpupack.load(make(seed=5), sharded)


def test_a_listed_shard_the_index_leaves_out_is_refused(sharded):
    index = json.loads((sharded / WEIGHTS_INDEX).read_text())
    last = shards_of(sharded)[-1]
    names = [name for name, shard in index["weight_map"].items() if shard == last]
    rewrite_json(sharded, WEIGHTS_INDEX, lambda index: [index["weight_map"].pop(name) for name in names])
    with pytest.raises(PackageFormatError):
        xpupack.load(make(seed=5), sharded)


def test_an_index_with_a_wrong_total_size_is_refused(sharded):
    rewrite_json(sharded, WEIGHTS_INDEX, lambda index: index["metadata"].update(total_size=1))
    with pytest.raises(PackageFormatError, match="total_size"):
        xpupack.load(make(seed=5), sharded)


def test_a_manifest_naming_other_weights_is_refused(sharded):
    rewrite_manifest(sharded, lambda manifest: manifest["model"].update(weights=shards_of(sharded)[0]))
    with pytest.raises(PackageFormatError, match="a package holds its weights in"):
        xpupack.load(make(seed=5), sharded)


# -- the digest checked once: while streaming, and remembered for unchanged files --


class Hashes:
    """Counts the weights files hashed: by the load as it streams them, or on their own."""

    def __init__(self, monkeypatch):
        self.files: list[str] = []
        self.by: set[str] = set()  # of the weights files: "the load" (as it streams them), "a thread" (on their own)
        weights_io = importlib.import_module("xpupack._weights_io")
        original_hashing, original_sha256 = weights_io._Hashing, digests.sha256_of

        def hashing(path):
            self.files.append(path.name)
            self.by.add("the load")
            return original_hashing(path)

        def sha256_of(path, stop=None):
            self.files.append(path.name)
            if path.name.endswith(".safetensors"):
                self.by.add("a thread")
            return original_sha256(path, stop)

        monkeypatch.setattr(weights_io, "_Hashing", hashing)
        monkeypatch.setattr(digests, "sha256_of", sha256_of)

    def weights(self) -> list[str]:
        return sorted(name for name in self.files if name.endswith(".safetensors"))


def test_a_load_hashes_each_shard_once(sharded, monkeypatch, hashing):
    hashes = Hashes(monkeypatch)
    model = make(seed=5)
    xpupack.load(model, sharded)
    assert hashes.weights() == shards_of(sharded)
    assert hashes.by == {"a thread" if hashing == "ahead" else "the load"}
    assert all(torch.equal(model.state_dict()[name], value) for name, value in tuned().state_dict().items())


def test_a_verified_unchanged_file_is_not_hashed_again(sharded, monkeypatch):
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)  # as if the package had been written a while ago
    xpupack.load(make(seed=5), sharded)
    remembered = json.loads((digests.cache_dir() / "verified-files.json").read_text())["files"]
    assert len(remembered) == len(shards_of(sharded))
    hashes = Hashes(monkeypatch)
    model = make(seed=5)
    xpupack.load(model, sharded)
    assert hashes.weights() == []
    assert torch.equal(model.layers[0].weight, tuned().layers[0].weight)
    monkeypatch.setenv("XPUPACK_REMEMBER_VERIFIED", "0")
    xpupack.load(make(seed=5), sharded)
    assert hashes.weights() == shards_of(sharded)


def test_a_remembered_file_changed_in_place_is_hashed_again_and_refused(sharded, monkeypatch):
    """Same size, modification time put back: the change time still tells (no program can set it)."""
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)
    xpupack.load(make(seed=5), sharded)
    shard = sharded / shards_of(sharded)[2]
    info = shard.stat()
    flip_a_data_byte(shard)
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert shard.stat().st_size == info.st_size and shard.stat().st_mtime_ns == info.st_mtime_ns
    hashes = Hashes(monkeypatch)
    model = make(seed=5)
    before = snapshot(model)
    with pytest.raises(IntegrityError, match="model-00003"):
        xpupack.load(model, sharded)
    assert shard.name in hashes.weights()
    assert_unchanged(model, before)


def test_a_touched_file_is_hashed_again(sharded, monkeypatch):
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)
    xpupack.load(make(seed=5), sharded)
    first = sharded / shards_of(sharded)[0]
    first.write_bytes(first.read_bytes())  # rewritten with the same bytes: another change time
    hashes = Hashes(monkeypatch)
    xpupack.load(make(seed=5), sharded)
    assert hashes.weights() == [first.name]


def test_a_file_changed_just_before_it_was_hashed_is_not_remembered(sharded, monkeypatch):
    """Within `SETTLE_S` of its last change, a write in the same timestamp tick could go unseen."""
    xpupack.load(make(seed=5), sharded)  # the package was written a moment ago
    assert not (digests.cache_dir() / "verified-files.json").exists()
    hashes = Hashes(monkeypatch)
    xpupack.load(make(seed=5), sharded)
    assert hashes.weights() == shards_of(sharded)


def test_verify_hashes_every_file_even_when_remembered(sharded, monkeypatch):
    from xpupack.report import verify_package

    monkeypatch.setattr(digests, "SETTLE_S", 0.0)
    xpupack.load(make(seed=5), sharded)
    hashes = Hashes(monkeypatch)
    assert verify_package(sharded)["ok"]
    assert hashes.weights() == shards_of(sharded)


def test_an_unreadable_remembered_list_only_costs_hashing(sharded, monkeypatch):
    digests.cache_dir().mkdir(parents=True, exist_ok=True)
    (digests.cache_dir() / "verified-files.json").write_text('{"version": 1, "files": [')
    hashes = Hashes(monkeypatch)
    xpupack.load(make(seed=5), sharded)
    assert hashes.weights() == shards_of(sharded)


# -- a package without weights still knows what it was tuned on --


def test_a_package_without_weights_records_names_shapes_and_dtypes(tmp_path):
    root = xpupack.save(tuned(), tmp_path / "pkg", weights=False)
    manifest = read_manifest(root)
    assert manifest["model"]["weights"] is None and not list(root.glob("*.safetensors"))
    assert manifest["model"]["tensors"]["layers.0.weight"] == {"shape": [32, 32], "dtype": "float32"}
    assert set(manifest["model"]["tensors"]) == set(make().state_dict())
    model = make(seed=5)
    own = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    xpupack.load(model, root)
    assert all(torch.equal(model.state_dict()[name], own[name]) for name in own)  # its own weights kept


@pytest.mark.parametrize("other", [lambda: make(seed=5, width=8), lambda: make(seed=5).double()])
def test_a_package_without_weights_refuses_a_model_of_other_shapes_or_dtypes(tmp_path, other):
    root = xpupack.save(tuned(), tmp_path / "pkg", weights=False)
    model = other()
    before = snapshot(model)
    with pytest.raises(ModelMismatchError, match="does not match the package"):
        xpupack.load(model, root)
    assert_unchanged(model, before)


# -- inspect and the command line --


def test_inspect_shows_the_shards_and_their_size(sharded):
    from click.testing import CliRunner

    from xpupack.cli import main
    from xpupack.report import package_report

    model = package_report(sharded)["model"]
    shards = shards_of(sharded)
    assert model["weights_files"] == len(shards)
    assert model["weights_bytes"] == sum((sharded / shard).stat().st_size for shard in shards)
    output = CliRunner().invoke(main, ["inspect", str(sharded)]).output
    assert f"weights in {len(shards)} shards" in output


def test_inspect_and_verify_of_a_sharded_package_import_no_torch(sharded, run_python):
    output = run_python(f"""
        import sys
        from click.testing import CliRunner
        from xpupack.cli import main
        for command in ("inspect", "verify"):
            result = CliRunner().invoke(main, [command, {str(sharded)!r}])
            assert result.exit_code == 0, result.output
            print(result.output)
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
    """).stdout
    assert "shards" in output and "intact" in output


def test_build_writes_shards_past_max_shard_size(tmp_path):
    from click.testing import CliRunner

    from xpupack.cli import main

    out = tmp_path / "pkg"
    arguments = ["build", "xpupack.examples:tiny_transformer", "--samples", "xpupack.examples:tiny_transformer_samples"]
    arguments += ["--modules", "layers.*.mlp", "--backends", "eager", "--out", str(out)]
    result = CliRunner().invoke(main, [*arguments, "--max-shard-size", "16KB"])
    assert result.exit_code == 0, result.output
    assert len(shards_of(out)) > 1 and (out / WEIGHTS_INDEX).is_file()
    refused = CliRunner().invoke(main, [*arguments, "--max-shard-size", "lots"])
    assert refused.exit_code != 0 and "--max-shard-size" in refused.output


# -- on a GPU: tensors that stay there are written in place, and the device holds nothing more --


@pytest.mark.requires_cuda
def test_a_load_into_a_model_on_the_gpu_writes_in_place_and_allocates_nothing_there(sharded):
    model = make(seed=5).cuda()
    pointers = [p.data_ptr() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    xpupack.load(model, sharded)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 4096  # at most a tensor's worth for the load's own runs
    assert [p.data_ptr() for p in model.parameters()] == pointers
    expected = tuned().state_dict()
    assert all(torch.equal(model.state_dict()[name].cpu(), expected[name]) for name in expected)


@pytest.mark.requires_cuda
def test_a_failed_load_on_the_gpu_writes_the_old_values_back(sharded, monkeypatch):
    monkeypatch.setattr(
        importlib.import_module("xpupack.loading"), "attach", lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    model = make(seed=5).cuda()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        xpupack.load(model, sharded)
    assert_unchanged(model, before)


@pytest.mark.requires_cuda
def test_a_model_on_the_cpu_loads_onto_the_gpu(sharded):
    model = make(seed=5)
    xpupack.load(model, sharded, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"} and model.out.weight is model.embed.weight
    assert torch.equal(model.layers[1].weight.cpu(), tuned().layers[1].weight)


@pytest.mark.requires_cuda
def test_a_model_on_the_gpu_saves_shards_a_tensor_at_a_time(tmp_path):
    model = xpupack.tune(make().cuda(), [tokens().cuda()], modules=["layers.*"], strategy=EAGER)
    root = xpupack.save(model, tmp_path / "pkg", max_shard_size=SHARD)
    assert len(shards_of(root)) > 2
    loaded = make(seed=5)
    xpupack.load(loaded, root, device="cpu")
    assert all(torch.equal(loaded.state_dict()[name], tensor.cpu()) for name, tensor in model.state_dict().items())


def test_a_tensor_comes_to_the_host_for_writing_contiguous_and_a_host_one_is_not_copied_again():
    from xpupack._device import host_bytes_copy

    weight = torch.randn(4, 3)
    assert host_bytes_copy(weight) is weight
    transposed = host_bytes_copy(weight.t())
    assert transposed.is_contiguous() and torch.equal(transposed, weight.t())


@pytest.mark.parametrize("rows", [3, 3000], ids=["small", "zeroed-first"])
def test_a_written_tensors_old_values_come_back_whole_on_rollback(rows):
    """`ModelEdit.copy_into` keeps a tensor's old values on the host (`host_copy`: a large one's memory zeroed
    first from torch's threads), and rollback writes them back into the same tensor, strides and all."""
    from xpupack._device import _PREFAULT_BYTES, host_copy
    from xpupack._model_edit import ModelEdit

    weight = torch.randn(3000, rows).t()  # transposed: dense, not contiguous
    assert (weight.untyped_storage().nbytes() >= _PREFAULT_BYTES) == (rows == 3000)
    copy = host_copy(weight)
    assert torch.equal(copy, weight) and copy.stride() == weight.stride()
    assert copy.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    model = nn.Linear(1, 1)
    edit, before, address = ModelEdit(model), weight.clone(), weight.data_ptr()
    edit.copy_into(weight, torch.zeros_like(weight))
    assert weight.count_nonzero() == 0 and weight.data_ptr() == address
    edit.rollback()
    assert torch.equal(weight, before) and weight.data_ptr() == address
