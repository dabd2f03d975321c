"""Device slots: which device each tuned module runs on, in a package and here (docs/multi-gpu.md).

A model split over devices (layers on ``cuda:0`` and ``cuda:1``, as accelerate's
``device_map`` places them) is tuned module by module, each on the device its
own parameters are on. A package does not name those devices, it numbers
them: slot ``i`` is the ``i``-th of the devices the tuned modules used, in a
stable order (`slot_order`). The manifest lists the build device of each slot
(``devices``) and each module's slot (``device_slot``); a loader maps slots to
its own devices (`resolve_placement`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ._device import model_device
from .environment import resolve_device
from .errors import DeviceMapError, DeviceUnavailableError, PackageFormatError
from .manifest import MANIFEST, module_slot, package_slots
from .signature import device_from_name


def manifest_devices(manifest: dict, root: Path) -> list[torch.device]:
    """The device each device slot of the package was built on (tensor leaves of its specs are on them)."""
    try:
        return [device_from_name(name) for name in package_slots(manifest)]
    except ValueError as exc:
        raise PackageFormatError(
            f"{root / MANIFEST}: {exc}; the package is damaged — rebuild it", path=MANIFEST
        ) from None


def slot_order(devices: Iterable[torch.device]) -> list[torch.device]:
    """The distinct ``devices`` in slot order: CPU first, then by device type and index."""
    return sorted(set(devices), key=lambda d: (d.type != "cpu", d.type, d.index if d.index is not None else -1))


@dataclass(frozen=True)
class Placement:
    """Where a load puts each tuned module, and whether it moves tensors to get there."""

    #: module path -> the device it is restored and recorded on
    modules: dict[str, torch.device]
    #: slot -> the device its leaves are mapped to (the first of its modules', without a map)
    slots: dict[int, torch.device]
    #: ``device=``: the whole model moves there; None: only what `modules` names moves (or nothing)
    everything: torch.device | None
    #: True when tuned modules move to their slot's device (``device_map=``)
    moves_modules: bool

    def spec_map(self, build_devices: Sequence[torch.device], path: str, slot: int) -> dict:
        """Build device -> device here, for the leaves of the specs of the module at ``path``."""
        mapping = {build_devices[s]: device for s, device in self.slots.items()}
        mapping[build_devices[slot]] = self.modules[path]
        return mapping

    @property
    def first(self) -> torch.device:
        """Slot 0's device here: the session's device (its environment is what a later save records)."""
        return self.slots[min(self.slots)]

    def tensor_device(self, state_name: str, current: torch.device) -> torch.device:
        """Where a load puts the model's tensor ``state_name``, now on ``current``: with ``device=`` there; with
        ``device_map=`` on the device of the innermost tuned module holding it; else where it is, and an empty
        model's tensor (on the meta device) where its tuned module is, or slot 0's device."""
        if self.everything is not None:
            return self.everything
        empty = current.type == "meta"
        if not (self.moves_modules or empty):  # every tensor of a load stays where it is: nothing to look up
            return current
        owners = [path for path in self.modules if not path or state_name.startswith(path + ".")]
        if owners:
            return self.modules[max(owners, key=len)]
        return self.first if empty else current


def resolve_placement(model: nn.Module, manifest: dict, *, device, device_map, default: torch.device) -> Placement:
    """Where each tuned module of ``manifest`` goes in ``model``.

    ``device`` is the single-device shorthand: every slot, and the whole model, there.
    ``device_map`` (``{slot: device}``, or a list indexed by slot) moves each tuned
    module to its slot's device, leaving the rest of the model where it is. With
    neither, each module stays on the device its parameters are on.

    Raises:
        DeviceMapError: both given; a map that names a slot the package lacks, or lacks one it uses.
        DeviceUnavailableError: a device this machine lacks.
    """
    entries = manifest["modules"]
    count = len(package_slots(manifest))  # `read_manifest` checked that every module's slot is below it
    used = sorted({module_slot(entry) for entry in entries})
    if device is not None and device_map is not None:
        raise DeviceMapError(
            "pass device= (every module on one device) or device_map= (a device per slot), not both", slots=used
        )
    if device is not None:
        here = resolve_device(device)
        return Placement({e["path"]: here for e in entries}, {s: here for s in range(count)}, here, False)
    if device_map is not None:
        mapping = _read_map(device_map, count, used)
        return Placement({e["path"]: mapping[module_slot(e)] for e in entries}, mapping, None, True)
    modules = {e["path"]: model_device(model.get_submodule(e["path"]), default) for e in entries}
    slots: dict[int, torch.device] = {}
    for entry in entries:
        slots.setdefault(module_slot(entry), modules[entry["path"]])
    return Placement(modules, slots or {0: default}, None, False)


def _read_map(device_map: Mapping | Sequence, count: int, used: list[int]) -> dict[int, torch.device]:
    if isinstance(device_map, Mapping):
        items = list(device_map.items())
    elif isinstance(device_map, Sequence) and not isinstance(device_map, str):
        items = list(enumerate(device_map))
    else:
        raise DeviceMapError(
            f"device_map={device_map!r}: give {{slot: device}} or a list of devices by slot", slots=used
        )
    unknown = [
        slot for slot, _ in items if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < count
    ]
    if unknown:
        raise DeviceMapError(
            f"device_map names slot(s) {unknown}, but the package has slots "
            f"{list(range(count))}; `xpupack inspect` shows each module's slot",
            slots=used,
            unknown=unknown,
        )
    missing = [slot for slot in used if slot not in dict(items)]
    if missing:
        raise DeviceMapError(
            f"device_map lacks slot(s) {missing}, which the package's modules use (slots "
            f"{used}); map every one of them to a device, e.g. device_map="
            f"{ {slot: 'cuda:' + str(slot) for slot in used} }",
            slots=used,
            missing=missing,
        )
    resolved = {}
    for slot, value in items:
        if value is None:  # resolve_device(None) would pick the best device here: a map says where
            raise DeviceMapError(
                f"device_map slot {slot} is None; map it to a device such as 'cuda:{slot}' or 'cpu'", slots=used
            )
        try:
            resolved[slot] = resolve_device(value)
        except DeviceUnavailableError as exc:
            raise DeviceUnavailableError(
                f"device_map slot {slot}: {exc}", device=exc.device, available=exc.available
            ) from None
    return resolved
