"""Device slots (`xpupack.device_slots`): the manifest's slots, ``load(device_map=...)`` and its errors, inputs on
another device. A CPU has one device: a second slot is made by relabelling a tuned module's device as ``meta``
before saving; the runs over two real devices are in tests/test_multi_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import xpupack
from support.models import make_stack, stack_samples
from support.package_tools import assert_unchanged, rewrite_manifest, snapshot
from support.strategies import EAGER
from xpupack.cli import main
from xpupack.errors import DeviceMapError, DeviceUnavailableError, PackageFormatError
from xpupack.manifest import MANIFEST
from xpupack.tuned import session_of

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))


def _tuned():
    return xpupack.tune(make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], strategy=EAGER)


@pytest.fixture
def two_slot_package(tmp_path):
    """The stack's MLPs as if ``layers.1.mlp`` had been tuned on a second device (``meta`` stands for it)."""
    model = _tuned()
    session_of(model).devices["layers.1.mlp"] = torch.device("meta")
    return xpupack.save(model, tmp_path / "pkg")


def _manifest(root):
    return json.loads((root / MANIFEST).read_text())


def test_tune_without_device_records_each_module_where_it_is_and_writes_no_slots(tmp_path):
    model = _tuned()
    assert session_of(model).devices == {"layers.0.mlp": torch.device("cpu"), "layers.1.mlp": torch.device("cpu")}
    manifest = _manifest(xpupack.save(model, tmp_path / "pkg"))
    # one device: the manifest is what an xpupack without device slots writes and reads
    assert "devices" not in manifest and all("device_slot" not in m for m in manifest["modules"])
    assert manifest["device"] == "cpu"


def test_save_numbers_the_devices_in_slot_order(two_slot_package):
    manifest = _manifest(two_slot_package)
    assert manifest["devices"] == ["cpu", "meta"] and manifest["device"] == "cpu"
    assert {m["path"]: m["device_slot"] for m in manifest["modules"]} == {"layers.0.mlp": 0, "layers.1.mlp": 1}


@pytest.mark.parametrize("device_map", [None, {0: "cpu", 1: "cpu"}, ["cpu", "cpu"], {1: "cpu", 0: "cpu"}])
def test_a_two_slot_package_loads_with_or_without_a_map(two_slot_package, device_map):
    model = xpupack.load(make_stack(seed=9), two_slot_package, device_map=device_map)
    with torch.no_grad():
        torch.testing.assert_close(model(X), make_stack(seed=0)(X))
    stats = xpupack.stats(model)
    assert all(s["calls"] == 1 and s["fallbacks"] == 0 for s in stats.values())
    assert session_of(model).devices == {"layers.0.mlp": torch.device("cpu"), "layers.1.mlp": torch.device("cpu")}


def test_a_loaded_split_package_saves_its_slots_again(two_slot_package, tmp_path):
    model = xpupack.load(make_stack(seed=9), two_slot_package, device_map={0: "cpu", 1: "cpu"})
    session_of(model).devices["layers.1.mlp"] = torch.device("meta")  # what a load onto two devices records
    again = _manifest(xpupack.save(model, tmp_path / "again"))
    assert again["devices"] == ["cpu", "meta"]
    assert [m["device_slot"] for m in again["modules"]] == [0, 1]


@pytest.mark.parametrize(
    "device_map, error, match",
    [
        ({0: "cpu"}, DeviceMapError, r"lacks slot\(s\) \[1\]"),
        ({0: "cpu", 1: "cpu", 2: "cpu"}, DeviceMapError, r"names slot\(s\) \[2\].*slots \[0, 1\]"),
        ({"0": "cpu", 1: "cpu"}, DeviceMapError, r"names slot\(s\) \['0'\]"),
        (["cpu"], DeviceMapError, r"lacks slot\(s\) \[1\]"),
        ("cpu", DeviceMapError, "give {slot: device} or a list"),
        ({0: "cpu", 1: "cuda:7"}, DeviceUnavailableError, "device_map slot 1: device 'cuda:7' is not available"),
        ({0: "cpu", 1: "nonsense"}, DeviceUnavailableError, "device_map slot 1"),
        ({0: None, 1: "cpu"}, DeviceMapError, "device_map slot 0 is None; map it to a device"),
        (
            {0: "cpu", 1: "meta"},
            DeviceUnavailableError,
            "device_map slot 1: .*xpupack runs on cpu, cuda, xpu, not on meta",
        ),
        ({0: "cpu", 1: "cpu:1"}, DeviceUnavailableError, "device_map slot 1: .*CPUs are one device"),
    ],
)
def test_bad_device_maps_are_refused_before_the_model_changes(two_slot_package, device_map, error, match):
    model = make_stack(seed=9)
    before = snapshot(model)
    with pytest.raises(error, match=match) as caught:
        xpupack.load(model, two_slot_package, device_map=device_map)
    assert isinstance(caught.value, xpupack.XpupackError)
    assert_unchanged(model, before)
    if isinstance(caught.value, DeviceMapError):
        assert caught.value.slots == [0, 1]


def test_device_and_device_map_together_are_refused(two_slot_package):
    with pytest.raises(DeviceMapError, match="not both"):
        xpupack.load(make_stack(seed=9), two_slot_package, device="cpu", device_map={0: "cpu", 1: "cpu"})


def test_device_puts_every_slot_on_that_device(two_slot_package):
    model = xpupack.load(make_stack(seed=9), two_slot_package, device="cpu")
    assert set(session_of(model).devices.values()) == {torch.device("cpu")}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m["modules"][1].update(device_slot=2), "device slot 2, but lists 2 device"),
        (lambda m: m.update(devices=["meta", "cpu"]), "must be the first of them"),
        (lambda m: m["modules"][1].update(device_slot=-1), "device_slot"),
        (lambda m: m.update(devices=[]), "devices"),
    ],
)
def test_damaged_device_slots_are_refused(two_slot_package, change, match):
    rewrite_manifest(two_slot_package, change)
    with pytest.raises(PackageFormatError, match=match):
        xpupack.load(make_stack(seed=9), two_slot_package)


def test_inspect_shows_the_slots(two_slot_package):
    report = json.loads(CliRunner().invoke(main, ["inspect", str(two_slot_package), "--json"]).output)
    assert report["devices"] == ["cpu", "meta"]
    assert [m["device_slot"] for m in report["modules"]] == [0, 1]
    text = CliRunner().invoke(main, ["inspect", str(two_slot_package)], env={"COLUMNS": "200"}).output
    assert "device slots" in text and "1: built on meta" in text and "slot 1" in text


def test_an_input_on_another_device_falls_back_and_is_never_copied(fallback_calls, emulated_graphs):
    """The fit check compares each input's device with the recording's: an input on another device is a
    counted fallback, and the original module then fails as eager would, rather than a copy to the module's."""
    model = xpupack.tune(
        make_stack(seed=0), stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.Only(xpupack.GraphBackend())
    )
    mlp = model.layers[0]["mlp"]
    with pytest.raises(RuntimeError, match="device"), torch.no_grad():
        mlp(torch.randn(4, 8, device="meta"))
    stats = xpupack.stats(model)["layers.0.mlp"]
    assert stats["fallbacks"] == 1 and stats["fallback_reasons"] == {"device": 1}
    assert [event.path for event in fallback_calls] == ["layers.0.mlp"]
    assert fallback_calls[0].reason == "an input on meta, but the recordings take cpu: (float32[4, 8]@meta)"
    with torch.no_grad():
        # a batch larger than any recorded, on the module's device: an ordinary fallback
        mlp(torch.randn(5, 8), scale=1.0)
    assert xpupack.stats(model)["layers.0.mlp"]["fallback_reasons"] == {"device": 1, "signature": 1}
