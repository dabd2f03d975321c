"""`xpupack.tune`: record, choose a backend per module, activate."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import _device, _hooks, _inference, device_slots, distributed, padding
from ._model_edit import edits_model
from .backends.eager import EagerBackend
from .candidate import Candidate
from .environment import environment, resolve_device
from .errors import TuningError
from .module_spec import ModuleSpec, Target
from .recorder import BufferWatch, record, run_on_copy, select_modules
from .searches import SEARCHES, check_search, quantized_backends, search_strategy
from .signature import map_tensors
from .strategies import Strategy, reporting
from .tuned import (
    Session,
    TunedModule,
    attach,
    check_model,
    check_verify_padding,
    describe_architecture,
    detach,
    find_session,
    generate_compile_off,
)

log = logging.getLogger("xpupack")


@edits_model
def tune(
    model: nn.Module,
    samples: Iterable[Any],
    modules: str | Iterable[str] | None = None,
    device: str | torch.device | None = None,
    strategy: Strategy | None = None,
    run: Callable[[nn.Module, Any], Any] | None = None,
    *,
    batch_sizes: Iterable[int] | None = None,
    batch_axis: int | None = None,
    progress: Callable[[str], None] | None = None,
    search: str = "quick",
    quantize: bool | Iterable[str | Any] = False,
    verify_padding: str = "first",
) -> nn.Module:
    """Tunes ``model`` in place and returns it, with the tuned modules active.

    The samples run through the model (in eval mode, without autograd) while
    the selected modules' calls are recorded; then each module gets the first
    (or fastest) backend of ``strategy`` whose outputs match eager.

    Args:
        model: the model; it is put in eval mode.
        samples: inputs the model is called with: a tensor (``model(x)``), a
            tuple/list (``model(*x)``), a dict (``model(**x)``), or anything ``run`` takes.
        modules: glob patterns over ``named_modules()`` paths (``"layers.*.mlp"``);
            None tunes the whole model as one unit.
        device: where to tune; the model (and tensor samples) move there. Default: nothing
            moves, and each selected module is tuned on the device its own parameters are on
            (a model split over devices; tensor samples go to the first parameter's device).
        strategy: default ``FirstWins([GraphBackend(), InductorBackend(), EagerBackend()])``, and on a
            GPU ``GraphBackend(base=InductorBackend())`` first (``search="quick"``).
        run: ``run(model, item)`` drives the model for one sample (e.g. a ``generate()`` loop).
        batch_sizes: also record these batch sizes, made from each sample by repeating or cutting
            its rows (along ``batch_axis`` of its tensors); each is checked against eager like any
            call. Smaller batches than a recorded one are then padded up to it where the module
            allows; each tuned module's own batch axes are found from the recorded sizes.
        batch_axis: the samples' batch axis for ``batch_sizes`` (default 0); e.g. 1 for
            ``[sequence, batch, hidden]`` inputs, whose axis 0 must not be resized. Token ids
            ``[batch, length]`` with ``batch_axis=1`` make sequence-length buckets: shorter sequences
            are then padded up to them with zeros where the module allows (docs/serving-shapes.md).
        progress: called with short status messages (the CLI shows them): each sample recorded, each
            module, each candidate built, checked and timed. None: the ``xpupack`` logger's INFO messages.
        search: without a ``strategy``, ``"quick"`` (the default above) or ``"thorough"``: every
            candidate of `searches.thorough_backends` checked and timed, the fastest kept (Inductor's
            default settings, coordinate descent on a GPU, max-autotune; docs/tuning.md).
        quantize: with ``search="thorough"``, also try TorchAO configurations: True for
            int8, float8 and int4 weight-only (each where the device has it), or a list of config
            names or ``TorchAOBackend`` instances. Quantization changes numerics: off by default.

        verify_padding: ``"first"`` (default): padding is checked on the samples while tuning, and no
            padded call runs the original module; ``"always"``: every padded call is also run by the
            original module and compared on the caller's rows — one more eager run per padded call, for
            a module whose rows may mix only for some inputs (docs/serving-shapes.md). A call
            that disagrees gets the original's answer, and its recording is no longer padded into.

    Returns:
        The same model object.

    Raises:
        ValueError: ``verify_padding`` is not ``"first"`` or ``"always"``.
        DeviceUnavailableError: ``device`` names a device this machine lacks.
        TuningError: no samples, no module matches ``modules``, ``batch_sizes``/``batch_axis`` are not
            what they must be, or ``search``/``quantize`` are not, or come with a ``strategy``.
        NoCandidateError: a module no backend of the strategy could tune.

    Examples:
        >>> model = xpupack.tune(model, [torch.randn(1, 16, 64)], modules=["layers.*.mlp"])
        >>> xpupack.save(model, "pkg/")
        >>> model = xpupack.tune(model, samples, device="cuda", search="thorough", quantize=["int8-weight-only"])
    """
    check_model(model, "tune")
    quantize = _check_search(search, quantize, strategy)
    check_verify_padding(verify_padding)
    # the samples run in the caller's mode; everything xpupack makes is made outside inference mode, so
    # that the tuned model serves in any mode (`xpupack._inference`)
    samples_mode = torch.inference_mode if torch.is_inference_mode_enabled() else torch.no_grad
    with _inference.normal_tensors(model):
        return _tune(
            model,
            samples,
            modules,
            device,
            strategy,
            run,
            batch_sizes,
            batch_axis,
            progress,
            samples_mode,
            search,
            quantize,
            verify_padding,
        )


def _tune(
    model: nn.Module,
    samples: Iterable[Any],
    modules: str | Iterable[str] | None,
    device: str | torch.device | None,
    strategy: Strategy | None,
    run: Callable[[nn.Module, Any], Any] | None,
    batch_sizes: Iterable[int] | None,
    batch_axis: int | None,
    progress: Callable[[str], None] | None,
    samples_mode: Callable[[], Any],
    search: str,
    quantize: bool | Iterable[Any],
    verify_padding: str,
) -> nn.Module:
    # device=None: every module stays, and is tuned, where its parameters are (a model split over devices)
    in_place = device is None
    progress = progress or _log_progress
    device = resolve_device(device, default=_device.model_device(model))
    sizes, axis = _check_batching(batch_sizes, batch_axis)
    _undo_previous(model)
    _prepare_model(model, device, in_place=in_place)
    samples = _prepare_samples(samples, device, run, sizes, axis)
    architecture = describe_architecture(model)
    selected = select_modules(model, modules)
    placed = {path: _device.model_device(module, device) for path, module in selected.items()}
    if in_place:  # the session's device: slot 0's
        device = device_slots.slot_order(placed.values())[0]
    if strategy is None:
        strategy = search_strategy(search, device, quantize)
    distributed.check_strategy(selected, strategy)
    with generate_compile_off(model):
        specs = record(model, selected, samples, run, progress, mode=samples_mode)
    tuned = _tune_modules(selected, specs, placed, strategy, progress)
    for module in tuned.values():
        module.verify_padding(verify_padding)
    _activate(model, tuned, device, strategy, architecture, placed, samples_mode)
    return model


def _prefixed(progress: Callable[[str], None], head: str) -> Callable[[str], None]:
    """``progress`` with each message after ``head`` (the module being tuned)."""
    return lambda message: progress(f"{head}: {message}")


def _log_progress(message: str) -> None:
    """``tune``'s progress where the caller gave none: the ``xpupack`` logger's INFO messages."""
    log.info("%s", message)


def _check_batching(batch_sizes: Iterable[int] | None, batch_axis: int | None) -> tuple[list[int] | None, int]:
    """``batch_sizes`` checked (None when not given) and the batch axis they resize (0 by default)."""
    sizes = padding.check_batch_sizes(batch_sizes) if batch_sizes is not None else None
    if batch_axis is not None and sizes is None:
        raise TuningError(
            f"batch_axis={batch_axis!r} names the axis batch_sizes resizes; pass batch_sizes too, "
            "e.g. batch_sizes=[1, 2, 4, 8]"
        )
    axis = padding.check_batch_axis(batch_axis) if batch_axis is not None else 0
    return sizes, axis


def _undo_previous(model: nn.Module) -> None:
    """Re-tuning replaces an earlier tuning, from the original weights: its runners' changes are undone."""
    previous = find_session(model)
    if previous is not None:
        previous.deactivate()
        for tuned_module in previous.modules.values():
            tuned_module.runner.undo()
        detach(model)


def _prepare_model(model: nn.Module, device: torch.device, *, in_place: bool) -> None:
    """The model in eval mode, on ``device`` unless it is tuned where its parameters are."""
    if not in_place:
        model.to(device)
    model.eval()


def _prepare_samples(
    samples: Iterable[Any],
    device: torch.device,
    run: Callable[[nn.Module, Any], Any] | None,
    sizes: list[int] | None,
    axis: int,
) -> Iterable[Any]:
    """The samples as the model is called with them: their tensors on ``device`` (unless a ``run`` function
    takes them as they are), and each one repeated or cut to every size of ``batch_sizes``."""
    if run is None:
        samples = [map_tensors(lambda tensor: tensor.to(device), sample) for sample in samples]
    if sizes is not None:
        samples = padding.batch_ladder(list(samples), sizes, axis)
    return samples


def _tune_modules(
    selected: dict[str, nn.Module],
    specs: dict[str, ModuleSpec],
    placed: dict[str, torch.device],
    strategy: Strategy,
    progress: Callable[[str], None],
) -> dict[str, TunedModule]:
    """Each selected module tuned on its own device, in order; its recorded samples are dropped afterwards,
    whether tuning it succeeded or not."""
    tuned: dict[str, TunedModule] = {}
    for number, (path, module) in enumerate(selected.items(), 1):
        spec = specs[path]
        target = Target(path, module, _hooks.original_forward(module))
        head = f"tuning {path or '<model>'} ({number}/{len(selected)}, {len(spec.signatures)} signature(s))"
        progress(head)
        try:
            with _device.on_device(placed[path]), reporting(_prefixed(progress, head)):
                tuned[path] = _tune_one(target, spec, strategy, placed[path])
        except BaseException as exc:
            _drop_samples_after(spec, exc)
            raise
        if spec.samples is not None:
            spec.samples.drop()  # recorded data is never kept beyond tuning
    return tuned


def _activate(
    model: nn.Module,
    tuned: dict[str, TunedModule],
    device: torch.device,
    strategy: Strategy,
    architecture: dict,
    placed: dict[str, torch.device],
    samples_mode: Callable[[], Any],
) -> None:
    """Attaches a new session of the tuned modules to the model and activates it."""
    session = Session(
        tuned,
        device,
        environment=environment(device),
        strategy=repr(strategy),
        architecture=architecture,
        devices=placed,
        samples_mode="inference_mode" if samples_mode is torch.inference_mode else "no_grad",
    )
    attach(model, session)
    session.activate()


def _tune_one(target: Target, spec: ModuleSpec, strategy: Strategy, device: torch.device) -> TunedModule:
    if not spec.signatures:
        strategy.check_unrecorded(target, spec)
        why = "never called by the samples" if not spec.calls else "; ".join(spec.unrecordable)
        log.warning("%s: %s; it stays eager", target.path or "<model>", why)
        backend, facts = EagerBackend(), replace(spec, samples=None)
        return TunedModule(
            target, facts, backend, backend.build(target, facts, device), [Candidate("eager", "chosen", why)]
        )
    # tuning's own runs (references, checks, timing) leave the module's buffers as the samples' run left them
    with BufferWatch(target.module).kept() as buffers:
        references, mutates_inputs = _references(target, spec)
        spec = replace(spec, mutates_inputs=mutates_inputs, writes_buffers=bool(buffers.written()))
        buffers.restore()
        spec = padding.find_batch_axes(spec, target.forward, references)
        backend, runner, report = strategy.choose(target, spec, references, device)
    log.info("%s: %s", target.path or "<model>", backend.name)
    # `padding.find_batch_axes` checked the padding
    return TunedModule(target, replace(spec, samples=None), backend, runner, report, padding_checked=True)


def _references(target: Target, spec: ModuleSpec) -> tuple[list[list[Any]], bool]:
    """Eager's output on each recorded sample (``references[i][k]`` for sample ``k`` of signature ``i``, with
    the state after it for a call with state: `Samples.observe`), and whether eager changed a sample's
    inputs in place (run on copies: the samples stay as recorded)."""
    samples, mutates_inputs = spec.samples, False
    references: list[list[Any]] = []
    if samples is None:  # a spec without samples (a package's) has nothing to run
        return references, mutates_inputs
    for index in range(len(spec.signatures)):
        outputs = []
        for number in range(samples.count(index)):
            with samples.mode(index):
                args, kwargs = samples.sample(index, number)
                output, changed = run_on_copy(target.forward, args, kwargs)
                outputs.append(samples.observe(index, args, kwargs, output))
            mutates_inputs |= changed
        references.append(outputs)
    return references, mutates_inputs


def _drop_samples_after(spec: ModuleSpec, error: BaseException) -> None:
    """`Samples.drop` while ``error`` stops tuning: a failure of its own is logged, never raised in
    place of ``error`` (which says what went wrong first)."""
    try:
        if spec.samples is not None:
            spec.samples.drop()
    except Exception as cleanup:
        log.warning(
            "while tuning stopped on %s: %s, forgetting the recorded samples failed too (%s: %s)",
            type(error).__name__,
            error,
            type(cleanup).__name__,
            cleanup,
        )


def _check_search(search: Any, quantize: Any, strategy: Strategy | None) -> bool | list[Any]:
    """``search`` and ``quantize`` choose xpupack's own candidates; a ``strategy`` names its own. Returns
    ``quantize`` as a bool or a list (checked now, not after minutes of recording)."""
    if strategy is not None and search in SEARCHES and (search != "quick" or quantize):
        raise TuningError(
            f"strategy={strategy!r} names its candidates itself; search= and quantize= choose "
            "among xpupack's own: pass one or the other"
        )
    try:
        check_search(search, quantize)
    except ValueError as exc:
        raise TuningError(str(exc)) from None
    if isinstance(quantize, bool):
        return quantize
    quantize = [quantize] if isinstance(quantize, str) or not isinstance(quantize, Iterable) else list(quantize)
    try:
        quantized_backends(quantize)  # each name known, each item a name or a TorchAOBackend
    except (ValueError, TypeError) as exc:  # an unknown name (UnknownConfigError), or not a name or backend
        raise TuningError(str(exc)) from None
    return quantize
