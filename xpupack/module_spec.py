"""The spec types every floor above passes around: `Target` (the module tuned), `ModuleSpec` (what recording
found of its calls: signatures, batch axes, what it writes) and `Samples` (tuning's recorded calls).

They sit below the backends, padding and recording, which all take them (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._inference import own_copy, write, writing
from .signature import BatchAxes, Signature, flatten


@dataclass
class Target:
    """A module being tuned or loaded: its object path, the module, and its original forward.

    What `Backend.build` and `Backend.restore` get to work on.

    Args:
        path: the module's object path in the model (``"layers.0.mlp"``; ``""`` for the whole model).
        module: the module itself.
        forward: its original forward, what eager runs and a fallback calls (not the tuned dispatch).
    """

    path: str
    module: nn.Module
    forward: Callable[..., Any]


@dataclass(frozen=True)
class ModuleSpec:
    """What is known of one module's calls: its ``spec.json`` (docs/format.md), and at tune time its samples.

    Frozen: tuning and loading build it complete (`dataclasses.replace` where a step finds a fact) before a
    backend sees it, and a backend only reads it. The signatures a module meets while serving (a KV cache of
    a new length) are handed to its runner (`Runner.add_signature`), never added here.

    Args:
        signatures: the distinct call signatures, in the order they were first seen; a runner's
            ``supported`` and `Runner.run`'s ``index`` refer to positions in this tuple.
        calls: how many calls of the module the recording saw.
        signature_calls: ``signature_calls[i]``: how many recorded calls had ``signatures[i]`` (weights
            for timing).
        unrecordable: why calls could not be recorded -> how many such calls.
        samples: the recorded calls (`Samples`) at tune time; None at load, where only the signatures exist.

    The other fields are documented where they are declared.
    """

    signatures: tuple[Signature, ...]
    calls: int = 0
    signature_calls: tuple[int, ...] = ()
    unrecordable: dict[str, int] = field(default_factory=dict)
    #: signature index -> its batch axes, for the signatures a smaller batch may be padded up to
    #: (`xpupack.padding`); empty when nothing is padded
    batch_axes: dict[int, BatchAxes] = field(default_factory=dict)
    #: why this module's calls are never padded (its rows mix), or None
    padding_refused: str | None = None
    #: signature index -> its length axes, for the signatures a shorter sequence may be padded up to with
    #: zeros (`xpupack.padding`: the module keeps zero positions out of the real ones, by a mask or causal
    #: attention); empty when no length is padded
    length_axes: dict[int, BatchAxes] = field(default_factory=dict)
    #: why shorter sequences are not padded where another size (the batch) is, or None
    lengths_refused: str | None = None
    #: eager changed an input tensor in place on a recorded sample (a replay would change its copy); at
    #: load, also when the loader sees the module do it (a package's false is only its word)
    mutates_inputs: bool = False
    #: the module wrote its own buffers while tuning's (or a load's) runs called it: never padded, whose
    #: filler rows would reach them. Established from the module each time, never read from a package
    writes_buffers: bool = False
    #: the recorded calls, at tune time only (never written to a package)
    samples: Samples | None = field(default=None, compare=False, repr=False)

    def example(self, index: int) -> tuple[tuple, dict]:
        """A recorded sample of signature ``index`` where one exists (tune time), else synthesised inputs.

        Args:
            index: a signature's position in ``signatures``.

        Returns:
            ``(args, kwargs)`` of one call of that signature.

        Raises:
            Unsynthesizable: a signature with a state object and no sample (at load).
        """
        if self.samples is not None and self.samples.count(index):
            return self.samples.sample(index, 0)
        return self.signatures[index].synthesize()

    def signature_weights(self) -> list[int]:
        """How often each signature was called while recording (1 where that is not known)."""
        counts = self.signature_calls
        return [counts[i] if i < len(counts) and counts[i] > 0 else 1 for i in range(len(self.signatures))]


@dataclass(eq=False)
class Samples:
    """The calls tuning recorded of one module, a few per signature (`ModuleSpec.samples`): tune time only.

    Recorded inputs are never kept beyond tuning and never written to a package (they may be private
    data). Running a sample puts its state objects (a KV cache) back as they were before the recorded
    call, so every candidate runs it on the state eager ran it on; `drop` forgets the samples and gives the
    state objects back the contents they had when the samples' run ended.

    Args:
        signatures: the module's signatures (`ModuleSpec.signatures`).
        inputs: ``inputs[i]``: recorded ``(args, kwargs)`` of ``signatures[i]``.
        states: ``states[i][k]``: copies of the state tensors of ``inputs[i][k]`` from before that call
            (empty lists for signatures without state).
        counts: ``counts[i][k]``: the Python-side counters of the state objects of ``inputs[i][k]`` from
            before that call (`xpupack.state.SlidingWindowCounters`), or an empty list.
    """

    signatures: tuple[Signature, ...]
    inputs: list[list[tuple[tuple, dict]]]
    states: list[list[list[torch.Tensor]]]
    counts: list[list[list[tuple]]]
    #: state tensor -> its contents when tuning first put a recorded state back (restored by `drop`)
    _after_run: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    #: state object -> its counters when tuning first put a recorded state back (restored by `drop`)
    _counts_after_run: dict[int, tuple[Any, Any, tuple]] = field(default_factory=dict, repr=False)

    def count(self, index: int) -> int:
        """How many samples signature ``index`` has (0 once they are dropped).

        Args:
            index: a signature's position in ``signatures``.
        """
        return len(self.inputs[index]) if index < len(self.inputs) else 0

    def counted(self, index: int) -> bool:
        """Whether a sample of signature ``index`` has state objects with Python-side counters (a sliding-window
        KV cache, `xpupack.state`) that were running when it was recorded.

        Args:
            index: a signature's position in ``signatures``.
        """
        return index < len(self.counts) and any(any(sample) for sample in self.counts[index])

    def sample(self, index: int, number: int) -> tuple[tuple, dict]:
        """Recorded sample ``number`` of signature ``index``, its state objects put back as they were
        before that call (a module that updates a KV cache sees the cache it saw while recording).

        Args:
            index: a signature's position in ``signatures``.
            number: the sample's position among that signature's samples.

        Returns:
            ``(args, kwargs)`` as recorded.
        """
        args, kwargs = self.inputs[index][number]
        saved = self.states[index][number] if index < len(self.states) else []
        if saved:
            live = self.signatures[index].state_tensors(flatten(args, kwargs)[0])
            for tensor, copy in zip(live, saved):
                self._after_run.setdefault(id(tensor), (tensor, own_copy(tensor)))
                write(tensor, copy)
        counts = self.counts[index][number] if index < len(self.counts) else []
        for (counters, obj), saved_counts in zip(
            self.signatures[index].state_counters(flatten(args, kwargs)[0]), counts
        ):
            self._counts_after_run.setdefault(id(obj), (counters, obj, counters.read(obj)))
            counters.write(obj, saved_counts)
        return args, kwargs

    def mode(self, index: int) -> contextlib.AbstractContextManager:
        """The mode recorded calls of signature ``index`` run in while tuning, autograd off: inference mode
        when their state tensors were made there (the caller's ``generate()`` under `torch.inference_mode`),
        since only there can a call write them; `torch.no_grad` otherwise (`xpupack._inference`).

        Args:
            index: a signature's position in ``signatures``.

        Returns:
            A context manager to run that signature's recorded calls in.
        """
        if not self.signatures[index].state_slots or not self.count(index):
            return torch.no_grad()
        args, kwargs = self.inputs[index][0]
        return writing(self.signatures[index].state_tensors(flatten(args, kwargs)[0]))

    def observe(self, index: int, args: tuple, kwargs: dict, output: Any) -> Any:
        """What a candidate's call must reproduce: its output and, for a call with state, the state after it.

        Args:
            index: the signature's position in ``signatures``.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
            output: what the call returned.

        Returns:
            ``output``, or ``(output, copies of the state tensors)`` for a signature with state.
        """
        if not self.signatures[index].state_slots:
            return output
        live = self.signatures[index].state_tensors(flatten(args, kwargs)[0])
        return output, [own_copy(tensor) for tensor in live]

    def drop(self) -> None:
        """Forgets the recorded calls (never kept beyond tuning); state objects get back the contents
        they had when the samples' run ended."""
        for tensor, contents in self._after_run.values():
            write(tensor, contents)
        for counters, obj, counts in self._counts_after_run.values():
            counters.write(obj, counts)
        self._after_run.clear()
        self._counts_after_run.clear()
        self.inputs, self.states, self.counts = [], [], []
