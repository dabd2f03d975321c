"""Backends that exist only for tests: they make visible which path a call took."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from xpupack import _background
from xpupack.backends.base import Backend, Runner, register_backend


class CountingRunner(Runner):
    def __init__(self, forward, supported, offset=0.0, fail=False):
        super().__init__(supported)
        self.forward = forward
        self.runs = 0
        self.offset = offset
        self.fail = fail

    def run(self, index, args, kwargs, leaves):
        self.runs += 1
        if self.fail:
            raise RuntimeError("backend broke")
        out = self.forward(*args, **kwargs)
        return out + self.offset if self.offset else out


@register_backend
class CountingBackend(Backend):
    """Runs the original forward and counts; ``offset`` makes it wrong, ``fail`` makes it raise at call time."""

    name = "counting"

    def __init__(self, offset: float = 0.0, fail: bool = False, build_error: str | None = None):
        self.offset, self.fail, self.build_error = offset, fail, build_error

    def options(self):
        return {"offset": self.offset, "fail": self.fail}

    def build(self, target, spec, device):
        if self.build_error:
            raise RuntimeError(self.build_error)
        return CountingRunner(target.forward, set(range(len(spec.signatures))), self.offset, self.fail)


@register_backend
class CpuOnlyNever(Backend):
    name = "never"

    def available(self, device: torch.device) -> bool:
        return False

    def why_unavailable(self, device):
        return f"never available (asked for {device.type})"


class ArtifactRunner(CountingRunner):
    def __init__(self, forward, supported, from_artifacts):
        super().__init__(forward, supported)
        self.from_artifacts = from_artifacts


@register_backend
class ArtifactBackend(Backend):
    """Stands in for a backend with compiled artifacts that depend on the environment (Inductor, TorchAO).

    It saves a small artifact file; ``restore`` reads it only when allowed to
    (``use_artifacts``) and records in the runner whether it did.
    """

    name = "artifact"
    depends_on = ("torch", "torchao", "triton", "device_type", "device_name")
    compiled_artifacts = True
    supports_autograd = True

    def build(self, target, spec, device):
        return ArtifactRunner(target.forward, set(range(len(spec.signatures))), from_artifacts=False)

    def save(self, runner, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "artifact.json").write_text('{"compiled": true}')
        return {"artifact": "artifact.json"}

    def restore(self, target, spec, config, folder, device, *, use_artifacts):
        from xpupack.manifest import artifact_file

        if not use_artifacts:
            return self.build(target, spec, device)
        artifact_file(folder, config["artifact"]).read_text()
        return ArtifactRunner(target.forward, set(range(len(spec.signatures))), from_artifacts=True)


class DelayRunner(CountingRunner):
    def __init__(self, forward, supported, delay):
        super().__init__(forward, supported)
        self.delay = delay

    def run(self, index, args, kwargs, leaves):
        time.sleep(self.delay)
        return super().run(index, args, kwargs, leaves)


@register_backend
class DelayBackend(Backend):
    """Gives eager's outputs, ``delay`` seconds late: a candidate slower than eager by construction."""

    name = "delay"

    def __init__(self, delay: float = 0.005):
        self.delay = delay

    def options(self):
        return {"delay": self.delay}

    def build(self, target, spec, device):
        return DelayRunner(target.forward, set(range(len(spec.signatures))), self.delay)


@register_backend
class ShortcutBackend(Backend):
    """Runs the module's ``shortcut`` method (`models.SlowEager`): faster than eager by construction."""

    name = "shortcut"

    def build(self, target, spec, device):
        return CountingRunner(target.module.shortcut, set(range(len(spec.signatures))))


@register_backend
class PaddingCountingBackend(CountingBackend):
    """`CountingBackend` that takes padded calls the way Inductor does (a padded copy of the call)."""

    name = "counting-pads"
    pads_calls = True


@register_backend
class TransformingCountingBackend(CountingBackend):
    """`CountingBackend` that declares it changes the module in place (as TorchAO does)."""

    name = "counting-transforms"
    transforms_module = True


@register_backend
class FastArtifactBackend(ArtifactBackend):
    """An `ArtifactBackend` (compiled artifacts) that runs the module's ``shortcut`` (`models.SlowEager`):
    faster than eager, and than any backend that runs the forward, by construction."""

    name = "fast-artifact"

    def build(self, target, spec, device):
        return ArtifactRunner(target.module.shortcut, set(range(len(spec.signatures))), from_artifacts=False)


class SwitchRunner(Runner):
    """Runs the module's own forward; undo and redo switch a `models.Metered` module back and forth."""

    def __init__(self, module, forward, supported):
        super().__init__(supported)
        self.module, self.forward = module, forward

    def run(self, index, args, kwargs, leaves):
        return self.forward(*args, **kwargs)

    def undo(self):
        self.module.switched = False

    def redo(self):
        self.module.switched = True


@register_backend
class MeteredBackend(Backend):
    """Switches a `models.Metered` module to its candidate's cost in place, as TorchAO changes a module."""

    name = "metered"
    transforms_module = True

    def build(self, target, spec, device):
        runner = SwitchRunner(target.module, target.forward, set(range(len(spec.signatures))))
        runner.redo()
        return runner


class GatedRunner(CountingRunner):
    """A `CountingRunner` that `GatedCompileBackend` lists; ``prepare_fails``: it cannot get ready for a call
    with state (as a compile that fails off the caller's path)."""

    prepare_fails = False

    def prepare(self, index, args, kwargs, *, ready=None):
        if not self.prepare_fails:
            return None
        failed = Future()
        failed.set_exception(RuntimeError("the decode step does not compile"))
        return failed


def _waits_beside_the_callers_calls(gate) -> bool:
    """Waits for ``gate`` (30 s at most) as a compile's codegen would, not as its trace: a call on the caller's
    thread that runs the model's Python goes on meanwhile (`xpupack._background.between_jobs`), so that a
    test whose calls come while a restore waits never waits for its own gate. That a call waits for a job
    that runs the model's code is tested in test_threads.py."""
    lock, held = _background.model_code, 0
    while lock._is_owned():  # type: ignore[attr-defined]  # the worker holds it once per `_work` frame
        lock.release()
        held += 1
    try:
        return gate.wait(timeout=30)
    finally:
        for _ in range(held):
            lock.acquire()


@register_backend
class GatedCompileBackend(Backend):
    """Stands in for Inductor under a graph at load: compiled artifacts, and a `restore` that waits until
    the test opens ``GATE`` (as a compile on a fresh server takes seconds) or ``fail`` makes it raise.
    Its runners count their calls in ``RUNNERS``; ``offset`` makes them answer wrong."""

    name = "gated-compile"
    compiled_artifacts = True
    GATE = None  # a threading.Event, set by the test's fixture
    RUNNERS: list = []
    RESTORING = None  # a threading.Event the fixture sets up: set once a restore began

    def __init__(self, offset: float = 0.0, fail: bool = False, prepare_fails: bool = False):
        self.offset, self.fail, self.prepare_fails = offset, fail, prepare_fails

    def options(self):
        return {"offset": self.offset, "fail": self.fail, "prepare_fails": self.prepare_fails}

    def build(self, target, spec, device):
        return CountingRunner(target.forward, set(range(len(spec.signatures))))

    def restore(self, target, spec, config, folder, device, *, use_artifacts):
        type(self).RESTORING.set()
        if not _waits_beside_the_callers_calls(type(self).GATE):
            raise RuntimeError("the test never opened the gate")
        if self.fail:
            raise RuntimeError("the compile failed")
        runner = GatedRunner(target.forward, set(range(len(spec.signatures))), self.offset)
        runner.prepare_fails = self.prepare_fails
        type(self).RUNNERS.append(runner)
        return runner


class PreparingRunner(CountingRunner):
    def __init__(self, forward, supported):
        super().__init__(forward, supported)
        #: one future per new size taken while serving; the test finishes it (or fails it)
        self.preparations = []
        #: (index, signature) of each new size the dispatcher handed it
        self.added = []

    def add_signature(self, index, signature, args, kwargs):
        super().add_signature(index, signature, args, kwargs)
        self.added.append((index, signature))
        self.preparations.append(Future())
        return self.preparations[-1]


@register_backend
class PreparingBackend(Backend):
    """Takes a new size of a signature with state as a compiling backend does: not at once, but once
    work off the caller's path (a future the test holds, `PreparingRunner.preparations`) is done."""

    name = "preparing"

    def build(self, target, spec, device):
        return PreparingRunner(target.forward, set(range(len(spec.signatures))))
