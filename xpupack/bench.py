"""Latency of each tuned module against eager, per recorded signature (``xpupack bench``).

Uses the same device-synchronized timing as `Fastest`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import _timing
from .errors import BenchmarkError
from .tuned import session_of

log = logging.getLogger("xpupack")


def benchmark(model: nn.Module, *, iterations: int = 50, warmup: int = 5) -> list[dict]:
    """Times every tuned module of ``model`` on each recorded signature, tuned and eager side by side.

    Inputs are synthesised from the signatures (signatures with state, a KV
    cache, are left out: nothing can synthesise one). Both sides call the module the
    same way (``module(*args)``): first with the tuned modules active (fit check
    and dispatch included), then deactivated, which is plain eager PyTorch.
    """
    if type(iterations) is not int or iterations < 1 or type(warmup) is not int or warmup < 0:
        raise BenchmarkError(f"iterations={iterations!r}, warmup={warmup!r}: time at least one call "
                             "(iterations >= 1, warmup >= 0)")
    session = session_of(model)
    cases = [(path, tuned, signature, *signature.synthesize())
             for path, tuned in session.modules.items() for signature in tuned.spec.signatures
             if not signature.state_slots]
    skipped = sum(bool(s.state_slots) for tuned in session.modules.values() for s in tuned.spec.signatures)
    if skipped:
        log.warning("%d signature(s) with a KV cache are not timed: only a real call brings a cache "
                    "(benchmarks/llm_decode.py times decoding)", skipped)

    def time_all() -> list[_timing.Timing]:
        with torch.no_grad():
            return [_timing.measure(lambda: tuned.target.module(*args, **kwargs), session.device_of(path),
                                    warmup=warmup, iterations=iterations, budget_s=10.0)
                    for path, tuned, _signature, args, kwargs in cases]

    was_active = session.active
    session.activate()
    fallbacks = {path: tuned.fallbacks for path, tuned in session.modules.items()}
    tuned_timings = time_all()
    fell_back = {path for path, tuned in session.modules.items() if tuned.fallbacks > fallbacks[path]}
    session.deactivate()
    try:
        eager_timings = time_all()
    finally:
        if was_active:
            session.activate()
    return [{"module": path, "signature": signature.describe(), "backend": tuned.backend_name,
             "fell_back": path in fell_back, "tuned": fast.to_json(), "eager": eager.to_json(),
             "speedup": round(eager.median_us / fast.median_us, 3) if fast.median_us else None}
            for (path, tuned, signature, _a, _k), fast, eager in zip(cases, tuned_timings, eager_timings)]
