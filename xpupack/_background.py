"""Work off the caller's path: a compile that a call would otherwise wait for (docs/language-models.md).

One worker thread for the whole process runs the jobs one at a time, in the
order given; it starts with the first job (a process that compiles nothing
has none). At exit the job that runs finishes and the queued ones are
dropped: a daemon thread cut off inside torch's C++ code aborts the process
("terminate called without an active exception").

While a job runs the worker holds `device_work`. A device-graph capture must
not overlap another thread's work on the device (CUDA refuses most calls from
other threads while a stream captures, and the capture is lost), so the graph
backend records only while it holds that lock: a capture on the serving path
that cannot take it at once is made on a later call instead. That is why a
load can keep a job back (`hold`): a language model's decode
steps can only be recorded during a real call (they need its KV cache), so
their compile waits until the first of them is recorded and the caller pauses
(`Held.start`), instead of leaving the first `generate()` to run every step
on the original module.

A job must not run beside the model's own Python code on another thread. transformers' output capture
(and the kernels package) keep a process-wide variable while compiled code runs or Dynamo traces ("not
thread-safe when compilation is triggered", transformers says): a `generate()` on the caller's thread
beside the worker's trace of the same model changed it under the trace, whose guards then failed to build
(3 of 4 loads of a tiny Llama with `defer_compile=True`). So a call that runs the model's Python, eager or
compiled, takes `model_code` (`between_jobs`), which the worker holds while a job runs: it waits for a
running job, and a job waits for it. Replays of device graphs run no Python of the model and never wait,
and a capture's wait stays `device_work`'s (a load never waits for another model's job).

A job must not change the caller's random numbers. A compile restores the global random state it found
when it started (Dynamo does, for every frame), which from the worker would rewind the caller's
generators to that moment: a model built from a seed meanwhile took other weights, and sampling repeated
itself. While a job runs, the default generators' setters called from the worker do nothing
(`_random_state_kept`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

#: held by the worker while a job runs (see the module docstring); reentrant, so that a job that
#: reaches a capture itself goes on
device_work = threading.RLock()
#: held by the worker while a job runs and by a call that runs a model's Python (`between_jobs`); taken after
#: `device_work` where both are (a capture runs the model)
model_code = threading.RLock()

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_starting = threading.Lock()
_stopping = False


def submit(
    job: Callable[[], Any],
    future: Future | None = None,
    *,
    context: contextvars.Context | None = None,
    ready: Callable[[], bool] | None = None,
    runs_model: bool = True,
) -> Future:
    """Runs ``job()`` on the worker after the jobs given before it; its future (``future``, or a new one)
    holds the result or the error.

    The job runs in ``context`` (by default a copy of the caller's: what its block set, a load's file
    guard). With ``ready``, the worker polls it before the job and starts the job once it returns True,
    not holding `device_work` meanwhile (captures on the serving path go on). A job that traces or runs no
    model's code (``runs_model=False``) leaves `model_code` free for the callers' calls."""
    global _worker
    future = future if future is not None else Future()
    context = context if context is not None else contextvars.copy_context()
    _jobs.put((lambda: context.run(job), future, ready, runs_model))
    with _starting:
        if _worker is None:
            _worker = threading.Thread(target=_work, name="xpupack-background")
            _worker.start()
            # called as the interpreter exits, before it waits for threads like this one
            threading._register_atexit(_stop)  # type: ignore[attr-defined]
    return future


_NO_WAIT = contextlib.nullcontext()


def between_jobs() -> contextlib.AbstractContextManager:
    """The block runs the model's own Python code (eager or compiled, not a device-graph replay): entered,
    no job runs until it ends, and it waits for a running job (see the module docstring). Free where no
    worker was started, and on the worker itself."""
    if _worker is None or threading.current_thread() is _worker:
        return _NO_WAIT
    return model_code


def wait(timeout: float | None = None) -> None:
    """Returns once every job given so far has finished, held ones included: they start now (raises
    `TimeoutError` after ``timeout`` seconds)."""
    for held in list(_held):
        held.start()
    submit(lambda: None).result(timeout)


class Held:
    """A load's job kept back from the worker until `start` (`hold`).

    Only its owner (a runner) holds it strongly: a model dropped before its job started takes the
    job with it, and `wait` starts the ones still held."""

    def __init__(self, job: Callable[[], Any], future: Future):
        self.job, self.future = job, future
        self.context: contextvars.Context | None = None  # the load's, set when its `deferring` block ends
        self._lock = threading.Lock()

    def start(self, ready: Callable[[], bool] | None = None) -> None:
        """Gives the job to the worker (once; later calls do nothing), to run once ``ready()`` is true."""
        with self._lock:
            if self.context is None or self.future.done() or self not in _held:
                return
            _held.discard(self)
        submit(self.job, self.future, context=self.context, ready=ready)


#: held jobs of finished loads not started yet (weakly: their runners own them)
_held: weakref.WeakSet[Held] = weakref.WeakSet()


def quiet(last_call: Callable[[], float], *, pause_s: float = 0.2, at_most_s: float = 5.0) -> Callable[[], bool]:
    """A `Held.start` condition: true once ``last_call()`` (a `time.monotonic` reading) is ``pause_s`` old
    — the caller paused between requests — or ``at_most_s`` after this call, for a caller that never
    pauses."""
    deadline = time.monotonic() + at_most_s

    def ready() -> bool:
        now = time.monotonic()
        return now - last_call() >= pause_s or now >= deadline

    return ready


def _after_fork() -> None:
    """A forked child has no worker (threads do not survive a fork), whatever its parent had."""
    global device_work, model_code, _jobs, _worker, _starting, _stopping
    device_work, model_code, _starting = threading.RLock(), threading.RLock(), threading.Lock()
    _jobs, _worker, _stopping = queue.SimpleQueue(), None, False
    _held.clear()


os.register_at_fork(after_in_child=_after_fork)


def _stop() -> None:
    global _stopping
    _stopping = True
    _jobs.put(None)


_POLL_S = 0.02


def _work() -> None:
    while True:
        item = _jobs.get()
        if item is None:
            return
        job, future, ready, runs_model = item
        while ready is not None and not _stopping and not ready():
            time.sleep(_POLL_S)
        if _stopping:
            future.cancel()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            with device_work, model_code if runs_model else _NO_WAIT, _random_state_kept():
                result = job()
        except BaseException as exc:  # the caller's future reports it; the worker goes on
            future.set_exception(exc)
        else:
            future.set_result(result)
        del item, job, future, ready  # a finished job's inputs (a scratch KV cache) are freed now, not at the next job


#: the default generators' state setters (module, name) that a compile calls as it ends
_RANDOM_STATE_SETTERS = tuple((module, "set_rng_state") for module in ("torch.random", "torch.cuda", "torch.xpu"))


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Inside the block, calls of `_RANDOM_STATE_SETTERS` from the worker do nothing; other threads' calls go
    through. xpupack's jobs draw no random numbers from the default generators (inputs they make come from
    generators of their own), so keeping the state as the caller left it loses nothing."""
    swapped = []
    for module_name, name in _RANDOM_STATE_SETTERS:
        module = importlib.import_module(module_name)
        setter = getattr(module, name, None)
        if setter is not None:
            setattr(module, name, _from_caller_only(setter))
            swapped.append((module, name, setter))
    try:
        yield
    finally:
        for module, name, setter in swapped:
            setattr(module, name, setter)


def _from_caller_only(setter: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(setter)
    def set_state(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is _worker:
            return None
        return setter(*args, **kwargs)

    return set_state


#: the jobs a load queues (`deferring`): given to the worker once every module is restored, so that no
#: capture of the load waits for them; None outside such a load
_deferred_jobs: contextvars.ContextVar[list | None] = contextvars.ContextVar("xpupack_deferred_jobs", default=None)


@contextlib.contextmanager
def deferring(on: bool = True) -> Iterator[None]:
    """A load inside this block lets backends restore their compiled part on the worker (`deferred`,
    `later`): ``xpupack.load(..., defer_compile=True)``. The jobs start when the block ends, in the order
    given; a block that raises starts none (their futures are cancelled)."""
    jobs: list = []
    token = _deferred_jobs.set(jobs if on else None)
    try:
        yield
    except BaseException:
        for _job, future in jobs:
            future.cancel()
        raise
    finally:
        _deferred_jobs.reset(token)
    for job, future in jobs:
        if isinstance(job, Held):
            job.context = contextvars.copy_context()  # the load's, as `submit` would take it
            _held.add(job)
        else:
            submit(job, future)


def deferred() -> bool:
    """Whether the load in progress restores compiled modules off the caller's path."""
    return _deferred_jobs.get() is not None


def later(job: Callable[[], Any]) -> Future:
    """Queues ``job`` for the worker when the `deferring` block ends; its future holds the result."""
    future: Future = Future()
    _deferred_list().append((lambda: _not_deferring(job), future))  # `submit` runs it in a copy of this context
    return future


def hold(job: Callable[[], Any]) -> Held:
    """As `later`, but the job waits after the `deferring` block ends until its `Held.start` (or a
    `wait`); the returned `Held`'s ``future`` holds the result."""
    held = Held(lambda: _not_deferring(job), Future())
    _deferred_list().append((held, held.future))
    return held


def _deferred_list() -> list:
    jobs = _deferred_jobs.get()
    if jobs is None:
        raise RuntimeError("xpupack._background: a job deferred outside a deferring block")
    return jobs


def _not_deferring(job: Callable[[], Any]) -> Any:
    """Runs a queued job as the work it defers: nothing it restores is deferred again."""
    _deferred_jobs.set(None)
    return job()
