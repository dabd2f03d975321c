"""Work off the caller's path: a compile that a call would otherwise wait for (README: "Language models").

One worker thread for the whole process runs the jobs one at a time, in the
order given; it starts with the first job (a process that compiles nothing
has none). It is a daemon thread: an exit does not wait for a compile.

While a job runs the worker holds `device_work`. A device-graph capture must
not overlap another thread's work on the device (CUDA refuses most calls from
other threads while a stream captures, and the capture is lost), so the graph
backend records only while it holds that lock: a capture on the serving path
that cannot take it at once is made on a later call instead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

#: held by the worker while a job runs (see the module docstring); reentrant, so that a job that
#: reaches a capture itself goes on
device_work = threading.RLock()

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_starting = threading.Lock()


def submit(job: Callable[[], Any]) -> Future:
    """Runs ``job()`` on the worker after the jobs given before it; its future holds the result or the error."""
    global _worker
    future: Future = Future()
    _jobs.put((job, future))
    with _starting:
        if _worker is None:
            _worker = threading.Thread(target=_work, name="xpupack-background", daemon=True)
            _worker.start()
    return future


def wait(timeout: float | None = None) -> None:
    """Returns once every job given so far has finished (raises `TimeoutError` after ``timeout`` seconds)."""
    submit(lambda: None).result(timeout)


def _work() -> None:
    while True:
        job, future = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            with device_work:
                result = job()
        except BaseException as exc:  # the caller's future reports it; the worker goes on
            future.set_exception(exc)
        else:
            future.set_result(result)
        del job, future  # a finished job's inputs (a scratch KV cache) are freed now, not at the next job
