"""The private PyTorch entry points xpupack relies on, each named once here with the releases it was
checked on; ``tests/test_torch_compat.py`` holds a canary per item that fails loudly on a release that
changes it.

Each item, what xpupack uses it for, and the torch releases it was checked on (`CHECKED_ON` unless said):

- ``torch._C._aoti.AOTIModelPackageLoader``: maps a ``.pt2`` AOTInductor package in without Python's
  loader (which first compiles a vector-ISA probe: ~7 s on a CPU with an empty cache).
- its ``get_constant_fqns`` / ``load_constants``: hands the live model's tensors to the package as
  user-managed constants (no copy of the weights).
- ``torch._inductor.aoti_compile_and_package`` with ``aot_inductor.package_constants_in_so=False`` and
  ``always_keep_tensor_constants=True``: compiles without copying the weights into the library, small
  ones included.
- ``torch._C._tensors_data_ptrs_at_indices_equal``: a storage watch's check of every weight's address in
  one C loop (absent: a Python loop does it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: the torch releases these entry points were checked on
CHECKED_ON = ("2.11", "2.13")

#: ``(tensors, addresses, indices) -> bool``: whether each tensor still has its address; None where absent
data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def aoti_compile(exported: Any, path: Path) -> Path:
    """Compiles an exported program into an AOTInductor package at ``path``, the weights left out of the
    library (a load hands it the model's own tensors: `aoti_load`)."""
    import torch._inductor

    result = torch._inductor.aoti_compile_and_package(
        exported,
        package_path=str(path),
        # every parameter and buffer stays a constant the loader hands in: Inductor otherwise inlines small
        # ones (1-d with up to 8 values, scalars) into the code, where a changed model would never reach them
        inductor_configs={"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True},
    )
    return Path(result)


def aoti_load(path: Path) -> Any:
    """The package's runner on the current device. Single-threaded: the threaded runner's event
    bookkeeping breaks device-graph capture, and xpupack serialises calls itself."""
    loader_class = torch._C._aoti.AOTIModelPackageLoader
    try:  # (path, model name, run single-threaded, runners, device index: -1 is the current one)
        return loader_class(str(path), "model", True, 1, -1)
    except TypeError:  # releases before the runner count and device index were arguments
        return loader_class(str(path), "model", True)  # type: ignore[call-arg]


def aoti_constant_names(loader: Any) -> list[str]:
    """The fully qualified names of the constants (parameters, buffers) the package expects."""
    return list(loader.get_constant_fqns())


def aoti_use_constants(loader: Any, constants: dict[str, torch.Tensor]) -> None:
    """Points the package at ``constants`` themselves (user-managed: no copy; the caller keeps them
    alive and reloads them when the model's storages change). Every name must be given."""
    # (constants, use the inactive buffer, check that every constant is updated, user-managed)
    loader.load_constants(constants, False, True, True)


def aoti_run(loader: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call of the package: its flat tensor outputs."""
    return loader.run(inputs)
