import importlib

import pytest
import torch

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, rewrite_manifest, snapshot
from support.strategies import EAGER
from xpupack.errors import IntegrityError, ModelMismatchError, PackageFormatError, UnknownConfigError
from xpupack.examples import tiny_transformer, tiny_transformer_samples


@pytest.fixture
def package(tmp_path):
    model = xpupack.tune(make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)
    return xpupack.save(model, tmp_path / "pkg")


def test_load_restores_the_package_weights_over_other_weights(package):
    tuned = make_stack(seed=0)
    model = make_stack(seed=7)  # the user loaded other weights before
    params_before = [id(p) for p in model.parameters()]
    xpupack.load(model, package)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), tuned(x))
    assert [id(p) for p in model.parameters()] == params_before  # same Parameter objects
    assert set(xpupack.stats(model)) == {"layers.0.mlp", "layers.1.mlp"}


def test_a_module_entry_without_owned_tensors_owns_none(package):
    """``owned_tensors`` is optional in the manifest's schema (the fuzzer found a load that read it as required)."""
    rewrite_manifest(package, lambda m: [entry.pop("owned_tensors") for entry in m["modules"]])
    model = make_stack(seed=7)
    xpupack.load(model, package)
    with torch.no_grad():
        assert torch.equal(model(torch.ones(4, 8)), make_stack(seed=0)(torch.ones(4, 8)))


def test_a_load_says_where_its_time_went(package, caplog):
    model = make_stack(seed=7)
    with caplog.at_level("INFO", logger="xpupack"):
        xpupack.load(model, package)
    phases = xpupack.stats(model, totals=True)["totals"]["load_seconds"]
    assert list(phases) == ["verify", "weights", "shared_artifacts", "modules", "activate"]
    assert all(seconds >= 0 for seconds in phases.values())
    modules = xpupack.stats(model)
    assert all(0 <= modules[path]["load_s"] <= phases["modules"] for path in ("layers.0.mlp", "layers.1.mlp"))
    assert "loaded " in caplog.text and "modules " in caplog.text


def test_a_model_tuned_here_has_no_load_times():
    model = xpupack.tune(make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)
    assert "load_s" not in xpupack.stats(model)["layers.0.mlp"]
    assert "load_seconds" not in xpupack.stats(model, totals=True)["totals"]


def test_package_without_weights_keeps_the_models_own(tmp_path):
    model = xpupack.tune(make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)
    root = xpupack.save(model, tmp_path / "pkg", weights=False)
    other = make_stack(seed=3)
    expected = make_stack(seed=3)
    xpupack.load(other, root)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(other(x), expected(x))


def test_load_puts_the_model_in_eval_mode(package):
    model = make_stack().train()
    xpupack.load(model, package)
    assert not any(m.training for m in model.modules())


def test_loading_twice_replaces_the_first(package):
    model = make_stack()
    xpupack.load(model, package)
    xpupack.load(model, package)
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x, scale=1.0)
    assert xpupack.stats(model)["layers.0.mlp"]["calls"] == 1


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete", "add a file"])
def test_damaged_package_raises_and_leaves_the_model_unchanged(package, damage):
    target = package / "model.safetensors"
    if damage == "flip a byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "delete":
        target.unlink()
    else:
        (package / "modules" / "extra.bin").write_bytes(b"\0")
    model = make_stack(seed=5).train()
    before = snapshot(model)
    with pytest.raises(IntegrityError) as error:
        xpupack.load(model, package)
    assert ("extra.bin" if damage == "add a file" else "model.safetensors") in str(error.value)
    assert "rebuild" in str(error.value) or "remove" in str(error.value)
    assert_unchanged(model, before)


def test_wrong_architecture_fails_before_anything_changes(package):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    before = snapshot(model)
    with pytest.raises(ModelMismatchError, match="missing layers.0.mlp.up.weight"):
        xpupack.load(model, package)
    assert_unchanged(model, before)


def test_load_given_a_factory_says_to_call_it(package):
    from xpupack.errors import NotAModelError

    with pytest.raises(
        NotAModelError,
        match="xpupack.load needs the model .* not the function make_stack — "
        r"call it: xpupack.load\(make_stack\(\), \.\.\.\)",
    ):
        xpupack.load(make_stack, package)


def test_other_dtype_is_a_mismatch(package):
    with pytest.raises(ModelMismatchError, match="float64"):
        xpupack.load(make_stack().double(), package)


def test_failure_during_restore_rolls_everything_back(package, monkeypatch):
    model = make_stack(seed=5).train()
    before = snapshot(model)
    load_module = importlib.import_module("xpupack.loading")

    def explode(*args, **kwargs):
        raise RuntimeError("restore exploded")

    monkeypatch.setattr(load_module, "attach", explode)
    with pytest.raises(RuntimeError, match="restore exploded"):
        xpupack.load(model, package)
    assert_unchanged(model, before)


def test_failed_load_keeps_an_earlier_tuning_active(package):
    model = make_stack()
    xpupack.load(model, package)
    (package / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(IntegrityError):
        xpupack.load(model, package)
    assert xpupack.stats(model)["layers.0.mlp"]["active"]
    assert "forward" in model.layers[0]["mlp"].__dict__


def _serve(model):
    with torch.no_grad():
        return model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("failure", [RuntimeError("progress display broke"), KeyboardInterrupt()])
@pytest.mark.parametrize("kind", ["eager", "graph"])
def test_a_load_that_fails_midway_gives_back_the_earlier_tuning(tmp_path, request, kind, failure):
    """Active, counting, its recordings intact: the earlier tuning is exactly as it was."""
    if kind == "graph":
        emulated = request.getfixturevalue("emulated_graphs")
    strategy = EAGER if kind == "eager" else xpupack.Only(xpupack.GraphBackend())
    model = xpupack.tune(make_stack(), stack_samples(), modules=["layers.*.mlp"], strategy=strategy)
    root = xpupack.save(model, tmp_path / "pkg")
    model = xpupack.load(make_stack(seed=7), root)
    expected = _serve(model)
    before = xpupack.stats(model)
    replays = emulated.replays if kind == "graph" else 0

    def progress(message):
        raise failure

    with pytest.raises(type(failure)):
        xpupack.load(model, root, progress=progress)
    assert xpupack.stats(model) == before
    assert torch.equal(_serve(model), expected)
    after = xpupack.stats(model)
    assert {path: (s["active"], s["calls"], s["fallbacks"]) for path, s in after.items()} == {
        path: (True, s["calls"] + 1, s["fallbacks"]) for path, s in before.items()
    }
    if kind == "graph":  # replayed from the recordings it had, not recorded again
        assert emulated.replays == replays + 2 and {s["rerecordings"] for s in after.values()} == {0}


def test_future_format_version_says_upgrade(package):
    rewrite_manifest(package, lambda m: m.update(format_version=3))
    with pytest.raises(PackageFormatError, match="unsupported format_version 3.*upgrade xpupack"):
        xpupack.load(make_stack(), package)


def test_escaping_path_is_refused(package):
    def escape(manifest):
        manifest["files"]["../outside"] = {"sha256": "0" * 64, "size": 1}

    rewrite_manifest(package, escape)
    with pytest.raises(PackageFormatError):
        xpupack.load(make_stack(), package)


def test_unknown_backend_lists_known_ones(package):
    def rename(manifest):
        for module in manifest["modules"]:
            module["backend"]["name"] = "warp-drive"

    rewrite_manifest(package, rename)
    with pytest.raises(UnknownConfigError, match="eager.*graph.*inductor"):
        xpupack.load(make_stack(), package)


def test_not_a_package(tmp_path):
    with pytest.raises(PackageFormatError, match="not an xpupack package"):
        xpupack.load(make_stack(), tmp_path)


def test_demo_transformer_round_trip(tmp_path):
    model = xpupack.tune(tiny_transformer(), tiny_transformer_samples(), modules=["layers.*.mlp"], strategy=EAGER)
    root = xpupack.save(model, tmp_path / "pkg")
    loaded = xpupack.load(tiny_transformer(seed=9), root)
    with torch.no_grad():
        for ids in tiny_transformer_samples():
            assert torch.equal(loaded(ids), tiny_transformer()(ids))
    assert loaded.head.weight is loaded.embed.weight  # tying survives the load


def test_the_check_against_the_original_module_checks_the_spec_and_skips_sizes_met_while_serving():
    """A load that compiles off the caller's path checks its runner once the compile is done, by when the
    runner may have been handed a new size (`Runner.add_signature`) that the spec does not list."""
    from xpupack.backends.base import CallableRunner, check_against_original
    from xpupack.backends.eager import EagerBackend
    from xpupack.errors import OutputMismatchError
    from xpupack.module_spec import ModuleSpec, Target
    from xpupack.signature import Signature

    mlp = make_stack().layers[0]["mlp"]
    spec = ModuleSpec((Signature.of_call((torch.randn(2, 8),), {}),))
    target = Target("layers.0.mlp", mlp, mlp.forward)
    check_against_original(target, spec, EagerBackend(), CallableRunner(mlp.forward, {0, 1}))
    with pytest.raises(OutputMismatchError, match="layers.0.mlp"):
        check_against_original(target, spec, EagerBackend(), CallableRunner(lambda x: x + 1, {0, 1}))


# -- an empty model (accelerate's init_empty_weights): every weight from the package -----------------------


def test_an_empty_language_model_takes_every_weight_from_the_package_ties_and_buffers_kept(tmp_path):
    """Parameters on the meta device (accelerate's ``init_empty_weights``; its buffers are real) get the package's
    values on the device of the model's buffers; tied weights stay one Parameter."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from support.language_models import TINY, prompt, tune_llm

    config = LlamaConfig(**TINY, tie_word_embeddings=True)
    model, _ = tune_llm(EAGER, make=lambda: LlamaForCausalLM(config).eval())
    root = xpupack.save(model, tmp_path / "pkg")
    with init_empty_weights():
        empty = LlamaForCausalLM(config).eval()
    empty.tie_weights()  # as from_pretrained does
    assert empty.lm_head.weight is empty.model.embed_tokens.weight and empty.lm_head.weight.is_meta
    tied = empty.lm_head.weight
    xpupack.load(empty, root)
    assert not any(p.is_meta for p in empty.parameters())
    assert empty.lm_head.weight is empty.model.embed_tokens.weight is tied  # the same Parameter, now with data
    with torch.no_grad():
        assert torch.equal(empty(prompt()).logits, model(prompt()).logits)


def test_an_empty_model_whose_package_stores_no_weights_is_refused_and_stays_empty(tmp_path):
    from accelerate import init_empty_weights

    root = xpupack.save(xpupack.tune(make_stack(), stack_samples(), strategy=EAGER), tmp_path / "pkg", weights=False)
    with init_empty_weights():
        empty = make_stack(3)
    parameters = {name: id(p) for name, p in empty.named_parameters()}
    with pytest.raises(ModelMismatchError, match=r"is on the meta device \(an empty model\).*stores no weights"):
        xpupack.load(empty, root)
    assert {name: id(p) for name, p in empty.named_parameters()} == parameters
    assert all(p.is_meta for p in empty.parameters())
