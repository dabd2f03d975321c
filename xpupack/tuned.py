"""Tuned modules: the fit check, the fallback rule, and stats (docs/calls-and-fallback.md).

A tuned module keeps its class, parameters and state-dict keys. Activation
sets an instance attribute ``forward`` to a `TunedModule`, which checks each
call against the recorded signatures: a fitting call runs the backend, any
other call runs the original forward (the fallback) and is counted.
Deactivation removes the attribute, so the module is exactly as it was.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from . import _background, _hooks
from ._listeners import add_fallback_listener  # noqa: F401 (the plugin's)
from ._listeners import downgrade_listeners as _downgrade_listeners
from ._listeners import fallback_listeners as _fallback_listeners
from ._model_edit import edits_model
from ._new_sizes import NewSizes
from ._padded_calls import PaddedCalls, Padding
from .backends.base import Backend, Runner
from .candidate import Candidate
from .errors import NotAModelError, NotTunedError
from .module_spec import ModuleSpec, Target
from .padding import padded_rows_differ
from .recorder import BufferWatch
from .signature import BatchAxes, Signature, StateLeaf, dtype_name, fit_key
from .state import StateNotReady, allocate_ahead, state_type, unrecordable_hint

log = logging.getLogger("xpupack")

#: one call that says whether autocast is on for any device type (public: torch.is_autocast_enabled(type))
_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda", "xpu"))
)


@dataclass(frozen=True)
class FallbackEvent:
    """One call that ran the original module instead of the tuned backend.

    What the ``fallback_calls`` fixture of `xpupack.testing` collects.

    Args:
        path: the tuned module's object path (``""`` for the whole model).
        reason: why the call fell back (``"no recording fits: ..."``, ``"backend error"``...).
    """

    path: str
    reason: str


@dataclass(frozen=True)
class DowngradeEvent:
    """A loaded module that runs another backend than its package's.

    What the ``backend_downgrades`` fixture of `xpupack.testing` collects.

    Args:
        path: the module's object path.
        promised: the backend its package chose.
        running: the backend that runs instead (``"eager"``: the original module).
        reason: why (no device graphs here, a restore that failed...).
    """

    path: str
    promised: str
    running: str
    reason: str


#: how often padded calls are checked against the original module: ``"first"``, the first padded call into
#: each recording of a loaded package (a freshly tuned model was checked on its samples); ``"always"``,
#: every padded call (one more run of the original module each: for modules whose rows may mix only for
#: some inputs, which no check on data can rule out; docs/serving-shapes.md)
VERIFY_PADDING = ("first", "always")


def check_verify_padding(value: Any) -> str:
    """``value`` if it is one of `VERIFY_PADDING`, else ``ValueError`` saying what to pass."""
    if not isinstance(value, str) or value not in VERIFY_PADDING:
        raise ValueError(
            f"verify_padding={value!r}; give 'first' (check the first padded call into each recording of a "
            "loaded package) or 'always' (check every padded call against the original module)"
        )
    return value


@dataclass
class CallCounts:
    """What a tuned module's calls did since its load, its tuning or its warm-up (`TunedModule.forget_calls`):
    the figures of `xpupack.stats`."""

    calls: int = 0
    #: calls that ran the original module
    fallbacks: int = 0
    #: fallbacks by kind ("signature", "device", "training mode", "autograd needed", ...)
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    #: calls that ran the original module while their signature's compile was pending
    compiling: int = 0
    #: calls served by padding up to a recorded batch or length (`xpupack.padding`)
    padded: int = 0
    #: padded calls checked against the original module (the first per recording after a load, or all)
    padding_checks: int = 0


class TunedModule:
    """The ``forward`` of a tuned module: fit check, then backend or fallback.

    Args:
        target: the module.
        spec: its signatures.
        backend: the backend chosen for it.
        runner: that backend's runner.
        report: the strategy's (or the load's) report entries.
        padding_checked: padding into the recordings was checked against the original module already
            (at tune time); a loaded package's is checked on its first padded call.
        downgrade: set when a loaded module runs another backend than its package's.
        verify_padding: ``"first"`` (checks as ``padding_checked`` says) or ``"always"``: every padded
            call is also run by the original module and compared (`VERIFY_PADDING`).
    """

    def __init__(
        self,
        target: Target,
        spec: ModuleSpec,
        backend: Backend,
        runner: Runner,
        report: list[Candidate] | None = None,
        *,
        padding_checked: bool = False,
        downgrade: DowngradeEvent | None = None,
        verify_padding: str = "first",
    ):
        self.target = target
        self.spec = spec
        #: the signatures it serves, by index: the spec's, then the new sizes taken while serving
        #: (`_take_new_size`, handed to the runner with `Runner.add_signature`)
        self.signatures: list[Signature] = list(spec.signatures)
        self.backend = backend
        self.backend_name = backend.name
        self.runner = runner
        self.report = report or []
        self.counts = CallCounts()
        #: devices the recorded signatures' tensors are on: an input elsewhere is a "device" fallback
        self._devices = {leaf.device for signature in spec.signatures for leaf in signature.tensor_leaves}
        self.backend_errors: dict[int, str] = {}
        self._logged: set = set()
        self._params = list(target.module.parameters())
        self._check_grad = not backend.supports_autograd
        self._check_autocast = not backend.supports_autocast
        self._table = {
            signature.key: index for index, signature in enumerate(spec.signatures) if index in runner.supported
        }
        supported = set(self._table.values())  # the signatures the backend serves, by index
        #: fit key -> why the backend did not build that signature (its calls fall back as "not built")
        self._unbuilt = {spec.signatures[index].key: why for index, why in runner.unbuilt().items()}
        #: the calls of a tuned signature's family with a new state layout, taken as signatures of their own
        self._new_sizes = NewSizes(spec, supported)
        #: fit key of a call whose StaticCache has not allocated its tensors yet (a prefill into a new cache)
        #: -> the signatures it may become once they are allocated ahead (`_call_allocating`)
        self._unallocated: dict[tuple, list[int]] = {}
        for index, signature in enumerate(spec.signatures):
            if index in runner.supported:
                self._note_unallocated(index, signature)
        #: seconds the load spent restoring this module (compiling, recording, checking); None when tuned here
        self.load_s: float | None = None
        pads = backend.pads_calls and bool(spec.batch_axes or spec.length_axes)
        #: the calls padded up to a recording (None: this module pads none, or no longer any)
        self.padded_calls = PaddedCalls(spec, supported, runner, checked=padding_checked) if pads else None
        self.verify_padding(verify_padding)
        #: set by `xpupack.load` when the package's backend does not run here; each call reports it
        #: to the downgrade listeners (the pytest plugin), as each fallback is reported
        self.downgrade = downgrade
        #: eager runs the original module for any call: nothing to fit, nothing to pad, never a fallback
        self._runs_original = backend.name == "eager"
        #: advice already given as a warning (`_advise`); one set for all tuned modules of a model (`Session`)
        self.advised: set[type] = set()
        #: set while a load's warm-up calls run (`xpupack.warmup`): their fallbacks are counted, not reported
        self.warming_up = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the per-call path: a call that fits a tuned signature runs it with no helper call in between;
        # the rarer cases (padding, a new size, a fallback) each have a method of their own
        self.counts.calls += 1
        if _downgrade_listeners:
            self._report_downgrade()
        if self._runs_original:
            return self._run_original(args, kwargs)
        key, leaves = fit_key(args, kwargs)
        try:
            index = self._table.get(key)
        except TypeError:  # an unhashable constant never fits
            index = None
        padding = None
        if index is None:
            if self._unallocated and (served := self._call_allocating(key, args, kwargs, leaves)) is not _UNSERVED:
                return served
            index, padding = self._fit_new_size_or_padded(key, args, kwargs, leaves)
            if index is None:
                return self._fallback(args, kwargs, "signature", leaves, key)
        if self.target.module.training:
            return self._fallback(args, kwargs, "training mode", leaves)
        if self._check_grad and torch.is_grad_enabled() and self._needs_grad(leaves):
            return self._fallback(args, kwargs, "autograd needed", leaves)
        if self._check_autocast and _autocast_enabled():  # recordings are made without autocast
            return self._fallback(args, kwargs, "autocast enabled", leaves)
        if (pending := self._new_sizes.pending) and index in pending and not self._prepared(index, key):
            return self._call_while_not_prepared(index, args, kwargs, leaves)
        if padding is not None:
            return self._call_padded(index, key, padding, args, kwargs, leaves)
        try:
            return self.runner.run(index, args, kwargs, leaves)
        except Exception as exc:  # a broken backend must never break the model: fall back
            return self._backend_failed(index, key, exc, args, kwargs, leaves)

    def _note_unallocated(self, index: int, signature: Signature) -> None:
        """Lets a call of ``signature`` made before its StaticCache allocated its tensors find it."""
        key = signature.key_before_allocation
        if key is not None:
            self._unallocated.setdefault(key, []).append(index)

    def _call_allocating(self, key: tuple, args: tuple, kwargs: dict, leaves: list) -> Any:
        """A call whose StaticCache has not allocated its tensors yet (a prefill into a new cache, which
        transformers allocates in that call) and whose inputs are those of a tuned signature: xpupack
        allocates the cache ahead, exactly as the call would (`xpupack.state.allocate_ahead`), and the
        backend runs the call, which then fits. Where it fits no signature after all, or is not served
        (training mode, autograd, autocast, its compile pending, a backend error), the cache is put back
        unallocated and the original module runs the call as it would untuned. Returns ``_UNSERVED`` where
        no tuned signature has these inputs: the caller goes on as for any call that fits none."""
        candidates = _lookup(self._unallocated, key)
        if not candidates:
            return _UNSERVED
        if self.target.module.training:
            return self._fallback(args, kwargs, "training mode", leaves)
        if self._check_grad and torch.is_grad_enabled() and self._needs_grad(leaves):
            return self._fallback(args, kwargs, "autograd needed", leaves)
        if self._check_autocast and _autocast_enabled():
            return self._fallback(args, kwargs, "autocast enabled", leaves)
        for candidate in list(candidates):
            undo = self._allocate(self.signatures[candidate], leaves)
            if undo is None:
                continue
            allocated_key, _ = fit_key(args, kwargs)
            index = _lookup(self._table, allocated_key)
            if index is None:
                undo()
                continue
            if (pending := self._new_sizes.pending) and index in pending and not self._prepared(index, allocated_key):
                undo()
                return self._call_while_not_prepared(index, args, kwargs, leaves)
            try:
                return self.runner.run(index, args, kwargs, leaves)
            except Exception as exc:  # a broken backend must never break the model: fall back
                undo()
                return self._backend_failed(index, allocated_key, exc, args, kwargs, leaves)
        return _UNSERVED

    @staticmethod
    def _allocate(signature: Signature, leaves: list) -> Callable[[], None] | None:
        """Allocates each state object of a call as ``signature`` records it (`xpupack.state.allocate_ahead`);
        returns the undo of them all, or None (nothing done) where one cannot be."""
        undos: list[Callable[[], None]] = []
        for slot in signature.state_slots:
            leaf = signature.leaves[slot]
            assert isinstance(leaf, StateLeaf)  # a state slot holds a state leaf
            undo = allocate_ahead(leaves[slot], leaf.tensors)
            if undo is None:
                for done in reversed(undos):
                    done()
                return None
            undos.append(undo)

        def undo_all() -> None:
            for undo in reversed(undos):
                undo()

        return undo_all

    def _report_downgrade(self) -> None:
        """Tells the downgrade listeners (the pytest plugin) on each call that this module runs another
        backend than its package's, as each fallback is reported: one that its load said, or one whose
        compile off the caller's path failed after the load (`Runner.failed_upgrade`)."""
        if self.downgrade is None:
            failed = self.runner.failed_upgrade()
            if failed is None:
                return
            running, why = failed
            self.downgrade = DowngradeEvent(self.target.path, self.backend.label, running, why)
        for listener in list(_downgrade_listeners):
            listener(self.downgrade)

    def _fit_new_size_or_padded(
        self, key: tuple, args: tuple, kwargs: dict, leaves: list
    ) -> tuple[int | None, Padding | None]:
        """For a call no tuned signature fits as it is: the signature it becomes as a new size of a tuned
        signature with state (`_take_new_size`), else the recorded batch it is padded up to (``padding``
        names it, `xpupack.padding.PadTable.fit`). ``(None, None)``: neither, the call falls back."""
        if self._new_sizes and (index := self._take_new_size(key, args, kwargs)) is not None:
            return index, None
        if self.padded_calls and (padding := self.padded_calls.fit(key, leaves)) is not None:
            return padding[0], padding
        return None, None

    def _call_while_not_prepared(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """A call of new size ``index`` whose preparation off the caller's path has not finished well:
        while it still runs, the original module serves the call (counted as ``compiling``); once it
        failed, the call falls back as a backend error."""
        if index in self._new_sizes.pending:
            self.counts.compiling += 1
            return self._run_original(args, kwargs)
        return self._fallback(args, kwargs, "backend error", leaves)

    def _call_padded(self, index: int, key: tuple, padding: Padding, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Serves a smaller batch from signature ``index``'s recording, padded up to it (counted as
        ``padded``). The first padded call into a loaded package's recording is checked against the
        original module, which must see the buffers as the caller left them (the padded run may have
        written them)."""
        assert self.padded_calls is not None  # a call is padded only where its module pads
        buffers = BufferWatch(self.target.module) if self.padded_calls.needs_check(padding) else None
        try:
            outputs = self.padded_calls.run(padding, args, kwargs, leaves)
        except Exception as exc:  # a broken backend must never break the model: fall back
            return self._backend_failed(index, key, exc, args, kwargs, leaves)
        if buffers is not None:
            return self._check_first_padded_call(index, padding[1], outputs, args, kwargs, leaves, buffers)
        self.counts.padded += 1
        return outputs

    def _backend_failed(self, index: int, key: tuple, exc: Exception, args: tuple, kwargs: dict, leaves: list) -> Any:
        """The backend raised on a call of signature ``index``: the signature is retired and this call,
        like the later ones, runs the original module."""
        self._retire(index, key, f"{type(exc).__name__}: {exc}")
        return self._fallback(args, kwargs, "backend error", leaves)

    def _retire(self, index: int, key: tuple, error: str) -> None:
        """Signature ``index`` failed in the backend: its calls run the original module from now on."""
        self.backend_errors[index] = error
        self._table = {k: i for k, i in self._table.items() if i != index}
        self._unallocated = {k: [i for i in v if i != index] for k, v in self._unallocated.items()}
        if self.padded_calls:
            self.padded_calls.retire(index)
        self._new_sizes.refused.add(key)
        log.warning(
            "%s: %s backend failed (%s); this signature now runs the original module",
            self.target.path or "<model>",
            self.backend_name,
            error,
        )

    def _prepared(self, index: int, key: tuple) -> bool:
        """Whether the work off the caller's path for new size ``index`` finished well (it is then
        forgotten). False while it runs, and once it failed: the signature is then retired."""
        work = self._new_sizes.pending.get(index)
        if work is None:  # another thread took the outcome
            return index not in self.backend_errors
        if not work.done() or work.cancelled():  # cancelled: the process exits
            return False
        self._new_sizes.pending.pop(index, None)
        error = work.exception()
        if error is None:
            return True
        self._retire(index, key, f"compile off the caller's path: {type(error).__name__}: {error}")
        return False

    def _check_first_padded_call(
        self, index: int, axes: BatchAxes, outputs: Any, args: tuple, kwargs: dict, leaves: list, buffers: BufferWatch
    ) -> Any:
        """A loaded package's first padded call into signature ``index`` along ``axes`` (its batch or its
        length): the buffers go back to what they
        were before it, the original module runs the call (once: its buffers see it once), and its outputs
        are compared with the padded ones on the caller's rows. The load checked the batch axes on inputs of
        its own (`xpupack.padding.check_loaded`); this sees the caller's. On a mismatch that signature is no
        longer padded into; if the original module wrote its buffers, no call of the module is. Returns the
        call's outputs."""
        assert self.padded_calls is not None  # checked only while its module pads
        self.counts.padding_checks += 1
        buffers.restore()
        with torch.no_grad():
            expected = self._run_original(args, kwargs)
        written = buffers.written()
        problem = (
            f"the module writes its own buffers ({', '.join(written[:3])})"
            if written
            else padded_rows_differ(self.backend, outputs, expected)
        )
        if problem is None:
            self.padded_calls.checked.add((index, axes))
            self.counts.padded += 1
            return outputs
        if written:
            self.padded_calls = None
        else:
            self.padded_calls.retire(index)
        self.backend_errors[index] = f"padding check: {problem}"
        log.warning(
            "%s: a padded call into %s disagreed with the original module (%s); calls are no longer padded into %s",
            self.target.path or "<model>",
            self.signatures[index].describe(),
            problem,
            "any recording" if written else "it",
        )
        self._count_fallback("padding check", leaves)
        return expected

    def _take_new_size(self, key: tuple, args: tuple, kwargs: dict) -> int | None:
        """A call of a tuned signature's family whose state has a new layout becomes a signature of its own
        (`xpupack._new_sizes`); the backend prepares it as it does a new cache: the first call runs for real,
        the next one is recorded. Where that needs a compile, the runner does it off the caller's path, and
        the calls meanwhile run the original module (counted as ``compiling``)."""
        signature = self._new_sizes.new_signature(key, args, kwargs)
        if signature is None:
            return None
        index = len(self.signatures)
        self.signatures.append(signature)
        pending = self.runner.add_signature(index, signature, args, kwargs)
        if pending is not None:
            self._new_sizes.pending[index] = pending
        self._table[key] = index
        self._note_unallocated(index, signature)
        log.info(
            "%s: taking calls of %s (a new size of a tuned signature with state)%s",
            self.target.path or "<model>",
            signature.describe(),
            "; the original module runs them while it compiles" if pending is not None else "",
        )
        return index

    @property
    def served_spec(self) -> ModuleSpec:
        """The spec with the signatures taken while serving after its own (new sizes of a signature with
        state, `_take_new_size`): what `xpupack.save` writes."""
        if len(self.signatures) == len(self.spec.signatures):
            return self.spec
        return replace(self.spec, signatures=tuple(self.signatures))

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The original forward's signature: callers that look at it (transformers' ``generate()``
        passes ``logits_to_keep`` and position ids only to a forward that names them) see no change."""
        try:
            return inspect.signature(self.target.forward)
        except (TypeError, ValueError):
            return None

    def _needs_grad(self, leaves: list) -> bool:
        return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves) or any(
            p.requires_grad for p in self._params
        )

    def _fallback(self, args: tuple, kwargs: dict, reason: str, leaves: list, key: Any = None) -> Any:
        self._count_fallback(reason, leaves, key)
        return self._run_original(args, kwargs)

    def _run_original(self, args: tuple, kwargs: dict) -> Any:
        """The original module's forward on the call: the model's Python, which never runs beside a trace on
        xpupack's worker (`xpupack._background.between_jobs`)."""
        with _background.between_jobs():
            return self.target.forward(*args, **kwargs)

    def _count_fallback(self, reason: str, leaves: list, key: Any = None) -> None:
        """Counts, logs (once per reason) and reports a call that runs the original module; ``key``: the
        call's fit key, for a signature the backend did not build."""
        self.counts.fallbacks += 1
        if self.warming_up:  # a load's own warm-up call (`xpupack.warmup`): not the caller's, nothing to report
            return
        kind = reason
        unbuilt = _lookup(self._unbuilt, key) if reason == "signature" and self._unbuilt else None
        if unbuilt is not None:
            kind = "not built"
            reason = f"the {self.backend_name} backend did not build {_describe_call(leaves)}: {unbuilt}"
        elif reason == "signature":
            elsewhere = sorted(
                {str(x.device) for x in leaves if isinstance(x, torch.Tensor) and x.device not in self._devices}
            )
            if elsewhere and self._devices:  # never copied over: the original module gets the input as it is
                kind = "device"
                reason = (
                    f"an input on {', '.join(elsewhere)}, but the recordings take "
                    f"{', '.join(sorted(map(str, self._devices)))}: " + _describe_call(leaves)
                )
            else:
                reason = "no recorded signature fits " + _describe_call(leaves)
                self._advise(leaves)
        self.counts.fallback_reasons[kind] = self.counts.fallback_reasons.get(kind, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("%s: %s; running the original module", self.target.path or "<model>", reason)
        if _fallback_listeners:
            event = FallbackEvent(self.target.path, reason)
            for listener in list(_fallback_listeners):
                listener(event)

    def _advise(self, leaves: list) -> None:
        """Warns, once per model, about an argument that makes every call fall back and that can be
        changed (a transformers ``DynamicCache``: a plain ``generate()``); the fallback itself is logged at
        INFO, as most fallbacks are single unusual calls."""
        for x in leaves:
            if isinstance(x, torch.Tensor) or type(x) in _PLAIN or state_type(x) is not None:
                continue
            hint = unrecordable_hint(x)
            if hint and type(x) not in self.advised:
                self.advised.add(type(x))
                log.warning(
                    "%s: calls with a %s cannot be recorded and run the original module on every call%s",
                    self.target.path or "<model>",
                    type(x).__name__,
                    hint,
                )

    def forget_calls(self) -> None:
        """Sets the call counts of `stats` back to zero (after a load's warm-up calls, `xpupack.warmup`);
        what the calls prepared (compiled code, recordings, retired signatures) stays."""
        self.counts = CallCounts()

    def verify_padding(self, mode: str) -> None:
        """``"always"``: every padded call is also run by the original module and compared; ``"first"``: the
        first into each recording of a loaded package (`VERIFY_PADDING`)."""
        if self.padded_calls is not None:
            self.padded_calls.verify_every = check_verify_padding(mode) == "always"

    def stats(self) -> dict:
        """This module's entry of `xpupack.stats`."""
        described = self.runner.describe()
        # calls the runner served from the original module's recordings while its compiled code was not
        # ready (a load's `defer_compile`) count with those that ran the original while a compile ran
        counts = self.counts
        compiling = counts.compiling + described.pop("compiling", 0)
        return {
            "backend": self.backend_name,
            "calls": counts.calls,
            "fallbacks": counts.fallbacks,
            "padded": counts.padded,
            "padding_checks": counts.padding_checks,
            "compiling": compiling,
            "signatures": len(self.signatures),
            "active_signatures": len(self._table),
            "memory_bytes": self.runner.memory_bytes(),
            **described,
            **({"new_sizes": self._new_sizes.taken} if self._new_sizes else {}),
            **({"load_s": round(self.load_s, 3)} if self.load_s is not None else {}),
            **({"backend_errors": dict(self.backend_errors)} if self.backend_errors else {}),
            **(
                {"downgraded": {"package": self.downgrade.promised, "why": self.downgrade.reason}}
                if self.downgrade
                else {}
            ),
            **({"fallback_reasons": dict(counts.fallback_reasons)} if counts.fallback_reasons else {}),
        }

    def __deepcopy__(self, memo):
        raise TypeError(
            "cannot deepcopy a model with active xpupack modules; "
            "call xpupack.deactivate(model) first, or copy it before tuning"
        )


#: what `TunedModule._call_allocating` returns for a call it did not take
_UNSERVED = object()


def _lookup(table: dict, key: Any) -> Any:
    try:
        return table.get(key)
    except TypeError:  # an unhashable constant
        return None


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _describe_call(leaves: list) -> str:
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(f"{dtype_name(x.dtype)}{list(x.shape)}@{x.device}")
        elif state_type(x) is not None:
            parts.append(_describe_state(x))
        else:
            parts.append(repr(x) if len(repr(x)) < 40 else type(x).__name__ + unrecordable_hint(x))
    return "(" + ", ".join(parts) + ")"


def _describe_state(x: Any) -> str:
    try:
        state_type(x).state_tensors(x)
    except StateNotReady as exc:
        return f"{type(x).__name__} not ready: {exc}"
    return type(x).__name__


@dataclass
class Session:
    """Everything xpupack knows about one tuned model.

    Args:
        modules: object path -> its tuned module.
        device: the device the tuned modules run on where ``devices`` does not say otherwise.
        active: whether calls go through the backends.
        devices: module path -> the device it runs on.
        environment: the environment it was tuned or loaded in (`xpupack.environment`).
        strategy: the strategy's repr.
        architecture: state-dict name -> shape and dtype of the model as built.
        owner: the model (`attach` sets it).
        load_seconds: where a load's time went, per phase.
        samples_mode: the mode tuning ran the samples in, ``"inference_mode"`` or ``"no_grad"`` (where
            compiled code made from its calls guards on the mode); empty for a package that does not say.
    """

    modules: dict[str, TunedModule]
    device: torch.device
    active: bool = False
    #: module path -> the device it runs on (`xpupack.device_slots`); a module missing here runs on ``device``
    devices: dict[str, torch.device] = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    strategy: str = ""
    #: state-dict name -> {"shape", "dtype"} of the model as built, before any backend changed it
    architecture: dict = field(default_factory=dict)
    #: the model this session tunes (`attach` sets it)
    owner: weakref.ref[nn.Module] | None = None
    #: where a load's time went, seconds per phase (verify, weights, shared_artifacts, modules, activate,
    #: and warmup where the load made warm-up calls); empty for a session tuned here
    load_seconds: dict[str, float] = field(default_factory=dict)
    samples_mode: str = ""

    def __post_init__(self) -> None:
        advised: set = set()  # advice is given once per model, not once per tuned module
        for tuned in self.modules.values():
            tuned.advised = advised

    def device_of(self, path: str) -> torch.device:
        """The device the tuned module at ``path`` runs on.

        Args:
            path: a tuned module's object path.

        Returns:
            Its device.
        """
        return self.devices.get(path, self.device)

    def activate(self) -> None:
        """Routes every tuned module's calls through its backend."""
        for tuned in self.modules.values():
            _hooks.install(tuned.target.module, tuned)
        self.active = True
        self._switch_generate_compile(off=True)

    def deactivate(self) -> None:
        """Gives every tuned module its original forward back and releases what the runners hold."""
        for tuned in self.modules.values():
            _hooks.uninstall(tuned.target.module, tuned, tuned.target.forward)
            tuned.runner.release()
        self.active = False
        self._switch_generate_compile(off=False)

    def _switch_generate_compile(self, *, off: bool) -> None:
        """A tuned model has transformers' own compile switched off while active (`generate_compile_off`),
        and back as it was once no session of it is active (a load replacing a session deactivates the
        old one after the new one is active)."""
        model = self.owner() if self.owner else None
        config = _generation_config(model)
        if config is None:
            return
        if off:
            _generate_compile_before.setdefault(model, bool(config.disable_compile))
            config.disable_compile = True
        elif find_session(model) in (None, self) and model in _generate_compile_before:
            config.disable_compile = _generate_compile_before.pop(model)


def _generation_config(model: nn.Module | None) -> Any:
    config = getattr(model, "generation_config", None)
    return config if hasattr(config, "disable_compile") else None


@contextlib.contextmanager
def generate_compile_off(model: nn.Module):
    """transformers' ``generate()`` compiles the forward itself when the cache is static (with CUDA
    graphs of its own): that would trace the tuned modules, and while tuning it would hand the
    recorder outputs that its next step overwrites. Switched off for the block."""
    config = _generation_config(model)
    if config is None:
        yield
        return
    previous, config.disable_compile = config.disable_compile, True
    try:
        yield
    finally:
        config.disable_compile = previous


_sessions: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()
#: model -> its ``generation_config.disable_compile`` from before any of its sessions was active
_generate_compile_before: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def describe_architecture(model: nn.Module) -> dict[str, dict]:
    """State-dict name -> ``{"shape", "dtype"}``: what a package records and a loader checks."""
    return {name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for name, t in model.state_dict().items()}


def check_model(model: Any, function: str) -> None:
    """Raises `NotAModelError` unless ``model`` is a module: ``function`` (``"tune"``, ``"load"``) says whose
    first argument it is. A factory passed where its model belongs would otherwise fail deep inside with
    an ``AttributeError``."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type):
        what, fix = f"the class {model.__name__}", f" — build it: xpupack.{function}({model.__name__}(...), ...)"
    elif callable(model):
        name = getattr(model, "__name__", type(model).__name__)
        what, fix = f"the function {name}", f" — call it: xpupack.{function}({name}(), ...)"
    else:
        what, fix = f"a {type(model).__name__}", f" — pass the model first: xpupack.{function}(model, ...)"
    raise NotAModelError(
        f"xpupack.{function} needs the model (a torch.nn.Module) as its first argument, not {what}{fix}",
        actual=type(model).__name__,
    )


def session_of(model: nn.Module) -> Session:
    """The session of a tuned or loaded ``model``.

    Args:
        model: the model.

    Returns:
        Its session.

    Raises:
        NotTunedError: the model has no tuned modules.
    """
    try:
        return _sessions[model]
    except KeyError:
        raise NotTunedError(
            f"{type(model).__name__} has no tuned modules; "
            "call xpupack.tune(model, samples) or xpupack.load(model, path) first"
        ) from None


def find_session(model: nn.Module) -> Session | None:
    """The session of ``model``, or None when it has none.

    Args:
        model: the model.

    Returns:
        Its session, or None.
    """
    return _sessions.get(model)


def attach(model: nn.Module, session: Session) -> None:
    """Makes ``session`` the session of ``model`` (kept as long as the model lives).

    Args:
        model: the model.
        session: its new session.
    """
    session.owner = weakref.ref(model)
    _sessions[model] = session


def detach(model: nn.Module) -> None:
    """Forgets the session of ``model``, if any.

    Args:
        model: the model.
    """
    _sessions.pop(model, None)


def stats(model: nn.Module, *, totals: bool = False) -> dict[str, dict]:
    """Per tuned module (by object path): backend, calls, fallbacks, padded, compiling, signatures, memory.

    ``compiling`` counts the calls that ran the original module (or a device graph of it) while a
    compile for their signature ran off the caller's path: a new KV-cache length, or a load's compiled
    code (``load(defer_compile=True)``; ``compiled_serving`` then says whether it serves yet, and
    ``upgrade_error`` why it never will). They are not fallbacks.

    ``memory_bytes`` is the device memory the module's recordings hold (graph backend; 0 for the
    others), ``recording_memory`` each recording's share, ``skipped`` what ``max_memory`` left out.

    A loaded module's entry has ``load_s``: the seconds its restore took (compiling or loading
    compiled code, recording device graphs, the check against the original module).

    Args:
        model: a tuned or loaded model.
        totals: return ``{"modules": <the per-module dict>, "totals": {...}}`` instead, where
            ``totals`` sums ``calls``, ``fallbacks``, ``padded`` and ``memory_bytes`` over the modules
            and, for a loaded model, holds ``load_seconds``: where the load's time went, per phase.

    Returns:
        Object path -> that module's counters and facts (or, with ``totals``, both levels).

    Raises:
        NotTunedError: the model has no tuned modules.

    Examples:
        >>> xpupack.stats(model)["layers.0.mlp"]
        {'backend': 'graph', 'calls': 10, 'fallbacks': 1, 'signatures': 2, ...}
        >>> xpupack.stats(model, totals=True)["totals"]["memory_bytes"]
        25165824
    """
    session = session_of(model)
    modules = {path: {**tuned.stats(), "active": session.active} for path, tuned in session.modules.items()}
    if not totals:
        return modules
    summed = {
        key: sum(entry[key] for entry in modules.values()) for key in ("calls", "fallbacks", "padded", "memory_bytes")
    }
    if session.load_seconds:
        summed["load_seconds"] = {phase: round(seconds, 3) for phase, seconds in session.load_seconds.items()}
    return {"modules": modules, "totals": summed}


@edits_model  # after a load into the model running in another thread, never amid it
def activate(model: nn.Module) -> nn.Module:
    """Routes calls of the tuned modules through their backends again (after `deactivate`).

    Device graphs released by `deactivate` are recorded again on the next fitting call.

    Args:
        model: a tuned or loaded model.

    Returns:
        The same model.

    Raises:
        NotTunedError: the model has no tuned modules.

    Examples:
        >>> xpupack.deactivate(model)
        >>> model.train()  # fine-tune with the original modules...
        >>> xpupack.activate(model.eval())
    """
    session_of(model).activate()
    return model


@edits_model
def deactivate(model: nn.Module) -> nn.Module:
    """Restores every tuned module's original forward; `activate` undoes it.

    The device memory the recordings hold is released; the tuned state (signatures, backends) is kept. A module
    TorchAO quantized keeps its quantized weights: its original forward runs them, as its fallback does (a
    loaded package holds no full-precision copy of them; docs/quantization.md).

    Args:
        model: a tuned or loaded model.

    Returns:
        The same model.

    Raises:
        NotTunedError: the model has no tuned modules.

    Examples:
        >>> xpupack.deactivate(model)
        >>> reference = model(x)  # the original modules, untouched by xpupack
    """
    session_of(model).deactivate()
    return model
