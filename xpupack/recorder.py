"""Recording: which submodules to tune, and how the samples call them."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import _hooks
from ._inference import own_copy
from .errors import SampleError, TuningError
from .module_spec import ModuleSpec, Samples
from .signature import Signature, Unrecordable, dtype_name, flatten, map_tensors
from .state import state_type, unallocated

#: recorded samples kept per signature (only for accuracy checks and timing at tune time)
SAMPLES_PER_SIGNATURE = 2


def path_matches(path: str, pattern: str) -> bool:
    """Whether the object path ``path`` matches the glob ``pattern``, segment by segment.

    Both are split at dots. ``**`` matches any number of segments, none
    included; any other pattern segment matches exactly one path segment
    with `fnmatch` rules (``*``, ``?``, ``[seq]``), so ``*`` never crosses a
    dot: ``layers.*`` matches ``layers.0`` but not ``layers.0.mlp``;
    ``**.mlp`` matches ``mlp`` and ``layers.0.mlp``.
    """
    return _match(path.split(".") if path else [], pattern.split("."))


def _match(parts: list[str], pattern: list[str]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        # collapse runs of "**", then let this one take 0..len(parts) segments
        while rest and rest[0] == "**":
            rest = rest[1:]
        return any(_match(parts[skip:], rest) for skip in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and _match(parts[1:], rest)


def select_modules(model: nn.Module, patterns: Iterable[str] | None) -> dict[str, nn.Module]:
    """Object path -> module for every ``named_modules()`` path matching a glob pattern (`path_matches`:
    ``*`` is one path segment, ``**`` any number of them).

    ``None`` selects the whole model as one unit (object path ``""``). Nested
    selections are refused: a module and one of its ancestors cannot both be
    tuned, because the outer backend would record the inner one.
    """
    if patterns is None:
        return {"": model}
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    named = dict(model.named_modules())
    selected = {
        path: module
        for path, module in named.items()
        if path and any(path_matches(path, pattern) for pattern in patterns)
    }
    if not selected:
        examples = ", ".join(list(p for p in named if p)[:8])
        raise TuningError(
            f"no submodule matches {patterns} (`*` matches one dot-separated segment, `**` any "
            f"number of them); object paths look like: {examples}"
        )
    for pattern in patterns:  # a pattern that selects nothing is a typo the others would hide
        if not any(path_matches(path, pattern) for path in named if path):
            close = difflib.get_close_matches(pattern, [p for p in named if p], n=5, cutoff=0.5)
            raise TuningError(
                f"the module pattern {pattern!r} matches no submodule (the others match "
                f"{len(selected)}); "
                + (
                    f"close object paths: {', '.join(close)}"
                    if close
                    else f"object paths look like: {', '.join(list(selected)[:5])}"
                )
                + " — fix or drop the pattern"
            )
    for path in selected:
        for other in selected:
            if other != path and path.startswith(other + "."):
                raise TuningError(
                    f"both {other!r} and its submodule {path!r} are selected; "
                    "tune one or the other (narrow the --modules patterns)"
                )
    return selected


def snapshot(value: Any) -> Any:
    """A detached copy of the tensors of a call, so later in-place updates do not change it (normal tensors,
    even of a call under inference mode: `xpupack._inference`)."""
    return map_tensors(own_copy, value)


def same_values(a: Any, b: Any) -> bool:
    """Whether two calls' tensor leaves hold the same values (NaNs in the same places count as equal)."""
    a_leaves, a_spec = flatten((a,), {})
    b_leaves, b_spec = flatten((b,), {})
    if a_spec != b_spec:
        return False
    for x, y in zip(a_leaves, b_leaves):
        if isinstance(x, torch.Tensor) and not (
            torch.equal(x, y)
            or (
                (x.dtype.is_floating_point or x.dtype.is_complex)
                and x.shape == y.shape
                and bool(((x == y) | (x.isnan() & y.isnan())).all())
            )
        ):
            return False
    return True


def run_on_copy(forward: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """``forward`` run on a copy of the call's tensors: its outputs, and whether it changed that copy in place.

    A write is seen by the values it changes and by the tensors' version counters, so a write that leaves
    these inputs' values as they were (a clamp they are already inside) still counts: on other inputs it
    would change them.
    """
    call = snapshot((args, kwargs))
    tensors = [leaf for leaf in flatten(*call)[0] if isinstance(leaf, torch.Tensor)]
    versions = [_version(tensor) for tensor in tensors]
    outputs = forward(*call[0], **call[1])
    changed = not same_values(call, (args, kwargs)) or versions != [_version(tensor) for tensor in tensors]
    return outputs, changed


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


class BufferWatch:
    """A module's buffers (its submodules' too) as they are now: which ones calls write, and putting them back.

    A module that writes its buffers in ``forward`` (a row counter, running statistics, a running maximum)
    must not be padded, whose filler rows would reach them; and xpupack's own runs of it (tuning's checks
    and timing, a load's recordings and checks) must leave them as the caller's calls left them.
    Copies the buffers: as much memory again as they hold, while the watch lives.
    """

    def __init__(self, module: nn.Module):
        self._entries = [
            (owner, f"{prefix}.{name}" if prefix else name, name, tensor, tensor.detach().clone())
            for prefix, owner in module.named_modules()
            for name, tensor in owner._buffers.items()
            if tensor is not None and not tensor.is_meta
        ]  # meta: its values live elsewhere
        self._versions = [_version(tensor) for _, _, _, tensor, _ in self._entries]

    def written(self) -> list[str]:
        """The buffers replaced or written in place since the watch began (or was last `restore`d)."""
        return [
            path
            for (owner, path, name, tensor, saved), version in zip(self._entries, self._versions)
            if owner._buffers.get(name) is not tensor or _version(tensor) != version or not same_values(tensor, saved)
        ]

    def restore(self) -> None:
        """Puts every buffer back: the same tensor objects (a recording reads them where they are), the
        values they held."""
        with torch.no_grad():
            for owner, _, name, tensor, saved in self._entries:
                owner._buffers[name] = tensor
                if not same_values(tensor, saved):
                    tensor.copy_(saved)
        self._versions = [_version(tensor) for _, _, _, tensor, _ in self._entries]

    @contextlib.contextmanager
    def kept(self):
        """The block's writes to the buffers are undone when it ends."""
        try:
            yield self
        finally:
            self.restore()


def observe_calls(forward: Callable[..., Any], module: nn.Module, spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with ``mutates_inputs`` and ``writes_buffers`` set where ``forward`` (``module``'s) is seen to
    write an input in place or a buffer of its own, on inputs synthesised from each signature without state.

    A loaded package's ``mutates_inputs`` is its author's word, and the buffers are never in it: the loader
    sees for itself, before recording or padding anything, and puts the buffers back. What the module does
    only on other inputs than these (a write behind a data-dependent branch) stays unseen.
    """
    mutates_inputs, writes_buffers = spec.mutates_inputs, spec.writes_buffers
    buffers = BufferWatch(module)
    with torch.no_grad(), buffers.kept():
        for index, signature in enumerate(spec.signatures):
            if signature.state_slots:
                continue  # only a real call brings a KV cache
            _, changed = run_on_copy(forward, *signature.synthesize(seed=index + 1))
            mutates_inputs |= changed
            writes_buffers |= bool(buffers.written())
            buffers.restore()
    return replace(spec, mutates_inputs=mutates_inputs, writes_buffers=writes_buffers)


class _SampledCalls:
    """One module's calls as tuning samples them: their signatures, counts and a few copies of each."""

    def __init__(self):
        self.index: dict[Signature, int] = {}
        self.signatures: list[Signature] = []
        self.calls = 0
        self.signature_calls: list[int] = []
        self.unrecordable: dict[str, int] = {}
        self.inputs: list[list[tuple[tuple, dict]]] = []
        self.states: list[list[list[torch.Tensor]]] = []
        self.counts: list[list[list[tuple]]] = []
        #: per call under way, innermost last: None, or what `done` needs of a call that allocates its state
        self._open: list[tuple | None] = []

    def add(self, args: tuple, kwargs: dict) -> None:
        """Before a call: its signature, with a copy of its inputs and state."""
        self.calls += 1
        try:
            signature = Signature.of_call(args, kwargs)
        except Unrecordable as exc:
            self._open.append(self._allocating(args, kwargs))
            if self._open[-1] is None:
                self._unrecordable(exc)
            return
        self._open.append(None)
        leaves = flatten(args, kwargs)[0]
        # a state object is kept by reference; its tensors as they are before this call are copied,
        # so that every candidate later runs this call on the state eager ran it on
        self._keep(
            signature,
            args,
            kwargs,
            lambda: [own_copy(tensor) for tensor in signature.state_tensors(leaves)],
            [counters.read(obj) for counters, obj in signature.state_counters(leaves)],
        )

    def _allocating(self, args: tuple, kwargs: dict) -> tuple | None:
        """What `done` records of a call whose state objects are all StaticCaches that allocate their tensors
        in this call (a prefill into a new cache, `xpupack.state.unallocated`), or None for another call."""
        leaves = flatten(args, kwargs)[0]
        kinds = [(leaf, kind) for leaf in leaves if (kind := state_type(leaf)) is not None]
        if not kinds or not all(unallocated(leaf) for leaf, _ in kinds):
            return None
        counts = [kind.counters.read(leaf) for leaf, kind in kinds if kind.counters is not None]
        return args, kwargs, snapshot(args), snapshot(kwargs), counts

    def done(self, args: tuple, kwargs: dict) -> None:
        """After a call: one that allocated its state (`_allocating`) is recorded now, its signature that of
        the allocated state, the state it started from that state zeroed (as `xpupack.state.allocate_ahead`
        gives it before a served call)."""
        if not self._open:
            return
        opened = self._open.pop()
        if opened is None:
            return
        args, kwargs, args_copy, kwargs_copy, counts = opened
        try:
            signature = Signature.of_call(args, kwargs)
        except Unrecordable as exc:  # an unallocated cache is not all the call holds that is not recordable
            self._unrecordable(exc)
            return
        leaves = flatten(args, kwargs)[0]
        self._keep(
            signature,
            args_copy,
            kwargs_copy,
            lambda: [own_copy(tensor).zero_() for tensor in signature.state_tensors(leaves)],
            counts,
            copied=True,
        )

    def _unrecordable(self, exc: Unrecordable) -> None:
        reason = f"calls with {exc} cannot be recorded; they run the original module"
        self.unrecordable[reason] = self.unrecordable.get(reason, 0) + 1

    def _keep(
        self,
        signature: Signature,
        args: tuple,
        kwargs: dict,
        state: Callable[[], list[torch.Tensor]],
        counts: list[tuple],
        *,
        copied: bool = False,
    ) -> None:
        """Counts a call of ``signature`` and keeps it as a sample (up to `SAMPLES_PER_SIGNATURE`): its
        inputs (``copied`` already), the copies ``state()`` makes of its state tensors from before the
        call, and the Python-side counters of its state objects from before the call."""
        index = self.index.get(signature)
        if index is None:
            index = self.index[signature] = len(self.signatures)
            self.signatures.append(signature)
            self.inputs.append([])
            self.states.append([])
            self.counts.append([])
            self.signature_calls.append(0)
        self.signature_calls[index] += 1
        if len(self.inputs[index]) < SAMPLES_PER_SIGNATURE:
            self.inputs[index].append((args, kwargs) if copied else (snapshot(args), snapshot(kwargs)))
            self.states[index].append(state())
            self.counts[index].append(counts)

    def spec(self) -> ModuleSpec:
        """What was seen, with the samples attached (`ModuleSpec.samples`)."""
        signatures = tuple(self.signatures)
        return ModuleSpec(
            signatures,
            calls=self.calls,
            signature_calls=tuple(self.signature_calls),
            unrecordable=dict(self.unrecordable),
            samples=Samples(signatures, self.inputs, self.states, self.counts),
        )


def record(
    model: nn.Module,
    modules: dict[str, nn.Module],
    samples: Iterable[Any],
    run: Callable[[nn.Module, Any], Any] | None,
    progress: Callable[[str], None] | None = None,
    *,
    mode: Callable[[], Any] = torch.no_grad,
) -> dict[str, ModuleSpec]:
    """Runs ``samples`` through ``model`` under ``mode`` (`torch.no_grad`, or `torch.inference_mode` where the
    caller runs in it) and returns each selected module's recorded spec, its samples attached."""
    sampled = {path: _SampledCalls() for path in modules}
    handles = [_hooks.observe(module, sampled[path].add, sampled[path].done) for path, module in modules.items()]
    count = 0
    try:
        with mode():
            for count, sample in enumerate(samples, 1):
                if progress:
                    progress(f"recording sample {count}")
                try:
                    _run_sample(model, sample, run)
                except TuningError:
                    raise
                except Exception as exc:
                    raise SampleError(
                        f"sample {count - 1} (counting from 0), {describe_sample(sample)}, failed in the model"
                        f"{' (through run)' if run is not None else ''}: {type(exc).__name__}: {exc} — the model "
                        "must run every sample as it is, so fix or leave out that sample",
                        index=count - 1,
                    ) from exc
    finally:
        for handle in handles:
            handle.remove()
    if count == 0:
        raise TuningError("samples is empty; pass at least one input the model is called with")
    return {path: calls.spec() for path, calls in sampled.items()}


def describe_sample(sample: Any) -> str:
    """A sample for a message: ``a Tensor of shape [2, 7], float32``, ``a dict {'x': [2, 7]}``,
    ``a tuple [[2, 8], 1.0]``, ``a Batch``."""
    if isinstance(sample, torch.Tensor):
        return f"a Tensor of shape {list(sample.shape)}, {dtype_name(sample.dtype)}"
    if isinstance(sample, dict):
        return f"a dict {{{', '.join(f'{key!r}: {_leaf(value)}' for key, value in sample.items())}}}"
    if isinstance(sample, (tuple, list)):
        return f"a {type(sample).__name__} [{', '.join(map(_leaf, sample))}]"
    return f"a {type(sample).__name__}"


def _leaf(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


def _run_sample(model: nn.Module, sample: Any, run: Callable | None) -> None:
    if run is not None:
        run(model, sample)
    elif isinstance(sample, torch.Tensor):
        model(sample)
    elif isinstance(sample, (tuple, list)):
        model(*sample)
    elif isinstance(sample, dict):
        model(**sample)
    else:
        raise TuningError(
            f"cannot call the model with a {type(sample).__name__} sample; "
            "pass a tensor, tuple, list or dict, or give run=lambda model, item: ..."
        )
