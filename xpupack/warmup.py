"""Warm-up calls inside `xpupack.load`: what only a real call can compile, compiled before the load returns.

A call with a KV cache (a language model's prefill and decode steps) cannot be compiled or recorded from
its signature alone: only a real call brings the cache. Without a warm-up (``warmup=None``), the first such
call after a load compiles on the caller's path (seconds, docs/cold-start.md). ``load(..., warmup=...)`` makes
those calls inside the load instead: the caller's own function, or ``"auto"`` (the default), a greedy
``generate()`` of each prompt length and cache length the package was tuned on, for a model tuned as a whole
with a static cache.
Compiled code guards on the mode of a call with state, so a server that warms up in one mode and serves in
the other compiles its own variant at its first call. The warm-up runs in the mode ``load`` was called in
(`torch.inference_mode()` or `torch.no_grad()`); called in neither, in the mode the package was tuned in
(its calls' compiled artifacts are for that mode: a warm-up in another compiles from scratch, 136 s for
Llama-3-8B's shapes on an H100), else under `torch.no_grad` (``generate()``'s own mode).
Its calls are not counted in `xpupack.stats`; a warm-up that fails leaves the model as the load made it
(its calls then compile at their first call, as without one) and says why in a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._inference import caller_mode
from .signature import Signature, StateLeaf, TensorLeaf, unflatten
from .state import STATIC_CACHE
from .tuned import Session, TunedModule

log = logging.getLogger("xpupack")

#: what ``load(warmup=...)`` takes besides a function of the model
WARMUP_CHOICES = (None, "auto")


def check_warmup(warmup: Any) -> None:
    """Raises ``ValueError`` unless ``warmup`` is None, ``"auto"`` or a function of the model."""
    if warmup not in WARMUP_CHOICES and not callable(warmup):
        raise ValueError(
            f"warmup={warmup!r}: give None, 'auto' (a generate() of each tuned prompt and cache length) "
            "or a function that calls the model as your server will, e.g. lambda m: m.generate(ids, ...)"
        )


def warm_up(model: nn.Module, session: Session, warmup: Any, progress: Callable[[str], None] | None) -> bool:
    """Runs ``warmup`` (`check_warmup`) on the loaded ``model``, then forgets its calls in ``session``'s
    counts. Never raises for the warm-up's own failure: it is logged, and the model serves as loaded.
    Returns whether it made any call (``"auto"`` makes none for a package without ``generate()`` prefills)."""
    if warmup is None:
        return False
    calls = generate_calls(model, session) if warmup == "auto" else [warmup]
    if not calls:
        return False
    mode = torch.inference_mode if warmup_mode(session) == "inference_mode" else torch.no_grad
    for module in session.modules.values():
        module.warming_up = True
    try:
        for number, call in enumerate(calls, 1):
            if progress:
                progress(f"warming up ({number}/{len(calls)})")
            try:
                with mode():
                    call(model)
            except Exception as exc:  # the model is loaded and serves; its first calls compile as without one
                log.warning(
                    "xpupack.load: the warm-up failed (%s: %s); calls it would have compiled compile at their "
                    "first call",
                    type(exc).__name__,
                    exc,
                )
                break
    finally:
        for module in session.modules.values():
            module.warming_up = False
            module.forget_calls()
    return True


def warmup_mode(session: Session) -> str:
    """``"inference_mode"`` or ``"no_grad"``: the mode the load was called in, or where it was called in
    neither, the mode the package was tuned in (compiled code guards on the mode of a call with state)."""
    return caller_mode() or session.samples_mode or "no_grad"


def generate_calls(model: nn.Module, session: Session) -> list[Callable[[nn.Module], Any]]:
    """For a model tuned as a whole (``""``) that has ``generate()``: a greedy ``generate()`` with a static
    cache for each (batch, prompt length, cache length) of a tuned prefill; none for any other package."""
    tuned = session.modules.get("")
    if tuned is None or not callable(getattr(model, "generate", None)):
        return []
    shapes = sorted({shape for signature in tuned.spec.signatures if (shape := _prefill_shape(signature))})
    return [
        _until_one_fits(tuned, [_greedy_generate(batch, length, cache_length, mask) for mask in masks])
        for batch, length, cache_length, masks in shapes
    ]


def _until_one_fits(tuned: TunedModule, tries: list[Callable[[nn.Module], Any]]) -> Callable[[nn.Module], Any]:
    """The first of ``tries`` whose calls all fit the tuned module (none falls back): the next is tried where
    one did not (a ``generate()`` given a mask passes its forward another mask than one given none)."""

    def call(model: nn.Module) -> Any:
        for attempt in tries:
            before = tuned.counts.fallbacks
            result = attempt(model)
            if tuned.counts.fallbacks == before:
                break
        return result

    return call


#: keywords that ``generate()``'s decoding loop passes to the model and a hand-written loop rarely does
GENERATE_KEYWORDS = frozenset({"return_dict", "logits_to_keep"})


def _prefill_shape(signature: Signature) -> tuple[int, int, int, tuple[bool, ...]] | None:
    """``(batch, prompt length, cache length, masks)`` of a ``generate()``'s prefill into a StaticCache (token
    ids of more than one position, a cache, `GENERATE_KEYWORDS`), or None for any other call. ``masks``: whether
    to give ``generate()`` an attention mask, in the order to try: a forward without a mask had none (an all-ones
    mask is dropped, as a Llama's); one with a mask had either (a sliding window's forward always gets one,
    built from the mask given, if any, and of another dtype when none was). The cache length is the longest
    layer's: a sliding-window layer's is its window. A hand-written loop's
    prefill is left out: a warm-up ``generate()`` of its cache length would leave that cache on the model,
    which transformers reuses for every later ``generate()`` that fits in it, so that their calls came at
    another cache length than tuned (H100, Llama-3-8B's shapes: every prefill a fallback, the decode step
    compiled again)."""
    caches = [leaf for leaf in signature.leaves if isinstance(leaf, StateLeaf) and leaf.type_name == STATIC_CACHE]
    if not caches or not caches[0].tensors:
        return None
    args, kwargs = unflatten(list(signature.leaves), signature.tree)
    if not GENERATE_KEYWORDS.intersection(kwargs):
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, TensorLeaf) or len(ids.shape) != 2 or ids.shape[1] < 2:
        return None
    lengths = [shape[2] for shape, _, _, _ in caches[0].tensors if len(shape) == 4]  # [batch, KV heads, length, size]
    if not lengths or max(lengths) < ids.shape[1]:
        return None
    masks = (True, False) if isinstance(kwargs.get("attention_mask"), TensorLeaf) else (False,)
    return ids.shape[0], ids.shape[1], max(lengths), masks


def _greedy_generate(batch: int, length: int, cache_length: int, with_mask: bool) -> Callable[[nn.Module], Any]:
    def call(model: nn.Module) -> Any:
        device = next(model.parameters()).device
        ids = torch.ones((batch, length), dtype=torch.long, device=device)
        new = cache_length - length + 1  # generate() sizes a static cache one short of its whole length
        generate: Callable[..., Any] = getattr(model, "generate")  # noqa: B009 (nn.Module types it a Tensor)
        return generate(
            ids,
            **({"attention_mask": torch.ones_like(ids)} if with_mask else {}),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,  # transformers' own torch.compile of the forward is not the package's
        )

    return call
