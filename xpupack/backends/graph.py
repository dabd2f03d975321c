"""The device-graph backend: record once per static signature, replay (DESIGN §3, §4).

Each recorded signature (one per batch size, one per other static shape) gets
its own recording: static input buffers, a device graph (``XPUGraph`` on
XPU, ``CUDAGraph`` on CUDA) and its static outputs. All recordings on a
device share one memory pool; that is safe because replays run one at a
time on the current stream and outputs are copied out before the next one. A call copies its tensor leaves into the
static buffers, replays, and returns a *copy* of the static outputs by
default (``copy_outputs=False`` returns aliases that the next replay
overwrites).

Before each replay the runner checks that the module still holds the very
parameter and buffer storage it recorded: after ``.to()``, a dtype change or
replaced parameters the recording would read freed memory, so it is
re-recorded (and, if that fails, the call falls back). In-place updates such
as ``load_state_dict`` keep the storage, so replays see the new values.

The package stores only the signatures; `restore` records again on the
loading device from inputs synthesised from them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import _device
from ..signature import flatten, unflatten
from .base import Backend, ComposedBackend, ModuleSpec, Runner, Target, register_backend

log = logging.getLogger(__name__)


class _Recording:
    """One signature's static input buffers, replay function and static outputs."""

    def __init__(self, static_leaves: list, replay: Callable[[], None], outputs: Any):
        self.static_leaves = static_leaves
        self.tensor_slots = [i for i, leaf in enumerate(static_leaves) if isinstance(leaf, torch.Tensor)]
        self.replay = replay
        self.output_leaves, self.output_spec = flatten((outputs,), {})
        self.single_output = outputs if isinstance(outputs, torch.Tensor) else None


# Bumped whenever any module anywhere registers a parameter, buffer or submodule
# (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``...):
# the cheap signal that an identity check is due.
_registrations = [0]


def _bump(*_args: Any) -> None:
    _registrations[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_bump)
nn.modules.module.register_module_buffer_registration_hook(_bump)
nn.modules.module.register_module_module_registration_hook(_bump)

_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class _StorageWatch:
    """Tells, in about a microsecond, whether a module still holds the storage a recording reads.

    Two kinds of change make a recording stale: a parameter, buffer or submodule
    object replaced (caught by the registration counter, then an identity check),
    and a tensor's storage swapped (``.to()``, ``.half()``, ``param.data = ...``),
    caught by comparing storage addresses. The watch keeps the recorded storages
    alive, so no new tensor can ever reuse one of those addresses: an unchanged
    address really is the recorded memory, with the recorded dtype and shape.
    """

    def __init__(self, module: nn.Module):
        self.generation = _registrations[0]
        self.entries: list[tuple[dict, str, Any]] = []
        for submodule in module.modules():
            for table in (submodule._parameters, submodule._buffers, submodule._modules):
                self.entries += [(table, name, value) for name, value in table.items() if value is not None]
        self.tensors = [value for _, _, value in self.entries if isinstance(value, torch.Tensor)]
        self.pinned = [tensor.detach() for tensor in self.tensors]
        self.addresses = [tensor.data_ptr() for tensor in self.tensors]
        self.indices = list(range(len(self.tensors)))

    def changed(self) -> bool:
        if self.generation != _registrations[0]:
            if any(table.get(name) is not value for table, name, value in self.entries):
                return True
            self.generation = _registrations[0]
        if _ptrs_equal is not None:
            return not _ptrs_equal(self.tensors, self.addresses, self.indices)
        return any(t.data_ptr() != a for t, a in zip(self.tensors, self.addresses))


class GraphRunner(Runner):
    def __init__(self, target: Target, spec: ModuleSpec, device: torch.device,
                 api: _device.DeviceGraphs, function: Callable[..., Any], *,
                 max_recordings: int, copy_outputs: bool, base_runner: Runner | None = None):
        super().__init__(set())
        self.target = target
        self.spec = spec
        self.device = device
        self.api = api
        self.function = function
        self.max_recordings = max_recordings
        self.copy_outputs = copy_outputs
        self.base_runner = base_runner
        self.recordings: dict[int, _Recording] = {}
        self.failures: dict[int, str] = {}
        self.rerecordings = 0
        self._memory = 0
        self._watch: _StorageWatch | None = None

    # -- recording -------------------------------------------------------------
    def record_all(self, *, strict: bool) -> None:
        """Records every signature (up to the cap); ``strict`` raises on the first failure."""
        before = self.api.memory_in_use(self.device)
        for index in range(len(self.spec.signatures)):
            if index >= self.max_recordings:
                self.failures[index] = f"over the cap of {self.max_recordings} recordings per module"
                continue
            args, kwargs = self.spec.example(index)
            try:
                self.record(index, args, kwargs)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                if strict:
                    raise RuntimeError(f"recording {self.spec.signatures[index].describe()} failed: {reason}") from exc
                self.failures[index] = reason
                log.warning("%s: recording %s failed (%s); those calls run the original module",
                            self.target.path or "<model>", self.spec.signatures[index].describe(), reason)
        self._memory = max(0, self.api.memory_in_use(self.device) - before)
        self._watch = _StorageWatch(self.target.module)

    def record(self, index: int, args: tuple, kwargs: dict) -> None:
        leaves, treespec = flatten(args, kwargs)
        static = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def call() -> Any:
            static_args, static_kwargs = unflatten(static, treespec)
            return self.function(index, static_args, static_kwargs, static)

        replay, outputs = self.api.capture(call, device=self.device, pool=self.api.shared_pool(self.device))
        self.recordings[index] = _Recording(static, replay, outputs)
        self.supported.add(index)
        self.failures.pop(index, None)

    def release(self) -> None:
        """Drops every recording and the storages they read; the next call records again."""
        self.recordings.clear()
        self._watch = None

    def _rerecord(self) -> None:
        """The module's storage moved (or was released): record again from the signatures."""
        log.info("%s: recording again (parameters or buffers changed storage, or the module was deactivated)",
                 self.target.path or "<model>")
        self.release()
        self.supported.clear()
        self.rerecordings += 1
        self.record_all(strict=False)

    # -- calls -------------------------------------------------------------------
    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        if self._watch is None or self._watch.changed():
            self._rerecord()
        recording = self.recordings.get(index)
        if recording is None:
            raise RuntimeError(self.failures.get(index, "signature not recorded"))
        static = recording.static_leaves
        for slot in recording.tensor_slots:
            static[slot].copy_(leaves[slot])
        recording.replay()
        if not self.copy_outputs:
            return unflatten(recording.output_leaves, recording.output_spec)[0][0]
        if recording.single_output is not None:
            return recording.single_output.clone()
        copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in recording.output_leaves]
        return unflatten(copies, recording.output_spec)[0][0]

    def memory_bytes(self) -> int:
        return self._memory

    def describe(self) -> dict:
        facts = {"recordings": len(self.recordings), "rerecordings": self.rerecordings}
        if self.failures:
            facts["not_recorded"] = {self.spec.signatures[i].describe(): why for i, why in self.failures.items()}
        return facts


def _refuse_input_mutation(spec: ModuleSpec) -> None:
    if spec.mutates_inputs:
        raise RuntimeError("the module changes its input tensors in place; a replay would change its own "
                           "static copies of them, not the caller's tensors")


@register_backend
class GraphBackend(ComposedBackend):
    """Records the module as a device graph once per signature and replays it.

    Args:
        base: another backend whose runner is recorded instead of the original
            module, e.g. ``GraphBackend(base=TorchAOBackend("int8-weight-only"))``
            for quantized + replay.
        max_recordings: the most signatures recorded per module; calls of the
            others fall back (device drivers run out of graph resources).
        copy_outputs: return copies of the static outputs (safe, the default) or
            aliases that the next replay of this module overwrites.
    """

    name = "graph"

    def __init__(self, base: Backend | dict | None = None, *, max_recordings: int = 16,
                 copy_outputs: bool = True):
        self._set_base(base)
        if isinstance(self.base, GraphBackend):
            raise ValueError("GraphBackend(base=GraphBackend()) would record a recording")
        if isinstance(max_recordings, bool) or not isinstance(max_recordings, int) or max_recordings < 1:
            raise ValueError(f"GraphBackend(max_recordings={max_recordings!r}): give a positive integer")
        if not isinstance(copy_outputs, bool):
            raise ValueError(f"GraphBackend(copy_outputs={copy_outputs!r}): give True or False")
        self.max_recordings = max_recordings
        self.copy_outputs = copy_outputs

    @property
    def depends_on(self) -> tuple[str, ...]:
        return self.base.depends_on if self.base else ()

    @property
    def compiled_artifacts(self) -> bool:  # type: ignore[override]
        return bool(self.base and self.base.compiled_artifacts)

    def options(self) -> dict:
        options = self._base_options()
        if self.max_recordings != 16:
            options["max_recordings"] = self.max_recordings
        if not self.copy_outputs:
            options["copy_outputs"] = False
        return options

    def available(self, device: torch.device) -> bool:
        return _device.graphs_for(device) is not None and (self.base is None or self.base.available(device))

    def why_unavailable(self, device: torch.device) -> str:
        if _device.graphs_for(device) is None:
            return f"no device graphs on {device.type}"
        return self.base.why_unavailable(device)

    def tolerances(self):
        return self.base.tolerances() if self.base else super().tolerances()

    def _runner(self, target: Target, spec: ModuleSpec, device: torch.device,
                base_runner: Runner | None) -> GraphRunner:
        api = _device.graphs_for(device)
        if base_runner is not None:
            function = base_runner.run
        else:
            forward = target.forward
            function = lambda index, args, kwargs, leaves: forward(*args, **kwargs)  # noqa: E731
        return GraphRunner(target, spec, device, api, function, max_recordings=self.max_recordings,
                           copy_outputs=self.copy_outputs, base_runner=base_runner)

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        _refuse_input_mutation(spec)
        runner = self._runner(target, spec, device, self._build_base(target, spec, device))
        try:
            with _device.on_device(device):
                runner.record_all(strict=True)
        except BaseException:
            runner.undo()
            raise
        return runner

    def restore(self, target: Target, spec: ModuleSpec, config: dict, folder: Path,
                device: torch.device, *, use_artifacts: bool) -> Runner:
        _refuse_input_mutation(spec)
        base_runner = self._restore_base(target, spec, config, folder, device, use_artifacts)
        runner = self._runner(target, spec, device, base_runner)
        try:
            with _device.on_device(device):
                runner.record_all(strict=False)
            if not runner.supported:
                raise RuntimeError("no signature could be recorded: " + "; ".join(runner.failures.values()))
        except BaseException:
            runner.undo()
            raise
        return runner

    def save_shared(self, folder: Path, runners: list[Runner]) -> dict:
        if not (self.base and hasattr(self.base, "save_shared")):
            return {}
        return self.base.save_shared(folder, [runner.base_runner for runner in runners])

    def restore_shared(self, config: dict, folder: Path, *, use_artifacts: bool) -> None:
        if self.base and hasattr(self.base, "restore_shared"):
            self.base.restore_shared(config, folder, use_artifacts=use_artifacts)
