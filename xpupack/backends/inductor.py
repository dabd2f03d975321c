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

from .base import Backend, ModuleSpec, Runner, Target, backend_from_json, register_backend

log = logging.getLogger(__name__)

CACHE_FILE = "cache.bin"


class InductorRunner(Runner):
    def __init__(self, compiled: Callable[..., Any], supported: set[int], base_runner: Runner | None = None):
        super().__init__(supported)
        self._compiled = compiled
        self.base_runner = base_runner

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        return self._compiled(*args, **kwargs)

    def owned_tensors(self) -> set[str]:
        return self.base_runner.owned_tensors() if self.base_runner else set()

    def undo(self) -> None:
        if self.base_runner is not None:
            self.base_runner.undo()

    def redo(self) -> None:
        if self.base_runner is not None:
            self.base_runner.redo()


@register_backend
class InductorBackend(Backend):
    """Compiles the module with Torch Inductor, one static compilation per recorded signature.

    Args:
        mode: ``torch.compile`` mode (``None``, ``"max-autotune-no-cudagraphs"``...).
            Modes that use CUDA graphs are refused: the graph backend does that job.
        base: a backend that transforms the module in place, compiled on top:
            ``InductorBackend(base=TorchAOBackend("int8-weight-only"))`` compiles
            the quantized module. Its artifacts (quantized weights) are saved with it.
    """

    name = "inductor"
    compiled_artifacts = True
    supports_autograd = True

    def __init__(self, mode: str | None = None, *, base: Backend | dict | None = None):
        if mode not in (None, "default", "max-autotune-no-cudagraphs"):
            raise ValueError(f"InductorBackend(mode={mode!r}) would record CUDA graphs; "
                             "use GraphBackend for that, or mode='max-autotune-no-cudagraphs'")
        if isinstance(base, dict):
            base = backend_from_json(base["name"], base.get("options", {}))
        if base is not None and not base.transforms_module:
            raise ValueError(f"InductorBackend(base={base!r}): only a backend that transforms the module "
                             "in place (TorchAOBackend) can be compiled on top")
        self.mode = mode
        self.base = base

    @property
    def depends_on(self) -> tuple[str, ...]:
        own = ("torch", "triton", "python", "device_type", "device_name")
        return own + tuple(key for key in self.base.depends_on if key not in own) if self.base else own

    def options(self) -> dict:
        options: dict = {"mode": self.mode} if self.mode else {}
        if self.base is not None:
            options["base"] = {"name": self.base.name, "options": self.base.options()}
        return options

    def available(self, device: torch.device) -> bool:
        return self.base is None or self.base.available(device)

    def why_unavailable(self, device: torch.device) -> str:
        return self.base.why_unavailable(device) if self.base else super().why_unavailable(device)

    def compare(self, actual, expected):
        return self.base.compare(actual, expected) if self.base else super().compare(actual, expected)

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        base_runner = self.base.build(target, spec, device) if self.base else None
        try:
            return self._compile(target, spec, base_runner)
        except BaseException:
            if base_runner is not None:
                base_runner.undo()
            raise

    def _compile(self, target: Target, spec: ModuleSpec, base_runner: Runner | None) -> Runner:
        # a base transforms the module in place, so its own forward is what gets compiled
        compiled = torch.compile(target.forward, dynamic=False, mode=self.mode)
        with torch.no_grad():
            for index in range(len(spec.signatures)):
                args, kwargs = spec.example(index)
                compiled(*args, **kwargs)  # compile now, not on the user's first call
        return InductorRunner(compiled, set(range(len(spec.signatures))), base_runner)

    def save(self, runner: Runner, folder: Path) -> dict:
        if self.base is None:
            return {}
        return {"base": self.base.save(runner.base_runner, folder / self.base.name)}

    def restore(self, target: Target, spec: ModuleSpec, config: dict, folder: Path,
                device: torch.device, *, use_artifacts: bool) -> Runner:
        if self.base is None:
            return self.build(target, spec, device)
        base_runner = self.base.restore(target, spec, config.get("base", {}), folder / self.base.name,
                                        device, use_artifacts=use_artifacts)
        try:
            return self._compile(target, spec, base_runner)
        except BaseException:
            base_runner.undo()
            raise

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
            torch.compiler.load_cache_artifacts((folder / config["cache"]).read_bytes())
            log.info("loaded Inductor cache artifacts from %s", folder)
