"""The TorchAO backend: quantized weights in the package, restored without quantize_ or pickle."""

import importlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import xpupack
from support.models import make_stack
from xpupack import _device, digests
from xpupack.backends.base import backend_from_json
from xpupack.errors import (
    IncompatiblePackageError,
    IntegrityError,
    NoCandidateError,
    PackageFormatError,
    UnknownConfigError,
)
from xpupack.manifest import sha256_of

pytest.importorskip("torchao")

WIDTH = 128
MODULES = ["layers.*.mlp"]
CPU_CONFIGS = ["int8-weight-only", "int8-dynamic", "float8-weight-only"]
TENSOR_TYPE = {
    "int8-weight-only": "Int8Tensor",
    "int8-dynamic": "Int8Tensor",
    "float8-weight-only": "Float8Tensor",
    "int4-weight-only": "Int4TilePackedTo4dTensor",
}


def samples(device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(batch, WIDTH, generator=generator).to(device, dtype) for batch in (2, 4)]


def tune_quantized(config="int8-weight-only", *, device="cpu", dtype=torch.float32, seed=0, strategy=None):
    model = make_stack(seed, WIDTH).to(device, dtype)
    strategy = strategy or xpupack.Only(xpupack.TorchAOBackend(config))
    return xpupack.tune(model, samples(device, dtype), modules=MODULES, device=device, strategy=strategy)


def weight_types(model):
    return {name: type(p).__name__ for name, p in model.named_parameters() if name.endswith("weight")}


def fp32_weight_bytes(model):
    return sum(t.numel() * 4 for t in model.state_dict().values())


def package_weight_bytes(root):
    return sum(path.stat().st_size for path in root.rglob("*.safetensors"))


def snapshot(model):
    return (
        {name: (id(p), type(p).__name__, p.detach().clone()) for name, p in model.named_parameters()},
        [("forward" in m.__dict__) for m in model.modules()],
    )


def assert_unchanged(model, before):
    params, forwards = snapshot(model)
    assert forwards == before[1]
    assert params.keys() == before[0].keys()
    for name, (ident, kind, value) in before[0].items():
        assert params[name][:2] == (ident, kind), name
        assert torch.equal(params[name][2], value), name


# -- tune, save, load --------------------------------------------------------------

CASES = [pytest.param(config, "cpu", torch.float32, id=f"{config}-cpu") for config in CPU_CONFIGS] + [
    pytest.param(config, "cuda", torch.bfloat16, id=f"{config}-cuda", marks=pytest.mark.requires_cuda)
    for config in (*CPU_CONFIGS, "int4-weight-only")
]

FRESH_LOAD = """
import pickle, sys, torch
import torchao.quantization as tq
import torchao.quantization.quant_api as quant_api

def refuse(what):
    def call(*args, **kwargs):
        raise AssertionError(what + " called while loading")
    return call

# nothing may unpickle, and loading may not quantize weights
pickle.load = pickle.loads = pickle.Unpickler = refuse("pickle")
torch.load = refuse("torch.load")
tq.quantize_ = quant_api.quantize_ = refuse("quantize_")
QUANTIZED = (tq.Int8Tensor, tq.Float8Tensor, tq.Int4TilePackedTo4dTensor)
from_hp = [cls.__dict__["from_hp"] for cls in QUANTIZED]
for cls in QUANTIZED:
    cls.from_hp = classmethod(refuse(cls.__name__ + ".from_hp"))

import xpupack
from support.models import make_stack
from safetensors.torch import load_file

model = make_stack(9, {width}).to({dtype})
xpupack.load(model, {root!r}, device={device!r})
for cls, original in zip(QUANTIZED, from_hp):
    cls.from_hp = original  # dynamic configs quantize activations on every call
expected = load_file({expected!r})
with torch.inference_mode():
    actual = model(expected["x"].to({device!r})).cpu()
if {exact}:
    assert torch.equal(actual, expected["y"]), (actual - expected["y"]).abs().max()
else:
    torch.testing.assert_close(actual, expected["y"])
stats = xpupack.stats(model)
assert {{s["backend"] for s in stats.values()}} == {{{backend!r}}}, stats
assert sum(s["fallbacks"] for s in stats.values()) == 0, stats
print(sorted({{type(p).__name__ for p in model.parameters()}}))
"""


def fresh_load(run_python, model, root, tmp_path, *, device="cpu", dtype=torch.float32, backend="torchao"):
    """Loads ``root`` in a fresh process with quantize_, pickle and torch.load refused; outputs must match."""
    x = samples(device, dtype)[1]
    with torch.inference_mode():
        y = model(x)
    save_file({"x": x.cpu(), "y": y.cpu()}, str(tmp_path / "expected.safetensors"))
    code = FRESH_LOAD.format(
        width=WIDTH,
        dtype=dtype,
        root=str(root),
        device=device,
        backend=backend,
        expected=str(tmp_path / "expected.safetensors"),
        exact=device == "cpu",
    )
    return run_python(code).stdout


@pytest.mark.slow
@pytest.mark.parametrize(("config", "device", "dtype"), CASES)
def test_package_loads_in_a_fresh_process_without_quantize_or_pickle(config, device, dtype, tmp_path, run_python):
    model = tune_quantized(config, device=device, dtype=dtype)
    assert set(weight_types(model).values()) == {TENSOR_TYPE[config]}
    root = xpupack.save(model, tmp_path / "pkg")
    printed = fresh_load(run_python, model, root, tmp_path, device=device, dtype=dtype)
    assert TENSOR_TYPE[config] in printed


@pytest.mark.parametrize("config", ["int8-weight-only", "int8-dynamic", "float8-weight-only"])
def test_package_is_well_under_40_percent_of_the_fp32_weights(config, tmp_path):
    fp32 = fp32_weight_bytes(make_stack(0, WIDTH))
    root = xpupack.save(tune_quantized(config), tmp_path / "pkg")
    assert package_weight_bytes(root) / fp32 < 0.40
    with safe_open(str(root / "model.safetensors"), "pt") as handle:
        plain = set(handle.keys())
    assert plain == {f"layers.{i}.mlp.{layer}.bias" for i in (0, 1) for layer in ("up", "down")}
    manifest = json.loads((root / "xpupack.json").read_text())
    entry = manifest["modules"][0]
    assert entry["owned_tensors"] == ["down.weight", "up.weight"]
    assert entry["backend"]["config"]["config"]["_type"].endswith("Config")  # config_to_dict form
    assert "modules/layers.0.mlp/torchao/weights.safetensors" in manifest["files"]


def test_quantized_weights_past_the_shard_size_are_shards_that_load_verify_and_are_remembered(tmp_path, monkeypatch):
    model = tune_quantized()
    root = xpupack.save(model, tmp_path / "pkg", max_shard_size="20KB")  # each int8 weight is 16 KiB and more
    entry = json.loads((root / "xpupack.json").read_text())["modules"][0]
    files = entry["backend"]["config"]["weights"]
    assert files == ["weights-00001-of-00002.safetensors", "weights-00002-of-00002.safetensors"]
    folder = root / entry["folder"] / "torchao"
    for file in files:  # each shard a safetensors file of its own tensors, with its own header
        with safe_open(str(folder / file), "pt") as handle:
            assert len(json.loads(handle.metadata()["tensor_names"])) == 1
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)  # as if the package had been written a while ago
    loaded = xpupack.load(make_stack(4, WIDTH), root)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert set(weight_types(loaded).values()) == {"Int8Tensor"}
    remembered = json.loads((digests.cache_dir() / "verified-files.json").read_text())["files"]
    assert {Path(path).name for path in remembered} >= set(files)  # as the model's weights files are
    from xpupack.cli import main

    verified = CliRunner().invoke(main, ["verify", str(root)])
    assert verified.exit_code == 0, verified.output
    (folder / files[1]).unlink()
    (folder / files[0]).rename(folder / files[1])
    with pytest.raises(IntegrityError):
        xpupack.load(make_stack(4, WIDTH), root)


def test_a_shard_holding_another_shards_tensor_is_refused(tmp_path):
    root = xpupack.save(tune_quantized(), tmp_path / "pkg", max_shard_size="20KB")
    manifest = json.loads((root / "xpupack.json").read_text())
    config = manifest["modules"][0]["backend"]["config"]
    config["weights"] = [config["weights"][0], config["weights"][0]]
    (root / "xpupack.json").write_text(json.dumps(manifest))
    model = make_stack(4, WIDTH)
    before = snapshot(model)
    with pytest.raises(PackageFormatError, match="again, which another shard holds"):
        xpupack.load(model, root, trust_compiled=True, on_mismatch="error")
    assert_unchanged(model, before)


def test_an_empty_model_gets_the_quantized_weights_without_its_full_precision_ones(tmp_path, monkeypatch):
    """The way to a quantized model's memory: build it empty (accelerate's ``init_empty_weights``) and load the
    package; the weights it quantized never exist at full precision, and a failed load leaves it empty."""
    from accelerate import init_empty_weights

    model = tune_quantized()
    root = xpupack.save(model, tmp_path / "pkg")
    with init_empty_weights():
        empty = make_stack(4, WIDTH)
    xpupack.load(empty, root)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        assert torch.equal(empty(x), model(x))
    assert set(weight_types(empty).values()) == {"Int8Tensor"}
    assert not any(p.is_meta for p in empty.parameters())
    runners = [tuned.runner for tuned in xpupack.tuned.session_of(empty).modules.values()]
    assert all(swap.original.is_meta for runner in runners for swap in runner.swaps)  # kept for undo: no memory

    with init_empty_weights():
        other = make_stack(4, WIDTH)
    before = snapshot(other)
    monkeypatch.setattr(importlib.import_module("xpupack.loading"), "attach", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        xpupack.load(other, root)
    assert all(p.is_meta for p in other.parameters())
    assert [(name, ident, kind) for name, (ident, kind, _) in snapshot(other)[0].items()] == [
        (name, ident, kind) for name, (ident, kind, _) in before[0].items()
    ]


def test_fallback_runs_the_quantized_module(fallback_calls):
    model = tune_quantized()
    x = torch.randn(3, WIDTH)  # batch 3 was never recorded
    with torch.no_grad():
        fell_back = model(x)
        xpupack.deactivate(model)
        assert torch.equal(model(x), fell_back)
    assert {event.path for event in fallback_calls} == {"layers.0.mlp", "layers.1.mlp"}
    assert set(weight_types(model).values()) == {"Int8Tensor"}


# -- configs: names, instances, the allow-list ---------------------------------------


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownConfigError) as error:
        xpupack.TorchAOBackend("int3-magic")
    message = str(error.value)
    assert "'int3-magic'" in message
    for name in ("int8-weight-only (cpu, cuda)", "int8-dynamic", "int4-weight-only (cuda", "float8-weight-only"):
        assert name in message


def test_options_round_trip_through_json():
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    for backend in (
        xpupack.TorchAOBackend("int8-dynamic"),
        xpupack.TorchAOBackend("int8-weight-only", min_sqnr_db=33),
        xpupack.TorchAOBackend(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))),
        xpupack.GraphBackend(base=xpupack.TorchAOBackend("float8-weight-only")),
    ):
        options = json.loads(json.dumps(backend.options()))
        again = backend_from_json(backend.name, options)
        assert again.options() == backend.options()


def test_a_config_class_outside_the_allow_list_is_refused():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    with pytest.raises(UnknownConfigError, match="Int8WeightOnlyConfig"):
        xpupack.TorchAOBackend(Int8DynamicActivationIntxWeightConfig())


def test_a_package_states_its_quantization_in_inspect_and_the_model_card(emulated_graphs, tmp_path):
    from xpupack.card import package_card
    from xpupack.cli import main
    from xpupack.manifest import read_manifest
    from xpupack.report import package_report

    backend = xpupack.GraphBackend(base=xpupack.TorchAOBackend("int8-weight-only"))
    root = xpupack.save(tune_quantized(strategy=xpupack.Only(backend)), tmp_path / "pkg")
    modules = package_report(root)["modules"]
    labelled = {(m["label"], m["quantization"]) for m in modules}
    assert labelled == {("graph+torchao:int8-weight-only", "int8-weight-only")}
    shown = CliRunner().invoke(main, ["inspect", str(root)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "quantized (TorchAO, stored as such, not quantized again at load): layers.0.mlp int8-weight-only" in (
        " ".join(shown.output.split())
    )
    card = package_card(root, read_manifest(root))
    assert "- torchao" in card and "| graph+torchao:int8-weight-only |" in card
    assert "Quantized with TorchAO: `layers.0.mlp` (int8-weight-only), `layers.1.mlp` (int8-weight-only)" in card

    plain = xpupack.save(tune_quantized(strategy=xpupack.Only(xpupack.GraphBackend())), tmp_path / "plain")
    assert {m["quantization"] for m in package_report(plain)["modules"]} == {None}
    card = package_card(plain, read_manifest(plain))
    assert "Quantized" not in card and "- torchao" not in card


def test_a_config_instance_is_packaged_and_loaded(tmp_path):
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    model = tune_quantized(strategy=xpupack.Only(xpupack.TorchAOBackend(config)))
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(make_stack(4, WIDTH), root)
    x = samples()[0]
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert set(weight_types(loaded).values()) == {"IntxUnpackedToInt8Tensor"}


def instance_package(tmp_path):
    from torchao.quantization import Int8WeightOnlyConfig

    backend = xpupack.TorchAOBackend(Int8WeightOnlyConfig(set_inductor_config=False))
    return xpupack.save(tune_quantized(strategy=xpupack.Only(backend)), tmp_path / "pkg")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda config: config.update(_type="EvilConfig"), "EvilConfig"),
        (lambda config: config["_data"]["granularity"].update(_type="os.system"), "os.system"),
        (lambda config: config["_data"].update(group_size={"_type": "torch.dtype", "_data": "load"}), "'load'"),
    ],
)
def test_manifest_naming_an_unknown_config_class_is_refused(tmp_path, change, named):
    root = instance_package(tmp_path)
    manifest = json.loads((root / "xpupack.json").read_text())
    change(manifest["modules"][0]["backend"]["options"]["config"])
    (root / "xpupack.json").write_text(json.dumps(manifest))
    model = make_stack(4, WIDTH)
    before = snapshot(model)
    with pytest.raises(UnknownConfigError, match=named):
        xpupack.load(model, root)
    assert_unchanged(model, before)


def test_weights_header_naming_an_unknown_tensor_class_is_refused(tmp_path):
    root = xpupack.save(tune_quantized(), tmp_path / "pkg")
    relative = "modules/layers.1.mlp/torchao/weights.safetensors"
    with safe_open(str(root / relative), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(root / relative))
    entry = json.loads(metadata["module.up.weight"])
    entry["_type"] = "NF4Tensor"
    metadata["module.up.weight"] = json.dumps(entry)
    save_file(tensors, str(root / relative), metadata=metadata)
    manifest = json.loads((root / "xpupack.json").read_text())
    manifest["files"][relative] = {"sha256": sha256_of(root / relative), "size": (root / relative).stat().st_size}
    (root / "xpupack.json").write_text(json.dumps(manifest))
    model = make_stack(4, WIDTH)
    before = snapshot(model)
    with pytest.raises(UnknownConfigError, match="NF4Tensor.*known tensor classes"):
        xpupack.load(model, root)
    assert_unchanged(model, before)  # layers.0.mlp was restored first, then put back


def _rewrite_header(root, change):
    """Changes the torchao header of layers.1.mlp's weights and updates the digest (a self-consistent package)."""
    relative = "modules/layers.1.mlp/torchao/weights.safetensors"
    with safe_open(str(root / relative), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(root / relative))
    change(metadata)
    save_file(tensors, str(root / relative), metadata=metadata)
    manifest = json.loads((root / "xpupack.json").read_text())
    manifest["files"][relative] = {"sha256": sha256_of(root / relative), "size": (root / relative).stat().st_size}
    (root / "xpupack.json").write_text(json.dumps(manifest))
    return relative


@pytest.mark.parametrize("depth", [5000, 400])
def test_a_weights_header_nested_too_deep_is_a_format_error(tmp_path, depth):
    """Deep JSON fails fast with an xpupack error, whether the JSON parser or the type check would recurse
    (docs/safety.md)."""
    root = xpupack.save(tune_quantized(), tmp_path / "pkg")

    def deepen(metadata):
        entry = json.loads(metadata["module.up.weight"])
        entry["_data"]["extra"] = json.loads("[" * min(depth, 900) + "]" * min(depth, 900)) if depth < 900 else 0
        text = json.dumps(entry)
        if depth >= 900:  # beyond what json.dumps itself can write
            text = text.replace('"extra": 0', '"extra": ' + "[" * depth + "]" * depth)
        metadata["module.up.weight"] = text

    relative = _rewrite_header(root, deepen)
    model = make_stack(4, WIDTH)
    before = snapshot(model)
    with pytest.raises(xpupack.PackageFormatError, match="nested") as caught:
        xpupack.load(model, root)
    assert relative in str(caught.value) and "rebuild the package" in str(caught.value)
    assert_unchanged(model, before)


# -- accuracy --------------------------------------------------------------------------


def test_an_impossible_tolerance_rejects_the_candidate_with_the_reason():
    model = make_stack(0, WIDTH)
    before = snapshot(model)
    strategy = xpupack.FirstWins([xpupack.TorchAOBackend("int8-weight-only", min_sqnr_db=200), xpupack.EagerBackend()])
    xpupack.tune(model, samples(), modules=MODULES, strategy=strategy)
    rejected = xpupack.tuned.session_of(model).modules["layers.0.mlp"].report[0]
    assert rejected.status == "rejected"
    assert "SQNR" in rejected.reason and "below the 200 dB required" in rejected.reason
    assert "int8-weight-only" in rejected.reason and "f32[2,128]" in rejected.reason
    xpupack.deactivate(model)
    assert_unchanged(model, before)  # the refused candidate's quantization was undone


def test_only_raises_the_accuracy_reason():
    with pytest.raises(NoCandidateError, match=r"torchao:float8-weight-only backend rejected: .*SQNR \d+\.\d dB"):
        tune_quantized(strategy=xpupack.Only(xpupack.TorchAOBackend("float8-weight-only", min_sqnr_db=90)))


def test_sqnr_measures_relative_noise():
    from xpupack._compare import mismatch, sqnr_db

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert sqnr_db(x, x) == float("inf")
    assert sqnr_db(x * 1.01, x) == pytest.approx(40.0, abs=0.01)
    assert mismatch(x * 1.01, x, min_sqnr_db=35) is None
    assert "SQNR 40.0 dB" in mismatch(x * 1.01, x, min_sqnr_db=45)
    assert mismatch(torch.tensor([1, 2]), torch.tensor([1, 3]), min_sqnr_db=0) == "output 0: values differ from eager"


# -- composition -------------------------------------------------------------------


def test_graph_records_the_quantized_module(emulated_graphs, tmp_path, monkeypatch):
    backend = xpupack.GraphBackend(base=xpupack.TorchAOBackend("int8-weight-only"))
    model = tune_quantized(strategy=xpupack.Only(backend))
    assert {s["backend"] for s in xpupack.stats(model).values()} == {"graph"}
    assert set(weight_types(model).values()) == {"Int8Tensor"}
    root = xpupack.save(model, tmp_path / "pkg")
    assert (root / "modules/layers.0.mlp/graph/torchao/weights.safetensors").is_file()
    assert package_weight_bytes(root) / fp32_weight_bytes(make_stack(0, WIDTH)) < 0.40

    loaded = xpupack.load(make_stack(5, WIDTH), root)
    replays = emulated_graphs.replays
    x = samples()[0]
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert emulated_graphs.replays > replays
    assert {s["backend"] for s in xpupack.stats(loaded).values()} == {"graph"}

    # where no device graphs exist, the package still runs its quantized weights
    monkeypatch.delitem(_device.GRAPH_APIS, "cpu")
    plain = xpupack.load(make_stack(6, WIDTH), root)
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))
    assert {s["backend"] for s in xpupack.stats(plain).values()} == {"torchao"}


def test_fastest_compares_quantized_candidates_from_the_original_weights(emulated_graphs):
    strategy = xpupack.Fastest(
        [
            xpupack.TorchAOBackend("int8-weight-only"),
            xpupack.GraphBackend(base=xpupack.TorchAOBackend("int8-weight-only")),
            xpupack.EagerBackend(),
        ],
        iterations=3,
        min_speedup=None,
    )
    model = tune_quantized(strategy=strategy)
    for path, tuned in xpupack.tuned.session_of(model).modules.items():
        statuses = [entry.status for entry in tuned.report]
        assert statuses.count("chosen") == 1 and "rejected" not in statuses  # eager ran unquantized
        chosen = tuned.report[statuses.index("chosen")].backend
        quantized = {type(p).__name__ for p in tuned.target.module.parameters()} == {"Int8Tensor", "Parameter"}
        assert quantized == (chosen != "eager"), (path, tuned.report)


@pytest.mark.slow
def test_inductor_compiles_the_quantized_module(tmp_path):
    backend = xpupack.InductorBackend(base=xpupack.TorchAOBackend("int8-weight-only"))
    model = tune_quantized(strategy=xpupack.Only(backend))
    root = xpupack.save(model, tmp_path / "pkg")
    assert (root / "modules/layers.0.mlp/inductor/torchao/weights.safetensors").is_file()
    loaded = xpupack.load(make_stack(5, WIDTH), root)
    x = samples()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    assert {s["backend"] for s in xpupack.stats(loaded).values()} == {"inductor"}
    assert set(weight_types(loaded).values()) == {"Int8Tensor"}


def test_cli_builds_quantized_packages(tmp_path):
    from xpupack.cli import main
    from xpupack.cli.build import parse_backends

    graph, inductor, plain = parse_backends("graph+torchao:int8-dynamic,inductor+torchao,torchao:float8-weight-only")
    assert (graph.name, graph.label) == ("graph", "graph+torchao:int8-dynamic")
    assert (inductor.name, inductor.label) == ("inductor", "inductor+torchao:int8-weight-only")
    assert plain.label == "torchao:float8-weight-only"

    out = tmp_path / "pkg"
    result = CliRunner().invoke(
        main,
        [
            "build",
            "xpupack.examples:tiny_transformer",
            "--samples",
            "xpupack.examples:tiny_transformer_samples",
            "--modules",
            "layers.*.mlp",
            "--device",
            "cpu",
            "--backends",
            "graph+torchao,torchao:int8-weight-only,eager",
            "--min-speedup",
            "none",  # torchao's CPU kernels are slower than eager
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "xpupack.json").read_text())
    assert {m["backend"]["name"] for m in manifest["modules"]} == {"torchao"}
    assert "no device graphs on cpu" in manifest["modules"][0]["candidates"][0]["reason"]


# -- loading leaves the model as it was on failure ---------------------------------------


def test_failed_load_puts_the_original_parameters_back(tmp_path, monkeypatch):
    root = xpupack.save(tune_quantized(), tmp_path / "pkg")
    model = make_stack(4, WIDTH)
    before = snapshot(model)

    def explode(*args, **kwargs):
        raise RuntimeError("attach exploded")

    monkeypatch.setattr(importlib.import_module("xpupack.loading"), "attach", explode)
    with pytest.raises(RuntimeError, match="attach exploded"):
        xpupack.load(model, root)
    assert_unchanged(model, before)


def test_loading_and_tuning_again_start_from_the_original_parameters(tmp_path):
    root = xpupack.save(tune_quantized("float8-weight-only"), tmp_path / "pkg")
    model = make_stack(4, WIDTH)
    originals = {name: id(p) for name, p in model.named_parameters()}
    xpupack.load(model, root)
    xpupack.load(model, root)
    assert set(weight_types(model).values()) == {"Float8Tensor"}
    xpupack.tune(model, samples(), modules=MODULES, strategy=xpupack.Only(xpupack.EagerBackend()))
    assert {name: id(p) for name, p in model.named_parameters()} == originals
    assert set(weight_types(model).values()) == {"Parameter"}


def test_without_torchao_a_quantized_package_says_how_to_install(tmp_path, monkeypatch):
    root = xpupack.save(tune_quantized(), tmp_path / "pkg")
    monkeypatch.setattr(
        "xpupack.backends.torchao.torchao_missing", lambda: "torchao is not installed; pip install 'xpupack[torchao]'"
    )
    assert not xpupack.TorchAOBackend().available(torch.device("cpu"))
    model = make_stack(4, WIDTH)
    before = snapshot(model)
    with pytest.raises(IncompatiblePackageError, match=r"pip install 'xpupack\[torchao\]'.*only in that backend"):
        xpupack.load(model, root)
    assert_unchanged(model, before)


def test_int4_is_cuda_only_and_says_so():
    backend = xpupack.TorchAOBackend("int4-weight-only")
    assert not backend.available(torch.device("cpu"))
    assert "needs CUDA" in backend.why_unavailable(torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.requires_cuda
def test_quantized_cuda_graph_in_a_fresh_process(tmp_path, run_python):
    backend = xpupack.GraphBackend(base=xpupack.TorchAOBackend("int8-weight-only"))
    model = tune_quantized(device="cuda", dtype=torch.bfloat16, strategy=xpupack.Only(backend))
    root = xpupack.save(model, tmp_path / "pkg")
    fresh_load(run_python, model, root, tmp_path, device="cuda", dtype=torch.bfloat16, backend="graph")


CONFIG_EXAMPLES = [  # enums, a NamedTuple, lists, dtypes and granularities inside configs
    "int8-weight-only",
    "int8-dynamic",
    "int4-weight-only",
    "float8-weight-only",
    lambda q: q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=q.PerGroup(32)),
    lambda q: q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow()),
    lambda q: q.Int8DynamicActivationInt8WeightConfig(granularity=q.PerTensor(), set_inductor_config=False),
]


@pytest.mark.parametrize("example", CONFIG_EXAMPLES)
def test_a_stored_config_reads_back_as_the_config_torchao_wrote(example):
    import torchao.quantization as q
    from torchao.core.config import config_to_dict

    from xpupack.backends.torchao_configs import config_from_json

    config = xpupack.TorchAOBackend(example).config if isinstance(example, str) else example(q)
    stored = json.loads(json.dumps(config_to_dict(config)))
    again = config_from_json(stored)
    assert type(again) is type(config) and again == config
    assert config_to_dict(again) == stored


def test_reading_a_config_uses_no_torchao_global(monkeypatch):
    """torchao's generic decoder resolves classes through its process-wide allow-list (one entry imports
    transformers); xpupack neither calls it nor changes that list, so other threads see torchao as it is."""
    import torchao.core.config as torchao_config

    from xpupack.backends.torchao_configs import config_from_json

    def refuse(*args, **kwargs):
        raise AssertionError("torchao's config_from_dict was called")

    stored = torchao_config.config_to_dict(xpupack.TorchAOBackend("int8-dynamic").config)
    mine = ["xpupack_no_such_module"]
    monkeypatch.setattr(torchao_config, "ALLOWED_AO_MODULES", mine)
    monkeypatch.setattr(torchao_config, "config_from_dict", refuse)
    assert type(config_from_json(stored)).__name__ == "Int8DynamicActivationInt8WeightConfig"
    assert torchao_config.ALLOWED_AO_MODULES is mine


def test_every_allow_listed_config_class_and_part_exists_in_this_torchao():
    from xpupack.backends.torchao_configs import _CONFIG_PARTS, CONFIG_CLASSES, _torchao_class

    for name in sorted(set(CONFIG_CLASSES) | _CONFIG_PARTS - {"torch.dtype"}):
        assert _torchao_class(name, "test").__name__ == name


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda config: config["_data"].update(__class__="os"), "__class__"),
        (lambda config: config["_data"]["granularity"]["_data"].update(callback="print"), "callback"),
        (
            lambda config: config["_data"].update(granularity={"_type": "MappingType", "_data": "__class__"}),
            "__class__",
        ),
        (lambda config: config["_data"].update(granularity={"_type": "PerRow", "_data": "dim"}), "PerRow"),
        (lambda config: config["_data"].update(group_size={"inner": {"_type": "EvilConfig"}}), "EvilConfig"),
        # a ``_type`` that is no name, and a ``_version`` that is no number, are refused as such
        (lambda config: config["_data"].update(group_size={"_type": None, "_data": 1}), "None"),
        (lambda config: config["_data"].update(group_size={"_type": ["PerRow"], "_data": {}}), "PerRow"),
        (lambda config: config.update(_type=["Int8WeightOnlyConfig"]), "Int8WeightOnlyConfig"),
        (lambda config: config.update(_version={"_type": "os.system"}), "version"),
        (lambda config: config.update(_version="2"), "version"),
    ],
)
def test_a_stored_config_may_set_only_its_class_fields_and_enum_members(change, named):
    from torchao.core.config import config_to_dict

    from xpupack.backends.torchao_configs import config_from_json

    stored = config_to_dict(xpupack.TorchAOBackend("int8-weight-only").config)
    change(stored)
    with pytest.raises(UnknownConfigError, match=named):
        config_from_json(stored)
