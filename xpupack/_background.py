"""Work off the caller's path: a compile that a call would otherwise wait for (README: "Language models").

One worker thread for the whole process runs the jobs one at a time, in the
order given; it starts with the first job (a process that compiles nothing
has none). At exit the job that runs finishes and the queued ones are
dropped: a daemon thread cut off inside torch's C++ code aborts the process
("terminate called without an active exception").

While a job runs the worker holds `device_work`. A device-graph capture must
not overlap another thread's work on the device (CUDA refuses most calls from
other threads while a stream captures, and the capture is lost), so the graph
backend records only while it holds that lock: a capture on the serving path
that cannot take it at once is made on a later call instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

#: held by the worker while a job runs (see the module docstring); reentrant, so that a job that
#: reaches a capture itself goes on
device_work = threading.RLock()

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_starting = threading.Lock()
_stopping = False


def submit(job: Callable[[], Any], future: Future | None = None) -> Future:
    """Runs ``job()`` on the worker after the jobs given before it; its future (``future``, or a new one)
    holds the result or the error."""
    global _worker
    future = future if future is not None else Future()
    context = contextvars.copy_context()  # the job sees what the caller's block set (a load's file guard)
    _jobs.put((lambda: context.run(job), future))
    with _starting:
        if _worker is None:
            _worker = threading.Thread(target=_work, name="xpupack-background")
            _worker.start()
            # called as the interpreter exits, before it waits for threads like this one
            threading._register_atexit(_stop)  # type: ignore[attr-defined]
    return future


def wait(timeout: float | None = None) -> None:
    """Returns once every job given so far has finished (raises `TimeoutError` after ``timeout`` seconds)."""
    submit(lambda: None).result(timeout)


def _after_fork() -> None:
    """A forked child has no worker (threads do not survive a fork), whatever its parent had."""
    global device_work, _jobs, _worker, _starting, _stopping
    device_work, _starting = threading.RLock(), threading.Lock()
    _jobs, _worker, _stopping = queue.SimpleQueue(), None, False


os.register_at_fork(after_in_child=_after_fork)


def _stop() -> None:
    global _stopping
    _stopping = True
    _jobs.put(None)


def _work() -> None:
    while True:
        item = _jobs.get()
        if item is None:
            return
        job, future = item
        if _stopping:
            future.cancel()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            with device_work:
                result = job()
        except BaseException as exc:  # the caller's future reports it; the worker goes on
            future.set_exception(exc)
        else:
            future.set_result(result)
        del item, job, future  # a finished job's inputs (a scratch KV cache) are freed now, not at the next job


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
        submit(job, future)


def deferred() -> bool:
    """Whether the load in progress restores compiled modules off the caller's path."""
    return _deferred_jobs.get() is not None


def later(job: Callable[[], Any]) -> Future:
    """Queues ``job`` for the worker when the `deferring` block ends; its future holds the result."""
    jobs = _deferred_jobs.get()
    if jobs is None:
        raise RuntimeError("xpupack._background.later outside a deferring block")
    future: Future = Future()
    jobs.append((lambda: _not_deferring(job), future))  # `submit` runs it in a copy of this context
    return future


def _not_deferring(job: Callable[[], Any]) -> Any:
    """Runs a queued job as the work it defers: nothing it restores is deferred again."""
    _deferred_jobs.set(None)
    return job()
