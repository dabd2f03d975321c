"""The environment fingerprint stored in a package, and the comparison with the running one."""

from __future__ import annotations

import platform
from importlib import metadata

import torch

from . import _device
from .errors import DeviceUnavailableError

__version__ = "0.1.0"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """What a compiled artifact may depend on: library versions and the device."""
    env = {
        "xpupack": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": _version("torchao"),
        "triton": _version("triton") or _version("pytorch-triton-xpu"),
        "device_type": device.type,
        "device_name": _device.device_name(device),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["architecture"] = f"sm_{major}{minor}"
        env["driver"] = torch.version.cuda
    elif device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        env["architecture"] = getattr(props, "architecture", None) and str(props.architecture)
        env["driver"] = getattr(props, "driver_version", None)
    elif device.type == "cpu":
        # compiled CPU kernels use the vector instructions of the machine that built them (AVX-512
        # code dies of SIGILL on an AVX2 machine); the device name (e.g. x86_64) does not say which
        env["architecture"] = torch.backends.cpu.get_cpu_capability()
    return env


def differences(built: dict, here: dict, keys: tuple[str, ...]) -> dict[str, tuple]:
    """``{key: (built, here)}`` for each of ``keys`` whose value differs."""
    return {key: (built.get(key), here.get(key)) for key in keys if built.get(key) != here.get(key)}


def devices_here() -> list[str]:
    """Every device this process can use: ``cpu``, then ``cuda:N`` and ``xpu:N``."""
    devices = ["cpu"]
    for device_type in ("cuda", "xpu"):
        module = getattr(torch, device_type, None)
        if module is not None and module.is_available():
            devices += [f"{device_type}:{index}" for index in range(module.device_count())]
    return devices


def resolve_device(device: str | torch.device | None, *, default: torch.device | None = None) -> torch.device:
    """The concrete device ``device`` names (None: ``default``, else the best here).

    Raises:
        DeviceUnavailableError: not a device name, or a GPU this machine or PyTorch build lacks.
    """
    here = devices_here()

    def refuse(why: str) -> DeviceUnavailableError:
        return DeviceUnavailableError(f"device {str(device)!r} is not available here ({why}); devices here: "
                                      f"{', '.join(here)} — pass one of them (device= or --device)",
                                      device=str(device), available=here)

    try:
        resolved = _device.resolve(device, default=default)
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:  # how torch says "no such device"
        raise refuse(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    if resolved.type in ("cuda", "xpu") and str(resolved) not in here:
        raise refuse(f"this machine has {sum(d.startswith(resolved.type) for d in here)} {resolved.type} device(s)")
    return resolved
