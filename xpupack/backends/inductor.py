"""The Inductor backend: ``torch.compile`` per module, compiled artifacts carried in the package.

At save, PyTorch's portable cache artifacts ("mega-cache",
``torch.compiler.save_cache_artifacts``) go into ``backends/inductor/``; at
load, ``torch.compiler.load_cache_artifacts`` puts them back into the local
Inductor caches before the modules are compiled again from synthesised
inputs, so compilation hits the caches instead of starting from scratch.

The mega-cache holds generated source, not the C++ libraries Inductor builds
from it on CPU (nor the results of its vector-ISA probe, about 7 s on a fresh
cache); so the libraries built while tuning are carried too
(``backends/inductor/kernels/``) and put back into the local cache, where
Inductor finds them by the hash of their source.

All of these are pickles and native code: they load only when trusted
(DESIGN §5); otherwise the module is compiled locally.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch

from .._compare import mismatch
from ..errors import PackageFormatError
from ..manifest import artifact_file
from ..signature import Unsynthesizable
from .base import Backend, CallableRunner, ComposedBackend, ModuleSpec, Runner, Target, register_backend

log = logging.getLogger(__name__)

CACHE_FILE = "cache.bin"
KERNELS = "kernels"
#: files of Inductor's local cache that hold compiled code (not locks or in-flight temporaries)
_KERNEL_SUFFIXES = (".so", ".cpp", ".h", ".json")
#: when this process first compiled through the backend: kernels built since belong to packages
_first_build: list[float] = []


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


@register_backend
class InductorBackend(ComposedBackend):
    """Compiles the module with Torch Inductor, one static compilation per recorded signature.

    Args:
        mode: ``torch.compile`` mode (``None``, ``"max-autotune-no-cudagraphs"``...).
            Modes that use CUDA graphs are refused: the graph backend does that job.
        base: a backend that transforms the module in place, compiled on top:
            ``InductorBackend(base=TorchAOBackend("int8-weight-only"))`` compiles
            the quantized module. Its artifacts (quantized weights) are saved with it.
    """

    name = "inductor"
    #: SQNR (dB) a bfloat16/float16 output missing the elementwise tolerance must still reach: fusions
    #: round differently from eager's op-by-op kernels, and through a deep model (an LLM's logits)
    #: that adds up past any elementwise bound fit for one op, while a wrong kernel falls far below
    LOW_PRECISION_SQNR_DB = 25.0
    compiled_artifacts = True  # grad-mode calls fall back: tuning compiled for inference only
    supports_autocast = True  # Dynamo guards on the autocast state and compiles again

    def __init__(self, mode: str | None = None, *, base: Backend | dict | None = None):
        if mode not in (None, "default", "max-autotune-no-cudagraphs"):
            raise ValueError(f"InductorBackend(mode={mode!r}) would record CUDA graphs; "
                             "use GraphBackend for that, or mode='max-autotune-no-cudagraphs'")
        self._set_base(base)
        if self.base is not None and not self.base.transforms_module:
            raise ValueError(f"InductorBackend(base={self.base!r}): only a backend that transforms the module "
                             "in place (TorchAOBackend) can be compiled on top")
        self.mode = mode

    @property
    def depends_on(self) -> tuple[str, ...]:
        own = ("torch", "triton", "python", "device_type", "device_name", "architecture")
        return own + tuple(key for key in self.base.depends_on if key not in own) if self.base else own

    def options(self) -> dict:
        return {**({"mode": self.mode} if self.mode else {}), **self._base_options()}

    def compare(self, actual, expected) -> str | None:
        if self.base is not None:
            return self.base.compare(actual, expected)
        return mismatch(actual, expected, self.tolerances(), low_precision_sqnr_db=self.LOW_PRECISION_SQNR_DB)

    def available(self, device: torch.device) -> bool:
        return self.base is None or self.base.available(device)

    def why_unavailable(self, device: torch.device) -> str:
        return self.base.why_unavailable(device) if self.base else super().why_unavailable(device)

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        return self._compile_or_undo(target, spec, self._build_base(target, spec, device))

    def _compile_or_undo(self, target: Target, spec: ModuleSpec, base_runner: Runner | None) -> Runner:
        """Compiles; if that fails, the base's changes to the module are taken back."""
        try:
            return self._compile(target, spec, base_runner)
        except BaseException:
            if base_runner is not None:
                base_runner.undo()
            raise

    def _compile(self, target: Target, spec: ModuleSpec, base_runner: Runner | None) -> Runner:
        if not _first_build:
            _first_build.append(time.time() - 1.0)  # file times can be a little coarse
        # a base transforms the module in place, so its own forward is what gets compiled
        compiled = torch.compile(target.forward, dynamic=False, mode=self.mode)
        with torch.no_grad():
            for index in range(len(spec.signatures)):
                try:
                    args, kwargs = spec.example(index)
                except Unsynthesizable:
                    continue  # a call with a KV cache at load: it compiles on its first real call
                compiled(*args, **kwargs)  # compile now, not on the user's first call
        runner = CallableRunner(compiled, set(range(len(spec.signatures))))
        runner.base_runner = base_runner
        return runner

    def restore(self, target: Target, spec: ModuleSpec, config: dict, folder: Path,
                device: torch.device, *, use_artifacts: bool) -> Runner:
        return self._compile_or_undo(target, spec,
                                     self._restore_base(target, spec, config, folder, device, use_artifacts))

    def save_shared(self, folder: Path) -> dict:
        """Writes the process's Inductor cache artifacts (all modules share one blob)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return {}
        blob, _info = saved
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CACHE_FILE).write_bytes(blob)
        return {"cache": CACHE_FILE, KERNELS: self._save_kernels(folder / KERNELS)}

    def _save_kernels(self, folder: Path) -> list[str]:
        """Copies the compiled libraries built since this process first compiled through the backend."""
        if not _first_build:
            return []
        root = _inductor_cache_dir()
        saved = []
        for path in sorted(root.rglob("*")):
            if (path.suffix in _KERNEL_SUFFIXES and path.is_file() and not path.is_symlink()
                    and path.stat().st_mtime >= _first_build[0]
                    and path.relative_to(root).parts[0] not in ("locks", "fxgraph", "aotautograd")):
                relative = path.relative_to(root).as_posix()
                (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, folder / relative)
                saved.append(relative)
        return saved

    def restore_shared(self, config: dict, folder: Path, *, use_artifacts: bool) -> None:
        if not use_artifacts:
            return
        # every name is checked, even from a trusted source: none may reach outside the package
        # (nor, for kernels, outside the Inductor cache they are copied into)
        kernels = config.get(KERNELS, [])
        if not isinstance(kernels, list):
            raise PackageFormatError(f"the backend config for {folder} lists the kernels as {kernels!r}, not as "
                                     "a list of files; the package is damaged — rebuild it", path=str(folder))
        sources = [artifact_file(folder / KERNELS, relative) for relative in kernels]
        if "cache" in config:
            torch.compiler.load_cache_artifacts(artifact_file(folder, config["cache"]).read_bytes())
        root = _inductor_cache_dir()
        for relative, source in zip(kernels, sources):
            destination = root / relative
            if not destination.exists():  # never overwrite what this machine built itself
                destination.parent.mkdir(parents=True, exist_ok=True)
                temporary = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
                shutil.copy2(source, temporary)
                os.replace(temporary, destination)
        log.info("loaded Inductor cache artifacts and %d compiled kernels from %s", len(kernels), folder)
