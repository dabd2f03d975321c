"""Latency of each tuned module against eager, per recorded signature (``xpupack bench``).

Uses the speed gate's timing (`_timing.compare`): tuned and eager calls take turns.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import _hooks, _timing
from .errors import BenchmarkError
from .tuned import Session, session_of

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
    timings that scattered widely.
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
    fallbacks = {path: tuned.fallbacks for path, tuned in session.modules.items()}
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
    fell_back = {path for path, tuned in session.modules.items() if tuned.fallbacks > fallbacks[path]}
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
