"""The Inductor backend: ``torch.compile`` per module, compiled artifacts carried in the package.

At save, PyTorch's portable cache artifacts ("mega-cache",
``torch.compiler.save_cache_artifacts``) go into ``backends/inductor/``; at
load, ``torch.compiler.load_cache_artifacts`` puts them back into the local
Inductor caches before the modules are compiled again from synthesised
inputs, so compilation hits the caches instead of starting from scratch. The
artifacts are pickles and compiled code: they load only when trusted
(DESIGN §5); otherwise the module is compiled locally.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ..manifest import artifact_file
from .base import Backend, ModuleSpec, Runner, Target, register_backend

log = logging.getLogger(__name__)

CACHE_FILE = "cache.bin"


class InductorRunner(Runner):
    def __init__(self, compiled: Callable[..., Any], supported: set[int]):
        super().__init__(supported)
        self._compiled = compiled

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        return self._compiled(*args, **kwargs)


@register_backend
class InductorBackend(Backend):
    """Compiles the module with Torch Inductor, one static compilation per recorded signature.

    Args:
        mode: ``torch.compile`` mode (``None``, ``"max-autotune-no-cudagraphs"``...).
            Modes that use CUDA graphs are refused: the graph backend does that job.
    """

    name = "inductor"
    depends_on = ("torch", "triton", "python", "device_type", "device_name", "architecture")
    compiled_artifacts = True
    supports_autograd = True
    supports_autocast = True  # Dynamo guards on the autocast state and compiles again

    def __init__(self, mode: str | None = None):
        if mode not in (None, "default", "max-autotune-no-cudagraphs"):
            raise ValueError(f"InductorBackend(mode={mode!r}) would record CUDA graphs; "
                             "use GraphBackend for that, or mode='max-autotune-no-cudagraphs'")
        self.mode = mode

    def options(self) -> dict:
        return {"mode": self.mode} if self.mode else {}

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        compiled = torch.compile(target.forward, dynamic=False, mode=self.mode)
        with torch.no_grad():
            for index in range(len(spec.signatures)):
                args, kwargs = spec.example(index)
                compiled(*args, **kwargs)  # compile now, not on the user's first call
        return InductorRunner(compiled, set(range(len(spec.signatures))))

    def save_shared(self, folder: Path) -> dict:
        """Writes the process's Inductor cache artifacts (all modules share one blob)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return {}
        blob, _info = saved
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CACHE_FILE).write_bytes(blob)
        return {"cache": CACHE_FILE}

    def restore_shared(self, config: dict, folder: Path, *, use_artifacts: bool) -> None:
        if use_artifacts and "cache" in config:
            # checked even from a trusted source: the name must not reach outside the package
            blob = artifact_file(folder, config["cache"]).read_bytes()
            torch.compiler.load_cache_artifacts(blob)
            log.info("loaded Inductor cache artifacts from %s", folder)
