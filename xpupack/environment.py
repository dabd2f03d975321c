"""The environment fingerprint stored in a package, and the comparison with the running one.

Importing this module imports no torch, and neither does describing a CPU
machine (`device_here`, `environment` of a CPU device): `xpupack inspect` and
`xpupack verify` use them to tell whether a package runs here without paying
for ``import torch``. Where torch is imported already, or a fact can only come
from it (a GPU's name, whether a GPU is there at all, the CPU thread count
under ``MKL_NUM_THREADS`` or an ``OMP_NUM_THREADS`` beyond the cores), torch
answers.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import DeviceUnavailableError, first_line

if TYPE_CHECKING:
    import torch

__all__ = [
    "__version__",
    "environment",
    "differences",
    "unknown",
    "devices_here",
    "resolve_device",
    "device_here",
    "CPU",
]


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class CPU:
    """This machine's CPU as a device, for the questions `device_here` answers without torch.

    Only ``type`` and ``index`` are read there (what ``torch.device("cpu")`` has).
    """

    type: str = "cpu"
    index: None = None

    def __str__(self) -> str:
        return "cpu"


@cache
def _torch_build() -> dict[str, Any]:
    """``torch/version.py``'s constants (``__version__``, ``cuda``, ``hip``, ``xpu``), read without importing
    torch: the file holds nothing but literal assignments. Empty when torch is not installed or the
    file is not what this expects."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    try:
        tree = ast.parse(Path(spec.submodule_search_locations[0], "version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    facts = {}
    for node in tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else node.target
            if isinstance(node, ast.AnnAssign)
            else None
        )
        if isinstance(target, ast.Name) and isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            try:
                facts[target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return facts


def _torch_loaded() -> bool:
    return "torch" in sys.modules


def _torch_version() -> str:
    if not _torch_loaded():
        version = _torch_build().get("__version__")
        if isinstance(version, str):
            return version
    import torch

    return torch.__version__


def _cpu_capability() -> str:
    """The vector instruction set PyTorch's CPU kernels use here (``torch.backends.cpu.get_cpu_capability``)."""
    if not _torch_loaded():
        known = _cpu_capability_without_torch()
        if known is not None:
            return known
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _cpu_capability_without_torch() -> str | None:
    """ATen's own choice (``compute_cpu_capability`` in ATen/native/DispatchStub.cpp), read from
    ``ATEN_CPU_CAPABILITY`` and ``/proc/cpuinfo``: only on Linux x86-64, where PyTorch's builds carry
    AVX2 and AVX-512 kernels; None elsewhere (torch answers then)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    chosen = {"avx512": "AVX512", "avx2": "AVX2", "default": "DEFAULT"}.get(os.environ.get("ATEN_CPU_CAPABILITY", ""))
    if chosen is not None:
        return chosen
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            flags = next((set(line.split(":", 1)[1].split()) for line in stream if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None:
        return None
    if {"avx512vl", "avx512bw", "avx512dq", "fma"} <= flags:
        return "AVX512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "DEFAULT"


def _cpu_threads() -> int:
    """The intra-op thread count of this process (``torch.get_num_threads()``): Inductor generates its CPU
    kernels for it and keys its FX graph cache on it (``cpp_runtime_thread_count`` in ``codecache.py``)."""
    if not _torch_loaded():
        known = _cpu_threads_without_torch()
        if known is not None:
            return known
    import torch

    return torch.get_num_threads()


#: settings besides ``OMP_NUM_THREADS`` that change PyTorch's thread count (through MKL or OpenMP)
_OTHER_THREAD_SETTINGS = ("MKL_NUM_THREADS", "MKL_DOMAIN_NUM_THREADS", "OMP_THREAD_LIMIT")


def _cpu_threads_without_torch() -> int | None:
    """The thread count a process starting here gets, where that is clear without torch (on Linux,
    reading sysfs): one thread per physical core, or ``OMP_NUM_THREADS`` where it is a number no larger.
    None otherwise (torch answers then): PyTorch's x86-64 builds take the count from MKL
    (``mkl_get_max_threads``, ATen/ParallelOpenMP.cpp), which has rules of its own for
    ``MKL_NUM_THREADS``, for values it cannot parse and for more threads than cores (it caps them
    unless ``MKL_DYNAMIC=false``), and other builds from ATen (``intraop_default_num_threads``), which
    does not cap them."""
    if sys.platform != "linux" or any(os.environ.get(name) for name in _OTHER_THREAD_SETTINGS):
        return None
    try:
        siblings = [
            path.read_text(encoding="utf-8").strip()
            for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list")
        ]
    except OSError:
        return None
    cores = len(set(siblings))  # the hardware threads of one core list the same siblings
    if not cores:
        return None
    requested = os.environ.get("OMP_NUM_THREADS")
    if requested is None:
        return cores  # MKL's count and cpuinfo's (TaskThreadPoolBase::defaultNumThreads): the physical cores
    return int(requested) if requested.isdigit() and 0 < int(requested) <= cores else None


def environment(device: torch.device | CPU) -> dict:
    """What a compiled artifact may depend on: library versions and the device.

    A CPU's facts are read without importing torch (where it is not imported yet).
    """
    env: dict[str, Any] = {
        "xpupack": __version__,
        "python": platform.python_version(),
        "torch": _torch_version(),
        "torchao": _version("torchao"),
        "triton": _version("triton") or _version("pytorch-triton-xpu"),
        "device_type": device.type,
    }
    if device.type == "cpu":
        env["device_name"] = platform.processor() or platform.machine()
        # compiled CPU kernels use the vector instructions of the machine that built them (AVX-512
        # code dies of SIGILL on an AVX2 machine); the device name (e.g. x86_64) does not say which
        env["architecture"] = _cpu_capability()
        # Inductor's C++ kernels are generated for this many threads, and its caches are keyed on it
        env["cpu_threads"] = _cpu_threads()
        return env
    import torch

    from . import _device

    assert isinstance(device, torch.device)  # only a CPU comes as `CPU`

    env["device_name"] = _device.device_name(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["architecture"] = f"sm_{major}{minor}"
        env["driver"] = torch.version.cuda
    elif device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        env["architecture"] = getattr(props, "architecture", None) and str(props.architecture)
        env["driver"] = getattr(props, "driver_version", None)
    return env


#: facts an older xpupack did not record: a package without one was built for a value nobody knows
RECORDED_LATER = ("cpu_threads",)


def differences(built: dict, here: dict, keys: tuple[str, ...]) -> dict[str, tuple]:
    """``{key: (built, here)}`` for each of ``keys`` whose value differs (not one the package does not
    know, `unknown`)."""
    return {
        key: (built.get(key), here.get(key))
        for key in keys
        if built.get(key) != here.get(key) and key not in unknown(built, here, keys)
    }


def unknown(built: dict, here: dict, keys: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``keys`` that this machine has and that a package written before they were recorded
    (`RECORDED_LATER`) lacks."""
    return tuple(key for key in keys if key in RECORDED_LATER and key not in built and here.get(key) is not None)


def devices_here() -> list[str]:
    """Every device this process can use: ``cpu``, then ``cuda:N`` and ``xpu:N``."""
    import torch

    devices = ["cpu"]
    for device_type in ("cuda", "xpu"):
        module = getattr(torch, device_type, None)
        if module is not None and module.is_available():
            devices += [f"{device_type}:{index}" for index in range(module.device_count())]
    return devices


#: the device types xpupack runs on (docs/hardware.md)
DEVICE_TYPES = ("cpu", "cuda", "xpu")


def resolve_device(device: str | torch.device | None, *, default: torch.device | None = None) -> torch.device:
    """The concrete device ``device`` names (None: ``default``, else the best here).

    Raises:
        DeviceUnavailableError: not a device name, a device type xpupack does not run on (``mps``,
            ``meta``...), a CPU index other than 0, or a GPU this machine or PyTorch build lacks.
    """
    from . import _device

    here = devices_here()

    def refuse(why: str) -> DeviceUnavailableError:
        return DeviceUnavailableError(
            f"device {str(device)!r} is not available here ({why}); devices here: "
            f"{', '.join(here)} — pass one of them (device= or --device)",
            device=str(device),
            available=here,
        )

    try:
        resolved = _device.resolve(device, default=default)
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:  # how torch says "no such device"
        raise refuse(first_line(exc)) from None
    if resolved.type not in DEVICE_TYPES:  # mps, hpu, meta...: torch names them, xpupack does not run there
        raise refuse(f"xpupack runs on {', '.join(DEVICE_TYPES)}, not on {resolved.type}")
    if resolved.type == "cpu":
        if resolved.index not in (None, 0):
            raise refuse("a machine's CPUs are one device, 'cpu'")
        return _device.resolve("cpu")  # 'cpu:0' is 'cpu', the device CPU tensors report
    if str(resolved) not in here:
        raise refuse(f"this machine has {sum(d.startswith(resolved.type) for d in here)} {resolved.type} device(s)")
    return resolved


def device_here(device: str | None) -> torch.device | CPU:
    """`resolve_device` for the commands that only read a package (inspect, verify).

    Returns `CPU` without importing torch when the answer is this machine's CPU and torch is not
    imported yet: ``device`` is ``"cpu"``, or None and the installed PyTorch was built for no GPU
    (its ``version.py`` names no CUDA, ROCm or XPU). Anything else needs torch to answer.
    """
    if not _torch_loaded():
        build = _torch_build()
        gpu_build = any(build.get(key) for key in ("cuda", "hip", "rocm", "xpu"))
        if device == "cpu" or (device is None and build and "__version__" in build and not gpu_build):
            return CPU()
    return resolve_device(device)
