"""The device-graph backend: record once per static signature, replay (docs/device-graphs.md).

Each recorded signature (one per batch size, one per other static shape) gets
its own recording: static input buffers, a device graph (``XPUGraph`` on
XPU, ``CUDAGraph`` on CUDA) and its static outputs. All recordings on a
device share one memory pool; that is safe because replays run one at a
time on the current stream and outputs are copied out before the next one.
A call copies its tensor leaves into the static buffers, replays, and
returns a *copy* of the static outputs by default (``copy_outputs=False``
returns aliases that the next replay overwrites). One call runs at a time
per module: concurrent callers wait.

Calls with state (a KV cache, `xpupack.state`) are recorded while serving:
the state's tensors are read and written where they are, so a recording fits
only calls whose state tensors sit at the recorded addresses. The first call
at new addresses runs for real (it also warms up libraries and Inductor), the
second is recorded and replayed; the least recently used of these
recordings is dropped at the ``max_recordings`` cap. A recording never holds
a reference to the state, so a freed cache is really freed. A state object
with Python-side counters (a sliding-window KV cache, `xpupack.state`) is
recorded once per Python path its counters put the call on, and its
counters are advanced after each replay.
No capture
overlaps a compile that runs off the caller's path (`xpupack._background`):
a call that would be recorded meanwhile runs for real, the next is recorded.

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
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from .. import _background, _device
from .._compare import LOW_PRECISION_SQNR_DB
from .._inference import own_copy
from ..distributed import is_sharded
from ..errors import TuningError, error_line
from ..padding import check_output_axes, signature_batch
from ..signature import BatchAxes, Signature, flatten, unflatten
from ..state import state_type
from ._facts import GRAPH_MAX_RECORDINGS, no_graphs_on
from ._graph_handover import BaseHandover
from ._storage_watch import StorageWatch
from .base import (
    Backend,
    ComposedBackend,
    ModuleSpec,
    Runner,
    Target,
    changes_module,
    check_against_original,
    register_backend,
)

log = logging.getLogger(__name__)


class _StateRef:
    """Stands, in a recording's outputs, for the call's own state object (never the recorded one)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot


#: non-tensor outputs a recording of a call with state may return as recorded
_PLAIN_OUTPUTS = (type(None), bool, int, float, str)


class _Capture:
    """One recorded call: static input buffers, the replay function, static outputs.

    State leaves (a KV cache) get no static buffer: the recording reads and
    writes the state tensors where they were when it was made. It holds no
    reference to them (a cache can be gigabytes): ``live`` holds the calling
    objects only while a call runs.
    """

    def __init__(self, static_leaves: list, state_slots: tuple[int, ...]):
        self.static_leaves = static_leaves
        self.state_slots = state_slots
        self.tensor_slots = [i for i, leaf in enumerate(static_leaves) if isinstance(leaf, torch.Tensor)]
        self.live: dict[int, Any] = {}
        self.replay: Callable[[], None] = lambda: None
        self.output_leaves: list = []
        self.output_spec: Any = None
        self.single_output: torch.Tensor | None = None
        self.memory = 0

    def leaves_now(self) -> list:
        """The leaves a recorded function sees: static buffers, and the calling state objects."""
        if not self.state_slots:
            return self.static_leaves
        leaves = list(self.static_leaves)
        for slot in self.state_slots:
            leaves[slot] = self.live[slot]
        return leaves

    def set_outputs(self, outputs: Any) -> None:
        leaves, self.output_spec = flatten((outputs,), {})
        if self.state_slots:
            leaves = [self._output_leaf(leaf) for leaf in leaves]
        self.output_leaves = leaves
        self.single_output = outputs if isinstance(outputs, torch.Tensor) else None

    def _output_leaf(self, leaf: Any) -> Any:
        """An output leaf of a call with state, as the recording keeps it."""
        for slot in self.state_slots:
            if leaf is self.live[slot]:
                return _StateRef(slot)
        if isinstance(leaf, torch.Tensor):
            state = {
                t.untyped_storage().data_ptr()
                for slot in self.state_slots
                for t in state_type(self.live[slot]).state_tensors(self.live[slot])
            }
            if leaf.untyped_storage().data_ptr() in state:
                raise RuntimeError(
                    "the module returns one of its state tensors; a replay for another "
                    "state object would return the recorded one"
                )
        elif type(leaf) not in _PLAIN_OUTPUTS:
            raise RuntimeError(f"the module returns a {type(leaf).__name__} object a replay cannot renew")
        return leaf

    def cut_outputs(self, axes: BatchAxes, rows: int, copy: bool) -> Any:
        """The first ``rows`` rows of the static outputs (a padded call's own), copied or as views."""
        if self.single_output is not None:
            view = self.single_output.narrow(axes.outputs[0], 0, rows)
            return view.clone() if copy else view
        cut = [x.narrow(axis, 0, rows) if axis is not None else x for x, axis in zip(self.output_leaves, axes.outputs)]
        if copy:
            cut = [x.clone() if isinstance(x, torch.Tensor) else x for x in cut]
        return unflatten(cut, self.output_spec)[0][0]

    def outputs(self, leaves: list, copy: bool) -> Any:
        """The replayed outputs: copies of the static outputs (or aliases), the caller's state objects."""
        if self.single_output is not None:
            return self.single_output.clone() if copy else self.single_output
        results = [
            leaves[x.slot] if isinstance(x, _StateRef) else x.clone() if copy and isinstance(x, torch.Tensor) else x
            for x in self.output_leaves
        ]
        return unflatten(results, self.output_spec)[0][0]


#: state addresses remembered as run once (the next call there is recorded)
_WARM_RUNS_KEPT = 64

#: `GraphRunner._recording_now`: another thread's compile holds the device, the call runs unrecorded
_NOT_NOW = object()


class GraphRunner(BaseHandover, Runner):
    """Replays one device-graph recording per signature; what `GraphBackend` builds and restores.

    Signatures without state are recorded up front (`record_all`); signatures with state (a KV
    cache) while serving, per set of state addresses (see the module docstring). ``stats`` shows
    ``recordings``, ``rerecordings``, ``memory_bytes`` and what could not be recorded. With a base
    restored off the caller's path, its calls move over to the base as it gets ready (`BaseHandover`).

    Args:
        target: the module.
        spec: its signatures (and, at tune time, samples).
        device: the device recorded on.
        api: the device layer that records and replays (`xpupack._device.graphs_for`).
        function: ``function(index, args, kwargs, leaves)``: what a recording records (the original
            module's forward, or the base runner's `Runner.run`).
        max_recordings: the most recordings the module keeps.
        copy_outputs: return copies of the static outputs, or aliases the next replay overwrites.
        max_memory: a budget in bytes for the recordings, or None.
        base_runner: the runner of ``GraphBackend(base=...)``'s base, or None.
    """

    def __init__(
        self,
        target: Target,
        spec: ModuleSpec,
        device: torch.device,
        api: _device.DeviceGraphs,
        function: Callable[..., Any],
        *,
        max_recordings: int,
        copy_outputs: bool,
        max_memory: int | None = None,
        base_runner: Runner | None = None,
    ):
        super().__init__(set())
        self.target = target
        self.spec = spec
        self.device = device
        self.api = api
        self.function = function
        self.max_recordings = max_recordings
        self.max_memory = max_memory
        self.copy_outputs = copy_outputs
        self.base_runner = base_runner
        #: index -> signature: the spec's, then those `add_signature` handed it while serving
        self.signatures: dict[int, Signature] = dict(enumerate(spec.signatures))
        #: signature index -> recording, for calls without state (recorded up front)
        self.recordings: dict[int, _Capture] = {}
        #: (signature index, state tensor addresses, counter paths) -> recording, least recently used first
        self.state_recordings: OrderedDict[tuple, _Capture] = OrderedDict()
        #: signature index -> what one call adds to each state object's Python-side counters
        self._added: dict[int, tuple] = {}
        #: calls with counters on a path no recording can follow (`SlidingWindowCounters.path`), run for real
        self.unreplayable_runs = 0
        self._warm: OrderedDict[tuple, None] = OrderedDict()
        self.failures: dict[int, str] = {}
        #: signature index -> why the memory budget left it out (its calls are padded up or fall back)
        self.skipped: dict[int, str] = {}
        self.rerecordings = 0
        self.warm_runs = 0
        self._watch: StorageWatch | None = None
        # one call at a time: a replay fills shared static buffers, and two threads interleaving
        # there would hand each other's results back
        self._lock = threading.Lock()
        #: the state addresses of each signature's latest call run once, kept over recordings made again
        self._last_warm: dict[int, tuple] = {}
        #: the load found the device taken by another thread's compile: the first free call records
        self._recording_left_to_first_call = False
        self._init_handover()

    def add_signature(self, index: int, signature: Signature, args: tuple, kwargs: dict) -> Future | None:
        """Records the new signature as any call with state (`_run_with_state`), once the base is ready.

        Args:
            index: the new signature's index.
            signature: the new signature.
            args: its first call's positional arguments.
            kwargs: its first call's keyword arguments.

        Returns:
            The base runner's future where it compiles for the new size, else None.
        """
        with self._lock:  # a call of another thread may be recording again (`record_all` reads them)
            self.signatures[index] = signature
            self.supported.add(index)
            base = self.base_runner
            if base is None and self._original is not None:
                self._unknown_to_base.add(index)  # the base being restored learns of it once it serves
        if base is None:
            return None
        # the base takes it too (`Runner.add_signature`), outside the lock: it may start a compile
        return base.add_signature(index, signature, *self._for_base(index, args, kwargs))

    # -- recording -------------------------------------------------------------
    def record_all(self, *, strict: bool) -> None:
        """Records every signature without state (up to the cap and the memory budget); ``strict``
        raises on the first failure.

        Largest first, so that smaller recordings reuse the memory the larger ones' captures left
        free in the shared pool. With ``max_memory``, in order of benefit instead (`_recording_order`):
        once the recordings' memory passes the budget, the one that passed it is dropped and the rest
        are skipped. Signatures with state are recorded during calls (`run`): only a real call brings
        their state.

        Args:
            strict: raise on the first failure (tune time) instead of noting it and recording the
                rest (load time).
        """
        self.supported.update(index for index, signature in self.signatures.items() if signature.state_slots)
        stateless = [index for index, signature in self.signatures.items() if not signature.state_slots]
        self.skipped = {}
        spent = 0
        for rank, index in enumerate(self._recording_order(stateless)):
            if self._left_out(rank, index):
                continue
            recording = self._record_example(index, strict=strict)
            if recording is None or self._over_budget(index, recording, spent):
                continue
            spent += recording.memory
            self._keep_recording(index, recording)
        self._watch = StorageWatch(self.target.module)

    def _left_out(self, rank: int, index: int) -> bool:
        """Whether signature ``index``, ``rank``-th in the recording order, goes unrecorded before it is
        tried (noting why): past the cap, or after the memory budget was spent on recordings of more
        benefit."""
        if rank >= self.max_recordings:
            self.failures[index] = f"over the cap of {self.max_recordings} recordings per module"
            return True
        if self.skipped:  # the budget is spent: a recording of less benefit comes after
            self.skipped[index] = (
                f"over the memory budget (max_memory={self.max_memory} bytes): recordings of more benefit took it"
            )
            return True
        return False

    def _record_example(self, index: int, *, strict: bool) -> _Capture | None:
        """Records signature ``index`` on its example call; a failure raises when ``strict`` (tune time),
        else is noted and logged and gives None (load time: the other signatures still record)."""
        args, kwargs = self.spec.example(index)
        try:
            with _background.device_work:  # waits for a compile on another thread (at load, after .to())
                return self.record(index, args, kwargs)
        except Exception as exc:
            reason = error_line(exc)
            if strict:
                raise RuntimeError(f"recording {self.signatures[index].describe()} failed: {reason}") from exc
            self.failures[index] = reason
            log.warning(
                "%s: recording %s failed (%s); those calls run the original module",
                self.target.path or "<model>",
                self.signatures[index].describe(),
                reason,
            )
            return None

    def _over_budget(self, index: int, recording: _Capture, spent: int) -> bool:
        """Whether ``recording`` would take the recordings' memory past ``max_memory`` with ``spent``
        bytes kept already; it is then dropped and noted as skipped (which skips the rest, `_left_out`)."""
        if self.max_memory is None or spent + recording.memory <= self.max_memory:
            return False
        self.skipped[index] = (
            f"over the memory budget (max_memory={self.max_memory} bytes): it took "
            f"{recording.memory} bytes with {spent} spent"
        )
        log.info(
            "%s: %s not kept: %s",
            self.target.path or "<model>",
            self.signatures[index].describe(),
            self.skipped[index],
        )
        return True

    def _keep_recording(self, index: int, recording: _Capture) -> None:
        """Signature ``index``'s calls replay ``recording`` from now on (a failure noted earlier is forgotten)."""
        self.recordings[index] = recording
        self.supported.add(index)
        self.failures.pop(index, None)

    def _recording_order(self, indices: list[int]) -> list[int]:
        """Largest first (input bytes); with a memory budget, most benefit first: the most calls
        while recording, then the largest (a smaller batch left out can still be padded up to it)."""
        sizes = {
            index: sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in self.signatures[index].tensor_leaves)
            for index in indices
        }
        if self.max_memory is None:
            return sorted(indices, key=lambda index: -sizes[index])
        weights = self.spec.signature_weights()
        return sorted(indices, key=lambda index: (-weights[index], -sizes[index]))

    def record(self, index: int, args: tuple, kwargs: dict, *, warmup: int = 2) -> _Capture:
        """Records one call: tensor inputs copied into new static buffers, state objects used in place.

        Args:
            index: the signature's index (`signatures`).
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            warmup: calls run before the capture. ``0`` for a call with state: it must run exactly
                once, and the call before it at the same state ran for real (warming libraries and
                compilers up).

        Returns:
            The recording (its static inputs, replay function and static outputs).
        """
        leaves, treespec = flatten(args, kwargs)
        slots = self.signatures[index].state_slots
        # normal tensors, even for a call under inference mode: a later call in another mode copies into them
        static = [
            None if i in slots else own_copy(leaf) if isinstance(leaf, torch.Tensor) else leaf
            for i, leaf in enumerate(leaves)
        ]
        recording = _Capture(static, slots)

        def call() -> Any:
            now = recording.leaves_now()
            static_args, static_kwargs = unflatten(now, treespec)
            return self._function(index)(index, static_args, static_kwargs, now)

        recording.live = {slot: leaves[slot] for slot in slots}
        try:
            with _device.on_device(self.device):
                recording.replay, outputs, pool_memory = self.api.capture(
                    call, device=self.device, warmup=warmup, pool=self.api.shared_pool(self.device)
                )
            recording.set_outputs(outputs)
        finally:
            recording.live = {}
        for padding_axes in (self.spec.batch_axes, self.spec.length_axes):
            axes = padding_axes.get(index)
            if axes is not None:  # padded calls are cut by these axes: they must fit (a package's are a claim)
                check_output_axes(outputs, axes, signature_batch(self.signatures[index], axes)[1])
        # its static inputs, and what its capture added to the shared pool (outputs, work space)
        recording.memory = pool_memory + sum(static[slot].untyped_storage().nbytes() for slot in recording.tensor_slots)
        return recording

    def release(self) -> None:
        """Drops every recording and the storages they read; the next call records again.

        Under the call lock: a call between its storage check and its replay would otherwise find its
        recording gone (`deactivate` while other threads call)."""
        with self._lock:
            self._drop_recordings()

    def _drop_recordings(self) -> None:
        self.recordings.clear()
        self.state_recordings.clear()
        self._original_tried.clear()  # recorded again before a base's compile of them starts
        self._warm.clear()
        self._watch = None

    def _rerecord(self) -> None:
        """The module's storage moved (or was released), or the load left its recordings to the first call
        (`record_at_first_call`): record again from the signatures. Under the lock."""
        if self._recording_left_to_first_call:
            self._recording_left_to_first_call = False
            log.info("%s: recording now (the load left it to the first call)", self.target.path or "<model>")
        else:
            log.info(
                "%s: recording again (parameters or buffers changed storage, or the module was deactivated)",
                self.target.path or "<model>",
            )
            self.rerecordings += 1
        self._record_again()

    def record_at_first_call(self) -> None:
        """A load's recordings, left to the first call: another thread's compile holds the device
        (`xpupack._background.device_work`) and a load never waits for another model's work. Until a call
        finds the device free, calls run what the recordings would replay, unrecorded."""
        self._recording_left_to_first_call = True
        self.supported.update(self.signatures)
        self._watch = None

    def _record_again(self) -> None:
        """Drops every recording and records every signature without state again (with `_function`'s
        choice of what each runs). Under the lock."""
        self._drop_recordings()
        self.supported.clear()
        self.failures.clear()
        self.record_all(strict=False)

    # -- calls -------------------------------------------------------------------
    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Copies the call's tensor leaves into the recording's static buffers and replays it.

        A recording whose module storage moved is made again first; a call with state replays the
        recording made at its state's addresses, or runs for real (and is recorded on the next call).
        See `Runner.run`.

        Args:
            index: the signature the call fits.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            leaves: the call's inputs in the signature's leaf order.

        Returns:
            The outputs: copies of the static outputs, or aliases with ``copy_outputs=False``.

        Raises:
            RuntimeError: the signature has no recording (it failed, or the memory budget skipped it).
        """
        with self._lock:
            if self._original is not None:  # an upgrade pending: the held restore waits for the caller's pause
                self._last_call = time.monotonic()
                self._take_upgrade(index, args, kwargs)
            recording = self._recording_now(index, wait=False)
            if recording is _NOT_NOW:
                return self._run_unrecorded(index, args, kwargs, leaves)
            if recording is None:
                return self._run_with_state(index, args, kwargs, leaves)
            return self._replay(recording, leaves)

    def _recording_now(self, index: int, *, wait: bool = True) -> Any:
        """The recording of signature ``index``, made again first if the module's storage moved (or the load
        left it to the first call); None for a signature with state (`_run_with_state` finds its recording).
        Without ``wait``, `_NOT_NOW` while another thread's compile holds the device: the call runs
        unrecorded and a later one records. Called under the lock."""
        if self._watch is None or self._watch.changed():
            if not _background.device_work.acquire(blocking=wait):
                return _NOT_NOW
            try:
                self._rerecord()
            finally:
                _background.device_work.release()
        if self.signatures[index].state_slots:
            return None
        recording = self.recordings.get(index)
        if recording is None:
            raise RuntimeError(self.failures.get(index) or self.skipped.get(index) or "signature not recorded")
        return recording

    def run_padded(self, index: int, leaves: list, axes: BatchAxes, batch: int) -> Any:
        """Replays recording ``index`` (of a larger batch) for a call of ``batch`` rows: the call's rows go
        into the start of the static buffers and zeros into the rest (what the tune-time check verified),
        and only the call's rows of the outputs come back (copied, or views of the static outputs).

        Args:
            index: the recorded signature of the larger batch.
            leaves: the call's inputs in the signature's leaf order.
            axes: the batch axis of each input and output leaf.
            batch: the call's number of rows.

        Returns:
            The outputs, cut to ``batch`` rows.
        """
        with self._lock:
            if self._original is not None:
                self._take_upgrade(index, (), {})
            recording = self._recording_now(index)  # never None: signatures with state are not padded
            static = recording.static_leaves
            for slot in recording.tensor_slots:
                axis = axes.inputs[slot]
                if axis is None:
                    static[slot].copy_(leaves[slot])
                else:
                    buffer = static[slot]
                    buffer.narrow(axis, 0, batch).copy_(leaves[slot])
                    buffer.narrow(axis, batch, buffer.shape[axis] - batch).zero_()
            recording.replay()
            return recording.cut_outputs(axes, batch, self.copy_outputs)

    def _replay(self, recording: _Capture, leaves: list) -> Any:
        static = recording.static_leaves
        for slot in recording.tensor_slots:
            static[slot].copy_(leaves[slot])
        if recording.state_slots:
            recording.live = {slot: leaves[slot] for slot in recording.state_slots}
            try:
                recording.replay()
            finally:
                recording.live = {}
        else:
            recording.replay()
        return recording.outputs(leaves, self.copy_outputs)

    def _run_with_state(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """A call with state replays the recording made at its state tensors' addresses (and, for state
        with Python-side counters, on its counters' path). The first call at new addresses runs for real
        (once: it updates the state), the next one there is recorded."""
        signature = self.signatures[index]
        counted = signature.state_counters(leaves)
        before = tuple(counters.read(obj) for counters, obj in counted)
        paths: tuple = ()
        if any(before):
            added = self._added.get(index)
            if added is None:  # the first such call: run it for real to learn what it adds
                output = self._run_unrecorded(index, args, kwargs, leaves)
                self._added[index] = _difference(tuple(counters.read(obj) for counters, obj in counted), before)
                self.warm_runs += 1
                return output
            paths = tuple(
                counters.path(obj, counts, adds) for (counters, obj), counts, adds in zip(counted, before, added)
            )
            if None in paths:
                self.unreplayable_runs += 1
                self._original_tried.add(index)  # no recording will come: the base may get ready now
                if self._held is not None:  # no recording will come to wait for
                    self._start_held_upgrade()
                return self._run_unrecorded(index, args, kwargs, leaves)
        tensors = signature.state_tensors(leaves)
        if paths:
            tensors += [t for counters, obj in counted for t in counters.tensors(obj)]
        key = (index, tuple(t.data_ptr() for t in tensors), paths)
        recording = self.state_recordings.get(key)
        if recording is not None:
            self.state_recordings.move_to_end(key)
            if not paths:
                return self._replay(recording, leaves)
            for counters, obj in counted:
                counters.sync(obj)
            output = self._replay(recording, leaves)
            for (counters, obj), counts, adds in zip(counted, before, self._added[index]):
                counters.write(obj, _sum(counts, adds))  # what the call's Python would have counted
            return output
        if index in self._original_unrecordable and self._function(index) is self._original:
            return self._run_unrecorded(index, args, kwargs, leaves)  # the original, until the base serves it
        if key not in self._warm:
            if self._last_warm.setdefault(index, key[1]) != key[1]:
                # its calls come at fresh state each time (a prefill into each generate()'s new cache): no
                # recording of it will come to wait for, and the base may get ready for it now
                self._original_tried.add(index)
                if self._held is not None:
                    self._start_held_upgrade()
            self._last_warm[index] = key[1]
            self._warm[key] = None
            if len(self._warm) > _WARM_RUNS_KEPT:
                self._warm.popitem(last=False)
            self.warm_runs += 1
            return self._run_unrecorded(index, args, kwargs, leaves)
        if not _background.device_work.acquire(blocking=False):  # another thread's compile: record later
            return self._run_unrecorded(index, args, kwargs, leaves)
        try:
            self._make_room()
            with ExitStack() as following:
                for counters, obj in counted:
                    counters.sync(obj)
                    following.enter_context(counters.following(obj))
                recording = self._record_state_call(index, args, kwargs, counted, before)
            self._original_tried.add(index)
        finally:
            _background.device_work.release()
            if self._held is not None:  # recorded (or refused): the compile may start once the caller pauses
                self._start_held_upgrade()
        del self._warm[key]
        if recording is None:
            with _background.between_jobs():
                return self._original(index, args, kwargs, leaves)  # type: ignore[misc]
        if (
            paths and _difference(tuple(counters.read(obj) for counters, obj in counted), before) != self._added[index]
        ):  # its replays would advance the counters by what another call added
            log.warning(
                "%s: calls of %s change their state's counters by different amounts; not replayed",
                self.target.path or "<model>",
                signature.describe(),
            )
            self._added.pop(index)
        else:
            self.state_recordings[key] = recording
        if self.api.capture_executes:  # the capture itself ran this call
            return recording.outputs(leaves, self.copy_outputs)
        return self._replay(recording, leaves)

    def _run_unrecorded(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Runs a call with state for real, not replayed. Compiled code gets the call as its recordings and
        tuning's recorded calls give it: each input besides the state a tensor of its own, not a view or an
        inference tensor (`own_copy`; the graph backend takes no module that writes its inputs). Otherwise
        Dynamo compiles another graph for it, on the caller's path and missing the package's: a
        ``generate()``'s attention mask is a view."""
        function = self._function(index)
        with _background.between_jobs():  # the model's Python never runs beside a trace on the worker
            if self.base_runner is None or function is self._original:  # the module itself takes any call
                return function(index, args, kwargs, leaves)
            return function(index, *self._as_recorded(index, args, kwargs, leaves))

    def _as_recorded(self, index: int, args: tuple, kwargs: dict, leaves: list) -> tuple[tuple, dict, list]:
        """``(args, kwargs, leaves)`` of the call with each input besides the state a copy of its own, as a
        recording's static buffers and tuning's recorded calls are (`_run_unrecorded`; a compile off the
        caller's path runs on such copies too, `xpupack.state.scratch_copy`)."""
        slots = self.signatures[index].state_slots
        own = [
            own_copy(leaf) if isinstance(leaf, torch.Tensor) and slot not in slots else leaf
            for slot, leaf in enumerate(leaves)
        ]
        own_args, own_kwargs = unflatten(own, flatten(args, kwargs)[1])
        return own_args, own_kwargs, own

    def _for_base(self, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call as the base's compiled code will meet it, from the recordings (`_as_recorded`), for the base
        to compile for (`Runner.prepare`, `Runner.add_signature`)."""
        own_args, own_kwargs, _ = self._as_recorded(index, args, kwargs, flatten(args, kwargs)[0])
        return own_args, own_kwargs

    def _record_state_call(
        self, index: int, args: tuple, kwargs: dict, counted: list, before: tuple
    ) -> _Capture | None:
        """Records a call with state; None where the capture of the original module failed while the base
        is still to take the signature over (a TorchAO-quantized module that a capture refuses, whose
        compiled form records): the signature then runs the original module unrecorded until the base
        serves it, rather than being given up for good. A capture that fails ran none of the call's device
        work (``warmup=0``, and a capture only records), so the call itself can still run, unless the
        capture's Python moved the call's Python-side counters (``counted``, read ``before`` it)."""
        try:
            return self.record(index, args, kwargs, warmup=0)
        except Exception as exc:
            moved = tuple(counters.read(obj) for counters, obj in counted) != before
            if self._function(index) is not self._original or moved:
                raise
            self._original_unrecordable.add(index)
            log.warning(
                "%s: recording the original module's %s failed (%s); it runs unrecorded until the compiled "
                "module takes it",
                self.target.path or "<model>",
                self.signatures[index].describe(),
                error_line(exc),
            )
            return None

    def _make_room(self) -> None:
        """Drops least recently used recordings with state until one more fits under the cap."""
        while self.state_recordings and len(self.recordings) + len(self.state_recordings) >= self.max_recordings:
            self.state_recordings.popitem(last=False)
        if len(self.recordings) >= self.max_recordings:
            raise RuntimeError(f"over the cap of {self.max_recordings} recordings per module")

    def memory_bytes(self) -> int:
        """Device memory the recordings hold: their static inputs and their share of the pool."""
        with self._lock:  # `stats` from another thread must not read the recordings while a call changes them
            return self._memory_bytes()

    def _memory_bytes(self) -> int:
        return sum(r.memory for r in (*self.recordings.values(), *self.state_recordings.values()))

    def recorded(self) -> dict:
        """The recordings' memory, each one's and the module's, and what the budget skipped (`describe`,
        and the package's config for `xpupack inspect`)."""
        signatures = self.signatures
        facts: dict = {
            "memory_bytes": self._memory_bytes(),
            "recording_memory": {signatures[i].describe(): r.memory for i, r in self.recordings.items()},
        }
        if self.max_memory is not None:
            facts["max_memory"] = self.max_memory
        if self.skipped:
            facts["skipped"] = {signatures[i].describe(): why for i, why in self.skipped.items()}
        return facts

    def describe(self) -> dict:
        """Recordings, re-recordings, memory, and what could not be recorded, for `stats` and `inspect`."""
        with self._lock:
            facts = {
                "recordings": len(self.recordings) + len(self.state_recordings),
                "rerecordings": self.rerecordings,
                **self.recorded(),
            }
            if self._has_state():
                facts["warm_runs"] = self.warm_runs
            if self.unreplayable_runs:
                facts["unreplayable_runs"] = self.unreplayable_runs
            if self._original is not None or self.compiling or self.upgrade_error:
                facts["compiling"] = self.compiling
                facts["compiled_serving"] = self._upgrade is None and self.upgrade_error is None
            if self.upgrade_error:
                facts["upgrade_error"] = self.upgrade_error
            if self.failures:
                facts["not_recorded"] = {self.signatures[i].describe(): why for i, why in self.failures.items()}
            return facts


def _forward_of(target: Target) -> Callable[..., Any]:
    """The module's own forward as a runner's function, ``(index, args, kwargs, leaves) -> output``."""
    forward = target.forward
    return lambda index, args, kwargs, leaves: forward(*args, **kwargs)


def _difference(after: tuple, before: tuple) -> tuple:
    """Counters ``after`` less ``before``, per state object and counter."""
    return tuple(tuple(a - b for a, b in zip(later, earlier)) for later, earlier in zip(after, before))


def _sum(counts: tuple, added: tuple) -> tuple:
    return tuple(count + adds for count, adds in zip(counts, added))


def _refuse_unsafe_collectives(target: Target, device: torch.device, opted_in: bool) -> None:
    """A sharded (DTensor) module calls collectives. Unless the device's graphs are known to record them,
    or the caller opted in, it is refused before anything is captured: a failed capture of a collective
    can leave every rank's communicator hung, which no fallback undoes. Every rank refuses alike."""
    api = _device.graphs_for(device)
    if is_sharded(target.module) and not opted_in and not (api and api.records_collectives):
        raise RuntimeError(
            "a tensor-parallel module's collectives are not recorded on "
            f"{device.type}: capturing an all-reduce failed on torch 2.11 with NCCL ('CUDA error: invalid "
            "argument') and left the ranks hung; GraphBackend(record_collectives=True) tries anyway"
        )


def _refuse_input_mutation(spec: ModuleSpec) -> None:
    if spec.mutates_inputs:
        raise RuntimeError(
            "the module changes its input tensors in place; a replay would change its own "
            "static copies of them, not the caller's tensors"
        )


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
        max_memory: a budget, in bytes, for each module's recordings (their static inputs and
            what their captures add to the shared pool). Signatures are recorded in order of
            benefit, the most recorded calls first and, among equals, the largest batch first; once
            the recordings pass the budget, the rest are skipped (``stats`` and ``inspect`` list them
            under ``skipped``) and their calls are padded up to a larger recording where the module
            allows it, else run the original module. None: no budget. Applied again when a loader
            records. Calls with state (a KV cache) are recorded while serving, outside the budget.
        record_collectives: record tensor-parallel (DTensor) modules, collectives included, on a
            GPU. Off by default: capturing an NCCL all-reduce failed on torch 2.11 and left the
            ranks hung (docs/multi-gpu.md); such modules are refused before any
            capture and run the strategy's next backend. Turn on only where a test on your
            stack shows the capture works.

    Raises:
        ValueError: ``base`` is a `GraphBackend`, or an option is out of range (`TuningError`, a
            ``ValueError``, for ``max_memory``).

    Examples:
        >>> xpupack.GraphBackend(max_memory=2 * 2**30)  # at most 2 GiB of recordings per module
    """

    name = "graph"
    pads_calls = True
    #: a replay may run other kernels than eager did (cuBLAS picks others under capture), and through a deep
    #: model that rounding adds up past any elementwise bound (an 8B Llama's logits: 30.3 dB from eager's)
    low_precision_sqnr_db = LOW_PRECISION_SQNR_DB

    def __init__(
        self,
        base: Backend | dict | None = None,
        *,
        max_recordings: int = GRAPH_MAX_RECORDINGS,
        copy_outputs: bool = True,
        max_memory: int | None = None,
        record_collectives: bool = False,
    ):
        self._set_base(base)
        if isinstance(self.base, GraphBackend):
            raise ValueError("GraphBackend(base=GraphBackend()) would record a recording")
        if isinstance(max_recordings, bool) or not isinstance(max_recordings, int) or max_recordings < 1:
            raise ValueError(f"GraphBackend(max_recordings={max_recordings!r}): give a positive integer")
        if not isinstance(copy_outputs, bool):
            raise ValueError(f"GraphBackend(copy_outputs={copy_outputs!r}): give True or False")
        if max_memory is not None and (
            isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 1
        ):
            raise TuningError(
                f"GraphBackend(max_memory={max_memory!r}): give a positive number of bytes "
                "(an int, e.g. 2 * 2**30 for 2 GiB), or None for no budget"
            )
        if not isinstance(record_collectives, bool):
            raise ValueError(f"GraphBackend(record_collectives={record_collectives!r}): give True or False")
        self.max_recordings = max_recordings
        self.copy_outputs = copy_outputs
        self.max_memory = max_memory
        self.record_collectives = record_collectives

    def options(self) -> dict:
        """The constructor options that differ from their defaults, the base's included."""
        options = self._base_options()
        if self.max_recordings != GRAPH_MAX_RECORDINGS:
            options["max_recordings"] = self.max_recordings
        if not self.copy_outputs:
            options["copy_outputs"] = False
        if self.max_memory is not None:
            options["max_memory"] = self.max_memory
        if self.record_collectives:
            options["record_collectives"] = True
        return options

    def _own_available(self, device: torch.device) -> bool:
        """Whether ``device`` records device graphs (CUDA, XPU; not a CPU); the base must run there too
        (`ComposedBackend`)."""
        return _device.graphs_for(device) is not None

    def _own_why_unavailable(self, device: torch.device) -> str:
        return no_graphs_on(device)

    def _runner(
        self, target: Target, spec: ModuleSpec, device: torch.device, base_runner: Runner | None
    ) -> GraphRunner:
        api = _device.graphs_for(device)
        function = base_runner.run if base_runner is not None else _forward_of(target)
        return GraphRunner(
            target,
            spec,
            device,
            api,
            function,
            max_recordings=self.max_recordings,
            copy_outputs=self.copy_outputs,
            max_memory=self.max_memory,
            base_runner=base_runner,
        )

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        """Builds the base (if any), then records every signature without state. See `Backend.build`.

        Args:
            target: the module.
            spec: its recorded signatures and samples.
            device: a device with graphs.

        Returns:
            A `GraphRunner`.

        Raises:
            RuntimeError: a sharded module without ``record_collectives``, a module that changes its
                inputs in place, a recording that failed, or none that fits ``max_memory``.
        """
        _refuse_unsafe_collectives(target, device, self.record_collectives)
        _refuse_input_mutation(spec)
        runner = self._runner(target, spec, device, self._build_base(target, spec, device))
        try:
            with _device.on_device(device):
                runner.record_all(strict=True)
            if not runner.supported:
                raise RuntimeError("no recording fits the memory budget: " + "; ".join(runner.skipped.values()))
        except BaseException:
            runner.undo()
            raise
        return runner

    def restore(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, *, use_artifacts: bool
    ) -> Runner:
        """Restores the base, then records every signature again on this device from synthesised inputs.

        Within ``xpupack.load(..., defer_compile=True)``, a base with compiled code is restored off the
        caller's path and the original module's recordings serve meanwhile (docs/cold-start.md).
        See `Backend.restore`.

        Args:
            target: the module.
            spec: its signatures.
            config: what `save` returned.
            folder: where `save` wrote (the base's artifacts are in a sub-folder).
            device: a device with graphs.
            use_artifacts: passed on to the base.

        Returns:
            A `GraphRunner`.

        Raises:
            RuntimeError: as for `build`, or no signature could be recorded.
        """
        _refuse_unsafe_collectives(target, device, self.record_collectives)
        _refuse_input_mutation(spec)
        if self._defers(spec):
            runner = self._recorded(target, spec, device, None)
            restore = lambda: self._checked_base(target, spec, config, folder, device, use_artifacts)  # noqa: E731
            if any(signature.state_slots for signature in spec.signatures):
                runner.start_upgrade_after_recording(_background.hold(restore))
            else:
                runner.upgrade_when_ready(_background.later(restore))
            return runner
        runner = self._recorded(
            target, spec, device, self._restore_base(target, spec, config, folder, device, use_artifacts)
        )
        if runner.base_runner is not None and runner.base_runner.prepares_state_calls:
            # a base over TorchAO compiles its decode steps off the caller's path: the quantized module's
            # recordings serve them meanwhile, as the original module's do for a deferred base
            runner.prepare_state_calls(_forward_of(target))
        return runner

    def _defers(self, spec: ModuleSpec) -> bool:
        """Whether this load records the original module now and restores the base off the caller's path
        (docs/cold-start.md): a base with compiled code (Inductor: seconds of importing and loading on
        a fresh server) that leaves the module as it is, for a module that writes none of its buffers
        (the worker runs it while calls do)."""
        return (
            _background.deferred()
            and self.base is not None
            and self.base.compiled_artifacts
            and self.base.compiles_at_load
            and not changes_module(self.base)
            and not spec.writes_buffers
        )

    def _checked_base(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, use_artifacts: bool
    ) -> Runner:
        """The base runner, restored and checked against the original module (on the worker)."""
        with _device.on_device(device):
            base = self._restore_base(target, spec, config, folder, device, use_artifacts)
            check_against_original(target, spec, self, base)
        return base

    def _recorded(
        self, target: Target, spec: ModuleSpec, device: torch.device, base_runner: Runner | None
    ) -> GraphRunner:
        runner = self._runner(target, spec, device, base_runner)
        try:
            if not _background.device_work.acquire(blocking=False):
                runner.record_at_first_call()  # another model's compile holds the device: never wait for it
                return runner
            try:
                with _device.on_device(device):
                    runner.record_all(strict=False)
            finally:
                _background.device_work.release()
            if not runner.supported:
                raise RuntimeError(
                    "no signature could be recorded: "
                    + "; ".join([*runner.failures.values(), *runner.skipped.values()])
                )
        except BaseException:
            runner.undo()
            raise
        return runner

    def save(self, runner: Runner, folder: Path) -> dict:
        """The base's config, and the recordings' memory on the build device (for `xpupack inspect`;
        a loader records again and measures its own).

        Args:
            runner: the `GraphRunner`.
            folder: ``modules/<path>/graph/``.

        Returns:
            The config; it holds no recording.
        """
        return {**super().save(runner, folder), "recorded": runner.recorded()}

    def save_shared(self, folder: Path, runners: list[Runner]) -> dict:
        """The base's shared artifacts (Inductor's cache); recordings share nothing that is saved.

        Args:
            folder: ``backends/graph/``.
            runners: the `GraphRunner` of every module.

        Returns:
            The base's shared config, or ``{}``.
        """
        shared = self.base.save_shared(folder, [runner.base_runner for runner in runners]) if self.base else None
        return {} if shared is None else shared  # a graph package lists its shared entry, empty or not

    def restore_shared(self, config: dict, folder: Path, *, use_artifacts: bool) -> None:
        """Hands the shared artifacts to the base, which decides itself when to load them.

        Args:
            config: what `save_shared` returned.
            folder: where it wrote.
            use_artifacts: whether compiled artifacts may be loaded.
        """
        if self.base is not None:  # a base that compiles off the caller's path loads its artifacts there too
            self.base.restore_shared(config, folder, use_artifacts=use_artifacts)
