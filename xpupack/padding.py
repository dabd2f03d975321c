"""Padding a call up to a recorded batch (docs/calls-and-fallback.md).

A backend with static signatures (graph, Inductor) runs only the shapes it
recorded. A call that differs from a recorded signature only by a smaller
batch can run the smallest larger recorded batch instead: its rows go first,
zeros fill the rest, and the outputs are cut back to its rows.

That is right only for a module whose rows do not mix (no batch statistics,
no attention across the batch) and whose calls change nothing but their
outputs (no input written in place, no buffer of its own written). At tune
time `plan` finds each input's and output's batch axis from the recorded
signatures (the one axis whose size changes, together across leaves and
outputs, from one batch size to the next) and checks on the samples that
padded rows cannot change real rows: it runs each sample with some rows
replaced by two different fillers and compares the real rows. A module that
fails, or raises on the check's calls, is never padded, and the spec says why. At load, `check_loaded` runs the
same check on synthesised inputs before trusting a package's axes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ._compare import DEFAULT_TOLERANCES, mismatch
from .errors import TuningError
from .module_spec import ModuleSpec
from .recorder import snapshot
from .signature import BatchAxes, Signature, TensorLeaf, flatten, map_tensors, unflatten

_Tensor = torch.Tensor


# -- tune time: finding the batch axes and checking that rows do not mix -----------------------------


def find_batch_axes(spec: ModuleSpec, forward: Callable[..., Any], references: list[list[Any]]) -> ModuleSpec:
    """``spec`` with the axes its calls may be padded along, or with ``padding_refused``.

    ``batch_axes``: rows that never mix, padded with any filler; ``length_axes``: sequence positions that
    the module keeps out of the real ones when they are zeros (a padding mask of 0, causal attention), padded
    with zeros only. Within a call structure (a family), each size that changes across the recorded
    signatures (a batch, a sequence length; two at most) is checked on its own, among the signatures that
    agree on the other. ``references[i][k]`` is eager's output for recorded sample ``k`` of signature ``i``
    (``spec.samples``).
    """
    found: dict[str, dict[int, BatchAxes]] = {"batch": {}, "length": {}}
    groups: dict[tuple, list[int]] = {}
    for index, signature in enumerate(spec.signatures):
        if not signature.state_slots and signature.tensor_leaves:  # calls with state are never padded
            groups.setdefault(signature.family, []).append(index)
    lengths_refused = None
    for members in groups.values():
        sizes = _changing_sizes(spec, members) if len(members) > 1 else []
        for size in sizes:
            for group in _agreeing_on_the_others(spec, members, size, sizes):
                problem = _axes_of_one_size(spec, forward, group, references, found)
                if problem and len(sizes) == 1:  # the one size of these calls mixes rows: nothing is padded
                    return replace(spec, batch_axes={}, length_axes={}, padding_refused=problem)
                lengths_refused = lengths_refused or problem  # the other size pads as it may
    return replace(
        spec,
        batch_axes=found["batch"],
        length_axes=found["length"],
        padding_refused=None,
        lengths_refused=None if found["length"] else lengths_refused,
    )


def _changing_sizes(spec: ModuleSpec, members: list[int]) -> list[list[tuple[int, int]]]:
    """The sizes that change across the signatures ``members`` of one family, each as the input ``(leaf
    position, axis)`` pairs that change together (the same size in every signature); none where more than
    two change (nothing is padded then)."""
    together: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for position, column in enumerate(zip(*(spec.signatures[index].leaves for index in members))):
        if not isinstance(column[0], TensorLeaf):
            continue
        for axis in range(len(column[0].shape)):
            values = tuple(leaf.shape[axis] for leaf in column)
            if len(set(values)) > 1:
                together.setdefault(values, []).append((position, axis))
    return list(together.values()) if len(together) <= 2 else []


def _agreeing_on_the_others(
    spec: ModuleSpec, members: list[int], size: list[tuple[int, int]], sizes: list[list[tuple[int, int]]]
) -> list[list[int]]:
    """``members`` grouped by the values of every changing size but ``size`` (groups of two or more)."""
    others = [other[0] for other in sizes if other is not size]
    groups: dict[tuple, list[int]] = {}
    for index in members:
        leaves = spec.signatures[index].leaves
        groups.setdefault(tuple(leaves[p].shape[a] for p, a in others), []).append(index)  # type: ignore[union-attr]
    return [group for group in groups.values() if len(group) > 1]


def _axes_of_one_size(
    spec: ModuleSpec,
    forward: Callable[..., Any],
    members: list[int],
    references: list[list[Any]],
    found: dict[str, dict[int, BatchAxes]],
) -> str | None:
    """Adds the axes of the one size that changes across ``members`` to ``found``: as a batch where every
    output follows it and rows never mix, else as a length where the inputs are a sequence (an integer or
    boolean input changes along it: token ids, a mask) and zeros after the real positions leave them as
    they are. Returns why neither holds where a check failed, else None."""
    axes = _batch_axes(spec, members, references)
    if isinstance(axes, str):
        return None  # the sizes differ in another way than a batch or a length: nothing to pad
    padding_axes, sizes, outputs_kept_whole = axes
    taken = {kind: any(index in found[kind] for index in members) for kind in found}
    sequence = _is_a_sequence(spec.signatures[members[0]], padding_axes)
    problem = None
    if not outputs_kept_whole:
        problem = _why_not_paddable(spec, forward, members, padding_axes, sizes, "batch")
        if problem is None:  # positions that never mix (causal attention) pass too: a sequence is a length
            kind = "length" if sequence or taken["batch"] else "batch"
            if not taken[kind]:
                found[kind].update(dict.fromkeys(members, padding_axes))
            return None
    if sequence and not taken["length"]:
        length_problem = _why_not_paddable(spec, forward, members, padding_axes, sizes, "length")
        if length_problem is None:
            found["length"].update(dict.fromkeys(members, padding_axes))
            return None
        problem = length_problem  # for a sequence, what the length check saw is the reason that matters
    return problem


def _is_a_sequence(signature: Signature, axes: BatchAxes) -> bool:
    """Whether an integer or boolean input (token ids, a mask) changes along ``axes`` past its first axis
    (``[batch, length]``): what makes zeros after the real positions mean "no token" rather than a value
    that happens to change nothing."""
    return any(
        axis and isinstance(leaf, TensorLeaf) and not leaf.dtype.is_floating_point
        for axis, leaf in zip(axes.inputs, signature.leaves)
    )


def _batch_axes(
    spec: ModuleSpec, members: list[int], references: list[list[Any]]
) -> tuple[BatchAxes, list[int], bool] | str:
    """The axes along which the one size that changes across the signatures ``members`` (of one family)
    lies, each signature's size, and whether some output tensor keeps its shape across them (kept whole
    by a padded call: a pooled output); or why they change in another way."""
    found = _input_batch_axes([spec.signatures[index].leaves for index in members])
    if isinstance(found, str):
        return found
    inputs, sizes = found
    outputs = _output_batch_axes([references[index][0] for index in members], sizes)
    if isinstance(outputs, str):
        return outputs
    output_axes, kept_whole = outputs
    return BatchAxes(inputs, output_axes), sizes, kept_whole


def _input_batch_axes(leaves: list[tuple[Any, ...]]) -> tuple[tuple[int | None, ...], list[int]] | str:
    """The axis each input leaf changes size in across the signatures' ``leaves`` (None: it does not, or is
    no tensor) and the signatures' sizes there, or why the inputs have no such axes: one size that every
    changing input shares."""
    inputs: list[int | None] = []
    sizes: list[int] | None = None
    for position, column in enumerate(zip(*leaves)):
        if not isinstance(column[0], TensorLeaf):
            inputs.append(None)
            continue
        axis = _varying_axis([leaf.shape for leaf in column])
        if axis == -1:
            return f"input {position} changes in more than one axis"
        inputs.append(axis)
        if axis is not None:
            changed = [leaf.shape[axis] for leaf in column]
            if sizes is not None and changed != sizes:
                return "inputs change size independently"
            sizes = changed
    if sizes is None:
        return "no input changes size"
    return tuple(inputs), sizes


def _output_batch_axes(outputs: list[Any], sizes: list[int]) -> tuple[tuple[int | None, ...], bool] | str:
    """The axis of each output tensor that follows the inputs' ``sizes`` across the signatures' reference
    ``outputs`` (a padded call's outputs are cut back along it; None: no tensor, or one that keeps its shape)
    and whether some output tensor keeps its shape; or why the outputs change in another way."""
    flat = [flatten((output,), {}) for output in outputs]
    if any(structure != flat[0][1] for _, structure in flat):
        return "the outputs' structure changes with the batch"
    axes: list[int | None] = []
    kept_whole = False
    for position, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        if not isinstance(column[0], _Tensor):
            axes.append(None)
            continue
        axis = _varying_axis([tuple(tensor.shape) for tensor in column])
        if axis is None:
            kept_whole = True
        elif axis == -1 or [tensor.shape[axis] for tensor in column] != sizes:
            return f"output {position} does not follow the batch"
        axes.append(axis)
    if all(axis is None for axis in axes):
        return "no output follows the batch"
    return tuple(axes), kept_whole


def _varying_axis(shapes: list[tuple[int, ...]]) -> int | None:
    """The one axis whose size differs among ``shapes``; None if none does, -1 if several do."""
    varying = [axis for axis in range(len(shapes[0])) if len({shape[axis] for shape in shapes}) > 1]
    if not varying:
        return None
    return varying[0] if len(varying) == 1 else -1


#: SQNR (dB) the real rows of a padded bfloat16/float16 call must reach where they miss the elementwise
#: tolerance: a larger batch runs other matrix kernels (other tiling, other summation order), which
#: through a deep model moves half-precision outputs past any elementwise bound, as running eager at
#: another batch size does; rows that really mix (a batch mean) come out far below it
ROWS_SQNR_DB = 25.0


#: what each kind of padding fills in, and what its check fills in besides (`_rows_mix`)
FILLERS = {"batch": ("zeros", "other"), "length": ("zeros",)}


def _why_not_paddable(
    spec: ModuleSpec, forward: Callable[..., Any], members: list[int], axes: BatchAxes, sizes: list[int], kind: str
) -> str | None:
    """Runs eager on each recorded sample of a size above 1 with its last rows (positions for a ``kind``
    of ``"length"``) replaced (`_rows_mix`)."""
    refused = _side_effects_refusal(spec)
    if refused:
        return refused
    generator = torch.Generator().manual_seed(0)
    for index, size in zip(members, sizes):
        if size < 2:
            continue
        described = spec.signatures[index].describe()
        for args, kwargs in spec.samples.inputs[index]:
            try:
                problem = _rows_mix(forward, args, kwargs, axes, size, size // 2, generator, described, kind)
            except Exception as exc:  # a module that cannot run the check's calls is not padded; the tune goes on
                return (
                    f"the padding check's call of {described} cut to {size // 2} {_UNITS[kind]}(s) failed to run "
                    f"({type(exc).__name__}: {exc})"
                )
            if problem:
                return f"{_UNITS[kind]}s mix: {problem}"
    return None


#: what a kind of padding cuts, in messages
_UNITS = {"batch": "row", "length": "position"}


def _side_effects_refusal(spec: ModuleSpec) -> str | None:
    """Why a module whose calls change something besides their outputs is not padded, or None."""
    if spec.mutates_inputs:
        return "the module changes its input tensors in place (a padded call would change a copy)"
    if spec.writes_buffers:
        return "the module writes its own buffers (a padded call's filler rows would reach them)"
    return None


def _rows_mix(
    forward: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    axes: BatchAxes,
    batch: int,
    rows: int,
    generator: torch.Generator,
    described: str,
    kind: str = "batch",
) -> str | None:
    """Runs eager on a call of ``batch`` rows cut to its first ``rows``, then with the rest filled in again
    by each of the ``kind``'s `FILLERS`: zeros (what padding fills in) and, for a batch, other values: the
    real rows must come out as eager gives them alone. A ``kind`` of ``"length"`` does this along a
    sequence: rows are positions. Returns what differed (the call ``described``), or None."""
    leaves, tree = flatten(*snapshot((args, kwargs)))
    # contiguous: a caller's smaller call is a tensor of its own, not a strided view (GPT-2's Conv1D views)
    real = [_cut(leaf, axis, rows, contiguous=True) for leaf, axis in zip(leaves, axes.inputs)]
    real_args, real_kwargs = unflatten(real, tree)
    with torch.no_grad():
        expected = _cut_outputs(forward(*real_args, **real_kwargs), axes, rows)
        for filler in FILLERS[kind]:
            padded = [
                _pad(leaf, axis, batch, filler, generator, source)
                for leaf, axis, source in zip(real, axes.inputs, leaves)
            ]
            args_, kwargs_ = unflatten(padded, tree)
            problem = mismatch(
                _cut_outputs(forward(*args_, **kwargs_), axes, rows),
                expected,
                DEFAULT_TOLERANCES,
                low_precision_sqnr_db=ROWS_SQNR_DB,
            )
            if problem:
                unit = _UNITS[kind]
                return (
                    f"{rows} real {unit}(s) of {described} padded with {filler} to {batch} came out unlike "
                    f"eager on the real {unit}s alone ({problem})"
                )
    return None


# -- load time: a package's batch axes are its author's claim ------------------------------------------

#: random batches a loader checks each signature a package pads into on, each with another number of
#: real rows (half the batch, one, all but one)
LOAD_CHECK_BATCHES = 3


def check_loaded(spec: ModuleSpec, forward: Callable[..., Any], *, trusted: bool) -> ModuleSpec:
    """Checks the batch axes a loaded package names the way tuning checked them (`_rows_mix`), on inputs
    synthesised from each signature it pads into. Returns ``spec``, or on a failure ``spec`` without its
    ``batch_axes`` and with why in ``padding_refused``, as tuning would have.

    Tuning checked its own samples; a package's axes are its author's word, and a module whose rows mix
    can agree with a padded call on one input and not on the next. The loader therefore checks several
    random batches with differently many real rows, both fillers, before any call is padded. Floating
    leaves vary from batch to batch; integer and boolean ones are zeros (the only values valid for any
    embedding), so a signature whose batched inputs are all integers gives the check nothing to vary:
    its padding is kept only from a ``trusted`` source (docs/calls-and-fallback.md).

    Length axes pad a sequence of token ids or a mask, which no synthesised input stands for (a mask of
    zeros hides every position): they too are kept only from a ``trusted`` source, and only where the
    module leaves its inputs and buffers alone; the first padded call into each recording is then
    checked on the caller's inputs (`xpupack.tuned.TunedModule`).
    """
    if spec.length_axes:
        refused = _side_effects_refusal(spec) or (
            None if trusted else "the loader cannot check sequence padding and the source is not trusted"
        )
        if refused:
            spec = replace(spec, length_axes={}, lengths_refused=f"{refused} (checked at load)")
    problem = _loaded_axes_problem(spec, forward, trusted) if spec.batch_axes else None
    if problem:
        return replace(spec, batch_axes={}, padding_refused=f"{problem} (checked at load)")
    return spec


def _loaded_axes_problem(spec: ModuleSpec, forward: Callable[..., Any], trusted: bool) -> str | None:
    refused = _side_effects_refusal(spec)
    if refused:
        return refused
    generator = torch.Generator().manual_seed(0)
    for index, axes in sorted(spec.batch_axes.items()):
        signature = spec.signatures[index]
        _, batch = signature_batch(signature, axes)
        if batch < 2:
            continue  # nothing is padded up to one row
        if not trusted and not any(
            axis is not None and leaf.dtype.is_floating_point  # type: ignore[union-attr]
            for axis, leaf in zip(axes.inputs, signature.leaves)
        ):
            return (
                f"the loader cannot check that the rows of {signature.describe()} do not mix (no floating "
                "input varies along the batch) and the source is not trusted"
            )
        for number in range(LOAD_CHECK_BATCHES):
            rows = (batch // 2, 1, batch - 1)[number % 3]
            args, kwargs = signature.synthesize(seed=_LOAD_SEED + LOAD_CHECK_BATCHES * index + number)
            try:
                problem = _rows_mix(forward, args, kwargs, axes, batch, rows, generator, signature.describe())
            except Exception as exc:  # a module that cannot run the check's calls is not padded
                return f"{signature.describe()} with {rows} real row(s) failed to run ({type(exc).__name__}: {exc})"
            if problem:
                return f"rows mix: {problem}"
    return None


#: seeds of the load-time check's batches: other values than tuning's and than the load's accuracy check
_LOAD_SEED = 7919


def _cut(leaf: Any, axis: int | None, rows: int, *, contiguous: bool = False) -> Any:
    if axis is None:
        return leaf
    cut = leaf.narrow(axis, 0, rows)
    return cut.contiguous() if contiguous else cut


def _cut_outputs(outputs: Any, axes: BatchAxes, rows: int) -> Any:
    if isinstance(outputs, _Tensor) and len(axes.outputs) == 1:
        return outputs.narrow(axes.outputs[0], 0, rows)
    leaves, tree = flatten((outputs,), {})
    return unflatten([_cut(leaf, axis, rows) for leaf, axis in zip(leaves, axes.outputs)], tree)[0][0]


def _pad(
    leaf: Any,
    axis: int | None,
    batch: int,
    filler: str = "zeros",
    generator: torch.Generator | None = None,
    source: Any = None,
) -> Any:
    """``leaf`` grown to ``batch`` rows along ``axis``: its own rows first, then the filler.

    ``"zeros"`` is what serving fills in; ``"other"`` (tune-time check only) is random normal values
    for floating leaves and the recorded sample's own rows (valid indices, say) for the others.
    """
    if axis is None:
        return leaf
    shape = list(leaf.shape)
    shape[axis] = batch
    # an inference tensor only where the caller's is one: compiled code guards on which it is
    with torch.inference_mode(leaf.is_inference()):
        padded = leaf.new_zeros(shape)
        padded.narrow(axis, 0, leaf.shape[axis]).copy_(leaf)
    if filler == "other":
        rest = padded.narrow(axis, leaf.shape[axis], batch - leaf.shape[axis])
        if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
            rest.copy_(torch.randn(rest.shape, generator=generator, dtype=leaf.dtype) * 3 + 1)
        else:
            rest.copy_(source.narrow(axis, leaf.shape[axis], batch - leaf.shape[axis]))
    return padded


# -- tune time: a ladder of batch sizes from the samples ----------------------------------------------


def batch_ladder(samples: list, sizes: list[int], axis: int = 0) -> list:
    """``samples`` followed by each sample resized to each of ``sizes`` along its batch ``axis``.

    A sample's batch is the size along ``axis`` of its first tensor that has that axis; every tensor
    whose size there is that batch gets its rows repeated (cycled) or cut to the new size, other
    leaves stay as they are.
    """
    ladder = list(samples)
    for sample in samples:
        tensors = [leaf for leaf in flatten((sample,), {})[0] if isinstance(leaf, _Tensor) and leaf.dim() > axis]
        if not tensors:
            raise TuningError(
                f"batch_sizes needs samples holding tensors with a batch axis {axis}, not "
                f"{_describe_sample(sample)}; record each batch size through samples instead, "
                "or name the samples' batch axis with batch_axis="
            )
        batch = tensors[0].shape[axis]
        for size in sizes:
            if size != batch:
                rows = torch.arange(size, device=tensors[0].device) % batch
                # map_tensors calls the lambda right away, so it sees this iteration's rows and batch
                ladder.append(
                    map_tensors(
                        lambda x: (
                            x.index_select(axis, rows.to(x.device))  # noqa: B023
                            if x.dim() > axis and x.shape[axis] == batch  # noqa: B023
                            else x
                        ),
                        sample,
                    )
                )
    return ladder


def _describe_sample(sample: Any) -> str:
    leaves = flatten((sample,), {})[0]
    shapes = [list(leaf.shape) for leaf in leaves if isinstance(leaf, _Tensor)]
    return f"tensors of shapes {shapes}" if shapes else f"a {type(sample).__name__} without tensors"


def check_batch_axis(axis: Any) -> int:
    """``axis`` if it is a non-negative integer; raises `TuningError` otherwise."""
    if type(axis) is not int or axis < 0:
        raise TuningError(
            f"batch_axis={axis!r}: give the samples' batch axis as a non-negative integer "
            "(0 for [batch, ...], 1 for [sequence, batch, ...])"
        )
    return axis


#: the largest batch size a recording can have (PyTorch's kernels index rows with 32-bit integers)
MAX_BATCH_SIZE = 2**31 - 1


def check_batch_sizes(sizes: Any) -> list[int]:
    """``sizes`` as a sorted list of distinct positive integers; raises `TuningError` otherwise."""
    try:
        values = list(sizes)
    except TypeError:
        values = None
    if not values or not all(type(v) is int and 0 < v <= MAX_BATCH_SIZE for v in values):
        raise TuningError(
            f"batch_sizes={sizes!r}: give a list of integers from 1 to {MAX_BATCH_SIZE}, e.g. [1, 2, 4, 8]"
        )
    return sorted(set(values))


# -- call time ---------------------------------------------------------------------------------------


def signature_batch(signature: Signature, axes: BatchAxes) -> tuple[tuple, int]:
    """A recorded signature's fit key without batch sizes, and its batch.

    Raises:
        ValueError: the axes do not give the signature's batched leaves one batch of at least one row
            (a spec that could only come from a damaged or hostile package).
    """
    shapes = [leaf.shape if isinstance(leaf, TensorLeaf) else None for leaf in signature.leaves]
    try:
        return _mask(signature.key, axes.inputs, shapes)
    except _NoBatch:
        raise ValueError(
            f"the batch axes {list(axes.inputs)} give {signature.describe()} no batch of at least one row"
        ) from None


class PadTable:
    """Finds, for a call no recording fits, a recorded signature it can be padded up to.

    Built from the spec's batch and length axes (a call is padded along one of them); looked up only after
    the exact fit check missed.
    """

    def __init__(self, spec: ModuleSpec, active: set[int]):
        #: batch or length axes -> {the fit key without those sizes: sorted [(size, signature index)]}
        self.groups: dict[BatchAxes, dict[tuple, list[tuple[int, int]]]] = {}
        for padding_axes in (spec.batch_axes, spec.length_axes):
            for index, axes in padding_axes.items():
                if index in active:
                    masked, batch = signature_batch(spec.signatures[index], axes)
                    bisect.insort(self.groups.setdefault(axes, {}).setdefault(masked, []), (batch, index))

    def __bool__(self) -> bool:
        return bool(self.groups)

    def fit(self, key: tuple, leaves: list) -> tuple[int, BatchAxes, int, int] | None:
        """``(signature index, batch axes, the call's batch, the recorded batch it is padded to)`` or None."""
        shapes = [leaf.shape if isinstance(leaf, _Tensor) else None for leaf in leaves]
        for axes, table in self.groups.items():
            if len(axes.inputs) != len(leaves):
                continue
            try:
                masked, batch = _mask(key, axes.inputs, shapes)
            except _NoBatch:
                continue
            entries = table.get(masked)
            if entries:
                position = bisect.bisect_right(entries, (batch, _LAST))  # the smallest larger batch
                if position < len(entries):
                    return entries[position][1], axes, batch, entries[position][0]
        return None

    def retire(self, index: int) -> None:
        """Stops padding into signature ``index`` (its backend failed)."""
        for table in self.groups.values():
            for entries in table.values():
                entries[:] = [entry for entry in entries if entry[1] != index]


_LAST = 1 << 62


class _NoBatch(Exception):
    """The call's leaves do not have the batch axes (a constant where a tensor was, sizes that disagree)."""


def _mask(key: tuple, axes: tuple[int | None, ...], shapes: list) -> tuple[tuple, int]:
    """The fit ``key`` of a call with each batch axis' size replaced by -1, and the batch size.

    ``shapes`` holds each leaf's shape (None for a leaf that is no tensor); the leaf keys are
    the last entries of ``key`` (`xpupack.signature.fit_key`).
    """
    count = len(shapes)
    leaf_keys = list(key[len(key) - count :])
    batch = None
    for position, axis in enumerate(axes):
        if axis is None:
            continue
        shape = shapes[position]
        if shape is None or len(shape) <= axis or (batch is not None and shape[axis] != batch):
            raise _NoBatch
        batch = shape[axis]
        _, dtype, device = leaf_keys[position]
        leaf_keys[position] = ((*shape[:axis], -1, *shape[axis + 1 :]), dtype, device)
    if not batch:
        raise _NoBatch
    return (*key[: len(key) - count], *leaf_keys), batch


def check_output_axes(outputs: Any, axes: BatchAxes, batch: int) -> None:
    """Checks a package's claim about where the rows of ``outputs`` (a call of ``batch`` rows) are.

    The batch axes tuning found always name one axis (or None) per output leaf, each batched leaf
    a tensor with ``batch`` rows on its axis; the input axes are checked when the spec is read.
    Axes that break this come from a damaged or hostile package, and cutting by them would hand
    back the wrong rows.

    Raises:
        ValueError: the axes do not fit the outputs.
    """
    leaves, _ = flatten((outputs,), {})
    if len(leaves) != len(axes.outputs) or any(
        axis is not None and not (isinstance(leaf, _Tensor) and leaf.dim() > axis and leaf.shape[axis] == batch)
        for leaf, axis in zip(leaves, axes.outputs)
    ):
        shapes = [list(leaf.shape) if isinstance(leaf, _Tensor) else type(leaf).__name__ for leaf in leaves]
        raise ValueError(
            f"the package's output batch axes {list(axes.outputs)} do not fit the outputs "
            f"{shapes} of a call of {batch} rows; the package is damaged — rebuild it"
        )


def padded_rows_differ(backend: Any, actual: Any, expected: Any) -> str | None:
    """Why a padded call's outputs (``actual``) differ from the original module's on the caller's rows
    alone (``expected``), or None: they pass the backend's own comparison, or, in half precision, reach
    the SQNR that a larger batch's other kernels leave (`ROWS_SQNR_DB`, as the tune-time check allows)."""
    problem = backend.compare(actual, expected)
    if problem is None or mismatch(actual, expected, backend.tolerances(), low_precision_sqnr_db=ROWS_SQNR_DB) is None:
        return None
    return problem


def pad_call(args: tuple, kwargs: dict, axes: BatchAxes, batch: int) -> tuple[tuple, dict, list]:
    """The call grown to ``batch`` rows, zeros filling the rows it lacks; returns ``(args, kwargs, leaves)``."""
    leaves, tree = flatten(args, kwargs)
    padded = [_pad(leaf, axis, batch) for leaf, axis in zip(leaves, axes.inputs)]
    args, kwargs = unflatten(padded, tree)
    return args, kwargs, padded


def cut_outputs(outputs: Any, axes: BatchAxes, rows: int) -> Any:
    """The outputs of a padded call cut back to the caller's ``rows`` (views of the padded outputs)."""
    return _cut_outputs(outputs, axes, rows)
