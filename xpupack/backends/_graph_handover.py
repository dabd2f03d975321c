"""The part of `GraphRunner` that hands its calls from the original module over to a base restored off the
caller's path (``defer_compile``, docs/cold-start.md): until the base runner is ready, recordings of the original
module serve; then each signature is recorded again over the base, the signatures with state one by one as the
base gets ready for each (`Runner.prepare`). A failed restore, or recordings over the base that fail where the
original's did not, leave the original module's recordings serving (``upgrade_error`` says why).

Its state lives on the runner itself (`BaseHandover._init_handover`): the runner's lock guards both, and the
per-call path reads ``_original`` first to know whether any of this applies.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .. import _background
from ..errors import error_line

if TYPE_CHECKING:
    from ..signature import Signature
    from .base import Runner, Target

log = logging.getLogger("xpupack.backends.graph")


class BaseHandover:
    """`GraphRunner`'s handover from the original module to its base runner (see the module docstring)."""

    if TYPE_CHECKING:  # the runner's own, which this part reads and calls
        target: Target
        signatures: dict[int, Signature]
        function: Callable[..., Any]
        base_runner: Runner | None
        failures: dict[int, str]
        state_recordings: OrderedDict[tuple, Any]

        def _record_again(self) -> None: ...
        def _for_base(self, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...

    def _init_handover(self) -> None:
        #: the base runner being restored off the caller's path (`upgrade_when_ready`); until it is
        #: ready every call replays a recording of the original module
        self._upgrade: Future | None = None
        #: the original module's function while the base runner takes over signature by signature
        self._original: Callable[..., Any] | None = None
        #: signatures with state the base runner is getting ready for (`Runner.prepare`), and those it is ready for
        self._preparing: dict[int, Future] = {}
        self._base_ready: set[int] = set()
        self._base_refused: set[int] = set()
        #: signatures with state whose capture over the original module failed: run unrecorded until the base
        #: takes them (`_record_state_call`)
        self._original_unrecordable: set[int] = set()
        #: signatures with state whose recording over the original module was made or tried: only then does
        #: the base get ready for them (`_prepare_state_signature`). A compile holds the device: started
        #: earlier, it left every call during it unrecorded, the original module run for real (on the H200 a
        #: TorchAO int8 package's first ``generate()`` took 29 s, where replays take about 1 s)
        self._original_tried: set[int] = set()
        #: signatures added while the base runner was being restored: it is handed them when it takes over
        self._unknown_to_base: set[int] = set()
        #: calls served by the original module's recordings while the base runner was being restored
        self.compiling = 0
        self.upgrade_error: str | None = None
        #: the base's restore, held back until the first recording with state (`start_upgrade_after_recording`)
        self._held: _background.Held | None = None
        #: time.monotonic() of the latest call while an upgrade is pending: the held restore waits for a pause
        self._last_call = 0.0

    def upgrade_when_ready(self, future: Future) -> None:
        """Serves every call with recordings of the original module until ``future`` (the base runner,
        restored by `xpupack._background`) is done; the first call after that records each signature
        again over the base (captures only: the compile is done) and replays those from then on.

        A failed restore, or recordings over the base that fail where the original's did not, leave the
        original module's recordings serving (`upgrade_error` says why).

        Args:
            future: resolves to the base runner, checked against the original module.
        """
        self._original = self.function
        self._upgrade = future

    def failed_upgrade(self) -> tuple[str, str] | None:
        """``("graph", why)`` once restoring the base off the caller's path failed: recordings of the original
        module serve (`Runner.failed_upgrade`)."""
        return ("graph", self.upgrade_error) if self.upgrade_error else None

    def prepare_state_calls(self, original: Callable[..., Any]) -> None:
        """For a base that is restored but compiles its calls with state off the caller's path
        (`Runner.prepares_state_calls`): ``original`` serves those calls, recorded, until the base is ready
        for their signature (`_prepare_state_signature`), as after an upgrade (`upgrade_when_ready`).

        Args:
            original: runs the module itself, ``(index, args, kwargs, leaves) -> output``.
        """
        self._original = original
        self._base_ready = self._stateless()

    def start_upgrade_after_recording(self, held: _background.Held) -> None:
        """For signatures with state (decode steps): their recordings need a real call's state, and a
        capture cannot overlap the worker's device work, so the restore (`held`) starts only once the
        first such call is recorded and the caller pauses (`_background.quiet`). Until then the
        original module's recordings serve, made on the caller's first calls."""
        self._held = held
        self.upgrade_when_ready(held.future)

    def _start_held_upgrade(self) -> None:
        held, self._held = self._held, None
        assert held is not None  # called only while a restore is held
        held.start(ready=_background.quiet(lambda: self._last_call))

    def _take_upgrade(self, index: int, args: tuple, kwargs: dict) -> None:
        """Called under the lock before each call while an upgrade is pending: adopts a finished base."""
        if self._upgrade is None:
            if self._original is not None and self.signatures[index].state_slots and index not in self._base_ready:
                self._prepare_state_signature(index, args, kwargs)
            return
        if not self._upgrade.done() or not _background.device_work.acquire(blocking=False):
            self.compiling += 1  # captures wait for the worker's device work: try again on a later call
            return
        try:
            future, self._upgrade = self._upgrade, None
            try:
                base = future.result()
            except Exception as exc:
                self._keep_original(f"restoring the compiled module failed: {error_line(exc)}")
                return
            self.base_runner, self.function = base, base.run
            self._base_ready = self._stateless()
            self._record_again()
            if self.failures:  # the original module's recordings served these: never lose one
                failed = "; ".join(self.failures.values())
                base.release()
                assert self._original is not None  # set for as long as an upgrade is pending
                self.base_runner, self.function = None, self._original
                self._record_again()
                self._keep_original(f"recording over the compiled module failed: {failed}")
                return
            log.info(
                "%s: the compiled module serves now (restored off the caller's path)", self.target.path or "<model>"
            )
            if not self._has_state():
                self._original = None  # every signature is the base's: nothing left to route
        finally:
            _background.device_work.release()
        if self.signatures[index].state_slots:
            self._prepare_state_signature(index, args, kwargs)

    def _keep_original(self, why: str) -> None:
        self.upgrade_error, self._original, self._base_ready = why, None, set()
        log.warning("%s: %s; recordings of the original module keep serving", self.target.path or "<model>", why)

    def _prepare_state_signature(self, index: int, args: tuple, kwargs: dict) -> None:
        """A call with state after the base took over: the base gets ready for it off the caller's path
        (`Runner.prepare`), the original module's recordings serving until then; then its recordings
        are made again over the base."""
        if index in self._base_refused:
            return
        future = self._preparing.get(index)
        if future is None:
            if index not in self._original_tried and index not in self._original_unrecordable:
                return  # its recording of the original module first: replays serve while the base compiles
            future = self._preparing[index] = self._base_prepares(index, args, kwargs) or _done()
        if not future.done():
            self.compiling += 1
            return
        del self._preparing[index]
        refused = future.exception()
        if refused is not None:
            log.warning(
                "%s: the compiled module could not take %s (%s); the original module's recordings serve it",
                self.target.path or "<model>",
                self.signatures[index].describe(),
                error_line(refused),
            )
            self._base_refused.add(index)  # never asked again
            return
        self._base_ready.add(index)
        for key in [key for key in self.state_recordings if key[0] == index]:
            del self.state_recordings[key]  # recorded again, over the base, on the next calls

    def _base_prepares(self, index: int, args: tuple, kwargs: dict) -> Future | None:
        """The base runner gets ready for signature ``index`` (`Runner.prepare`); one added while it was
        being restored is handed to it first (`Runner.add_signature`, whose work, if any, is that)."""
        args, kwargs = self._for_base(index, args, kwargs)
        base = self.base_runner
        assert base is not None  # only once the base took over (`_take_upgrade`)
        if index in self._unknown_to_base:
            self._unknown_to_base.discard(index)
            work = base.add_signature(index, self.signatures[index], args, kwargs)
            if work is not None:
                return work
        return base.prepare(index, args, kwargs, ready=_background.quiet(lambda: self._last_call))

    def _stateless(self) -> set[int]:
        """The signatures without state: recorded up front, so the base is ready for them once it serves."""
        return {i for i, signature in self.signatures.items() if not signature.state_slots}

    def _has_state(self) -> bool:
        return any(signature.state_slots for signature in self.signatures.values())

    def _function(self, index: int) -> Callable[..., Any]:
        """What signature ``index``'s calls run (and its recordings record): the base's, or the original
        module's where the base is not ready for it yet."""
        if self._original is not None and index not in self._base_ready:
            return self._original
        return self.function


def _done() -> Future:
    """A future that is already done (a base with nothing to prepare)."""
    future: Future = Future()
    future.set_result(None)
    return future
