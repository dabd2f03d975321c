"""Latency of each tuned module against eager, per recorded signature (``xpupack bench``).

Uses the speed gate's timing (`_timing.compare`): tuned and eager calls take turns.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import _hooks, _timing
from .errors import BenchmarkError
from .tuned import Session, session_of, stats

log = logging.getLogger("xpupack")


def benchmark(model: nn.Module, *, iterations: int = 50, warmup: int = 5) -> list[dict]:
    """Times every tuned module of ``model`` on each recorded signature, tuned and eager side by side.

    Inputs are synthesised from the signatures (signatures with state, a KV
    cache, are left out: nothing can synthesise one). Both sides call the module
    the same way (``module(*args)``), in turns: with the tuned forwards in place
    (fit check and dispatch included), then without them, which is plain eager
    PyTorch, and so on, so that other work on the machine slows both alike. Each
    row's ``speedup`` is the median over ``iterations`` rounds of eager's time over
    the tuned one's, with its 95% interval (``speedup_interval``); while that
    interval holds 1.0, up to 4x as many rounds are timed, and ``noisy`` marks
    timings that scattered widely. ``fell_back`` marks a row whose tuned calls
    ran the original module at times: a fallback, or a compile still running off
    the caller's path (load with ``defer_compile=False`` to time compiled code).
    """
    if type(iterations) is not int or iterations < 1 or type(warmup) is not int or warmup < 0:
        raise BenchmarkError(
            f"iterations={iterations!r}, warmup={warmup!r}: time at least one call (iterations >= 1, warmup >= 0)"
        )
    session = session_of(model)
    cases = [
        (path, tuned, signature, *signature.synthesize())
        for path, tuned in session.modules.items()
        for signature in tuned.signatures
        if not signature.state_slots
    ]
    skipped = sum(bool(s.state_slots) for tuned in session.modules.values() for s in tuned.signatures)
    if skipped:
        log.warning(
            "%d signature(s) with a KV cache are not timed: only a real call brings a cache "
            "(benchmarks/llm_decode.py times decoding)",
            skipped,
        )

    was_active = session.active
    session.activate()
    originals = _original_calls(model)
    try:
        with torch.no_grad():
            results = [
                _timing.compare(
                    [_call(tuned, args, kwargs)],
                    [_call(tuned, args, kwargs)],
                    session.device_of(path),
                    threshold=1.0,
                    rounds=iterations,
                    warmup=warmup,
                    budget_s=10.0,
                    to_eager=lambda: _route(session, tuned=False),
                    to_candidate=lambda: _route(session, tuned=True),
                )
                for path, tuned, _signature, args, kwargs in cases
            ]
    finally:
        if not was_active:
            session.deactivate()
    after = _original_calls(model)
    fell_back = {path for path in session.modules if after[path] > originals[path]}
    return [
        {
            "module": path,
            "signature": signature.describe(),
            "backend": tuned.backend_name,
            "fell_back": path in fell_back,
            "tuned": result.candidate.to_json(),
            "eager": result.eager.to_json(),
            **result.to_json(),
        }
        for (path, tuned, signature, _a, _k), result in zip(cases, results)
    ]


def _original_calls(model: nn.Module) -> dict[str, int]:
    """Per module, the calls the original module ran on the tuned side: fallbacks, and calls made while
    a compile ran off the caller's path (``load(defer_compile=True)``): a row with either did not time
    the tuned code alone."""
    return {path: entry["fallbacks"] + entry["compiling"] for path, entry in stats(model).items()}


def _call(tuned, args: tuple, kwargs: dict):
    module = tuned.target.module
    return lambda: module(*args, **kwargs)


def _route(session: Session, *, tuned: bool) -> None:
    """Puts the tuned forwards in place, or takes them off, without `Session.deactivate`'s releasing the
    recordings (which the next tuned turn would then make again)."""
    for module in session.modules.values():
        if tuned:
            _hooks.install(module.target.module, module)
        else:
            _hooks.uninstall(module.target.module, module, module.target.forward)
